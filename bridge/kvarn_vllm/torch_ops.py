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


def _sync_torch(device: torch.device) -> None:
    # JAX and torch use different CUDA streams: make torch's pending work visible to JAX.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _pad_rows(t: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    if t.shape[0] == n:
        return t
    out = torch.full((n,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


@functools.partial(jax.jit, static_argnames=("max_complete", "quantizer"))
def write_delta(cache, k, v, slot_mapping, seq_ids, positions, max_complete: int | None = None,
                quantizer: str = "reference") -> dict:
    """What `kvarn_jax.write(cache, k, v, ...)` would change, as {leaf key: (idx0, idx2, values)}.

    The leaf's rows `leaf[idx0, :, idx2] = values` (idx2 None: `leaf[idx0] = values`) with idx0 == -1
    skipped reproduce the library's write exactly (tested bit for bit against it): the routing and
    the completed blocks come from the library's own `write_plan` / `completed_blocks`. The cache is
    only read. max_complete: a static bound on the blocks this write completes (default: the
    library's bound from the token count); 0 skips quantization, which most decode steps need.
    quantizer: as in the library (`kvarn_jax.cache.paged.auto_quantizer`).
    """
    p = write_plan(cache, k, v, slot_mapping, seq_ids, positions)
    out = {}
    if cache.cfg.is_passthrough:
        for s in schemes.SIDES:
            out[f"pages.{s}.values"] = (jnp.where(p.in_range, p.blk, -1), p.off, p.xs[s])
        return out
    for s in schemes.SIDES:
        out[f"sink.{s}"] = (jnp.where(p.is_sink, p.seq, -1), p.off, p.xs[s])
        out[f"tail.{s}"] = (jnp.where(p.in_ring, p.seq, -1), p.pos % cache.tail_len, p.xs[s])
    n = k.shape[0]
    m = completed_block_bound(cache, n) if max_complete is None else min(max_complete, n)
    if m == 0:
        return out
    c_m, fields = completed_blocks(cache, p, m, quantizer)
    blocks = jnp.where(c_m < cache.num_blocks, c_m, -1)
    for s in schemes.SIDES:
        for name, f in fields[s].items():
            out[f"pages.{s}.{name}"] = (blocks, None, f.astype(cache.pages[s][name].dtype))
    return out


def _apply_delta(views: dict, delta: dict) -> int:
    """Store a `write_delta` into the torch views in place; returns the number of pages written."""
    pages, counted = 0, False
    for key, (i0, i2, vals) in delta.items():
        t = views[key]
        i0 = _to_torch(i0)
        sel = torch.nonzero(i0 >= 0).squeeze(1)
        if sel.numel() == 0:
            continue
        rows = i0[sel].long()
        vals_t = _to_torch(vals).index_select(0, sel)
        if i2 is None:
            t.index_copy_(0, rows, vals_t)
            if not counted:  # every completed block writes every field: count one
                pages, counted = sel.numel(), True
        else:
            t[rows, :, _to_torch(i2).index_select(0, sel).long()] = vals_t
    return pages


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
          seq_ids: torch.Tensor, positions: torch.Tensor, *, check_values: bool = True) -> None:
    """Store `key`/`value` ([tokens, Hk, D]) in the bound cache, in place (see the module docstring).

    slot_mapping: vLLM's slots (-1 = padding); seq_ids: each token's high-precision slot in
    [0, max_seqs); positions: each token's position in its sequence. check_values: validate index
    ranges on the host (cheap for CPU tensors; it synchronizes a GPU; without it one scalar, the
    number of blocks this write completes, is still read back).
    """
    t0 = time.perf_counter()
    completing = _check_tokens(bound, key, value, slot_mapping, seq_ids, positions, check_values)
    n = key.shape[0]
    if n == 0:
        return
    nb = _bucket(n)
    dev = key.device
    _sync_torch(dev)
    k = _to_jax(_pad_rows(key, nb))
    v = _to_jax(_pad_rows(value, nb))
    sm = _to_jax(_pad_rows(slot_mapping.to(torch.int32), nb, -1))
    sid = _to_jax(_pad_rows(seq_ids.to(torch.int32), nb, 0))
    pos = _to_jax(_pad_rows(positions.to(torch.int32), nb, 0))
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
    delta = write_delta(bound.cache, k, v, sm, sid, pos, max_complete=bound_m,
                        quantizer=auto_quantizer(bound.cache))
    delta = jax.block_until_ready(delta)
    blocks = _apply_delta(bound.views, delta)
    _count(write_calls=1, write_tokens=n, blocks_quantized=blocks, write_s=time.perf_counter() - t0)


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
           seq_ids: torch.Tensor, *, scale: float | None = None, impl: str = "auto") -> torch.Tensor:
    """One query token per sequence: query [B, Hq, D] -> [B, Hq, D] (query's dtype), via
    `kvarn_jax.paged_decode_attention` reading the bound cache in place.

    block_tables [B, max_blocks], seq_lens [B] (tokens in the cache, the query's own included),
    seq_ids [B] (high-precision slots). impl: 'auto' | 'pallas' | 'reference' (see the library).
    """
    t0 = time.perf_counter()
    b = query.shape[0]
    _check_rows(bound, query, block_tables, seq_lens, seq_ids, b)
    if b == 0:
        return query.new_empty(query.shape)
    bb = _bucket(b, 1)
    _sync_torch(query.device)
    q = _to_jax(_pad_rows(query, bb))
    cols = _used_columns(seq_lens.detach().cpu().numpy(), bound.layout.block_size, block_tables.shape[1])
    bt = _to_jax(_pad_rows(block_tables[:, :cols].to(torch.int32), bb, 0))
    sl = _to_jax(_pad_rows(seq_lens.to(torch.int32), bb, 0))
    # passthrough caches have no high-precision slots (and no seq_ids)
    sid = None if bound.layout.cfg.is_passthrough else _to_jax(_pad_rows(seq_ids.to(torch.int32), bb, 0))
    out = kvarn_jax.paged_decode_attention(q, bound.cache, bt, sl, scale, seq_ids=sid, impl=impl)
    out = jax.block_until_ready(out)
    _count(decode_calls=1, decode_rows=b, decode_s=time.perf_counter() - t0)
    return _to_torch(out)[:b]


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


def _used_columns(seq_lens: np.ndarray, block_size: int, width: int) -> int:
    """Block-table columns the longest sequence uses, rounded up to a power of two (few shapes)."""
    need = max(1, -(-int(seq_lens.max(initial=1)) // block_size))
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
    _sync_torch(query.device)
    bt = block_tables.to(torch.int32)
    sid = seq_ids.to(torch.int32)
    pending = []
    for r in range(rows):
        a, n = int(qsl[r] - qsl[0]), int(q_lens[r])
        if n == 0:
            continue
        cols = _used_columns(lens[r:r + 1], bound.layout.block_size, bt.shape[1])
        res = _prefill_attend(
            _to_jax(_pad_rows(query[a:a + n], _bucket(n))), bound.cache,
            _to_jax(bt[r:r + 1, :cols].contiguous()),
            _to_jax(seq_lens[r:r + 1].to(torch.int32)),
            None if bound.layout.cfg.is_passthrough else _to_jax(sid[r:r + 1].contiguous()),
            _to_jax(torch.tensor([n], dtype=torch.int32, device=query.device)), scale=sm)
        pending.append((a, n, res))
    for a, n, res in pending:
        out[a:a + n] = _to_torch(jax.block_until_ready(res))[:n]
    _count(prefill_calls=1, prefill_tokens=t, prefill_s=time.perf_counter() - t0)
    return out


__all__ = ["BoundCache", "bind", "write", "write_delta", "decode", "prefill", "counters", "count",
           "reset_counters", "PageLayout", "allocate_hp"]
