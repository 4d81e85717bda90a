"""Torch-level entry points: kvarn_jax on vLLM's torch tensors through DLPack. No vLLM needed.

`bind` turns one layer's vLLM cache tensor into a `kvarn_jax.PagedKVCache` whose leaves are views of
that tensor (no copy; checked by data pointer). A step is described once by a `plan.StepPlan`
(every layer shares it); per layer:

- `write(bound, key, value, plan)` stores the step's tokens in place. The tokens' stored rows (the
  storage frame: rotated for KVarN, rounded to the cache dtype) are computed by torch and copied
  into the high-precision sink/tail (or, for passthrough schemes, the pages) with one indexed copy
  whose destinations the plan computed once for the step. Only when the step completes blocks does
  JAX run: `kvarn_jax`'s own write plan and quantizer turn the completed blocks (ring + new rows)
  into page fields, which torch copies into the pages. XLA cannot write into a buffer it imported
  from torch, hence the split; what is copied is the new rows and the completed blocks' bytes.
- `attend(bound, query, plan, written=...)` attends every row with the semantics of
  `kvarn_jax.attention.prefill`: each query sees the sink and its own block in high precision and
  the full blocks before its own block quantized - the decode rule, so the result of a query does
  not depend on how its prompt was cut into chunks. The blocks a step's rows read are dequantized by
  one JAX call per layer (`dequantize_blocks` plus the sink/ring rows); the attention itself runs in
  torch (fused SDPA for prefill rows, a block-wise softmax for decode rows). Decode rows go through
  `kvarn_jax.paged_decode_attention` instead with impl "pallas" (NVIDIA GPUs: the fused kernel reads
  the pages itself) or "reference".

JAX functions are jitted and called through JAX's C++ dispatch (as fast as an AOT-compiled
executable, ~10 us); shapes are padded to few sizes so that few compile.

On a GPU nothing here waits for the device. torch and JAX use different CUDA streams and DLPack
orders them: importing a torch tensor into JAX makes JAX's stream wait for torch's work so far,
exporting a JAX array to torch makes torch's stream wait for JAX's. Every JAX call that reads the
cache imports a torch tensor made in the same step (the fence), and torch's writes into the cache
follow its import of JAX's results. Each bound cache keeps its last call's exchanged arrays alive
until its next call, so that neither allocator reuses a buffer the other's stream may still read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import kvarn_jax
from kvarn_jax import schemes
from kvarn_jax.attention.prefill import dequantize_blocks
from kvarn_jax.cache.paged import auto_quantizer, completed_blocks, completion_sizes, saturated_blocks, write_plan
from kvarn_jax.hadamard import hadamard_matrix_np, rotate, unrotate
from kvarn_jax.storage import QUANT_MAX, storage_values

from .layout import PageLayout, allocate_hp, carve, to_jax
from .plan import StepPlan, _bucket

IMPLS = ("auto", "pallas", "reference")

# ------------------------------------------------------------------------------------- counters
_COUNTERS = {"bind": 0, "write_calls": 0, "write_tokens": 0, "blocks_quantized": 0, "decode_calls": 0,
             "decode_rows": 0, "prefill_calls": 0, "prefill_tokens": 0, "blocks_dequantized": 0, "write_s": 0.0,
             "attend_s": 0.0, "seq_starts": 0, "seq_restarts": 0}
_LOCK = threading.Lock()


def count(**kw) -> None:
    """Add to the counters (also used by the metadata builder for sequence starts/restarts)."""
    with _LOCK:
        for k, n in kw.items():
            _COUNTERS[k] += n


# Tokens the writes did not store as given (`kvarn_jax.storage`'s rule), counted on the device of
# the caches so that counting never waits for it: per device an int64 [3] tensor in ALTERED order.
ALTERED = ("nonfinite_tokens", "saturated_tokens", "metadata_saturated_tokens")
_ALTERED: dict = {}


def _altered(device: torch.device) -> torch.Tensor:
    key = str(device)
    with _LOCK:
        if key not in _ALTERED:
            with torch.inference_mode(False):  # vLLM runs the model in inference mode; the totals outlive it
                _ALTERED[key] = torch.zeros(len(ALTERED), dtype=torch.int64, device=device)
        return _ALTERED[key]


def altered_tokens() -> dict:
    """{name: count} of the tokens the writes stored altered since the start (or `reset_counters`):
    `nonfinite_tokens` had a NaN/Inf in K or V and were stored as zeros, `saturated_tokens` had
    values the cache cannot hold and were stored clipped, `metadata_saturated_tokens` belong to
    quantized blocks whose KVarN scales saturated. Reads the device counters (waits for them)."""
    with _LOCK:
        tensors = list(_ALTERED.values())
    total = np.zeros(len(ALTERED), np.int64)
    for t in tensors:
        total += t.cpu().numpy()
    return dict(zip(ALTERED, (int(x) for x in total)))


def counters() -> dict:
    """How often the bridge ran (per process): binds, writes, tokens written, blocks quantized,
    attention calls with decode rows / prefill rows and their rows / tokens, blocks dequantized for
    attention, host seconds in write and attend, how many sequences started (restarts: a request
    that started again at position 0, e.g. after vLLM preempted it), and `altered_tokens`."""
    with _LOCK:
        out = dict(_COUNTERS)
    return {**out, **altered_tokens()}


def reset_counters() -> None:
    with _LOCK:
        for k in _COUNTERS:
            _COUNTERS[k] = 0.0 if k.endswith("_s") else 0
        _ALTERED.clear()


# ------------------------------------------------------------------------------------- binding
@dataclasses.dataclass
class BoundCache:
    """One layer's cache: the torch views into vLLM's memory and the JAX cache sharing them.

    rows: the write's destination as one [rows, D] view - the sink and tail regions (quantized
    schemes) or the K and V pages (passthrough), which lie back to back in memory.
    """

    layout: PageLayout
    num_blocks: int
    views: dict
    cache: kvarn_jax.PagedKVCache
    buffer: torch.Tensor
    rows: torch.Tensor
    # the last write's and attention's arrays exchanged through DLPack (module docstring): each
    # replaced by the next call of its kind
    held_write: tuple = ()
    held_attend: tuple = ()

    @property
    def cfg(self):
        return self.layout.cfg

    def pointers(self) -> dict:
        """{leaf key: (torch data_ptr, JAX buffer pointer)} - equal pairs prove the import is zero-copy."""
        out = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.cache)[0]:
            key = ".".join(str(getattr(p, "name", getattr(p, "key", p))) for p in path)
            if key in self.views:
                out[key] = (self.views[key].data_ptr(), leaf.unsafe_buffer_pointer())
        return out

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype attention runs in: bfloat16 for a bfloat16 model (as vLLM's own backends run it;
        the dequantized pages are rounded to it, the high-precision rows already are), float32
        otherwise (float16 attention is slow or emulated on CPUs; float32 models stay exact)."""
        return torch.bfloat16 if self.layout.dtype == "bfloat16" else torch.float32

    @functools.cached_property
    def rotation(self) -> dict:
        """{input dtype: H} on the cache's device, as `kvarn_jax.rotate` uses it: for fp16 inputs the
        matrix rounded to fp16 first (the KVarN reference's rotated tiles), else fp32."""
        h = torch.from_numpy(hadamard_matrix_np(self.layout.head_dim).astype(np.float32)).to(self.buffer.device)
        return {torch.float16: h.half().float(), None: h}


def _write_rows(views: dict, layout: PageLayout) -> torch.Tensor:
    """The regions a write stores rows into, as one [rows, head_dim] view (they are contiguous by
    construction of `layout.regions`; checked)."""
    keys = ["pages.k.values", "pages.v.values"] if layout.cfg.is_passthrough else ["sink.k", "sink.v", "tail.k",
                                                                                    "tail.v"]
    parts = [views[k] for k in keys]
    for a, b in zip(parts, parts[1:]):
        if b.data_ptr() != a.data_ptr() + a.numel() * a.element_size() or b.dtype != a.dtype:
            raise ValueError(f"kvarn: the regions {keys} are not back to back in one dtype; the bridge writes them "
                             "with one indexed copy")
    first = parts[0]
    total = sum(p.numel() for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total // layout.head_dim,
                                                                                      layout.head_dim))


def bind(kv_cache: torch.Tensor, layout: PageLayout, *, num_blocks: int | None = None,
         hp_buffers: dict | None = None, static=None) -> BoundCache:
    """Bind one layer's vLLM cache tensor.

    kv_cache: the tensor vLLM gives the layer, [num_blocks, 1, block_size, C] uint8 (or a flat
      uint8 buffer with `num_blocks` given); it must be contiguous (a layer-outer KV layout).
    hp_buffers: separate sink/tail tensors (`layout.allocate_hp`) or None to carve them from
      kv_cache after the pages. static: a static scheme's calibrated parameters.
    Raises ValueError if the tensor cannot hold the layout or any leaf would be copied on import.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache must be uint8 (the bridge's page format), got {kv_cache.dtype}")
    if kv_cache.dim() == 4:
        if num_blocks is not None and num_blocks != kv_cache.shape[0]:
            raise ValueError(f"num_blocks={num_blocks} disagrees with kv_cache.shape[0]={kv_cache.shape[0]}")
        num_blocks = kv_cache.shape[0]
        if kv_cache.shape[1] != 1 or kv_cache.shape[2] != layout.block_size:
            raise ValueError(f"kv_cache must be [num_blocks, 1, {layout.block_size}, C] (the spec the backend "
                             f"declares), got {tuple(kv_cache.shape)}")
    elif kv_cache.dim() != 1 or num_blocks is None:
        raise ValueError(f"kv_cache must be [num_blocks, 1, block_size, C], or 1-D with num_blocks given; "
                         f"got shape {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: the bridge needs a layer-outer KV cache layout "
                         "(VLLM_KV_CACHE_LAYOUT=LBHNC, vLLM's default for this backend)")
    flat = kv_cache.reshape(-1)
    views = carve(flat, layout, num_blocks, hp_buffers)
    cache = to_jax(views, layout, num_blocks, static)
    bound = BoundCache(layout, num_blocks, views, cache, flat, _write_rows(views, layout))
    for key, (tp, jp) in bound.pointers().items():
        if tp != jp:
            raise ValueError(f"DLPack import of {key} copied the buffer (torch {tp:#x}, jax {jp:#x}); "
                             "the bridge only runs zero-copy")
    count(bind=1)
    return bound


# ------------------------------------------------------------------------------------- helpers
def _to_jax(t: torch.Tensor):
    """A torch tensor as a JAX array; zero-copy when dense and aligned (inputs may be copied: they
    are this step's new tokens or indices, not the cache)."""
    return jax.dlpack.from_dlpack(t if t.is_contiguous() else t.contiguous())


def _to_torch(x) -> torch.Tensor:
    return torch.from_dlpack(x)


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    if t.shape[0] == n:
        return t
    out = t.new_zeros((n,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _rotate(bound: BoundCache, x: torch.Tensor, src_dtype=None) -> torch.Tensor:
    """x @ H in fp32 (`kvarn_jax.rotate`'s math; src_dtype: the dtype x had before, which picks H)."""
    return torch.matmul(x.to(torch.float32), bound.rotation.get(src_dtype, bound.rotation[None]))


def _token_max(x: torch.Tensor) -> torch.Tensor:
    """[2, tokens, ...] -> [tokens]: the largest magnitude of each token's K and V (NaN if any is)."""
    return x.abs().amax(dim=tuple(i for i in range(x.dim()) if i != 1))


def stored_rows(bound: BoundCache, key: torch.Tensor, value: torch.Tensor):
    """The tokens as the cache stores them, by `kvarn_jax.storage.storage_values`' rule: a token with
    a NaN/Inf value stored as zeros; quantized schemes clip to +-QUANT_MAX; the storage frame
    (rotated in fp32 for KVarN) rounded to the cache dtype with saturation. Returns (rows [2, tokens,
    Hk, D], nonfinite [tokens] bool, saturated [tokens] bool), equal to the library's (the rotation may
    round the last fp32 bit differently: torch's matmul and XLA's sum in different orders)."""
    kv = torch.stack((key, value))
    cfg = bound.cfg
    store = bound.rows.dtype  # the cache's value dtype (a float32 model's sink and tail are float16)
    m = _token_max(kv)
    nonfinite = ~torch.isfinite(m)
    saturated = None
    reach = torch.finfo(kv.dtype).max
    if not cfg.is_passthrough and reach > QUANT_MAX:
        saturated = m > QUANT_MAX
        kv = kv.clamp(-QUANT_MAX, QUANT_MAX)
        reach = QUANT_MAX
    kv = kv.masked_fill(nonfinite[None, :, None, None], 0)
    if cfg.rotated:
        y = _rotate(bound, kv, kv.dtype)
        reach *= math.sqrt(bound.layout.head_dim)  # a rotated value is at most sqrt(D) x the largest input
    else:
        y = kv if kv.dtype == torch.float32 else kv.to(torch.float32)
    big = torch.finfo(store).max
    if reach > big:  # only then can a finite value leave the storage dtype's range
        over = _token_max(y) > big
        saturated = over if saturated is None else saturated | over
        y = y.clamp(-big, big)
    if saturated is None:
        saturated = torch.zeros_like(nonfinite)
    return y.to(store), nonfinite, saturated & ~nonfinite


def _count_altered(device, counts: torch.Tensor, first: int = 0) -> None:
    """Add counts (a device tensor, `ALTERED[first:]` order) to the device's totals without waiting."""
    acc = _altered(device)
    acc[first:first + counts.shape[0]] += counts


def _check_plan(bound: BoundCache, plan: StepPlan):
    lay = bound.layout
    if not isinstance(plan, StepPlan):
        raise TypeError(f"plan must be a kvarn_vllm.plan.StepPlan, got {type(plan).__name__}")
    if plan.block_size != lay.block_size or plan.max_seqs != lay.max_seqs or \
            plan.tail_len != lay.block_size * lay.tail_blocks:
        raise ValueError(f"the plan was built for block_size={plan.block_size}, max_seqs={plan.max_seqs}, "
                         f"tail_len={plan.tail_len}; this cache has {lay.block_size}, {lay.max_seqs}, "
                         f"{lay.block_size * lay.tail_blocks}")
    if plan.device.type == "cpu" and plan.num_tokens and "checked" not in plan.cache:
        # cheap on the host; on a GPU the slots stay unread (the kernels clamp indices)
        sm = plan.slot_mapping.numpy().astype(np.int64)
        limit = bound.num_blocks * lay.block_size
        if np.any((sm < 0) | (sm >= limit)):
            raise ValueError(f"slot_mapping has entries outside [0, {limit}) for the step's tokens")
        if np.any(plan.positions % lay.block_size != sm % lay.block_size):
            raise ValueError("positions and slot_mapping disagree: position % block_size must equal slot % block_size")
        bt = plan.block_table.numpy()
        used = np.arange(bt.shape[1])[None, :] * lay.block_size < plan.seq_len[:, None]
        if np.any(used & ((bt < 0) | (bt >= bound.num_blocks))):
            raise ValueError(f"block_table has block ids outside [0, {bound.num_blocks}) in the blocks rows use")
        plan.cache["checked"] = True


def _check_tokens(bound: BoundCache, x: torch.Tensor, name: str, n: int, heads: int | None):
    lay = bound.layout
    want = f"[{n}, {heads if heads else 'num_heads'}, {lay.head_dim}]"
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != n or x.shape[2] != lay.head_dim or (
            heads is not None and x.shape[1] != heads):
        raise ValueError(f"{name} must be a {want} tensor (the plan's tokens), got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if heads is None and x.shape[1] % lay.num_kv_heads:
        raise ValueError(f"{name} has {x.shape[1]} heads, not a multiple of num_kv_heads={lay.num_kv_heads}")


# ------------------------------------------------------------------------------------- write
@dataclasses.dataclass
class Written:
    """What a write hands the same step's attention: the stored rows [2, tokens, Hk, D] and, per
    prefill row whose chunk starts inside a block, that block's earlier rows as they were before
    the write ({row: (k, v) [Hk, n, D]})."""

    rows: torch.Tensor
    before: dict


def _row_destinations(plan: StepPlan, bound: BoundCache):
    """(destination rows, source rows or None for all) of the write's indexed copy, per step."""
    lay = bound.layout
    hk, bs, n = lay.num_kv_heads, lay.block_size, plan.num_tokens
    heads = np.arange(hk)
    if lay.cfg.is_passthrough:
        def make():
            sm = plan.slot_mapping.to(torch.int64)
            base = (sm // bs * hk)[:, None] * bs + (sm % bs)[:, None]             # [n, 1]
            h = torch.arange(hk, device=sm.device)[None, :] * bs
            page = bound.num_blocks * hk * bs                                    # rows of one side
            return torch.stack((base + h, base + h + page)).reshape(-1), None
        return plan.cached(("rows", "pages", bound.num_blocks, hk), make)

    def make():
        s, tl = lay.max_seqs, plan.tail_len
        in_sink, in_ring = plan.stored()
        pos, seq = plan.positions, plan.token_seq
        sink_rows, tail_rows = s * hk * bs, s * hk * tl
        dst, src = [], []
        for side in (0, 1):
            # row of (token, head 0) in the [sink.k | sink.v | tail.k | tail.v] rows, and the head stride
            for mask, base, stride in ((in_sink, side * sink_rows + seq * hk * bs + pos % bs, bs),
                                       (in_ring, 2 * sink_rows + side * tail_rows + seq * hk * tl + pos % tl, tl)):
                t = np.nonzero(mask)[0]
                dst.append((base[t][:, None] + heads[None, :] * stride).reshape(-1))
                src.append(((side * n + t)[:, None] * hk + heads[None, :]).reshape(-1))
        dst, src = np.concatenate(dst), np.concatenate(src)
        every = src.shape[0] == 2 * n * hk and np.array_equal(src, np.arange(src.shape[0]))
        return plan.to_device(dst), None if every else plan.to_device(src)
    return plan.cached(("rows", "hp", lay.max_seqs, hk, bs), make)


def _before(bound: BoundCache, plan: StepPlan) -> dict:
    """Prefill rows starting inside a block: that block's earlier rows, read before the write can
    overwrite them in the ring (a chunk that completes the block wraps the ring around)."""
    lay = bound.layout
    if lay.cfg.is_passthrough:
        return {}
    out = {}
    bs, tl = lay.block_size, plan.tail_len
    for r in range(plan.num_decodes, plan.num_rows):
        ctx = int(plan.context[r])
        pre = ctx % bs
        if not pre:
            continue
        s, b = int(plan.seq_id[r]), ctx // bs
        if b == 0:
            out[r] = tuple(bound.views[f"sink.{x}"][s, :, :pre].clone() for x in "kv")
        else:
            o = (b * bs) % tl
            out[r] = tuple(bound.views[f"tail.{x}"][s, :, o:o + pre].clone() for x in "kv")
    return out


@functools.partial(jax.jit, static_argnames=("size", "quantizer"))
def _completed_pages(cache, rows, ids, *, size: int, quantizer: str):
    """The page fields of the blocks a write completes (the library's `write_plan` and
    `completed_blocks`, with the stored rows torch computed): (block ids [size], {leaf key: [size,
    ...]}); the first `completing` entries are the completed blocks, in token order."""
    p = write_plan(cache, rows[0], rows[1], ids[0], ids[1], ids[2])
    p = p._replace(xs={"k": rows[0], "v": rows[1]})  # already in the storage frame and dtype
    return _quantized_completions(cache, p, size, quantizer)


def _quantized_completions(cache, p, size, quantizer):
    """(block ids [size], {leaf key: fields [size, ...]}, [1] int32 tokens of blocks whose metadata
    saturated) for the blocks of write plan `p` (`completed_blocks`)."""
    c_m, fields = completed_blocks(cache, p, size, quantizer)
    bad = jnp.sum(saturated_blocks(cache, fields) & (c_m < cache.num_blocks), dtype=jnp.int32) * cache.block_size
    return c_m, {f"pages.{s}.{name}": f.astype(cache.pages[s][name].dtype)
                 for s in schemes.SIDES for name, f in fields[s].items()}, bad[None]


def _write_ids(plan: StepPlan, nb: int) -> torch.Tensor:
    """The write's [3, nb] int32 slots (-1: padding), slots' sequence ids and positions, on the device."""
    n = plan.num_tokens
    ids = torch.zeros((3, nb), dtype=torch.int32, device=plan.device)
    ids[0, n:] = -1
    ids[0, :n] = plan.slot_mapping
    ids[1, :n] = plan.to_device(plan.token_seq, torch.int32)
    ids[2, :n] = plan.to_device(plan.positions, torch.int32)
    return ids


def _store_completed(bound: BoundCache, rows: torch.Tensor, plan: StepPlan) -> list:
    """Quantize the blocks the step completes (JAX) and copy their fields into the pages (torch, one
    copy of whole blocks per field)."""
    n, c = plan.num_tokens, plan.completing
    nb = _bucket(n)
    sizes = completion_sizes(bound.cache, nb)
    size = next(m for m in sizes if m >= c) if c <= sizes[-1] else None
    if size is None:  # cannot happen: the bound counts every completion a write can make
        raise RuntimeError(f"kvarn: {c} blocks complete in one write of {n} tokens, above the bound {sizes[-1]}")

    ids = plan.cached(("write_ids", nb), lambda: _write_ids(plan, nb))
    padded = rows if nb == n else torch.cat((rows, rows.new_zeros((2, nb - n) + tuple(rows.shape[2:]))), 1)
    rows_j, ids_j = _to_jax(padded), _to_jax(ids)
    c_m, fields, bad = _completed_pages(bound.cache, rows_j, ids_j, size=size, quantizer=auto_quantizer(bound.cache))
    blocks = _to_torch(c_m)[:c].to(torch.int64)
    bad_t = _to_torch(bad)
    _count_altered(blocks.device, bad_t, 2)
    held = [padded, rows_j, ids_j, c_m, fields, blocks, bad, bad_t]
    for key, f in fields.items():
        vals = _to_torch(f)
        bound.views[key].index_copy_(0, blocks, vals[:c])
        held.append(vals)
    return held


def write(bound: BoundCache, key: torch.Tensor, value: torch.Tensor, plan: StepPlan) -> Written:
    """Store the step's key/value ([tokens, Hk, D], the plan's tokens) in the bound cache, in place
    (see the module docstring). Returns what the same step's `attend` needs."""
    t0 = time.perf_counter()
    _check_plan(bound, plan)
    n = plan.num_tokens
    _check_tokens(bound, key, "key", n, bound.layout.num_kv_heads)
    _check_tokens(bound, value, "value", n, bound.layout.num_kv_heads)
    rows, nonfinite, saturated = stored_rows(bound, key, value)
    _count_altered(rows.device, torch.stack((nonfinite, saturated)).sum(1))
    before = _before(bound, plan)
    held = []
    quantized = not bound.cfg.is_passthrough
    if quantized and plan.completing:  # reads the ring before the rows below overwrite it
        held = _store_completed(bound, rows, plan)
    if n:
        dst, src = _row_destinations(plan, bound)
        flat = rows.reshape(-1, bound.layout.head_dim)
        bound.rows.index_copy_(0, dst, flat if src is None else flat.index_select(0, src))
    bound.held_write = (rows, held)
    count(write_calls=1, write_tokens=n, blocks_quantized=plan.completing if quantized else 0,
          write_s=time.perf_counter() - t0)
    return Written(rows, before)


# ------------------------------------------------------------------------------------- attention
def decode_impl(impl: str) -> str:
    """What decode rows run for impl "auto" | "pallas" | "reference": the library's
    `paged_decode_attention` with that impl on GPUs and TPUs ("auto": its kernel where it supports the
    cache), and on other backends for "pallas" / "reference"; "served" for "auto" on the CPU, where no
    kernel compiles: one XLA computation per layer that dequantizes exactly the pages the rows read
    (the library's reference gathers whole padded block tables) and attends (`_decode_served`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    if impl == "auto" and jax.default_backend() not in ("gpu", "tpu"):
        return "served"
    return impl


@functools.partial(jax.jit, static_argnames=("scale", "impl", "passthrough"))
def _decode_library(q, cache, idx, *, scale, impl, passthrough):
    """`kvarn_jax.paged_decode_attention` on the step's packed indices [B, cols + 2] (block table,
    lengths, slots), in one dispatch."""
    cols = idx.shape[1] - 2
    return kvarn_jax.paged_decode_attention(q, cache, idx[:, :cols], idx[:, cols], scale,
                                            seq_ids=None if passthrough else idx[:, cols + 1], impl=impl,
                                            check_values=False)


def _used_columns(max_seq_len: int, block_size: int, width: int) -> int:
    """Block-table columns the longest sequence uses, rounded up to a power of two (few shapes)."""
    need = max(1, -(-int(max_seq_len) // block_size))
    return min(width, 1 << (need - 1).bit_length())


def _decode_rows_library(bound, query, plan, scale, impl, out):
    nd = plan.num_decodes
    bb = _bucket(nd, 1)
    cols = _used_columns(plan.max_decode_len, bound.layout.block_size, plan.block_table.shape[1])

    def make():
        idx = torch.zeros((bb, cols + 2), dtype=torch.int32, device=plan.device)
        idx[:nd, :cols] = plan.block_table[:nd, :cols]
        idx[:nd, cols] = plan.to_device(plan.seq_len[:nd], torch.int32)
        idx[:nd, cols + 1] = plan.to_device(plan.seq_id[:nd], torch.int32)
        return idx, _to_jax(idx)
    idx, idx_j = plan.cached(("decode_idx", bb, cols), make)
    q = _pad_rows(query[:nd], bb)
    q_j = _to_jax(q)  # also the fence: JAX's stream waits for torch's writes into the cache
    res = _decode_library(q_j, bound.cache, idx_j, scale=scale, impl=impl, passthrough=bound.cfg.is_passthrough)
    o = _to_torch(res)
    out[:nd].copy_(o[:nd])
    return (q, q_j, res, o)


def _entry_blocks(plan: StepPlan, entries: np.ndarray) -> torch.Tensor:
    """The physical block of each entry (entries[0]: row, entries[1]: block-table column; clamped, so
    padding entries read a real block), gathered by torch from vLLM's block table: the JAX calls
    then take [N] ids, whose shape does not change with the number of rows in the step."""
    t = plan.block_table
    rows = plan.to_device(np.clip(entries[0], 0, t.shape[0] - 1))
    cols = plan.to_device(np.clip(entries[1], 0, t.shape[1] - 1))
    return t[rows, cols].to(torch.int32)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _served(cache, blk, hp, *, dtype: str):
    """The blocks a step's rows read, as attention sees them, heads first: [Hk, N, bs, D] in `dtype`
    for K and V (see `StepPlan.served_entries`) - pages dequantized, sink entries from the sink, ring
    entries from the tail ring."""
    k, v = (x.astype(dtype) for x in dequantize_blocks(cache, blk))
    if not cache.has_hp:
        return k, v
    idx, seq, kind = hp[0], jnp.clip(hp[1], 0, cache.max_seqs - 1), hp[2]
    ring_pos = (jnp.maximum(kind - 1, 0)[:, None] + jnp.arange(cache.block_size)[None, :]) % cache.tail_len
    out = []
    for side, x in zip(schemes.SIDES, (k, v)):
        sink = cache.sink[side][seq]                                           # [M, Hk, bs, D]
        ring = cache.tail[side][seq[:, None], :, ring_pos].transpose(0, 2, 1, 3)
        val = jnp.where((kind == 0)[:, None, None, None], sink, ring).astype(dtype)
        out.append(x.at[:, idx].set(val.transpose(1, 0, 2, 3), mode="drop"))
    return tuple(out)


def _served_blocks(bound: BoundCache, plan: StepPlan):
    """(K, V) [Hk, N * bs, D] torch views of JAX's dequantized blocks the prefill rows read, the rows'
    block offsets into them, and what to keep alive."""
    passthrough = bound.cfg.is_passthrough

    def make():
        entries, hp, offsets, n = plan.served_entries(passthrough)
        return _entry_blocks(plan, entries), plan.to_device(hp, torch.int32), offsets, n
    blk, h, offsets, n = plan.cached(("served", passthrough), make)
    # imported per call: a fence for JAX's reads of the cache (module docstring)
    b_j, h_j = _to_jax(blk), _to_jax(h)
    k_j, v_j = _served(bound.cache, b_j, h_j, dtype=str(bound.compute_dtype).split(".")[-1])
    count(blocks_dequantized=n)
    hk, d = bound.layout.num_kv_heads, bound.layout.head_dim
    k, v = (_to_torch(x).view(hk, -1, d) for x in (k_j, v_j))
    return k, v, offsets, (b_j, h_j, k_j, v_j)


@functools.partial(jax.jit, static_argnames=("scale", "size", "quantizer"))
def _decode_served(q, cache, blk, entries, info, kv=None, ids=None, *, scale, size=0, quantizer="reference"):
    """Decode rows on the CPU in one XLA computation: dequantize the pages each row reads, attend
    with the sink and the ring's last block (quantized caches), softmax over all of a row's blocks.
    q [B, Hq, D]; entries / info: `StepPlan.decode_entries`. Each row's sums run over its own blocks
    in position order, whatever else is in the batch. Returns [B, Hq, D] in q's dtype.

    With kv ([2, B, Hk, D]: the step's new keys and values, one per row, not yet written) the step's
    write is done here too: it returns (rows, out, completed, altered) - the rows as the cache stores
    them ([2, B, Hk, D], `kvarn_jax.storage.storage_values`), the attention computed as if they were written
    (each row's new token in its sink, ring or page), and with size > 0 the page fields of the
    blocks the write completes (`_completed_pages`, ids: the write's [3, B] slots, slots' sequences,
    positions); altered: int32 [3] counts in `ALTERED` order. The caller stores rows and pages afterwards."""
    b, hq, d = q.shape
    hk, bs = cache.num_kv_heads, cache.block_size
    g = hq // hk
    qf = q.astype(jnp.float32)
    if cache.cfg.rotated:
        qf = rotate(qf)
    qg = qf.reshape(b, hk, g, d)
    rows = completed = None
    if kv is not None:
        store = cache.value_dtype
        k_s, v_s, nonfinite, saturated = storage_values(cache.cfg, kv[0], kv[1], store)
        rows = jnp.stack((k_s, v_s))
        live = info[4] >= 0                                                   # padding rows write nothing
        altered = jnp.stack([jnp.sum(m & live, dtype=jnp.int32) for m in (nonfinite, saturated)] + [jnp.int32(0)])
    row = entries[0]
    k, v = dequantize_blocks(cache, blk)                                  # [Hk, N, bs, D]
    pos = jnp.arange(bs)
    if rows is not None and not cache.has_hp:  # passthrough: the new token sits in its row's last page
        at = jnp.where(live, info[5], k.shape[1])
        k = k.at[:, at, info[6]].set(rows[0].astype(jnp.float32).transpose(1, 0, 2), mode="drop")
        v = v.at[:, at, info[6]].set(rows[1].astype(jnp.float32).transpose(1, 0, 2), mode="drop")
    qn = jnp.concatenate([qg, jnp.zeros((1, hk, g, d))])[jnp.clip(row, 0, b)]   # [N, Hk, G, D]
    s = jnp.einsum("nhgd,hnbd->nhgb", qn, k, precision="highest") * scale
    s = jnp.where((pos[None, :] < entries[2][:, None])[:, None, None, :], s, -jnp.inf)
    mx = jax.ops.segment_max(s.max(-1), row, num_segments=b + 1, indices_are_sorted=True)[:b]   # [B, Hk, G]
    parts = []
    if cache.has_hp:
        seq = jnp.clip(info[0], 0, cache.max_seqs - 1)
        ring_pos = (info[2][:, None] + pos[None, :]) % cache.tail_len
        in_sink = info[3] == 0                                               # the new token's block is the sink
        for src, lens, here in ((cache.sink, info[1], in_sink), (cache.tail, info[3], ~in_sink)):
            kk = (src["k"][seq] if src is cache.sink else src["k"][seq[:, None], :, ring_pos].transpose(0, 2, 1, 3))
            vv = (src["v"][seq] if src is cache.sink else src["v"][seq[:, None], :, ring_pos].transpose(0, 2, 1, 3))
            if rows is not None:  # the new token at its position of this part (info[4])
                new = (here & live)[:, None, None, None] & (pos[None, None, :, None] == info[4][:, None, None, None])
                kk = jnp.where(new, rows[0][:, :, None, :], kk)
                vv = jnp.where(new, rows[1][:, :, None, :], vv)
            sh = jnp.einsum("bhgd,bhtd->bhgt", qg, kk.astype(jnp.float32), precision="highest") * scale
            sh = jnp.where((pos[None, :] < lens[:, None])[:, None, None, :], sh, -jnp.inf)
            parts.append((sh, vv.astype(jnp.float32)))
            mx = jnp.maximum(mx, sh.max(-1))
        if rows is not None and size:
            p = write_plan(cache, rows[0], rows[1], ids[0], ids[1], ids[2])._replace(xs={"k": rows[0], "v": rows[1]})
            c_m, fields, bad = _quantized_completions(cache, p, size, quantizer)
            completed = (c_m, fields)
            altered = altered.at[2].add(bad[0])
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(s - jnp.concatenate([mx, jnp.zeros((1, hk, g))])[jnp.clip(row, 0, b)][..., None])
    den = jax.ops.segment_sum(p.sum(-1), row, num_segments=b + 1, indices_are_sorted=True)[:b]
    o = jax.ops.segment_sum(jnp.einsum("nhgb,hnbd->nhgd", p, v, precision="highest"), row, num_segments=b + 1,
                            indices_are_sorted=True)[:b]
    for sh, vv in parts:
        ph = jnp.exp(sh - mx[..., None])
        den = den + ph.sum(-1)
        o = o + jnp.einsum("bhgt,bhtd->bhgd", ph, vv, precision="highest")
    o = (o / jnp.where(den > 0, den, 1.0)[..., None]).reshape(b, hq, d)
    if cache.cfg.rotated:
        o = unrotate(o)
    o = o.astype(q.dtype)
    return o if kv is None else (rows, o, completed, altered)


def _decode_inputs(bound, plan):
    """The decode rows' per-step JAX inputs (entries, info, the entries' block ids), made once per step."""
    passthrough = bound.cfg.is_passthrough

    def make():
        entries, info = plan.decode_entries(passthrough)
        return tuple(_to_jax(plan.to_device(x, torch.int32)) for x in (entries, info)) + (
            _to_jax(_entry_blocks(plan, entries)),)
    return plan.cached(("decode_served", passthrough), make)


def _decode_rows_served(bound, query, plan, scale, out):
    nd = plan.num_decodes
    e_j, i_j, b_j = _decode_inputs(bound, plan)
    q = _pad_rows(query[:nd], i_j.shape[1])
    q_j = _to_jax(q)  # the fence (module docstring)
    res = _decode_served(q_j, bound.cache, b_j, e_j, i_j, scale=scale)
    o = _to_torch(res)
    out[:nd].copy_(o[:nd])
    return (q, q_j, res, o)


def _decode_step_served(bound, query, key, value, plan, scale, out):
    """A decode-only step on the CPU: the write and the attention in one XLA computation
    (`_decode_served` with kv); torch then stores the rows (and completed pages) and the output."""
    nd, c = plan.num_decodes, plan.completing
    e_j, i_j, b_j = _decode_inputs(bound, plan)
    bb = i_j.shape[1]
    q = _pad_rows(query[:nd], bb)
    kv = torch.stack((_pad_rows(key[:nd], bb), _pad_rows(value[:nd], bb)))
    q_j, kv_j = _to_jax(q), _to_jax(kv)
    size, ids_j, quantizer = 0, None, "reference"
    if c and not bound.cfg.is_passthrough:
        sizes = completion_sizes(bound.cache, bb)
        size = next(m for m in sizes if m >= c)
        ids_j = plan.cached(("decode_write_ids", bb), lambda: _to_jax(_write_ids(plan, bb)))
        quantizer = auto_quantizer(bound.cache)
    rows_j, res, completed, altered = _decode_served(q_j, bound.cache, b_j, e_j, i_j, kv_j, ids_j, scale=scale,
                                                     size=size, quantizer=quantizer)
    altered_t = _to_torch(altered)
    _count_altered(q.device, altered_t)
    held = [q, kv, q_j, kv_j, rows_j, res, completed, altered, altered_t]
    if completed is not None:  # before the rows: the pages came from the ring as it was
        blocks = _to_torch(completed[0])[:c].to(torch.int64)
        for key_, f in completed[1].items():
            vals = _to_torch(f)
            bound.views[key_].index_copy_(0, blocks, vals[:c])
            held.append(vals)
    rows = _to_torch(rows_j)[:, :nd]
    dst, src = _row_destinations(plan, bound)
    flat = rows.reshape(-1, bound.layout.head_dim)
    bound.rows.index_copy_(0, dst, flat if src is None else flat.index_select(0, src))
    o = _to_torch(res)
    out[:nd].copy_(o[:nd])
    return held + [rows, o]


def _prefill_mask(plan: StepPlan, r: int, passthrough: bool, device, dtype) -> torch.Tensor:
    """Row r's additive mask [q_len, keys]: keys are its served blocks (all of them for passthrough
    caches, else those before its last block), then - quantized caches - its own blocks' high-
    precision rows from the start of the chunk's first block. A query sees the blocks before its own
    block and its own block up to itself."""
    bs = plan.block_size
    ctx, ql = int(plan.context[r]), int(plan.q_len[r])
    last = (int(plan.seq_len[r]) - 1) // bs
    qpos = ctx + np.arange(ql)
    if passthrough:
        ok = np.arange((last + 1) * bs)[None, :] <= qpos[:, None]
    else:
        own = np.arange(ctx // bs * bs, ctx + ql)
        ok = np.concatenate([np.arange(last * bs)[None, :] // bs < qpos[:, None] // bs,
                             (own[None, :] // bs == qpos[:, None] // bs) & (own[None, :] <= qpos[:, None])], 1)
    mask = torch.from_numpy(np.where(ok, 0.0, -np.inf).astype(np.float32)).to(dtype)
    return mask if device.type == "cpu" else mask.pin_memory().to(device, non_blocking=True)


def _prefill_rows(bound, query, plan, k, v, offsets, written, scale, out):
    """Prefill rows, one fused SDPA call per row over its keys: its served blocks (`_served_blocks`),
    for quantized caches followed by its own blocks' high-precision rows (the chunk's first block
    from before the write, then the chunk's new rows), with the semantics' mask (`_prefill_mask`).
    A row's result depends only on its own keys, never on the batch it is in."""
    lay = bound.layout
    hk, bs, d = lay.num_kv_heads, lay.block_size, lay.head_dim
    hq = query.shape[1]
    g = hq // hk
    passthrough = bound.cfg.is_passthrough
    cdt = bound.compute_dtype
    for r in range(plan.num_decodes, plan.num_rows):
        a, ql = int(plan.q_start[r]), int(plan.q_len[r])
        if ql == 0:
            continue
        q = query[a:a + ql]
        q = (_rotate(bound, q, None) if bound.cfg.rotated else q).to(cdt)
        ks, vs = k[:, int(offsets[r]) * bs:int(offsets[r + 1]) * bs], v[:, int(offsets[r]) * bs:int(offsets[r + 1]) * bs]
        if not passthrough:
            before = written.before.get(r)
            ks, vs = ([x, *([] if before is None else [before[i].to(cdt)]),
                       written.rows[i, a:a + ql].transpose(0, 1).to(cdt)] for i, x in enumerate((ks, vs)))
            ks, vs = torch.cat(ks, 1), torch.cat(vs, 1)
        mask = plan.cached(("prefill_mask", r, passthrough, cdt),
                           lambda: _prefill_mask(plan, r, passthrough, query.device, cdt))
        if g > 1 and ql > 2 * hk * d * (g - 1) // g:
            # long chunks: each query head gets its kv head's keys (a copy the size of the keys)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ks.repeat_interleave(g, 0)[None],
                                               vs.repeat_interleave(g, 0)[None], attn_mask=mask[None, None],
                                               scale=scale)[0].transpose(0, 1)
        else:
            # short chunks: the query heads of kv head h side by side, [Hk, G * ql, D], the mask repeated
            qf = q.view(ql, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * ql, d)
            mg = plan.cached(("prefill_mask_g", r, passthrough, g, cdt), lambda: mask.repeat(g, 1))
            o = F.scaled_dot_product_attention(qf[None], ks[None], vs[None], attn_mask=mg[None, None], scale=scale)[0]
            o = o.view(hk, g, ql, d).permute(2, 0, 1, 3).reshape(ql, hq, d)
        if bound.cfg.rotated:
            o = _rotate(bound, o)
        out[a:a + ql].copy_(o)


def attend(bound: BoundCache, query: torch.Tensor, plan: StepPlan, *, written: Written | None = None,
           scale: float | None = None, impl: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's queries ([tokens, Hq, D]) over the bound cache, after this step's
    `write` (whose result `written` prefill rows need). Returns `out` ([tokens, Hq, D], query's dtype
    unless given) with every row's result. impl: what decode rows run, "auto" | "pallas" | "reference"
    (see `decode_impl`)."""
    t0 = time.perf_counter()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    _check_plan(bound, plan)
    n, nd = plan.num_tokens, plan.num_decodes
    _check_tokens(bound, query, "query", n, None)
    if out is None:
        out = query.new_empty(query.shape)
    elif tuple(out.shape) != tuple(query.shape):
        raise ValueError(f"out must be {tuple(query.shape)} like query, got {tuple(out.shape)}")
    prefill = plan.num_rows > nd
    if prefill and written is None:
        raise ValueError("prefill rows need this step's `write` result (written=)")
    sm = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    which = decode_impl(impl) if nd else None
    held = []
    if which in ("auto", "pallas", "reference"):
        held.append(_decode_rows_library(bound, query, plan, sm, which, out))
    elif which == "served":
        held.append(_decode_rows_served(bound, query, plan, sm, out))
    if prefill:
        k, v, offsets, keep = _served_blocks(bound, plan)
        held += [k, v, keep]
        _prefill_rows(bound, query, plan, k, v, offsets, written, sm, out)
    bound.held_attend = tuple(held)
    count(decode_calls=int(nd > 0), decode_rows=nd, prefill_calls=int(prefill), prefill_tokens=n - nd,
          attend_s=time.perf_counter() - t0)
    return out


def forward(bound: BoundCache, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: StepPlan, *,
            scale: float | None = None, impl: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """One attention layer of a step: `write` the step's key/value, then `attend` (what vLLM's impl
    calls). On the CPU a decode-only step runs both in one XLA computation (`_decode_step_served`):
    vLLM's CPU worker pins its threads to every core, and each torch op it then runs costs a wake-up
    of all of them - one JAX call instead of a dozen small ops."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    n, nd = plan.num_tokens, plan.num_decodes
    if not (nd == plan.num_rows and nd and decode_impl(impl) == "served"):
        written = write(bound, key, value, plan)
        return attend(bound, query, plan, written=written, scale=scale, impl=impl, out=out)
    t0 = time.perf_counter()
    _check_plan(bound, plan)
    _check_tokens(bound, key, "key", n, bound.layout.num_kv_heads)
    _check_tokens(bound, value, "value", n, bound.layout.num_kv_heads)
    _check_tokens(bound, query, "query", n, None)
    if out is None:
        out = query.new_empty(query.shape)
    elif tuple(out.shape) != tuple(query.shape):
        raise ValueError(f"out must be {tuple(query.shape)} like query, got {tuple(out.shape)}")
    sm = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    bound.held_write = ()
    bound.held_attend = tuple(_decode_step_served(bound, query, key, value, plan, sm, out))
    dt = time.perf_counter() - t0
    count(write_calls=1, write_tokens=n, blocks_quantized=0 if bound.cfg.is_passthrough else plan.completing,
          decode_calls=1, decode_rows=nd, attend_s=dt)
    return out


__all__ = ["BoundCache", "bind", "write", "attend", "forward", "Written", "stored_rows", "decode_impl", "counters", "count",
           "reset_counters", "PageLayout", "StepPlan", "allocate_hp", "IMPLS"]
