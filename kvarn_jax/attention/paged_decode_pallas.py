"""Fused paged decode attention in Pallas (GPU through Triton lowering; any backend with interpret=True).

Oracle: `reference.py` beside this file (`paged_decode_attention_reference`).

One program per (sequence, kv head, split). Each program walks its share of the sequence's
quantized tiles, reading codes and scales straight from the pages (never materializing fp16 K/V in
HBM), and keeps an fp32 online softmax for the query heads of its KV head (GQA group, padded to 16
rows for the matrix unit). Split 0 also covers the high-precision sink block and the partial tail.
The splits are merged afterwards (flash-decoding), so that small batches still fill the chip.

Scales stay out of the inner products (DESIGN.md §3). For KVarN, with K̂[d,t] = (c·sc[d] + z[d])·st[t]:
    q·K̂[:,t] = st[t]·( Σ_d (q[d]·sc[d])·c[d,t] + Σ_d q[d]·z[d] )
and with V̂[t,d] = (c·vt[t] + vz[t])·vc[d]:
    Σ_t p[t]·V̂[t,d] = vc[d]·( Σ_t (p[t]·vt[t])·c[t,d] + Σ_t p[t]·vz[t] )
so the per-element work is unpack + int→fp16, and both products run on raw codes.

The kernel works in the stored frame: for KVarN it takes the rotated query and returns the
rotated output; `paged_decode_attention` rotates once before and un-rotates once after.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..config import KVQuantConfig

NEG = -1e30          # masked logit; every processed chunk holds at least one valid position
HP_CHUNK = 64        # tokens per step through the high-precision sink/tail
TOKEN_CHUNK = 64     # tokens per step through the pages of per-token schemes


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def supports(cfg: KVQuantConfig, block_size: int, head_dim: int) -> str | None:
    """None if the Pallas kernel handles this cache, else the reason (the reference must be used)."""
    if not _pow2(block_size) or block_size < 16:
        return f"block_size={block_size} (the kernel needs a power of two >= 16)"
    if not _pow2(head_dim) or head_dim < 16:
        return f"head_dim={head_dim} (the kernel needs a power of two >= 16)"
    if cfg.method == "int" and not _pow2(cfg.channel_group("k", head_dim)):
        return f"channel group {cfg.channel_group('k', head_dim)} (must be a power of two)"
    return None


# ----------------------------------------------------------------------------- in-kernel helpers
def _unpack(c, bits: int):
    """uint8 [R, Cb] -> codes [R, Cb * 8 // bits] (element j of a byte at bit shift j*bits)."""
    if bits == 8:
        return c
    per = 8 // bits
    mask = (1 << bits) - 1
    p = [jnp.bitwise_and(jnp.right_shift(c, j * bits), mask) for j in range(per)]
    r, cb = c.shape
    if per == 2:
        out = jnp.stack([p[0], p[1]], axis=-1)
    else:  # per == 4: interleave as [i, c, e] -> 4i + 2c + e, holding plane 2c + e
        out = jnp.stack([jnp.stack([p[0], p[2]], axis=-1), jnp.stack([p[1], p[3]], axis=-1)], axis=-1)
    return out.reshape(r, cb * per)


def _f16(x):
    return x.astype(jnp.float16)


def _dot(a, b):
    """[M, K] @ [K, N] in fp16 with fp32 accumulation."""
    return jnp.dot(_f16(a), _f16(b), preferred_element_type=jnp.float32)


def _dot_t(a, b):
    """[M, K] @ [N, K]^T in fp16 with fp32 accumulation."""
    return lax.dot_general(_f16(a), _f16(b), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _expand_groups(x, cg: int, d: int):
    """Per-group values [T, D/cg] -> per-channel [T, D]."""
    t, n = x.shape
    if n == 1:
        return jnp.broadcast_to(x, (t, d))
    return jnp.broadcast_to(x[:, :, None], (t, n, cg)).reshape(t, d)


def _fp8(c):
    return lax.bitcast_convert_type(c, jnp.float8_e4m3fn).astype(jnp.float32)


# ----------------------------------------------------------------------------- per-scheme tiles
class _Tiles:
    """How one scheme turns a tile of pages into scores and value contributions.

    `f` maps field name -> loaded array for one tile of one head; `st` maps static parameter name
    -> loaded per-head array. q is fp32 [Gp, D]; p is fp32 [Gp, T].
    """

    def __init__(self, cfg: KVQuantConfig, head_dim: int):
        self.cfg, self.d = cfg, head_dim

    def scores(self, q, f, st):
        cfg, d = self.cfg, self.d
        if cfg.method == "kvarn":
            c = _unpack(f["codes"], cfg.k_bits)                               # [D, G]
            zq = jnp.sum(q * f["zero_chan"].astype(jnp.float32)[None, :], axis=1)
            s = _dot(q * f["scale_chan"].astype(jnp.float32)[None, :], c) + zq[:, None]
            return s * f["scale_tok"].astype(jnp.float32)[None, :]
        if cfg.method == "kivi":
            c = _unpack(f["codes"], cfg.k_bits)                               # [D, G]
            zq = jnp.sum(q * f["zero"].astype(jnp.float32)[None, :], axis=1)
            return _dot(q * f["scale"].astype(jnp.float32)[None, :], c) + zq[:, None]
        return _dot_t(q, self._dequant_rows(f, st, "k"))

    def values(self, p, f, st):
        cfg, d = self.cfg, self.d
        if cfg.method == "kvarn":
            c = _unpack(f["codes"], cfg.v_bits)                               # [G, D]
            zp = jnp.sum(p * f["zero_tok"].astype(jnp.float32)[None, :], axis=1)
            o = _dot(p * f["scale_tok"].astype(jnp.float32)[None, :], c) + zp[:, None]
            return o * f["scale_chan"].astype(jnp.float32)[None, :]
        return _dot(p, self._dequant_rows(f, st, "v"))

    def _dequant_rows(self, f, st, side):
        """Tokens-by-channels fp32 values of a tile of per-token rows ([T, D])."""
        cfg, d = self.cfg, self.d
        if cfg.method == "passthrough":
            return f["values"].astype(jnp.float32)
        if cfg.method == "fp8":
            v = _fp8(f["codes"])
            s = st["scale"].astype(jnp.float32)[None, :] if cfg.static else f["scale"].astype(jnp.float32)[:, None]
            return v * s
        bits = cfg.bits(side)
        c = _unpack(f["codes"], bits).astype(jnp.float32)                     # [T, D]
        if cfg.method == "int" and cfg.static:
            return c * st["scale"].astype(jnp.float32)[None, :] + st["zero"].astype(jnp.float32)[None, :]
        cg = cfg.channel_group(side, d)
        return (c * _expand_groups(f["scale"].astype(jnp.float32), cg, d)
                + _expand_groups(f["zero"].astype(jnp.float32), cg, d))


# ----------------------------------------------------------------------------- the kernel
def _kernel(*refs, cfg, names, has_static, has_hp, block_size, tail_len, tile_tokens, tiles_per_block,
            num_splits, sm_scale, window, head_dim):
    it = iter(refs)
    q_ref, bt_ref, len_ref, sid_ref = next(it), next(it), next(it), next(it)
    pages = {side: {n: next(it) for n in names[side]} for side in ("k", "v")}
    static = {side: {n: next(it) for n in has_static[side]} for side in ("k", "v")}
    if has_hp:
        sink_k, sink_v, tail_k, tail_v = next(it), next(it), next(it), next(it)
    o_ref, m_ref, l_ref = next(it), next(it), next(it)

    b, split = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]
    bs, t_tok, tpb = block_size, tile_tokens, tiles_per_block
    ws = jnp.maximum(length - window, 0) if window is not None else jnp.int32(0)
    q = q_ref[...].astype(jnp.float32)                                        # [Gp, D]
    gp = q.shape[0]
    tiles = _Tiles(cfg, head_dim)
    st = {side: {n: r[...] for n, r in static[side].items()} for side in ("k", "v")}

    def update(carry, s, pos, value_fn):
        m, l, acc = carry
        valid = (pos >= ws) & (pos < length)
        s = jnp.where(valid[None, :], s * sm_scale, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        l_new = alpha * l + jnp.sum(p, axis=1)
        acc_new = alpha[:, None] * acc + value_fn(p)
        return m_new, l_new, acc_new

    # ---- quantized tiles (for passthrough: every tile)
    n_full = length // bs
    if has_hp:
        t_begin, t_end = tpb, n_full * tpb
    else:
        t_begin, t_end = 0, pl.cdiv(length, t_tok)
    t_begin = jnp.maximum(t_begin, ws // t_tok)
    n_tiles = jnp.maximum(t_end - t_begin, 0)
    chunk = pl.cdiv(n_tiles, num_splits)
    lo = t_begin + split * chunk
    hi = jnp.minimum(lo + chunk, t_end)

    def tile_body(t, carry):
        blk = bt_ref[b, t // tpb]
        sub = t % tpb
        fk = {n: r[blk, sub] for n, r in pages["k"].items()}
        fv = {n: r[blk, sub] for n, r in pages["v"].items()}
        pos = t * t_tok + jnp.arange(t_tok, dtype=jnp.int32)
        s = tiles.scores(q, fk, st["k"])
        return update(carry, s, pos, lambda p: tiles.values(p, fv, st["v"]))

    carry = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
             jnp.zeros((gp, head_dim), jnp.float32))
    carry = lax.fori_loop(lo, jnp.maximum(lo, hi), tile_body, carry)

    # ---- high-precision sink and partial tail (split 0 only)
    if has_hp:
        sid = sid_ref[b]
        hc = min(HP_CHUNK, bs)
        first = split == 0

        def hp_loop(carry, k_ref, v_ref, base, start_pos, count):
            """Chunks of `hc` tokens from rows [base, base + count) of k_ref[sid] (positions start_pos...)."""
            c_lo = jnp.maximum(ws - start_pos, 0) // hc
            c_hi = jnp.where(first, pl.cdiv(count, hc), 0)

            def body(c, carry):
                rows = pl.ds(pl.multiple_of(base + c * hc, hc), hc)
                kk = k_ref[sid, rows].astype(jnp.float32)
                vv = v_ref[sid, rows].astype(jnp.float32)
                pos = start_pos + c * hc + jnp.arange(hc, dtype=jnp.int32)
                return update(carry, _dot_t(q, kk), pos, lambda p: _dot(p, vv))
            return lax.fori_loop(c_lo, jnp.maximum(c_lo, c_hi), body, carry)

        carry = hp_loop(carry, sink_k, sink_v, 0, 0, jnp.minimum(length, bs))
        tail_count = jnp.where(n_full >= 1, length - n_full * bs, 0)
        carry = hp_loop(carry, tail_k, tail_v, (n_full * bs) % tail_len, n_full * bs, tail_count)

    m, l, acc = carry
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def default_num_splits(batch: int, num_kv_heads: int, max_tiles: int) -> int:
    """Enough programs to fill an H100/H200-class chip (~132 SMs x 2), never more splits than tiles."""
    want = max(1, -(-264 // max(1, batch * num_kv_heads)))
    return int(max(1, min(want, max_tiles, 128)))


@functools.partial(jax.jit, static_argnames=("scale", "window", "num_splits", "interpret", "num_warps",
                                             "num_stages"))
def paged_decode_pallas(q_rot, cache, block_tables, seq_lens, seq_ids, *, scale: float, window: int | None,
                        num_splits: int | None = None, interpret: bool = False, num_warps: int = 4,
                        num_stages: int = 2):
    """Kernel entry: q_rot [B, Hq, D] in the stored frame -> output [B, Hq, D] fp32 in the stored frame."""
    cfg = cache.cfg
    nbt, hq, d = q_rot.shape
    hk = cache.num_kv_heads
    grp = hq // hk
    gp = max(16, 1 << (grp - 1).bit_length())
    mb = block_tables.shape[1]
    tpb = cache.tiles_per_block
    t_tok = cfg.tile_tokens if cfg.tile_tokens > 1 else min(TOKEN_CHUNK, cache.block_size)
    tiles_per_block = cache.block_size // t_tok
    splits = num_splits or default_num_splits(nbt, hk, mb * tiles_per_block)

    qg = q_rot.astype(jnp.float32).reshape(nbt, hk, grp, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - grp), (0, 0)))

    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))
    operands = [qg, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), seq_ids.astype(jnp.int32)]
    specs = [pl.BlockSpec((None, None, gp, d), lambda b, h, s: (b, h, 0, 0)),
             full(block_tables.shape), full(seq_lens.shape), full(seq_ids.shape)]
    names = {}
    for side in ("k", "v"):
        names[side] = sorted(cache.pages[side])
        for n in names[side]:
            a = cache.pages[side][n]
            if cfg.tile_tokens == 1:  # per-token schemes: a kernel tile is a chunk of t_tok tokens of a block
                a = a.reshape(a.shape[:2] + (tiles_per_block, t_tok) + a.shape[3:])
            shape = (a.shape[0], None) + a.shape[2:]
            operands.append(a)
            specs.append(pl.BlockSpec(shape, functools.partial(lambda nd, b, h, s: (0, h) + (0,) * nd, len(a.shape) - 2)))
    has_static = {}
    for side in ("k", "v"):
        has_static[side] = sorted(cache.static[side]) if cache.static else []
        for n in has_static[side]:
            a = cache.static[side][n]
            a = a.reshape(hk, -1)  # int: [Hk, D]; fp8: [Hk] -> [Hk, 1]
            operands.append(a)
            specs.append(pl.BlockSpec((None, a.shape[1]), lambda b, h, s: (h, 0)))
    if cache.has_hp:
        for a in (cache.sink["k"], cache.sink["v"], cache.tail["k"], cache.tail["v"]):
            operands.append(a)
            specs.append(pl.BlockSpec((a.shape[0], None) + a.shape[2:], lambda b, h, s: (0, h, 0, 0)))

    kernel = functools.partial(
        _kernel, cfg=cfg, names=names, has_static=has_static, has_hp=cache.has_hp,
        block_size=cache.block_size, tail_len=max(cache.tail_len, 1), tile_tokens=t_tok,
        tiles_per_block=tiles_per_block, num_splits=splits, sm_scale=scale, window=window, head_dim=d)
    out_shape = [jax.ShapeDtypeStruct((nbt, hk, splits, gp, d), jnp.float32),
                 jax.ShapeDtypeStruct((nbt, hk, splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct((nbt, hk, splits, gp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, gp, d), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0))]
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    acc, m, l = pl.pallas_call(kernel, grid=(nbt, hk, splits), in_specs=specs, out_specs=out_specs,
                               out_shape=out_shape, interpret=interpret,
                               name=f"kvarn_paged_decode_{cfg.name}", **params)(*operands)
    # merge the splits (flash-decoding)
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    l_all = jnp.sum(w * l, axis=2)
    o = jnp.sum(w[..., None] * acc, axis=2) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return o[:, :, :grp].reshape(nbt, hq, d)

