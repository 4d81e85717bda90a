"""Prefill attention over a `PagedKVCache`: a chunk of queries per sequence, pure jnp.

Semantics - the decode rule, applied to every query: the query at position p sees
- the sequence's first block (the sink) in high precision,
- every full block before its own block as the cache serves it (quantized pages), including
  blocks this very chunk completes (quantized exactly as `write` stores them),
- the positions of its own block up to p in high precision: the stored value of each token (the
  storage frame - rotated for KVarN - rounded to the cache dtype, by `kvarn_jax.storage`'s rule).
So a query's inputs do not depend on how the prompt was cut into chunks, nor on what else is in
the batch: a token prefilled in one chunk of 2,048 and the same token decoded one at a time see
the same keys and values. (Passthrough caches store every token exactly: the rule is then plain
causal attention over the stored values.)

`paged_prefill_attention_reference(q, k, v, cache, ...)` takes the cache *before* the chunk is written
(a serving loop calls it, then `write`s the chunk) and computes what the cache will serve: the
blocks the chunk completes are quantized by the library's own write (`write_reference`, applied
to a copy), the earlier positions of the chunk's first block come from the high-precision ring.
It materializes [Hq, C, L] scores: the reference for tests and for small chunks; the vLLM bridge
computes the same attention with torch's fused kernels.

`dequantize_blocks(cache, block_ids)`: physical blocks as attention sees their pages (fp32, in
the storage frame); what a caller that attends by itself (the bridge) reads.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import schemes
from ..cache import hp as hp_storage
from ..cache.paged import PagedKVCache, fields_from_pages, gather_dense, write_reference
from ..hadamard import SAFE_ABS, rotate, unrotate
from ..storage import QUANT_MAX, storage_values
from ..validation import check_array, check_finite, check_range, is_concrete


def dequantize_blocks(cache: PagedKVCache, block_ids: jnp.ndarray):
    """Pages of the physical blocks `block_ids` [N] as fp32 in the storage frame (rotated for KVarN),
    heads first: ([Hk, N, block_size, D], [Hk, N, block_size, D]) for K and V, so that consecutive
    blocks of one head are one run of positions ([Hk, N * block_size, D] as a view). The heads move
    in front on the gathered fields, before they are expanded. Ids are clamped into range (an
    unchecked bad id reads another page, never memory outside the cache). The sink and tail are not
    consulted: a block that is not full and quantized holds no meaningful page."""
    ids = jnp.clip(block_ids.astype(jnp.int32), 0, cache.num_blocks - 1)
    out = []
    for side in schemes.SIDES:
        f = fields_from_pages(cache.cfg, side, {name: jnp.swapaxes(a[ids], 0, 1)
                                                for name, a in cache.pages[side].items()})
        st = schemes.expand_static(cache.cfg, cache.static[side], 2) if cache.static else None
        x = schemes.dequantize_side(f, cache.cfg, side, cache.head_dim, st)   # [Hk, N, tpb, (G,) D]
        out.append(x.reshape(cache.num_kv_heads, ids.shape[0], cache.block_size, cache.head_dim))
    return tuple(out)


def _check(q, k, v, cache, block_tables, context_lens, q_lens, seq_ids):
    check_array(q, "q", ndim=4, floating=True)
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    p, c, hq, d = q.shape
    if d != cache.head_dim:
        raise ValueError(f"q head_dim {d} does not match the cache's head_dim {cache.head_dim}")
    if hq % cache.num_kv_heads:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's num_kv_heads={cache.num_kv_heads}")
    for name, x in (("k", k), ("v", v)):
        check_array(x, name, ndim=4, floating=True)
        if tuple(x.shape) != (p, c, cache.num_kv_heads, d):
            raise ValueError(f"{name} must be [{p}, {c}, {cache.num_kv_heads}, {d}] (q's sequences and chunk), "
                             f"got {tuple(x.shape)}")
    check_array(block_tables, "block_tables", ndim=2, integer=True)
    if block_tables.shape[0] != p:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {p} sequences")
    capacity = block_tables.shape[1] * cache.block_size
    for name, x in (("context_lens", context_lens), ("q_lens", q_lens)):
        check_array(x, name, ndim=1, integer=True)
        if x.shape[0] != p:
            raise ValueError(f"{name} has {x.shape[0]} entries for {p} sequences")
    check_range(q_lens, "q_lens", 0, c + 1, f"each sequence has at most the chunk's {c} queries")
    check_range(context_lens, "context_lens", 0, capacity + 1,
                f"a sequence holds at most block_tables.shape[1] * block_size = {capacity} tokens")
    if is_concrete(context_lens, q_lens):
        import numpy as np

        end = np.asarray(context_lens, np.int64) + np.asarray(q_lens, np.int64)
        if np.any(end > capacity):
            raise ValueError(f"context_lens + q_lens exceeds the block tables' capacity of {capacity} tokens")
        used = np.arange(block_tables.shape[1])[None, :] * cache.block_size < end[:, None]
        check_range(np.where(used, np.asarray(block_tables), 0), "block_tables", 0, cache.num_blocks,
                    f"block ids must be < num_blocks={cache.num_blocks} for the blocks a sequence uses")
    if seq_ids is not None:
        check_array(seq_ids, "seq_ids", ndim=1, integer=True)
        if seq_ids.shape[0] != p:
            raise ValueError(f"seq_ids has {seq_ids.shape[0]} entries for {p} sequences")
        if cache.has_hp:
            check_range(seq_ids, "seq_ids", 0, cache.max_seqs, f"sequence ids must be < max_seqs={cache.max_seqs}")
    elif cache.has_hp and p > cache.max_seqs:
        raise ValueError(f"{p} sequences but max_seqs={cache.max_seqs}: pass seq_ids")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_finite(x, name)


def paged_prefill_attention_reference(q, k, v, cache: PagedKVCache, block_tables, context_lens, q_lens=None,
                                      scale: float | None = None, *, seq_ids=None) -> jnp.ndarray:
    """Causal attention of a chunk of queries per sequence over the cache and the chunk itself.

    q: [P, C, Hq, D]; k, v: [P, C, Hk, D] - the chunk's queries, keys and values (model frame), the
      queries of sequence p at positions context_lens[p] + i for i < q_lens[p]; later rows are
      padding (their output is unspecified but finite).
    cache: the cache before the chunk is written. block_tables: [P, max_blocks], covering the chunk's
      positions too. context_lens: [P] tokens already in the cache. q_lens: [P] (default C).
    seq_ids: [P] high-precision slots (default: the row index). scale: default 1/sqrt(D).
    Returns [P, C, Hq, D] in q.dtype. Semantics: see the module docstring.
    """
    p, c = q.shape[:2]
    if q_lens is None:
        q_lens = jnp.full((p,), c, jnp.int32)
    _check(q, k, v, cache, block_tables, context_lens, q_lens, seq_ids)
    sm = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _prefill(q, k, v, cache, block_tables, context_lens, q_lens, seq_ids, sm)


@functools.partial(jax.jit, static_argnames=("scale",))
def _prefill(q, k, v, cache, block_tables, context_lens, q_lens, seq_ids, scale):
    p, c, hq, d = q.shape
    hk, bs = cache.num_kv_heads, cache.block_size
    mb = block_tables.shape[1]
    tbl = jnp.clip(block_tables.astype(jnp.int32), 0, cache.num_blocks - 1)
    ctx = context_lens.astype(jnp.int32)
    ql = q_lens.astype(jnp.int32)
    sid = jnp.arange(p, dtype=jnp.int32) if seq_ids is None else seq_ids.astype(jnp.int32)
    i = jnp.arange(c)
    pos = ctx[:, None] + i[None, :]                                          # [P, C]
    live = i[None, :] < ql[:, None]
    col = jnp.clip(pos // bs, 0, mb - 1)
    slots = jnp.where(live, jnp.take_along_axis(tbl, col, axis=1) * bs + pos % bs, -1)
    after = write_reference(cache, k.reshape(p * c, hk, d), v.reshape(p * c, hk, d), slots.reshape(-1),
                            jnp.repeat(sid, c), pos.reshape(-1))
    end = ctx + ql
    last = jnp.maximum(end - 1, 0) // bs                                     # each sequence's last block
    # what the cache serves after the write for blocks before `last` (sink, quantized pages) ...
    kq, vq = gather_dense(after, tbl, last * bs + 1, sid)                    # [P, Hk, L, D] fp32
    # ... and the high-precision values of the chunk's first block before the chunk (ring or sink)
    kh, vh = gather_dense(cache, tbl, ctx, sid)
    length = mb * bs
    t = jnp.arange(length)
    rel = t[None, :] - ctx[:, None]                                          # key's index in the chunk
    in_chunk = (rel >= 0) & (rel < ql[:, None])
    stored = storage_values(cache.cfg, k.reshape(p * c, hk, d), v.reshape(p * c, hk, d), cache.value_dtype)[:2]
    if not cache.cfg.is_passthrough:  # as the sink and ring give them back (e.g. int8 rows: codes x scale)
        stored = [hp_storage.roundtrip(cache.cfg, x, cache.dtype) for x in stored]
    xs = [jnp.take_along_axis(x.reshape(p, c, hk, d).astype(jnp.float32), jnp.clip(rel, 0, c - 1)[:, :, None, None],
                              axis=1).transpose(0, 2, 1, 3) for x in stored]  # [P, Hk, L, D]
    kh = jnp.where(in_chunk[:, None, :, None], xs[0], kh)
    vh = jnp.where(in_chunk[:, None, :, None], xs[1], vh)
    qf = q.astype(jnp.float32)
    if cache.cfg.rotated:
        qf = rotate(qf, max_abs=QUANT_MAX)
    qg = qf.reshape(p, c, hk, hq // hk, d)
    qblk, kblk = pos // bs, t // bs
    from_pages = kblk[None, None, :] < qblk[:, :, None]                      # [P, C, L]
    own = (kblk[None, None, :] == qblk[:, :, None]) & (t[None, None, :] <= pos[:, :, None])
    s_q = jnp.einsum("pchgd,phld->phgcl", qg, kq, precision="highest")
    s_h = jnp.einsum("pchgd,phld->phgcl", qg, kh, precision="highest")
    fp, ow = from_pages[:, None, None], own[:, None, None]
    s = jnp.where(fp, s_q, jnp.where(ow, s_h, -jnp.inf)) * scale
    mx = jnp.max(s, axis=-1, keepdims=True)
    w = jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0))
    den = jnp.sum(w, axis=-1, keepdims=True)
    w = w / jnp.where(den > 0, den, 1.0)
    o = (jnp.einsum("phgcl,phld->pchgd", jnp.where(fp, w, 0.0), vq, precision="highest")
         + jnp.einsum("phgcl,phld->pchgd", jnp.where(ow, w, 0.0), vh, precision="highest"))
    o = o.reshape(p, c, hq, d)
    if cache.cfg.rotated:
        o = unrotate(o, max_abs=SAFE_ABS)
    return o.astype(q.dtype)


__all__ = ["paged_prefill_attention_reference", "dequantize_blocks"]
