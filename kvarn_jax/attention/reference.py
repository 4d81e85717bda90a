"""Reference paged decode attention: pure jnp, runs anywhere, the oracle for the Pallas kernels.

Each part of a sequence's cache (pages, sink, the ring's block) is attended where it is stored, in
fp32 with GQA and one softmax over all parts (`attend`); what each position reads is what
`gather_dense` returns for it. For rotated schemes the query is rotated once and the output
un-rotated once, since the cache holds rotated K/V and H is orthonormal: (qH)(KH)^T = qK^T and
(P·VH)H = P·V.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import schemes
from ..cache import hp as hp_storage
from ..cache.paged import PagedKVCache, check_read_args, dense_blocks
from ..schemes import kvarn
from ..hadamard import SAFE_ABS, rotate, unrotate
from ..storage import QUANT_MAX
from ..schemes.arith import saturate
from ..validation import check_array, check_finite


def check_decode_args(q, cache, block_tables, seq_lens, seq_ids, window, values: bool = True, new_kv=None):
    """The decode entries' argument checks (ValueError naming the argument); values=False checks
    shapes and dtypes only, reading nothing back from the device."""
    check_array(q, "q", ndim=3, floating=True)
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    nbt, hq, d = q.shape
    if d != cache.head_dim:
        raise ValueError(f"q head_dim {d} does not match the cache's head_dim {cache.head_dim}")
    if hq % cache.num_kv_heads:
        raise ValueError(f"q has {hq} heads, which is not a multiple of the cache's num_kv_heads="
                         f"{cache.num_kv_heads} (GQA needs num_q_heads % num_kv_heads == 0)")
    check_read_args(cache, block_tables, seq_lens, seq_ids, batch=nbt, values=values)
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be a positive int (attend to the last `window` tokens) or None, got {window!r}")
    if new_kv is not None:
        if not (isinstance(new_kv, (tuple, list)) and len(new_kv) == 2):
            raise ValueError(f"new_kv must be a (k, v) pair of [B, Hk, D] arrays or None, got {type(new_kv).__name__}")
        for name, x in zip(("new_kv[0] (k)", "new_kv[1] (v)"), new_kv):
            check_array(x, name, ndim=3, floating=True)
            if tuple(x.shape) != (nbt, cache.num_kv_heads, d):
                raise ValueError(f"{name} must be [B, Hk, D] = {(nbt, cache.num_kv_heads, d)}, got {tuple(x.shape)}")
        if window is not None:
            raise ValueError("new_kv cannot be combined with window")
    if values:
        check_finite(q, "q")


def paged_decode_attention_reference(q: jnp.ndarray, cache: PagedKVCache, block_tables: jnp.ndarray,
                                     seq_lens: jnp.ndarray, scale: float | None = None, *,
                                     seq_ids: jnp.ndarray | None = None, window: int | None = None,
                                     rotated_io: bool = False, rotated_output: bool = False,
                                     new_kv=None) -> jnp.ndarray:
    """One query token per sequence against its cached tokens.

    q: [B, Hq, D] (Hq a multiple of the cache's Hk; query head h uses kv head h // (Hq // Hk)).
    block_tables: [B, max_blocks] physical block ids; seq_lens: [B] tokens per sequence (0 gives a
    zero output); seq_ids: [B] high-precision slots (default: the row index); scale: softmax scale
    (default 1/sqrt(D)); window: attend only to the last `window` tokens.
    rotated_io: q is already rotated and the output is returned rotated (kernels' convention).
    rotated_output: only the output is returned rotated (`paged_decode_attention`'s argument).
    new_kv: (k, v) [B, Hk, D] of one more token per row, not in the cache: the token at position
    seq_lens[b], as the cache would store it (`storage.storage_values`: the stored frame, rounded to
    the cache's value dtype). Each row attends to its seq_lens cached tokens and this one - what a
    write of the token followed by a decode with seq_lens + 1 computes. Not with window.
    Returns [B, Hq, D] in q.dtype.
    """
    check_decode_args(q, cache, block_tables, seq_lens, seq_ids, window, new_kv=new_kv)
    return attend(q, cache, block_tables, seq_lens, scale, seq_ids, window, rotated_io, rotated_output,
                  None if new_kv is None else tuple(new_kv))


@functools.partial(jax.jit, static_argnames=("scale", "window", "rotated_io", "rotated_output"))
def attend(q, cache, block_tables, seq_lens, scale, seq_ids, window, rotated_io, rotated_output=False,
           new_kv=None):
    """`paged_decode_attention_reference` without the argument checks (callers check first).

    A sequence's tokens come from three parts, each attended where it is stored (one softmax over
    all): its pages (blocks `paged_from // block_size` up to the query's own block), its sink, and
    the ring's block that holds the query's own block. Passthrough caches have pages only. Pages of
    KVarN caches are attended on their codes (`schemes.kvarn.key_scores` / `value_sums`), other
    schemes' are dequantized. Every part is a fixed-shape product: no dense copy of the context.
    new_kv: one more token per row after its cached ones (`paged_decode_attention_reference`), a
    fourth part."""
    nbt, hq, d = q.shape
    hk, bs = cache.num_kv_heads, cache.block_size
    g = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.astype(jnp.float32)
    if cache.cfg.rotated and not rotated_io:
        qf = rotate(qf, max_abs=QUANT_MAX)  # the kernels' bounds (`paged_decode._pallas`)
    qg = qf.reshape(nbt, hk, g, d)
    # unchecked indices (traced, or the decode entry's check_values=False) are clamped into range
    tbl = jnp.clip(block_tables.astype(jnp.int32), 0, cache.num_blocks - 1)
    lens = jnp.clip(seq_lens.astype(jnp.int32), 0, tbl.shape[1] * bs)

    def seen(pos):  # positions [B or 1, n] a row attends to
        ok = pos < lens[:, None]
        return ok if window is None else ok & (pos >= lens[:, None] - window)

    # the query's own block (its token's: with new_kv the one after the cached ones): read from the ring
    own = lens // bs if new_kv is not None else jnp.maximum((lens - 1) // bs, 0)
    j0 = cache.paged_from // bs
    m = jnp.full((nbt, hk, g), -jnp.inf)
    kvarn_codes = cache.cfg.method == "kvarn"
    paged = tbl.shape[1] > j0
    if paged:
        blocks = j0 + jnp.arange(tbl.shape[1] - j0)
        pos = blocks[:, None] * bs + jnp.arange(bs)                          # [m, bs]
        ok = seen(pos.reshape(1, -1)).reshape(nbt, -1, 1, 1, bs)
        if cache.has_hp:
            ok &= (blocks[None, :] < own[:, None])[:, :, None, None, None]
            if cache.sink_len < bs:  # a short sink: block 0's first tokens come from the sink
                ok &= (pos >= cache.sink_len)[None, :, None, None, :]
        if kvarn_codes:
            pages = {side: {n: a[tbl[:, j0:]] for n, a in cache.pages[side].items()} for side in schemes.SIDES}
            s = kvarn.key_scores(pages["k"], qg[:, None], cache.cfg.bits("k"))  # [B, m, Hk, R, G, T]
            s = s.swapaxes(-2, -3).reshape(s.shape[:3] + (g, bs))
        else:
            k, v = (dense_blocks(cache, side, tbl[:, j0:]) for side in schemes.SIDES)  # [B, m, Hk, bs, D]
            v = jnp.where(ok.reshape(nbt, -1, 1, bs, 1), v, 0.0)  # unread pages may hold anything, NaN too
            s = jnp.einsum("bhgd,bmhld->bmhgl", qg, k, precision="highest")
        s = jnp.where(ok, s * scale, -jnp.inf)                               # [B, m, Hk, G, bs]
        m = jnp.max(s, axis=(1, 4))
    near = []  # (scores [B, Hk, G, n], values [B, Hk, n, D]) of the sink and the ring's block
    if cache.has_hp:
        sid = jnp.clip((jnp.arange(nbt) if seq_ids is None else seq_ids).astype(jnp.int32), 0, cache.max_seqs - 1)
        ring_block = own % cache.tail_blocks
        pos_ring = own[:, None] * bs + jnp.arange(bs)[None]
        for part, ok_part in (("sink", seen(jnp.arange(cache.sink_len)[None])),
                              ("tail", seen(pos_ring) & (pos_ring >= cache.sink_len))):
            kv = []
            for side in schemes.SIDES:
                f = cache.hp_fields(part, side)
                if part == "sink":
                    f = {n: a[sid] for n, a in f.items()}
                else:  # the ring's block holding the query's own block: [B, Hk, bs, ...]
                    f = {n: a.reshape((a.shape[0], hk, cache.tail_blocks, bs) + a.shape[3:])[sid, :, ring_block]
                         for n, a in f.items()}
                kv.append(hp_storage.load(cache.cfg, f))
            sp = jnp.einsum("bhgd,bhtd->bhgt", qg, kv[0], precision="highest") * scale
            sp = jnp.where(ok_part[:, None, None, :], sp, -jnp.inf)
            near.append((sp, kv[1]))
            m = jnp.maximum(m, sp.max(-1))
    if new_kv is not None:  # seen by every row
        kn, vn = (x.astype(jnp.float32) for x in new_kv)                     # [B, Hk, D], stored frame
        sp = jnp.einsum("bhgd,bhd->bhg", qg, kn, precision="highest")[..., None] * scale
        near.append((sp, vn[:, :, None, :]))
        m = jnp.maximum(m, sp[..., 0])
    m = jnp.where(jnp.isfinite(m), m, 0.0)                                   # rows that see nothing
    denom = jnp.zeros((nbt, hk, g))
    o = jnp.zeros((nbt, hk, g, d))
    if paged:
        p = jnp.exp(s - m[:, None, :, :, None])
        denom = p.sum(axis=(1, 4))
        if kvarn_codes:
            pr = p.reshape(p.shape[:4] + (-1, cache.cfg.tile_tokens)).swapaxes(-2, -3)   # [B, m, Hk, R, G, T]
            o = kvarn.value_sums(pages["v"], pr, cache.cfg.bits("v"))                   # [B, m, Hk, R, G, D]
            # a block no position reads may hold anything (its scales NaN or inf): not 0 * NaN
            o = jnp.where(ok.any(axis=(2, 3, 4))[:, :, None, None, None, None], o, 0.0).sum(axis=(1, 3))
        else:
            o = jnp.einsum("bmhgl,bmhld->bhgd", p, v, precision="highest")
    for sp, vp in near:
        pp = jnp.exp(sp - m[..., None])
        denom = denom + pp.sum(-1)
        o = o + jnp.einsum("bhgt,bhtd->bhgd", pp, vp, precision="highest")
    o = (o / jnp.where(denom > 0, denom, 1.0)[..., None]).reshape(nbt, hq, d)
    if cache.cfg.rotated and not (rotated_io or rotated_output):
        o = unrotate(o, max_abs=SAFE_ABS)
    return saturate(o, q.dtype)
