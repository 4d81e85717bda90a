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
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..config import KVQuantConfig
from ..validation import is_power_of_two as _pow2

EXP = {}
NEG = -1e30          # masked logit; every processed chunk holds at least one valid position
HP_CHUNK = 64        # tokens per step through the high-precision sink/tail
TOKEN_CHUNK = 64     # tokens per step through the pages of per-token schemes


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
def _plane(c, bits: int, j: int):
    """Bit plane j of packed codes: element j of every byte (bit shift j*bits), as fp16.

    Codes are packed along the last axis, element j of a group of 8/bits at shift j*bits, so plane j
    holds elements j, j + per, j + 2 per, ... Working plane by plane avoids re-interleaving codes in
    registers: the token (K) or channel (V) order is restored outside the inner products.

    int -> float conversion instructions run at a fraction of the rate of integer logic on NVIDIA
    GPUs, so the code is turned into fp16 with the "magic number" trick instead: OR-ing a code
    c < 1024 into the bits of 1024.0 (0x6400) gives exactly 1024 + c, and an fp16 subtraction
    leaves c. Exact for every code width here.
    """
    if bits != 8:
        c = jnp.bitwise_and(jnp.right_shift(c, j * bits), (1 << bits) - 1)
    biased = lax.bitcast_convert_type(jnp.bitwise_or(c.astype(jnp.uint16), jnp.uint16(0x6400)), jnp.float16)
    return biased - jnp.float16(1024.0)


def _plane_asm(c, bits: int, j: int):
    """`_plane` in four PTX instructions per four codes (NVIDIA GPUs only; bit-identical result).

    Triton hands the asm four consecutive uint8 codes in one 32-bit register. `prmt` spreads bytes
    0,1 (and 2,3) into the two 16-bit halves of a register, `lop3` keeps plane j's bits and ORs them
    into 1024.0 in both halves at once (giving 1024 + c * 2^(j*bits), exact: the bits stay in the
    mantissa), and one `fma.f16x2` undoes the shift and the bias for two codes at a time. The jnp
    version needs a shift, an and, an or and a subtract per code.
    """
    mask16 = ((1 << bits) - 1) << (j * bits) if bits != 8 else 0xFF
    mask = mask16 | (mask16 << 16)
    shift = 0 if bits == 8 else j * bits
    mul = int(np.array(2.0 ** -shift, np.float16).view(np.uint16))
    add = int(np.array(-1024.0 * 2.0 ** -shift, np.float16).view(np.uint16))
    asm = f"""{{
    .reg .b32 t0, t1, z, m, a;
    mov.b32 z, 0;
    mov.b32 m, {mul | (mul << 16)};
    mov.b32 a, {add | (add << 16)};
    prmt.b32 t0, $2, z, 0x4140;
    prmt.b32 t1, $2, z, 0x4342;
    lop3.b32 t0, t0, {mask}, 0x64006400, 0xEA;
    lop3.b32 t1, t1, {mask}, 0x64006400, 0xEA;
    fma.rn.f16x2 $0, t0, m, a;
    fma.rn.f16x2 $1, t1, m, a;
    }}"""
    from jax.experimental.pallas import triton as plgpu
    (out,) = plgpu.elementwise_inline_asm(asm, args=[c], constraints="=r,=r,r", pack=4,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float16)])
    return out


def _magic(bits: int, j: int) -> int:
    """fp16 bit pattern of 2^(10 - j*bits): OR-ing plane j's bits *in place* (no shift) into it gives
    exactly 2^(10 - j*bits) + c, because those bits then sit in the mantissa where one unit is 1."""
    return (25 - j * bits) << 10


def _planes_biased(c, bits: int):
    """All bit planes of packed codes as fp16 `magic_j + code` (see `_magic`), jnp version."""
    out = []
    for j in range(8 // bits):
        mask = ((1 << bits) - 1) << (j * bits)
        v = jnp.bitwise_or(jnp.bitwise_and(c, jnp.uint8(mask)).astype(jnp.uint16), jnp.uint16(_magic(bits, j)))
        v = lax.bitcast_convert_type(v, jnp.float16)
        if EXP.get("u2sub"):
            v = v - jnp.float16(2.0 ** (10 - j * bits))
        out.append(v)
    return out


def _planes_biased_asm(c, bits: int):
    """`_planes_biased` in PTX: one asm spreads 4 code bytes into 16-bit lanes (two `prmt`, once for
    all planes), then one `lop3` per plane and pair of codes ((t & mask) | magic). Bit-identical to
    the jnp version. (Triton's inline asm takes one result per call, hence two steps.)"""
    from jax.experimental.pallas import triton as plgpu
    spread = ("{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, $2, z, 0x4140; prmt.b32 $1, $2, z, 0x4342; }")
    (wide,) = plgpu.elementwise_inline_asm(spread, args=[c], constraints="=r,=r,r", pack=4,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.int16)])
    out = []
    for j in range(8 // bits):
        mask16 = ((1 << bits) - 1) << (j * bits)
        mg = _magic(bits, j)
        code = f"lop3.b32 $0, $1, {mask16 | (mask16 << 16)}, {mg | (mg << 16)}, 0xEA;"
        if EXP.get("u2sub"):
            code = ("{ .reg .b32 t, m; " + f"mov.b32 m, {mg | (mg << 16)}; lop3.b32 t, $1, {mask16 | (mask16 << 16)}, m, 0xEA; "
                    + "sub.rn.f16x2 $0, t, m; }")
        (v,) = plgpu.elementwise_inline_asm(
            code, args=[wide],
            constraints="=r,r", pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float16)])
        out.append(v)
    return out


def _f16(x):
    return x.astype(jnp.float16)


def _dot(a, b):
    """[M, K] @ [K, N] in fp16 with fp32 accumulation.

    Triton's matrix instructions need every dimension >= 16; smaller products (e.g. 8-token classes
    of a 2-bit 32-token tile) are computed as a broadcast multiply and sum instead.
    """
    if min(a.shape[0], a.shape[1], b.shape[1]) < 16:
        return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :], axis=1)
    return jnp.dot(_f16(a), _f16(b), preferred_element_type=jnp.float32)


def _dot_t(a, b):
    """[M, K] @ [N, K]^T in fp16 with fp32 accumulation (see `_dot` for small shapes)."""
    if min(a.shape[0], a.shape[1], b.shape[0]) < 16:
        return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=2)
    return lax.dot_general(_f16(a), _f16(b), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _token_order(classes, rows: int):
    """Key scores per token class (class j holds tokens j, j + kc, ... of a tile: bit plane j of the
    packed key codes) -> one [rows, T] block in token order, by Triton's join (an interleave):
    token i*kc + j is element i of class j. Joining the scores once lets the softmax and the value
    products work on whole tiles (4 value products per tile for 2-bit values instead of 8) - 13-16%
    faster on the H200 (benchmarks/results/2026-11-29_decode_join_h200.json)."""
    def interleave(cs):  # [rows, n, 2, ..., 2]: index (i, bits of j) holds element i of class j
        if len(cs) == 1:
            return cs[0]
        return jnp.stack([interleave(cs[0::2]), interleave(cs[1::2])], axis=-1)
    return interleave(classes).reshape(rows, classes[0].shape[1] * len(classes))


def _expand_groups(x, cg: int, d: int):
    """Per-group values [T, D/cg] -> per-channel [T, D]."""
    t, n = x.shape
    if n == 1:
        return jnp.broadcast_to(x, (t, d))
    return jnp.broadcast_to(x[:, :, None], (t, n, cg)).reshape(t, d)


def _fp8(c):
    """e4m3 codes -> fp16 (exact: every e4m3 value is an fp16 value), the products' input type."""
    return lax.bitcast_convert_type(c, jnp.float8_e4m3fn).astype(jnp.float16)


# ----------------------------------------------------------------------------- per-scheme tiles
class _Plan:
    """Static facts of one scheme's inner loop.

    kc: token classes of a tile - keys of tiled schemes are packed along tokens, so bit plane j of
        the key codes holds tokens j, j + kc, ...; the scores are put back in token order once per
        tile (`_token_order`), so values and softmax see whole tiles.
    pk: channel planes of per-token keys (packed along channels); the query is split to match.
    vp: channel planes of values (packed along channels); the accumulator and output are kept as
        vp planes [Gp, D / vp] and re-interleaved outside the kernel.
    """

    def __init__(self, cfg: KVQuantConfig, head_dim: int, tile_tokens: int, unpack: str = "magic"):
        self.cfg, self.d, self.t = cfg, head_dim, tile_tokens
        self.plane = _plane_asm if unpack == "asm" else _plane
        self.planes = _planes_biased_asm if unpack == "asm" else _planes_biased
        self.tiled = cfg.method in ("kvarn", "kivi")
        self.kc = 8 // cfg.k_bits if self.tiled else 1
        self.pk = 8 // cfg.k_bits if cfg.method == "int" else 1
        self.vp = 8 // cfg.v_bits if cfg.method in ("kvarn", "kivi", "int") else 1

    # views of the page fields that make every in-kernel load a plain strided slice
    def page_view(self, side: str, name: str, a):
        cfg, kc, vp = self.cfg, self.kc, self.vp
        lead = a.shape[:3]                                                  # nb, Hk, tiles
        if cfg.method in ("kvarn", "kivi"):
            if side == "k" and name == "scale_tok":                        # [G] -> [G/kc, kc]
                return a.reshape(lead + (a.shape[3] // kc, kc))
            if side == "v" and name == "scale_chan":                       # [D] -> [D/vp, vp]
                return a.reshape(lead + (a.shape[3] // vp, vp))
            return a
        return a.reshape(a.shape[:2] + (a.shape[2] // self.t, self.t) + a.shape[3:])

    def static_view(self, side: str, a):
        """Canonical static params -> [Hk, D/planes, planes] (int) or [Hk, 1] (fp8)."""
        if self.cfg.method == "int":
            planes = self.pk if side == "k" else self.vp
            return a.reshape(a.shape[0], a.shape[1] // planes, planes)
        return a.reshape(a.shape[0], 1)

    # ---------------------------------------------------------------- keys
    def scores(self, q, q_planes, pages, st, blk, sub):
        """List over token classes j of raw scores [Gp, T / kc] (tokens j, j + kc, ... of the tile)."""
        cfg, kc = self.cfg, self.kc
        f = pages["k"]
        if cfg.method in ("kvarn", "kivi"):
            codes = f["codes"][blk, sub]                                   # [D, G*b/8]
            if EXP.get("tcodes"):
                codes_t = codes                                            # [G*b/8, D]
            if cfg.method == "kvarn":
                qs = q * f["scale_chan"][blk, sub].astype(jnp.float32)[None, :]
                zq = jnp.sum(q * f["zero_chan"][blk, sub].astype(jnp.float32)[None, :], axis=1)
                if EXP.get("abl_zq"):
                    zq = jnp.zeros((q.shape[0],), jnp.float32)
            else:
                qs = q * f["scale"][blk, sub].astype(jnp.float32)[None, :]
                zq = jnp.sum(q * f["zero"][blk, sub].astype(jnp.float32)[None, :], axis=1)
            qs = _f16(qs)
            out = []
            if EXP.get("u2") and cfg.method == "kvarn":
                planes = self.planes(codes_t, cfg.k_bits)
                if EXP.get("abl_sq") or EXP.get("u2sub"):
                    sq = jnp.zeros((q.shape[0],), jnp.float32)
                elif EXP.get("sumdot"):
                    sq = jnp.max(_dot(qs, jnp.ones((self.d, 16), jnp.float16)), axis=1)
                else:
                    sq = jnp.sum(qs.astype(jnp.float32), axis=1)
                for j in range(kc):
                    bias = zq - float(2.0 ** (10 - j * cfg.k_bits)) * sq
                    s = _dot_t(qs, planes[j]) + bias[:, None]
                    out.append(s * f["scale_tok"][blk, sub, :, j].astype(jnp.float32)[None, :])
                return out
            for j in range(kc):
                if EXP.get("tcodes"):
                    s = _dot_t(qs, self.plane(codes_t, cfg.k_bits, j)) + zq[:, None]
                else:
                    s = _dot(qs, self.plane(codes, cfg.k_bits, j)) + zq[:, None]
                if cfg.method == "kvarn":
                    s = s * f["scale_tok"][blk, sub, :, j].astype(jnp.float32)[None, :]
                out.append(s)
            return out
        if cfg.method == "int":
            codes = f["codes"][blk, sub]                                   # [T, D*b/8]
            if cfg.static:
                s = 0.0
                for n in range(self.pk):
                    k = (self.plane(codes, cfg.k_bits, n).astype(jnp.float32) * st["k"]["scale"][:, n][None, :]
                         + st["k"]["zero"][:, n][None, :])
                    s = s + _dot_t(q_planes[n], k)
                return [s]
            sc = f["scale"][blk, sub].astype(jnp.float32)                  # [T, D/cg]
            zr = f["zero"][blk, sub].astype(jnp.float32)
            if sc.shape[1] == 1:  # one scale per token: factor it out of the product
                raw = 0.0
                for n in range(self.pk):
                    raw = raw + _dot_t(q_planes[n], self.plane(codes, cfg.k_bits, n))
                return [raw * sc[:, 0][None, :] + jnp.sum(q, axis=1)[:, None] * zr[:, 0][None, :]]
            cgp = cfg.channel_group("k", self.d) // self.pk
            s = 0.0
            for n in range(self.pk):
                k = (self.plane(codes, cfg.k_bits, n).astype(jnp.float32) * _expand_groups(sc, cgp, self.d // self.pk)
                     + _expand_groups(zr, cgp, self.d // self.pk))
                s = s + _dot_t(q_planes[n], k)
            return [s]
        if cfg.method == "fp8":
            raw = _dot_t(q, _fp8(f["codes"][blk, sub]))                     # [Gp, T]
            if cfg.static:
                return [raw * st["k"]["scale"].astype(jnp.float32)[0]]
            return [raw * f["scale"][blk, sub].astype(jnp.float32)[None, :]]
        return [_dot_t(q, f["values"][blk, sub].astype(jnp.float32))]

    # ---------------------------------------------------------------- values
    def values(self, ps, pages, st, blk, sub):
        """[probabilities [Gp, T]] of a tile in token order -> list over channel planes of [Gp, D / vp]."""
        cfg, vp = self.cfg, self.vp
        f = pages["v"]
        p = ps[0]
        if self.tiled:  # probabilities of a whole tile in token order (see `_token_order`)
            codes = f["codes"][blk, sub]                                    # [G, D*b/8]
            if cfg.method == "kvarn":
                zp = jnp.sum(p * f["zero_tok"][blk, sub].astype(jnp.float32)[None, :], axis=1)
                if EXP.get("abl_zp"):
                    zp = jnp.zeros((p.shape[0],), jnp.float32)
                p16 = _f16(p * f["scale_tok"][blk, sub].astype(jnp.float32)[None, :])
                if EXP.get("u2"):
                    planes = self.planes(codes, cfg.v_bits)
                    if EXP.get("abl_sp") or EXP.get("u2sub"):
                        sp = jnp.zeros((p.shape[0],), jnp.float32)
                    elif EXP.get("sumdot"):
                        sp = jnp.max(_dot(p16, jnp.ones((p16.shape[1], 16), jnp.float16)), axis=1)
                    else:
                        sp = jnp.sum(p16.astype(jnp.float32), axis=1)
                    return [(_dot_t(p16, planes[n]) + (zp - float(2.0 ** (10 - n * cfg.v_bits)) * sp)[:, None])
                            * f["scale_chan"][blk, sub, :, n].astype(jnp.float32)[None, :] for n in range(vp)]
                if EXP.get("tcodes"):
                    return [(_dot_t(p16, self.plane(codes, cfg.v_bits, n)) + zp[:, None])
                            * f["scale_chan"][blk, sub, :, n].astype(jnp.float32)[None, :] for n in range(vp)]
                return [(_dot(p16, self.plane(codes, cfg.v_bits, n)) + zp[:, None])
                        * f["scale_chan"][blk, sub, :, n].astype(jnp.float32)[None, :] for n in range(vp)]
            cgp = cfg.channel_group("v", self.d) // vp
            sc = _expand_groups(f["scale"][blk, sub].astype(jnp.float32), cgp, self.d // vp)
            zr = _expand_groups(f["zero"][blk, sub].astype(jnp.float32), cgp, self.d // vp)
            return [_dot(p, self.plane(codes, cfg.v_bits, n).astype(jnp.float32) * sc + zr) for n in range(vp)]
        if cfg.method == "int":
            codes = f["codes"][blk, sub]
            if cfg.static:
                return [_dot(p, self.plane(codes, cfg.v_bits, n).astype(jnp.float32) * st["v"]["scale"][:, n][None, :]
                             + st["v"]["zero"][:, n][None, :]) for n in range(vp)]
            sc = f["scale"][blk, sub].astype(jnp.float32)
            zr = f["zero"][blk, sub].astype(jnp.float32)
            if sc.shape[1] == 1:
                pz = jnp.sum(p * zr[:, 0][None, :], axis=1)[:, None]
                ps16 = _f16(p * sc[:, 0][None, :])
                return [_dot(ps16, self.plane(codes, cfg.v_bits, n)) + pz for n in range(vp)]
            cgp = cfg.channel_group("v", self.d) // vp
            return [_dot(p, self.plane(codes, cfg.v_bits, n).astype(jnp.float32) * _expand_groups(sc, cgp, self.d // vp)
                         + _expand_groups(zr, cgp, self.d // vp)) for n in range(vp)]
        if cfg.method == "fp8":
            v = _fp8(f["codes"][blk, sub])
            if cfg.static:
                return [_dot(p, v) * st["v"]["scale"][...].astype(jnp.float32)[0]]
            return [_dot(p * f["scale"][blk, sub].astype(jnp.float32)[None, :], v)]
        return [_dot(p, f["values"][blk, sub].astype(jnp.float32))]


# ----------------------------------------------------------------------------- the kernel
def _kernel(*refs, plan, names, static_names, has_hp, block_size, tail_len, tiles_per_block,
            num_splits, sm_scale, window):
    d, vp, t_tok = plan.d, plan.vp, plan.t
    it = iter(refs)
    q_ref = next(it)
    qp_ref = next(it) if plan.pk > 1 else None
    bt_ref, len_ref, sid_ref = next(it), next(it), next(it)
    pages = {side: {n: next(it) for n in names[side]} for side in ("k", "v")}
    static = {side: {n: next(it) for n in static_names[side]} for side in ("k", "v")}
    if has_hp:
        sink_k, sink_v, tail_k, tail_v = next(it), next(it), next(it), next(it)
    o_ref, m_ref, l_ref = next(it), next(it), next(it)

    b, split = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]
    bs, tpb = block_size, tiles_per_block
    ws = jnp.maximum(length - window, 0) if window is not None else jnp.int32(0)
    q = q_ref[...].astype(jnp.float32)                                        # [Gp, D]
    q_planes = [qp_ref[n] for n in range(plan.pk)] if qp_ref is not None else [q]
    gp = q.shape[0]
    st = {side: {n: r[...] for n, r in static[side].items()} for side in ("k", "v")}

    if EXP.get("exp2"):
        q = q * (sm_scale * 1.4426950408889634)
        q_planes = [qq * (sm_scale * 1.4426950408889634) for qq in q_planes]
    _exp = jnp.exp2 if EXP.get("exp2") else jnp.exp
    _sm = 1.0 if EXP.get("exp2") else sm_scale

    def update(carry, ss, poss, value_fn, masked=True):
        """Online softmax over score blocks `ss` (positions `poss`), then acc += value_fn(probabilities)."""
        m, l, acc = carry
        if masked:
            ss = [jnp.where(((pos >= ws) & (pos < length))[None, :], s * _sm, NEG) for s, pos in zip(ss, poss)]
        elif _sm != 1.0:
            ss = [s * _sm for s in ss]
        m_new = m
        for s in ss:
            m_new = jnp.maximum(m_new, jnp.max(s, axis=1))
        alpha = _exp(m - m_new)
        if masked and not EXP.get("exp2"):
            ps = [jnp.where(((pos >= ws) & (pos < length))[None, :], _exp(s - m_new[:, None]), 0.0)
                  for s, pos in zip(ss, poss)]
        else:  # masked logits are NEG: exp gives exactly 0 once a row has seen one valid position
            ps = [_exp(s - m_new[:, None]) for s in ss]
        l_new = alpha * l
        for p in ps:
            l_new = l_new + jnp.sum(p, axis=1)
        contrib = value_fn(ps)
        return m_new, l_new, tuple(alpha[:, None] * a + c for a, c in zip(acc, contrib))

    # ---- quantized tiles (for passthrough: every tile)
    # blocks read from pages: full, not the sink, and not the query's own block (position length - 1)
    n_full = jnp.maximum(length - 1, 0) // bs if has_hp else length // bs
    if has_hp:
        t_begin, t_end = tpb, n_full * tpb
    else:
        t_begin, t_end = 0, pl.cdiv(length, t_tok)
    t_begin = jnp.maximum(t_begin, ws // t_tok)
    n_tiles = jnp.maximum(t_end - t_begin, 0)
    chunk = pl.cdiv(n_tiles, num_splits)
    lo = t_begin + split * chunk
    hi = jnp.minimum(lo + chunk, t_end)

    tok = jnp.arange(t_tok, dtype=jnp.int32)

    def tile_body(t, carry):
        blk = bt_ref[b, t // tpb]
        sub = t % tpb
        ss = [_token_order(plan.scores(q, q_planes, pages, st, blk, sub), gp)]
        poss = [t * t_tok + tok]
        return update(carry, ss, poss, lambda ps: plan.values(ps, pages, st, blk, sub),
                      masked=not (EXP.get("nomask") and has_hp and window is None))

    carry = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
             tuple(jnp.zeros((gp, d // vp), jnp.float32) for _ in range(vp)))
    carry = lax.fori_loop(lo, jnp.maximum(lo, hi), tile_body, carry)

    # ---- high-precision sink and partial tail (split 0 only)
    if has_hp:
        sid = sid_ref[b]
        hc = min(HP_CHUNK, bs)
        first = split == 0

        def hp_loop(carry, k_ref, v_ref, base, start_pos, count):
            """Chunks of `hc` tokens from rows [base, base + count) of the sequence's buffer."""
            c_lo = jnp.maximum(ws - start_pos, 0) // hc
            c_hi = jnp.where(first, pl.cdiv(count, hc), 0)

            def body(c, carry):
                rows = pl.ds(pl.multiple_of(base + c * hc, hc), hc)
                kk = k_ref[sid, rows].astype(jnp.float32)                   # [hc, D]
                pos = start_pos + c * hc + jnp.arange(hc, dtype=jnp.int32)
                vals = lambda ps: [_dot(ps[0], v_ref[sid, rows, :, n].astype(jnp.float32)) for n in range(vp)]
                return update(carry, [_dot_t(q, kk)], [pos], vals)
            return lax.fori_loop(c_lo, jnp.maximum(c_lo, c_hi), body, carry)

        carry = hp_loop(carry, sink_k, sink_v, 0, 0, jnp.minimum(length, bs))
        tail_count = jnp.where(n_full >= 1, length - n_full * bs, 0)
        carry = hp_loop(carry, tail_k, tail_v, (n_full * bs) % tail_len, n_full * bs, tail_count)

    m, l, acc = carry
    for n in range(vp):
        o_ref[n] = acc[n]
    m_ref[...] = m
    l_ref[...] = l


def default_num_warps(cfg: KVQuantConfig, batch: int, num_kv_heads: int) -> int:
    """Warps per program, from the H200 sweep in benchmarks/results/2026-11-29_decode_h200.json:
    2 warps win for KVarN/KIVI and fp8 once there are >= 64 (sequence, kv head) pairs; 4 elsewhere."""
    if cfg.method in ("kvarn", "kivi", "fp8") and batch * num_kv_heads >= 64:
        return 2
    return 4


def default_num_splits(batch: int, num_kv_heads: int, max_tiles: int) -> int:
    """Enough programs to fill an H100/H200-class chip (~132 SMs x 2), never more splits than tiles."""
    want = max(1, -(-264 // max(1, batch * num_kv_heads)))
    return int(max(1, min(want, max_tiles, 128)))


@functools.partial(jax.jit, static_argnames=("scale", "window", "num_splits", "interpret", "num_warps",
                                             "num_stages", "unpack"))
def paged_decode_pallas(q_rot, cache, block_tables, seq_lens, seq_ids, *, scale: float, window: int | None,
                        num_splits: int | None = None, interpret: bool = False, num_warps: int | None = None,
                        num_stages: int = 2, unpack: str | None = None):
    """Kernel entry: q_rot [B, Hq, D] in the stored frame -> output [B, Hq, D] fp32 in the stored frame.

    unpack: how codes become fp16 - "asm" (`_plane_asm`, PTX; the default when compiled: 14-15% faster
    for kvarn_k4v2_g128 and int4 at B=32/L=32K on the H200, bit-identical) or "magic" (`_plane`,
    jnp; the default interpreted, where PTX cannot run).
    """
    unpack = unpack or ("magic" if interpret else "asm")
    if unpack not in ("magic", "asm") or (unpack == "asm" and interpret):
        raise ValueError(f"unpack must be 'magic' or (compiled only) 'asm', got {unpack!r} (interpret={interpret})")
    cfg = cache.cfg
    nbt, hq, d = q_rot.shape
    hk = cache.num_kv_heads
    grp = hq // hk
    gp = max(16, 1 << (grp - 1).bit_length())
    mb = block_tables.shape[1]
    t_tok = cfg.tile_tokens if cfg.tile_tokens > 1 else min(TOKEN_CHUNK, cache.block_size)
    tiles_per_block = cache.block_size // t_tok
    splits = num_splits or default_num_splits(nbt, hk, mb * tiles_per_block)
    plan = _Plan(cfg, d, t_tok, unpack)

    qg = q_rot.astype(jnp.float32).reshape(nbt, hk, grp, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - grp), (0, 0)))
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))
    head_spec = lambda a: pl.BlockSpec((a.shape[0], None) + a.shape[2:],
                                       lambda b, h, s, nd=a.ndim - 2: (0, h) + (0,) * nd)
    operands = [qg]
    specs = [pl.BlockSpec((None, None, gp, d), lambda b, h, s: (b, h, 0, 0))]
    if plan.pk > 1:  # query split into the key channel planes: channels n, n + pk, ...
        qp = qg.reshape(nbt, hk, gp, d // plan.pk, plan.pk).transpose(0, 1, 4, 2, 3)
        operands.append(qp)
        specs.append(pl.BlockSpec((None, None, plan.pk, gp, d // plan.pk), lambda b, h, s: (b, h, 0, 0, 0)))
    operands += [block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), seq_ids.astype(jnp.int32)]
    specs += [full(block_tables.shape), full(seq_lens.shape), full(seq_ids.shape)]
    names = {}
    for side in ("k", "v"):
        names[side] = sorted(cache.pages[side])
        for n in names[side]:
            a = plan.page_view(side, n, cache.pages[side][n])
            if EXP.get("tcodes") == 1 and n == "codes" and plan.tiled:
                a = jnp.swapaxes(a, -1, -2)
            operands.append(a)
            specs.append(head_spec(a))
    static_names = {}
    for side in ("k", "v"):
        static_names[side] = sorted(cache.static[side]) if cache.static else []
        for n in static_names[side]:
            a = plan.static_view(side, cache.static[side][n])
            operands.append(a)
            specs.append(pl.BlockSpec((None,) + a.shape[1:], lambda b, h, s, nd=a.ndim - 1: (h,) + (0,) * nd))
    if cache.has_hp:
        for side, a in (("k", cache.sink["k"]), ("v", cache.sink["v"]), ("k", cache.tail["k"]), ("v", cache.tail["v"])):
            if side == "v":  # [.., D] -> [.., D/vp, vp]: value planes
                a = a.reshape(a.shape[:3] + (d // plan.vp, plan.vp))
            operands.append(a)
            specs.append(head_spec(a))

    kernel = functools.partial(
        _kernel, plan=plan, names=names, static_names=static_names, has_hp=cache.has_hp,
        block_size=cache.block_size, tail_len=max(cache.tail_len, 1), tiles_per_block=tiles_per_block,
        num_splits=splits, sm_scale=scale, window=window)
    vp = plan.vp
    out_shape = [jax.ShapeDtypeStruct((nbt, hk, splits, vp, gp, d // vp), jnp.float32),
                 jax.ShapeDtypeStruct((nbt, hk, splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct((nbt, hk, splits, gp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, vp, gp, d // vp), lambda b, h, s: (b, h, s, 0, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0))]
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        warps = num_warps or default_num_warps(cfg, nbt, hk)
        params["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=num_stages)
    acc, m, l = pl.pallas_call(kernel, grid=(nbt, hk, splits), in_specs=specs, out_specs=out_specs,
                               out_shape=out_shape, interpret=interpret,
                               name=f"kvarn_paged_decode_{cfg.name}", **params)(*operands)
    # merge the splits (flash-decoding) and re-interleave the value planes: channel vp*i + n
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = (jnp.exp2 if EXP.get("exp2") else jnp.exp)(m - m_all)
    l_all = jnp.sum(w * l, axis=2)
    o = jnp.sum(w[..., None, :, None] * acc, axis=2) / jnp.where(l_all > 0, l_all, 1.0)[..., None, :, None]
    o = o.transpose(0, 1, 3, 4, 2).reshape(nbt, hk, gp, d)
    return o[:, :, :grp].reshape(nbt, hq, d)
