"""Torch-level entry points: kvarn_jax on vLLM's torch tensors through DLPack.

`bind` turns one layer's vLLM cache tensor into a `kvarn_jax.PagedKVCache` whose leaves are views of
that tensor (no copy; checked by data pointer). Then:

- `write(bound, k, v, slot_mapping, seq_ids, positions)` stores new tokens *in place*. XLA cannot
  write into a buffer it imported from torch (a jitted, donating `kvarn_jax.write` returns a fresh
  buffer on CPU), so the write is split: a jitted JAX function reads the cache in place and computes
  only what changes - the new tokens' sink/tail rows in the storage frame and the fields of every
  block this write completes (quantized exactly as `kvarn_jax.write` does) - and torch stores those
  rows/blocks with one indexed copy per leaf. What is copied: the new tokens' rows (K and V,
  model dtype) and the completed blocks' page bytes; nothing else of the cache moves.
- `decode(...)` runs `kvarn_jax.paged_decode_attention` (the Pallas kernel on NVIDIA GPUs, the
  reference elsewhere) reading the cache in place; the result comes back zero-copy.
- `prefill(...)` attends queries of several tokens per sequence (prefill and chunked prefill)
  causally over everything the cache holds for their sequences (`kvarn_jax.gather_dense`: quantized
  full blocks, high-precision sink and tail), after the same step's `write` - the semantics of
  vLLM's own paged backends, which also read a chunk's keys back from the cache.

Token and batch counts are padded to powers of two (padding slots are -1, padding rows have length
0) so that XLA compiles a handful of shapes, not one per step.

No host synchronization on a GPU (when the caller passes what only the host knows, as the vLLM impl
does: `completing`, `max_seq_len`, and `check_values=False`): torch and JAX work on different CUDA
streams and DLPack orders them - importing a torch tensor into JAX makes JAX's stream wait for
torch's pending work, exporting a JAX array to torch makes torch's stream wait for JAX's - so a
layer's write, decode and the next layer's torch work are queued, not waited for. Each bound cache
keeps its last call's exchanged arrays alive until its next call, so that neither framework's
allocator reuses a buffer the other one's stream may still read.
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

import kvarn_jax
from kvarn_jax import schemes
from kvarn_jax.cache.paged import (auto_quantizer, completed_block_bound, completed_blocks, completion_sizes,
                                   write_plan)
from kvarn_jax.hadamard import rotate, unrotate

from .layout import PageLayout, allocate_hp, carve, to_jax

# ------------------------------------------------------------------------------------- counters
_COUNTERS = {"bind": 0, "write_calls": 0, "write_tokens": 0, "blocks_quantized": 0, "decode_calls": 0,
             "decode_rows": 0, "prefill_calls": 0, "prefill_tokens": 0, "write_s": 0.0, "decode_s": 0.0,
             "prefill_s": 0.0, "seq_starts": 0, "seq_restarts": 0}
_LOCK = threading.Lock()


def count(**kw) -> None:
    """Add to the counters (also used by the metadata builder for sequence starts/restarts)."""
    _count(**kw)


def _count(**kw):
    with _LOCK:
        for k, n in kw.items():
            _COUNTERS[k] += n


def counters() -> dict:
    """How often the bridge ran (per process): binds, writes, tokens written, blocks quantized,
    decode/prefill calls and rows/tokens, the seconds spent in each entry point, and how many
    sequences started (restarts: a request that started again at position 0, e.g. after vLLM
    preempted it)."""
    with _LOCK:
        return dict(_COUNTERS)


def reset_counters() -> None:
    with _LOCK:
        for k in _COUNTERS:
            _COUNTERS[k] = 0.0 if k.endswith("_s") else 0


# ------------------------------------------------------------------------------------- binding
@dataclasses.dataclass
class BoundCache:
    """One layer's cache: the torch views into vLLM's memory and the JAX cache sharing them."""

    layout: PageLayout
    num_blocks: int
    views: dict
    cache: kvarn_jax.PagedKVCache
    buffer: torch.Tensor
    # the last call's arrays exchanged through DLPack (module docstring): replaced by the next call
    in_flight: tuple = ()

    def pointers(self) -> dict:
        """{leaf key: (torch data_ptr, JAX buffer pointer)} - equal pairs prove the import is zero-copy."""
        out = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.cache)[0]:
            key = ".".join(str(getattr(p, "name", getattr(p, "key", p))) for p in path)
            if key in self.views:
                out[key] = (self.views[key].data_ptr(), leaf.unsafe_buffer_pointer())
        return out


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
    bound = BoundCache(layout, num_blocks, views, cache, flat)
    for key, (tp, jp) in bound.pointers().items():
        if tp != jp:
            raise ValueError(f"DLPack import of {key} copied the buffer (torch {tp:#x}, jax {jp:#x}); "
                             "the bridge only runs zero-copy")
    _count(bind=1)
    return bound


# ------------------------------------------------------------------------------------- helpers
def _bucket(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def _to_jax(t: torch.Tensor):
    """A torch tensor as a JAX array; zero-copy when dense and aligned (inputs may be copied: they
    are this step's new tokens, not the cache)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return jax.dlpack.from_dlpack(t)


def _to_torch(x) -> torch.Tensor:
    return torch.from_dlpack(x)


def _pad_rows(t: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    if t.shape[0] == n:
        return t
    out = torch.full((n,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


# the high-precision leaves a write stores token rows into, each with the index pair (row, offset)
# it uses: k and v of one kind share their routing, so their indices are exported once
_HP_LEAVES = (("sink.k", 0), ("sink.v", 0), ("tail.k", 1), ("tail.v", 1))
_PASSTHROUGH_LEAVES = (("pages.k.values", 0), ("pages.v.values", 0))


@functools.partial(jax.jit, static_argnames=("max_complete", "quantizer"))
def write_delta(cache, kv, ids, max_complete: int | None = None, quantizer: str = "reference") -> dict:
    """What `kvarn_jax.write(cache, k, v, slot_mapping, seq_ids, positions)` would change.

    kv: [2, n, Hk, D] (keys, values); ids: int32 [3, n] (slot_mapping, seq_ids, positions): packed
    so that torch hands JAX two arrays per write (each DLPack import costs ~80 us of host time on
    the H200). Returns
      "rows_index" [2 * P, n] int32 and "rows" [L, n, Hk, D]: leaf `_HP_LEAVES[j]` (passthrough:
        `_PASSTHROUGH_LEAVES[j]`), index pair p, gets leaf[rows_index[2p], :, rows_index[2p+1]] =
        rows[j];
      quantized caches with max_complete > 0, also "page_index" [m] and "pages" {leaf key: [m, ...]}:
        leaf[page_index] = pages[key], the fields of the blocks this write completes.
    Storing every entry reproduces the library's write exactly (tested bit for bit against it) when
    the write's targets are distinct (vLLM's are: one slot per token); for a slot given twice in one
    write neither the library's scatter nor this defines which token is kept. The routing and the
    completed blocks come from the library's own `write_plan` / `completed_blocks`.
    Every index is a valid row: an entry that stores nothing (padding, a token routed elsewhere, an
    unused block candidate) repeats another entry of its leaf - same row, same values - or, where
    the leaf gets nothing, rewrites row 0 with its current contents. So torch stores a leaf with one
    indexed copy and never has to read back which entries are live (that would wait for the GPU).
    The cache is only read. max_complete: a static bound on the blocks this write completes
    (default: the library's bound from the token count); 0 skips quantization, which most decode
    steps need. quantizer: as in the library (`kvarn_jax.cache.paged.auto_quantizer`).
    """
    k, v = kv[0], kv[1]
    p = write_plan(cache, k, v, ids[0], ids[1], ids[2])
    if cache.cfg.is_passthrough:
        routes = [(jnp.where(p.in_range, p.blk, -1), p.off)]
        leaves = [(cache.pages[s]["values"], p.xs[s]) for s in schemes.SIDES]
    else:
        routes = [(jnp.where(p.is_sink, p.seq, -1), p.off), (jnp.where(p.in_ring, p.seq, -1), p.pos % cache.tail_len)]
        leaves = [(cache.sink[s], p.xs[s]) for s in schemes.SIDES] + [(cache.tail[s], p.xs[s]) for s in schemes.SIDES]
    index, rows = [], []
    for r, (i0, i2) in enumerate(routes):
        for leaf, x in leaves[2 * r:2 * r + 2]:  # k and v: the same routing, so the same live entries
            a, b, vals = _every_entry_live(leaf, i0, i2, x.astype(leaf.dtype))
            rows.append(vals)
        index += [a, b]
    out = {"rows_index": jnp.stack(index).astype(jnp.int32), "rows": jnp.stack(rows)}
    if cache.cfg.is_passthrough:
        return out
    n = k.shape[0]
    m = completed_block_bound(cache, n) if max_complete is None else min(max_complete, n)
    if m == 0:
        return out
    c_m, fields = completed_blocks(cache, p, m, quantizer)
    blocks = jnp.where(c_m < cache.num_blocks, c_m, -1)
    out["pages"] = {}
    for s in schemes.SIDES:
        for name, f in fields[s].items():
            leaf = cache.pages[s][name]
            out["page_index"], _, out["pages"][f"pages.{s}.{name}"] = _every_entry_live(leaf, blocks, None,
                                                                                     f.astype(leaf.dtype))
    out["page_index"] = out["page_index"].astype(jnp.int32)
    return out


def _every_entry_live(leaf, i0, i2, vals):
    """(i0, i2, vals) with the entries i0 == -1 made harmless (see `write_delta`): they take the
    first live entry's row and values, or with none row 0 (offset 0) and its current contents."""
    live = i0 >= 0
    first = jnp.argmax(live)
    any_live = live[first]
    cur = leaf[0] if i2 is None else leaf[0, :, 0]
    fill = jnp.where(any_live, vals[first], cur.astype(vals.dtype))
    keep = live.reshape(live.shape + (1,) * (vals.ndim - 1))
    i0 = jnp.where(live, i0, jnp.where(any_live, i0[first], 0))
    if i2 is not None:
        i2 = jnp.where(live, i2, jnp.where(any_live, i2[first], 0))
    return i0, i2, jnp.where(keep, vals, fill[None])


def _apply_delta(bound: BoundCache, delta: dict) -> list:
    """Store a `write_delta` into the torch views in place (queued on torch's stream, nothing read
    back); returns the torch tensors of the delta (kept alive until the next call)."""
    views = bound.views
    index, rows = _to_torch(delta["rows_index"]), _to_torch(delta["rows"])
    held = [index, rows]
    for j, (key, pair) in enumerate(_PASSTHROUGH_LEAVES if bound.layout.cfg.is_passthrough else _HP_LEAVES):
        views[key][index[2 * pair], :, index[2 * pair + 1]] = rows[j]
    if "pages" in delta:
        blocks = _to_torch(delta["page_index"])
        held.append(blocks)
        for key, vals in delta["pages"].items():
            vals = _to_torch(vals)
            views[key][blocks] = vals
            held.append(vals)
    return held


def _check_tokens(bound: BoundCache, key, value, slot_mapping, seq_ids, positions, check_values: bool):
    lay = bound.layout
    for name, x in (("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (lay.num_kv_heads, lay.head_dim):
            raise ValueError(f"{name} must be a [tokens, {lay.num_kv_heads}, {lay.head_dim}] tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    n = key.shape[0]
    if value.shape[0] != n:
        raise ValueError(f"key has {n} tokens, value {value.shape[0]}")
    for name, x in (("slot_mapping", slot_mapping), ("seq_ids", seq_ids), ("positions", positions)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != n or x.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor of {n} entries, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if check_values and n:
        sm, sid, pos = (x.detach().cpu().numpy().astype(np.int64) for x in (slot_mapping, seq_ids, positions))
        live = sm != -1
        limit = bound.num_blocks * lay.block_size
        if np.any(live & ((sm < 0) | (sm >= limit))):
            raise ValueError(f"slot_mapping has entries outside [0, {limit}) (or -1 for padding)")
        if np.any(live & ((sid < 0) | (sid >= lay.max_seqs))):
            raise ValueError(f"seq_ids must be in [0, max_seqs={lay.max_seqs})")
        if np.any(live & ((pos < 0) | (pos % lay.block_size != sm % lay.block_size))):
            raise ValueError("positions must be >= 0 and position % block_size must equal slot % block_size")
        # blocks this write completes (last slot written, not the sink): bounds the quantization work
        return int(np.sum(live & (pos >= lay.block_size) & (pos % lay.block_size == lay.block_size - 1)))
    return None


def write(bound: BoundCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
          seq_ids: torch.Tensor, positions: torch.Tensor, *, check_values: bool = True,
          completing: int | None = None) -> None:
    """Store `key`/`value` ([tokens, Hk, D]) in the bound cache, in place (see the module docstring).

    slot_mapping: vLLM's slots (-1 = padding); seq_ids: each token's high-precision slot in
    [0, max_seqs); positions: each token's position in its sequence. check_values: validate index
    ranges on the host (cheap for CPU tensors; it synchronizes a GPU). completing: how many blocks
    this write completes (tokens at position >= block_size with position % block_size ==
    block_size - 1), counted by the caller on the host - the vLLM metadata builder has the
    positions there; it sizes the quantization and must not be lower than the true count (blocks
    past it would not be quantized; with check_values it is verified). None: counted here, which
    reads one scalar back from a GPU. Nothing else waits for the device: the result is queued.
    """
    t0 = time.perf_counter()
    counted = _check_tokens(bound, key, value, slot_mapping, seq_ids, positions, check_values)
    if completing is not None:
        if not isinstance(completing, (int, np.integer)) or completing < 0:
            raise ValueError(f"completing must be a non-negative int or None, got {completing!r}")
        if counted is not None and completing < counted:
            raise ValueError(f"completing={completing} but this write completes {counted} blocks")
    else:
        completing = counted
    n = key.shape[0]
    if n == 0:
        return
    nb = _bucket(n)
    kv = torch.zeros((2, nb) + tuple(key.shape[1:]), dtype=torch.promote_types(key.dtype, value.dtype),
                     device=key.device)
    kv[0, :n], kv[1, :n] = key, value
    ids = torch.zeros((3, nb), dtype=torch.int32, device=key.device)
    ids[0, :n], ids[0, n:] = slot_mapping, -1            # padding slots: -1
    ids[1, :n], ids[2, :n] = seq_ids, positions
    kv_j, ids_j = _to_jax(kv), _to_jax(ids)
    if completing is None and not bound.layout.cfg.is_passthrough:
        # blocks this write completes, counted where the tensors live (one scalar read back); without
        # it every call would quantize the library's worst-case number of blocks
        bs = bound.layout.block_size
        completing = int(((slot_mapping != -1) & (positions >= bs) & (positions % bs == bs - 1)).sum())
    if bound.layout.cfg.is_passthrough or completing is None:
        bound_m = None  # passthrough quantizes nothing: one compiled shape
    elif completing == 0:
        bound_m = 0
    else:  # the library's sizes, so that pages match `kvarn_jax.write` bit for bit
        sizes = completion_sizes(bound.cache, nb)
        bound_m = next((m for m in sizes if m >= completing), sizes[-1])
    delta = write_delta(bound.cache, kv_j, ids_j, max_complete=bound_m, quantizer=auto_quantizer(bound.cache))
    held = _apply_delta(bound, delta)
    bound.in_flight = (kv, ids, kv_j, ids_j, delta, held)
    _count(write_calls=1, write_tokens=n, blocks_quantized=0 if bound.layout.cfg.is_passthrough else completing,
           write_s=time.perf_counter() - t0)


# ------------------------------------------------------------------------------------- attention
def _check_rows(bound, query, block_tables, seq_lens, seq_ids, rows):
    lay = bound.layout
    if not isinstance(query, torch.Tensor) or query.dim() != 3 or query.shape[2] != lay.head_dim:
        raise ValueError(f"query must be [tokens, num_heads, {lay.head_dim}], got {getattr(query, 'shape', None)}")
    if query.shape[1] % lay.num_kv_heads:
        raise ValueError(f"query has {query.shape[1]} heads, not a multiple of num_kv_heads={lay.num_kv_heads}")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.shape[0] != rows:
        raise ValueError(f"block_tables must be [{rows}, max_blocks], got {getattr(block_tables, 'shape', None)}")
    for name, x in (("seq_lens", seq_lens), ("seq_ids", seq_ids)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != rows:
            raise ValueError(f"{name} must be a 1-D tensor of {rows} entries, got {getattr(x, 'shape', None)}")


def decode(bound: BoundCache, query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           seq_ids: torch.Tensor, *, scale: float | None = None, impl: str = "auto", max_seq_len: int | None = None,
           check_values: bool = True) -> torch.Tensor:
    """One query token per sequence: query [B, Hq, D] -> [B, Hq, D] (query's dtype), via
    `kvarn_jax.paged_decode_attention` reading the bound cache in place.

    block_tables [B, max_blocks], seq_lens [B] (tokens in the cache, the query's own included),
    seq_ids [B] (high-precision slots). impl: 'auto' | 'pallas' | 'reference' (see the library).
    max_seq_len: the longest of seq_lens, known to the caller on the host (vLLM's metadata has it;
    an upper bound is fine): it picks how many block-table columns the kernel gets. None: read
    from seq_lens (waits for a GPU). check_values: the library's range checks of the block ids,
    lengths and slots (they read the tensors back: False on a GPU keeps the call asynchronous; the
    kernels clamp indices either way). The returned tensor is a zero-copy view of JAX's result,
    which torch's stream waits for - nothing here waits on the host.
    """
    t0 = time.perf_counter()
    b = query.shape[0]
    _check_rows(bound, query, block_tables, seq_lens, seq_ids, b)
    if b == 0:
        return query.new_empty(query.shape)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    elif not isinstance(max_seq_len, (int, np.integer)) or max_seq_len < 0:
        raise ValueError(f"max_seq_len must be a non-negative int or None, got {max_seq_len!r}")
    bb = _bucket(b, 1)
    cols = _used_columns(max_seq_len, bound.layout.block_size, block_tables.shape[1])
    # one int32 array [bb, cols + 2]: the block table, then the lengths and the slots (padding rows:
    # length 0) - two DLPack imports per call instead of four (~80 us of host time each on the H200)
    idx = torch.zeros((bb, cols + 2), dtype=torch.int32, device=query.device)
    idx[:b, :cols], idx[:b, cols], idx[:b, cols + 1] = block_tables[:, :cols], seq_lens, seq_ids
    q, idx_j = _to_jax(_pad_rows(query, bb)), _to_jax(idx)
    passthrough = bound.layout.cfg.is_passthrough  # no high-precision slots (and no seq_ids)
    if check_values:  # the library's eager checks need the arrays themselves
        bt, sl, sid = idx_j[:, :cols], idx_j[:, cols], idx_j[:, cols + 1]
        out = kvarn_jax.paged_decode_attention(q, bound.cache, bt, sl, scale, seq_ids=None if passthrough else sid,
                                               impl=impl)
    else:
        out = _decode_unchecked(q, bound.cache, idx_j, scale=scale, impl=impl, passthrough=passthrough)
    res = _to_torch(out)
    bound.in_flight = (idx, q, idx_j, out, res)
    _count(decode_calls=1, decode_rows=b, decode_s=time.perf_counter() - t0)
    return res[:b]


@functools.partial(jax.jit, static_argnames=("scale", "impl", "passthrough"))
def _decode_unchecked(q, cache, idx, *, scale, impl, passthrough):
    """The library's decode on the packed indices of `decode`, in one dispatch."""
    cols = idx.shape[1] - 2
    return kvarn_jax.paged_decode_attention(q, cache, idx[:, :cols], idx[:, cols], scale,
                                            seq_ids=None if passthrough else idx[:, cols + 1], impl=impl,
                                            check_values=False)


@functools.partial(jax.jit, static_argnames=("scale",))
def _prefill_attend(q, cache, block_table, seq_len, seq_id, q_len, *, scale):
    """Causal attention of one sequence's last `q_len` positions over its cached tokens.

    q [Tq, Hq, D] (rows >= q_len are padding); block_table [1, blocks]; seq_len, seq_id, q_len [1].
    """
    tq, hq, d = q.shape
    hk = cache.num_kv_heads
    qf = q.astype(jnp.float32)
    if cache.cfg.rotated:
        qf = rotate(qf)
    k, v = kvarn_jax.gather_dense(cache, block_table, seq_len, seq_id)      # [1, Hk, L, D]
    length = k.shape[2]
    qg = qf.reshape(tq, hk, hq // hk, d)
    s = jnp.einsum("qhgd,hld->hgql", qg, k[0], precision="highest") * scale
    qpos = seq_len[0] - q_len[0] + jnp.arange(tq)
    kpos = jnp.arange(length)
    mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seq_len[0])
    s = jnp.where(mask[None, None], s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("hgql,hld->qhgd", p / jnp.where(den > 0, den, 1.0), v[0], precision="highest")
    o = o.reshape(tq, hq, d)
    if cache.cfg.rotated:
        o = unrotate(o)
    return o.astype(q.dtype)


def _used_columns(max_seq_len: int, block_size: int, width: int) -> int:
    """Block-table columns the longest sequence uses, rounded up to a power of two (few shapes)."""
    need = max(1, -(-int(max_seq_len) // block_size))
    return min(width, 1 << (need - 1).bit_length())


def prefill(bound: BoundCache, query: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, seq_ids: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Several query tokens per sequence (prefill, chunked prefill), causally over the cache.

    query [T, Hq, D]: the sequences' query tokens back to back; query_start_loc [R + 1] (row r's
    queries are query[qsl[r]:qsl[r+1]], the last positions of its seq_lens[r] tokens, which `write`
    has already stored). Returns [T, Hq, D] in query's dtype. Each row is one call whose query count
    and key length are padded to powers of two.
    """
    t0 = time.perf_counter()
    rows = seq_lens.shape[0]
    _check_rows(bound, query, block_tables, seq_lens, seq_ids, rows)
    if not isinstance(query_start_loc, torch.Tensor) or tuple(query_start_loc.shape) != (rows + 1,):
        raise ValueError(f"query_start_loc must have {rows + 1} entries")
    qsl = query_start_loc.detach().cpu().numpy().astype(np.int64)
    lens = seq_lens.detach().cpu().numpy().astype(np.int64)
    t = int(qsl[-1] - qsl[0])
    if t != query.shape[0]:
        raise ValueError(f"query_start_loc spans {t} tokens but query has {query.shape[0]}")
    q_lens = np.diff(qsl)
    if np.any(q_lens < 0) or np.any(q_lens > lens):
        raise ValueError("query_start_loc must be non-decreasing with at most seq_lens[r] queries per row")
    out = query.new_empty(query.shape)
    if t == 0:
        return out
    sm = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    bt = block_tables.to(torch.int32)
    sid = seq_ids.to(torch.int32)
    pending = []
    for r in range(rows):
        a, n = int(qsl[r] - qsl[0]), int(q_lens[r])
        if n == 0:
            continue
        cols = _used_columns(lens[r], bound.layout.block_size, bt.shape[1])
        # the row's torch inputs stay referenced until its result is ready: JAX frees an imported
        # buffer without waiting for its stream, so torch could otherwise hand the memory to the
        # next row's inputs while this row's kernel still reads it
        args = (_pad_rows(query[a:a + n], _bucket(n)), bt[r:r + 1, :cols].contiguous(),
                seq_lens[r:r + 1].to(torch.int32), sid[r:r + 1].contiguous(),
                torch.tensor([n], dtype=torch.int32, device=query.device))
        qj, btj, slj, sidj, nj = (_to_jax(x) for x in args)
        res = _prefill_attend(qj, bound.cache, btj, slj, None if bound.layout.cfg.is_passthrough else sidj, nj,
                              scale=sm)
        pending.append((a, n, res, args))
    for a, n, res, _ in pending:
        out[a:a + n] = _to_torch(jax.block_until_ready(res))[:n]
    _count(prefill_calls=1, prefill_tokens=t, prefill_s=time.perf_counter() - t0)
    return out


__all__ = ["BoundCache", "bind", "write", "write_delta", "decode", "prefill", "counters", "count",
           "reset_counters", "PageLayout", "allocate_hp"]
