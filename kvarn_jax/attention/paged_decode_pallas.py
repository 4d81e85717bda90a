"""Fused paged decode attention in Pallas (GPU through Triton lowering; any backend with interpret=True).

Oracle: `reference.py` beside this file (`paged_decode_attention_reference`).

One program per (sequence, kv head, split). Each program walks its share of the sequence's
quantized tiles, reading codes and scales straight from the pages (never materializing fp16 K/V in
HBM), and keeps an fp32 online softmax for the query heads of its KV head (its GQA group). Split 0
also covers the high-precision sink block and the partial tail. The splits are merged afterwards
(flash-decoding, `split_merge.py`), so that small batches still fill the chip; with one split the
program finishes its output itself (merge="kernel").

Two layouts of the products (`orient`, `default_orient`): tokens-major (scores [T, Gp] = codes @
q^T, the GQA group padded to the matrix unit's 8-wide N, zero-point sums as products with a ones
matrix) for the tiled schemes (KVarN, KIVI; on the H200 kvarn_k4v2_g128 at B=32/L=32K went from
0.645 to 0.378 ms, benchmarks/results/2026-12-01_decode_tokens_major_h200.md) and for int schemes
with one scale per token (scale and zero factored out of both products; int8 0.749 -> 0.686 ms,
2026-12-02_decode_value_layout_h200.md), and heads-major (scores [Gp, T] = q @ codes^T, the group
padded to 16 rows) for fp8, grouped or static int scales and passthrough.

Scales stay out of the inner products (docs/design.md §3). For KVarN, with K̂[d,t] = (c·sc[d] + z[d])·st[t]:
    q·K̂[:,t] = st[t]·( Σ_d (q[d]·sc[d])·c[d,t] + Σ_d q[d]·z[d] )
and with V̂[t,d] = (c·vt[t] + vz[t])·vc[d]:
    Σ_t p[t]·V̂[t,d] = vc[d]·( Σ_t (p[t]·vt[t])·c[t,d] + Σ_t p[t]·vz[t] )
so the per-element work is unpack + int→fp16, and both products run on raw codes. Tiled schemes
store their codes with the contracted axis contiguous (K [G*b/8, D], V [D*b/8, G];
`packing.store_tiled`), so each register the kernel loads holds 4 contraction-consecutive bytes;
per-token int and fp8 value codes are stored tokens last for the same reason (`paged.tokens_last`).
The softmax runs in base 2 with sm_scale·log2(e) folded into the query once (no per-score scaling,
exp2 instead of exp), and full quantized tiles need no masks.

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

from .. import triton_options
from . import split_merge
from ..cache.paged import tokens_last
from ..config import KVQuantConfig
from ..validation import is_power_of_two as _pow2

NEG = -1e30          # masked logit; every processed chunk holds at least one valid position
LOG2E = 1.4426950408889634
HP_CHUNK = 64        # tokens per step through the high-precision sink/tail (half that under a register cap)
IDS_GROUP = 128      # most block-table entries a program reads at once with num_stages >= 3 (`_kernel`)
TOKEN_CHUNK = 64     # tokens per step through the pages of per-token schemes (`default_chunk`: 128 for most)


def supports(cfg: KVQuantConfig, block_size: int, head_dim: int) -> str | None:
    """None if the Pallas kernel handles this cache, else the reason (the reference must be used)."""
    if not _pow2(block_size) or block_size < 16:
        return f"block_size={block_size} (the kernel needs a power of two >= 16)"
    if not _pow2(head_dim) or head_dim < 16:
        return f"head_dim={head_dim} (the kernel needs a power of two >= 16)"
    if cfg.method == "int" and not _pow2(cfg.channel_group("k", head_dim)):
        return f"channel group {cfg.channel_group('k', head_dim)} (must be a power of two)"
    return None


def value_planes(cfg: KVQuantConfig) -> int:
    """Channel planes of the values (packed along channels): the kernel's accumulator and partial
    outputs are kept as that many planes of D / planes channels, re-interleaved by the merge."""
    return 8 // cfg.v_bits if cfg.method in ("kvarn", "kivi", "int") else 1


def group_rows(group: int, tokens_major: bool) -> tuple[int, int]:
    """(Gp, stored) for a GQA group of `group` query heads: Gp, the query rows a program computes
    (the matrix unit's 8-wide N tokens-major, 16 rows heads-major, or the group rounded up to a power
    of two), and the heads of it whose partial outputs the kernel stores - the group rounded up to
    a power of two (Triton's tensors), at least 2 (a one-wide axis was not tried on the GPU)."""
    pow2 = 1 << (group - 1).bit_length()
    gp = max(8 if tokens_major else 16, pow2)
    return gp, min(gp, max(2, pow2))


def tokens_major_unsupported(cfg: KVQuantConfig, head_dim: int) -> str | None:
    """None if `orient="tokens"` applies to this scheme, else why not: the tiled schemes, and
    per-token schemes with one dynamic scale (and zero) per token, which factor out of both
    products. Per-channel static and grouped scales would need an elementwise dequantization of
    every code, which the heads-major layout already does."""
    if cfg.method in ("kvarn", "kivi") or (cfg.method == "fp8" and not cfg.static):
        return None
    if cfg.method == "int" and not cfg.static and cfg.channel_group("k", head_dim) == head_dim \
            and cfg.channel_group("v", head_dim) == head_dim:
        return None
    return "tokens-major products need KVarN/KIVI, or one dynamic scale per token (int, fp8)"


# ----------------------------------------------------------------------------- in-kernel helpers
def _magic(bits: int, j: int) -> int:
    """fp16 bit pattern of 2^(10 - j*bits). OR-ing bit plane j of a code byte *in place* (no shift)
    into it gives exactly 2^(10 - j*bits) + code: those bits then sit in the mantissa where one unit
    is worth 1. (int -> float conversions run at a fraction of the rate of integer logic on NVIDIA
    GPUs; this needs one logic op and one fp16 subtraction per two codes.)"""
    return (25 - j * bits) << 10


def _planes(c, bits: int, biased: bool = False):
    """Bit planes of packed codes as fp16: plane j holds element j of every byte (bit shift j*bits),
    i.e. elements j, j + 8/bits, ... of the packed axis. Working plane by plane avoids re-interleaving
    codes in registers; the order is restored outside the inner products. jnp version."""
    out = []
    for j in range(8 // bits):
        mask = ((1 << bits) - 1) << (j * bits)
        v = jnp.bitwise_or(jnp.bitwise_and(c, jnp.uint8(mask)).astype(jnp.uint16), jnp.uint16(_magic(bits, j)))
        v = lax.bitcast_convert_type(v, jnp.float16)
        out.append(v if biased else v - jnp.float16(2.0 ** (10 - j * bits)))
    return out


def _planes_asm(c, bits: int, biased: bool = False):
    """`_planes` in PTX (NVIDIA GPUs only; bit-identical). One asm spreads 4 code bytes into the
    16-bit halves of two registers (two `prmt`, once for all planes); then per plane and pair of
    codes one `lop3` ((t & mask) | magic, see `_magic`) and one `sub.f16x2` removing the magic.
    Triton's inline asm returns one result per call, hence the two steps. On the H200 this and the
    transposed code layout took kvarn_k4v2_g128 at B=32/L=32K from 0.81 to 0.63 ms
    (benchmarks/results/2026-12-01_decode_variants_h200.md)."""
    from jax.experimental.pallas import triton as plgpu
    # 8-bit codes (one plane): the spread itself puts the magic's high byte 0x64 above each code
    # (fp16 0x64cc = 1024 + c), so no `lop3` is needed
    whole = bits == 8
    fill = 0x64646464 if whole else 0
    spread = ("{ .reg .b32 z; " + f"mov.b32 z, {fill:#x}; "
              + "prmt.b32 $0, $2, z, 0x4140; prmt.b32 $1, $2, z, 0x4342; }")
    (wide,) = plgpu.elementwise_inline_asm(spread, args=[c], constraints="=r,=r,r", pack=4,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(
                                               c.shape, jnp.float16 if whole else jnp.int16)])
    out = []
    for j in range(8 // bits):
        mask16 = ((1 << bits) - 1) << (j * bits)
        mg = _magic(bits, j)
        if whole and biased:  # already magic + code
            out.append(wide)
            continue
        if whole:
            asm = "{ .reg .b32 m; " + f"mov.b32 m, {mg | (mg << 16)}; sub.rn.f16x2 $0, $1, m; " + "}"
        elif biased:  # magic + code: the caller removes magic * (sum of the other operand)
            asm = f"lop3.b32 $0, $1, {mask16 | (mask16 << 16)}, {mg | (mg << 16)}, 0xEA;"
        else:
            asm = ("{ .reg .b32 t, m; " + f"mov.b32 m, {mg | (mg << 16)}; "
                   + f"lop3.b32 t, $1, {mask16 | (mask16 << 16)}, m, 0xEA; sub.rn.f16x2 $0, t, m; " + "}")
        (v,) = plgpu.elementwise_inline_asm(asm, args=[wide], constraints="=r,r", pack=2,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float16)])
        out.append(v)
    return out


def _masked_load(ref, **kw):
    """A masked load (`jax.experimental.pallas.triton.load`; also runs interpreted)."""
    from jax.experimental.pallas import triton as plgpu
    return plgpu.load(ref, **kw)


def _f16(x):
    return x.astype(jnp.float16)


def _dot(a, b, min_n: int = 16):
    """[M, K] @ [K, N] in fp16 with fp32 accumulation.

    Triton's matrix instructions need M, K >= 16 and N >= 8 (mma m16n8k16; N >= 16 unless `min_n`
    says otherwise); smaller products are computed as a broadcast multiply and sum instead.
    """
    if min(a.shape[0], a.shape[1]) < 16 or b.shape[1] < min_n:
        return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :], axis=1)
    return jnp.dot(_f16(a), _f16(b), preferred_element_type=jnp.float32)


def _dot_t(a, b, min_n: int = 16):
    """[M, K] @ [N, K]^T in fp16 with fp32 accumulation (see `_dot` for small shapes)."""
    if min(a.shape[0], a.shape[1]) < 16 or b.shape[0] < min_n:
        return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=2)
    return lax.dot_general(_f16(a), _f16(b), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b, min_n: int = 16):
    """[K, M]^T @ [K, N] in fp16 with fp32 accumulation (see `_dot` for small shapes)."""
    if min(a.shape[0], a.shape[1]) < 16 or b.shape[1] < min_n:
        return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[:, None, :], axis=0)
    return lax.dot_general(_f16(a), _f16(b), (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _columns(x):
    """[R, n] -> the n columns [R] each, by masked sums along the (in-thread) minor axis. Loading a
    small strided vector (one plane's scales, x[:, j]) reads 2-byte elements, which Triton cannot
    copy asynchronously, so it was a plain load waited on in every tile; the whole [R, n] block is
    contiguous and is pipelined with the codes."""
    col = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return [jnp.sum(jnp.where(col == j, x, 0.0), axis=1) for j in range(x.shape[1])]


def _interleave(cs):
    """Classes [..., n] (class j: elements j, j + len(cs), ...) -> [..., n, 2, ..., 2] by nested
    joins (Triton joins along a new last axis only): index (i, bits of j) holds element i of class j."""
    if len(cs) == 1:
        return cs[0]
    return jnp.stack([_interleave(cs[0::2]), _interleave(cs[1::2])], axis=-1)


def _token_order(classes, rows: int):
    """Key scores per token class (class j holds tokens j, j + kc, ... of a tile: bit plane j of the
    packed key codes) -> one [rows, T] block in token order, by Triton's join (an interleave):
    token i*kc + j is element i of class j. Joining the scores once lets the softmax and the value
    products work on whole tiles (4 value products per tile for 2-bit values instead of 8) - 13-16%
    faster on the H200 (benchmarks/results/2026-11-29_decode_join_h200.json)."""
    return _interleave(classes).reshape(rows, classes[0].shape[1] * len(classes))


def _tokens_from_planes(planes):
    """Key code planes (plane j: tokens j, j + kc, ... of a tile, [G/kc, D] each) -> the tile [G, D] in
    token order (nested joins, as `_token_order`, then the plane axes moved before the channels)."""
    x = _interleave(planes)                                  # [G/kc, D, 2, ..., 2]
    nd = x.ndim
    x = jnp.transpose(x, (0,) + tuple(range(2, nd)) + (1,))  # [G/kc, 2, ..., 2, D]
    return x.reshape(planes[0].shape[0] * len(planes), planes[0].shape[1])


def _expand_groups(x, cg: int, d: int, axis: int = 1):
    """Per-group values [T, D/cg] -> per-channel [T, D] (axis=1), or [D/cg, T] -> [D, T] (axis=0)."""
    if axis == 0:
        n, t = x.shape
        if n == 1:
            return jnp.broadcast_to(x, (d, t))
        return jnp.broadcast_to(x[:, None, :], (n, cg, t)).reshape(d, t)
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
        the key codes ([G*b/8, D]) holds tokens j, j + kc, ...; the scores are put back in token
        order once per tile (`_token_order`), so values and softmax see whole tiles.
    pk: channel planes of per-token keys (packed along channels); the query is split to match.
    vp: channel planes of values (packed along channels); the accumulator and output are kept as
        vp planes [Gp, D / vp] and re-interleaved outside the kernel.
    """

    def __init__(self, cfg: KVQuantConfig, head_dim: int, tile_tokens: int, unpack: str = "magic",
                 fold: bool = False, sums: str = "reduce"):
        self.cfg, self.d, self.t = cfg, head_dim, tile_tokens
        self.fold, self.sums = fold, sums
        self.planes = _planes_asm if unpack == "asm" else _planes
        self.tiled = cfg.method in ("kvarn", "kivi")
        self.kc = 8 // cfg.k_bits if self.tiled else 1
        # key planes shorter than the matrix unit's 16 rows (2-bit keys, G=32): the tile is put back
        # in token order first and multiplied whole (a [16, D] x [D, 8] product would not lower to
        # the matrix unit and spills as a broadcast multiply)
        self.k_whole = self.tiled and tile_tokens // self.kc < 16
        self.pk = 8 // cfg.k_bits if cfg.method == "int" else 1
        self.vp = value_planes(cfg)

    # views of the page fields that make every in-kernel load a plain strided slice
    def page_view(self, side: str, name: str, a):
        cfg, kc, vp = self.cfg, self.kc, self.vp
        lead = a.shape[:3]                                                  # nb, Hk, tiles
        if cfg.method in ("kvarn", "kivi"):
            if side == "k" and name == "scale_tok" and not self.k_whole:   # [G] -> [G/kc, kc]
                return a.reshape(lead + (a.shape[3] // kc, kc))
            if side == "v" and name == "scale_chan":                       # [D] -> [D/vp, vp]
                return a.reshape(lead + (a.shape[3] // vp, vp))
            return a
        if tokens_last(cfg, side, name):                                    # [D*b/8, bs] -> [D*b/8, bs/t, t]
            return a.reshape(a.shape[:3] + (a.shape[3] // self.t, self.t))
        return a.reshape(a.shape[:2] + (a.shape[2] // self.t, self.t) + a.shape[3:])

    def static_view(self, side: str, a):
        """Canonical static params -> [Hk, D/planes, planes] (int) or [Hk, 1] (fp8)."""
        if self.cfg.method == "int":
            planes = self.pk if side == "k" else self.vp
            return a.reshape(a.shape[0], a.shape[1] // planes, planes)
        return a.reshape(a.shape[0], 1)

    # ---------------------------------------------------------------- keys
    def scores(self, q, q_planes, pages, st, blk, sub):
        """List over token classes j of raw scores [Gp, T / kc] (tokens j, j + kc, ... of the tile).
        Per-token int keys: q and q_planes come rounded to fp16 (`_kernel`), so Σ_d q below is the
        sum of the query the code products see."""
        cfg, kc = self.cfg, self.kc
        f = pages["k"]
        if cfg.method in ("kvarn", "kivi"):
            codes = f["codes"][blk, sub]                                   # [G*b/8, D]
            if cfg.method == "kvarn":
                qs = q * f["scale_chan"][blk, sub].astype(jnp.float32)[None, :]
                zq = jnp.sum(q * f["zero_chan"][blk, sub].astype(jnp.float32)[None, :], axis=1)
            else:
                qs = q * f["scale"][blk, sub].astype(jnp.float32)[None, :]
                zq = jnp.sum(q * f["zero"][blk, sub].astype(jnp.float32)[None, :], axis=1)
            qs = _f16(qs)
            # unpack after the query side is ready: the planes' registers then live only as long as
            # the products need them (unpacking first cost ~45 registers per thread)
            planes = self.planes(codes, cfg.k_bits)                         # kc x [G/kc, D]
            if self.k_whole:  # one product over the tile reassembled in token order
                s = _dot_t(qs, _tokens_from_planes(planes)) + zq[:, None]
                if cfg.method == "kvarn":
                    s = s * f["scale_tok"][blk, sub].astype(jnp.float32)[None, :]
                return [s]
            out = []
            for j in range(kc):
                s = _dot_t(qs, planes[j]) + zq[:, None]
                if cfg.method == "kvarn":
                    s = s * f["scale_tok"][blk, sub, :, j].astype(jnp.float32)[None, :]
                out.append(s)
            return out
        if cfg.method == "int":
            planes = self.planes(f["codes"][blk, sub], cfg.k_bits)          # pk x [T, D/pk]
            if cfg.static:
                s = 0.0
                for n in range(self.pk):
                    k = (planes[n].astype(jnp.float32) * st["k"]["scale"][n][None, :]
                         + st["k"]["zero"][n][None, :])
                    s = s + _dot_t(q_planes[n], k)
                return [s]
            sc = f["scale"][blk, sub].astype(jnp.float32)                  # [T, D/cg]
            zr = f["zero"][blk, sub].astype(jnp.float32)
            if sc.shape[1] == 1:  # one scale per token: factor it out of the product
                raw = 0.0
                for n in range(self.pk):
                    raw = raw + _dot_t(q_planes[n], planes[n])
                return [raw * sc[:, 0][None, :] + jnp.sum(q, axis=1)[:, None] * zr[:, 0][None, :]]
            cgp = cfg.channel_group("k", self.d) // self.pk
            s = 0.0
            for n in range(self.pk):
                k = (planes[n].astype(jnp.float32) * _expand_groups(sc, cgp, self.d // self.pk)
                     + _expand_groups(zr, cgp, self.d // self.pk))
                s = s + _dot_t(q_planes[n], k)
            return [s]
        if cfg.method == "fp8":
            raw = _dot_t(q, _fp8(f["codes"][blk, sub]))                     # [Gp, T]
            if cfg.static:
                return [raw * st["k"]["scale"].astype(jnp.float32)[0]]
            return [raw * f["scale"][blk, sub].astype(jnp.float32)[None, :]]
        return [_dot_t(q, f["values"][blk, sub].astype(jnp.float32))]

    # ---------------------------------------------------------------- tokens-major (per-token schemes)
    def query_pt(self, q_planes):
        """Per-program query side of a per-token scheme's tokens-major products, (q16, qsum, bias):
        the query's fp16 channel planes [Gp, D/pk] (one for 8-bit codes and fp8), Σ_d q as [1, Gp]
        (fp32) for the zero points, and with `fold` Σ_n 2^(10 - n·b)·Σ_d q16_n as [1, Gp], which the
        biased planes (2^(10 - n·b) + code, `_magic`) add to every raw score (else None). The query is
        the same for every chunk of the sequence, so unlike the tiled schemes' this costs nothing
        per chunk. Int keys: q_planes come rounded to fp16 (`_kernel`), so qsum is the sum of
        the query the code products see."""
        q16 = [_f16(x) for x in q_planes]
        qsum = sum(jnp.sum(x, axis=1) for x in q_planes)[None, :]
        if not self.fold:
            return q16, qsum, None
        bias = sum((2.0 ** (10 - n * self.cfg.k_bits)) * jnp.sum(x.astype(jnp.float32), axis=1)
                   for n, x in enumerate(q16))
        return q16, qsum, bias[None, :]

    def scores_pt(self, qside, pages, blk, sub):
        """Tokens-major scores [T, Gp] of a chunk of a per-token scheme (codes as the matrix unit's
        M operand, the heads its 8-wide N), with K[t, d] = c[t, d]·s[t] + z[t]:
            q·K[t] = s[t]·Σ_d q[d]·c[t, d] + z[t]·Σ_d q[d]
        qside: `query_pt`."""
        cfg = self.cfg
        f = pages["k"]
        q16, qsum, bias = qside
        if cfg.method == "fp8":
            raw = _dot_t(_fp8(f["codes"][blk, sub]), q16[0], min_n=8)        # [T, Gp]
            return raw * f["scale"][blk, sub].astype(jnp.float32)[:, None]
        planes = self.planes(f["codes"][blk, sub], cfg.k_bits, biased=bias is not None)  # pk x [T, D/pk]
        raw = 0.0
        for n in range(self.pk):
            raw = raw + _dot_t(planes[n], q16[n], min_n=8)
        if bias is not None:
            raw = raw - bias
        return (raw * f["scale"][blk, sub].astype(jnp.float32)
                + f["zero"][blk, sub].astype(jnp.float32) * qsum)           # [T, 1] scale and zero

    def values_pt(self, p, pages, blk, sub):
        """Tokens-major values of a per-token scheme: probabilities [T, Gp] -> list over channel planes
        of [D / vp, Gp], with V[t, d] = c[t, d]·s[t] + z[t]:
            Σ_t p[t]·V[t, d] = Σ_t (p[t]·s[t])·c[t, d] + Σ_t p[t]·z[t]
        (with `fold`, the biased planes' 2^(10 - n·b)·Σ_t p16 removed as well)."""
        cfg, vp = self.cfg, self.vp
        f = pages["v"]
        sc = f["scale"][blk, sub].astype(jnp.float32)
        if cfg.method == "fp8":                                             # [T] scales
            return [_dot(_fp8(f["codes"][blk, :, sub]), _f16(p * sc[:, None]), min_n=8)]  # codes [D, T]
        p16 = _f16(p * sc)                                                  # [T, 1] scales
        pz = p * f["zero"][blk, sub].astype(jnp.float32)
        planes = self.planes(f["codes"][blk, :, sub], cfg.v_bits, biased=self.fold)  # vp x [D/vp, T]
        corr = self.value_terms(pz, p16, planes[0].shape[0])
        return [_dot(planes[n], p16, min_n=8) + corr[n] for n in range(vp)]

    def value_terms(self, pz, p16, rows: int):
        """What the tokens-major value products [rows, Gp] of a tile leave out, per channel plane n:
        Σ_t p·z (pz: p·z per token, [T, Gp] fp32), and with `fold` minus 2^(10 - n·b)·Σ_t p16 (the
        biased planes' magic times the fp16 probabilities the products saw). sums="mma": as
        products ones [rows, T] @ x, which leave every row holding the sum in the outputs' layout;
        "reduce": jnp sums as [1, Gp]."""
        magic = [2.0 ** (10 - n * self.cfg.v_bits) for n in range(self.vp)]
        if self.sums == "mma":
            ones = jnp.ones((rows, pz.shape[0]), jnp.float16)
            zrows = _dot(ones, _f16(pz), min_n=8)
            srows = _dot(ones, p16, min_n=8) if self.fold else None
            return [zrows - m * srows if self.fold else zrows for m in magic]
        zp = jnp.sum(pz, axis=0)[None, :]
        psum = jnp.sum(p16.astype(jnp.float32), axis=0)[None, :] if self.fold else None
        return [zp - m * psum if self.fold else zp for m in magic]

    # ---------------------------------------------------------------- tokens-major (tiled schemes)
    def query_t(self, q, pages, blk, sub, z=None):
        """Per-tile query side of the tokens-major key product, shared by the tile's parts:
        (qs, zero, bias). qs: the query scaled by the tile's channel scales, fp16 [Gp, D].
        zero: the key zero-point term sum_d q[g, d] * z[d] as [1, Gp], an fp32 sum (z: the tile's
        zero points [D] if already loaded). As a product with a ones matrix it would be a sum of
        fp16 roundings of q*z, which for 8-bit keys with outlier channels put the kernel 1.5x
        outside the tests' tolerance; as a product of z with the query's two fp16 halves it is exact
        but keeps those halves live in the loop (the H200 then ran 1.8x slower: spills).
        bias (with `fold`, else None): sums="reduce": sum(qs) as [1, Gp]; sums="mma": qs itself,
        which `scores_t` sums as a product with a ones matrix (exact: qs is the fp16 operand of
        the score product)."""
        f = pages["k"]
        sc, zc = ("scale_chan", "zero_chan") if self.cfg.method == "kvarn" else ("scale", "zero")
        qs = _f16(q * f[sc][blk, sub].astype(jnp.float32)[None, :])
        z = f[zc][blk, sub] if z is None else z
        zero = jnp.sum(q * z.astype(jnp.float32)[None, :], axis=1)[None, :]
        # planes fed as 2^(10 - j*b) + code (fold): remove 2^(10 - j*b) * sum(qs) per score instead
        if not (self.fold and not self.k_whole):
            return qs, zero, None
        return qs, zero, qs if self.sums == "mma" else jnp.sum(qs.astype(jnp.float32), axis=1)[None, :]

    def scores_t(self, qside, pages, blk, sub, part=0, parts: int = 1, tok_scales=None):
        """Tokens-major scores of a tiled scheme: list over token classes j of [T / kc, Gp] (tokens
        j, j + kc, ... of the tile; one class in token order when `k_whole`). With parts > 1 only
        tokens [part * T/parts, (part + 1) * T/parts) of the tile (classes within that part).
        qside: `query_t` of the tile. tok_scales: KVarN's key token scales of the (whole) tile
        [T/kc, kc] if already loaded."""
        cfg, kc = self.cfg, self.kc
        f = pages["k"]
        rows = self.t * cfg.k_bits // 8 // parts
        codes = f["codes"][blk, sub, pl.ds(part * rows, rows)]             # [G*b/8 / parts, D]
        qs, zero, bias = qside
        planes = self.planes(codes, cfg.k_bits, biased=bias is not None)   # kc x [G/kc, D]
        ks = [_tokens_from_planes(planes)] if self.k_whole else planes     # short planes: one tile
        if self.sums == "mma" and bias is not None:  # every row of ones @ qs^T holds sum(qs), in the scores' layout
            bias = _dot_t(jnp.ones(ks[0].shape, jnp.float16), bias, min_n=8)
        n_tok = ks[0].shape[0]
        if cfg.method == "kvarn":  # token scales per class: [T/kc] each (whole-block load, `_columns`)
            st = f["scale_tok"]
            sts = ([st[blk, sub, pl.ds(part * n_tok, n_tok)].astype(jnp.float32)] if self.k_whole
                   else _columns((st[blk, sub, pl.ds(part * rows, rows)] if tok_scales is None
                                  else tok_scales).astype(jnp.float32)))
        out = []
        for j, k in enumerate(ks):
            s = _dot_t(k, qs, min_n=8) + zero
            if bias is not None:
                s = s - (2.0 ** (10 - j * cfg.k_bits)) * bias
            if cfg.method == "kvarn":
                s = s * sts[j][:, None]
            out.append(s)
        return out

    def values_t(self, p, pages, blk, sub, part=0, parts: int = 1, chan_tile=None):
        """Tokens-major values of a tiled scheme: probabilities [T / parts, Gp] in token order (of
        part `part` of the tile) -> list over channel planes of [D / vp, Gp]. chan_tile: KVarN's value
        channel scales of the tile [D/vp, vp] if already loaded."""
        cfg, vp = self.cfg, self.vp
        f = pages["v"]
        n_tok = self.t // parts
        toks = pl.ds(part * n_tok, n_tok)
        codes = f["codes"][blk, sub, :, toks]                              # [D*b/8, G / parts]
        if cfg.method == "kvarn":
            st, zt, chan = f["scale_tok"][blk, sub, toks], f["zero_tok"][blk, sub, toks], f["scale_chan"]
        elif cfg.channel_group("v", self.d) == self.d:
            # KIVI with one scale per token (the channel group is the whole head): V[t, d] =
            # c * s[t] + z[t], factored out of the product like KVarN's (no elementwise dequantization)
            st, zt, chan = f["scale"][blk, sub, toks, 0], f["zero"][blk, sub, toks, 0], None
        else:
            st = None
        if st is not None:
            planes = self.planes(codes, cfg.v_bits, biased=self.fold)       # vp x [D/vp, G/parts]
            p16 = _f16(p * st.astype(jnp.float32)[:, None])
            corr = self.value_terms(p * zt.astype(jnp.float32)[:, None], p16, planes[0].shape[0])
            out = [_dot(planes[n], p16, min_n=8) + corr[n] for n in range(vp)]
            if chan is not None:  # channel scales per plane (whole-block load, `_columns`)
                block = chan[blk, sub] if chan_tile is None else chan_tile
                out = [o * c[:, None] for o, c in zip(out, _columns(block.astype(jnp.float32)))]
            return out
        planes = self.planes(codes, cfg.v_bits)                             # vp x [D/vp, G/parts]
        cgp = cfg.channel_group("v", self.d) // vp
        sc = _expand_groups(f["scale"][blk, sub, toks].astype(jnp.float32).T, cgp, self.d // vp, axis=0)
        zr = _expand_groups(f["zero"][blk, sub, toks].astype(jnp.float32).T, cgp, self.d // vp, axis=0)
        return [_dot(planes[n].astype(jnp.float32) * sc + zr, p, min_n=8) for n in range(vp)]

    # ---------------------------------------------------------------- values
    def values(self, ps, pages, st, blk, sub):
        """[probabilities [Gp, T]] of a tile in token order -> list over channel planes of [Gp, D / vp]."""
        cfg, vp = self.cfg, self.vp
        f = pages["v"]
        p = ps[0]
        if self.tiled:  # probabilities of a whole tile in token order (see `_token_order`)
            codes = f["codes"][blk, sub]                                    # [D*b/8, G]
            if cfg.method == "kvarn":
                zp = jnp.sum(p * f["zero_tok"][blk, sub].astype(jnp.float32)[None, :], axis=1)
                p16 = _f16(p * f["scale_tok"][blk, sub].astype(jnp.float32)[None, :])
                planes = self.planes(codes, cfg.v_bits)                     # vp x [D/vp, G]
                return [(_dot_t(p16, planes[n]) + zp[:, None])
                        * f["scale_chan"][blk, sub, :, n].astype(jnp.float32)[None, :] for n in range(vp)]
            # KIVI: per-token scales in channel groups, laid out like the planes ([D/vp, G]; the
            # transposes are of the small [G, D/cg] scale arrays, not of the codes)
            cgp = cfg.channel_group("v", self.d) // vp
            planes = self.planes(codes, cfg.v_bits)
            sc = _expand_groups(f["scale"][blk, sub].astype(jnp.float32).T, cgp, self.d // vp, axis=0)
            zr = _expand_groups(f["zero"][blk, sub].astype(jnp.float32).T, cgp, self.d // vp, axis=0)
            return [_dot_t(p, planes[n].astype(jnp.float32) * sc + zr) for n in range(vp)]
        if cfg.method == "int":
            planes = self.planes(f["codes"][blk, :, sub], cfg.v_bits)       # vp x [D/vp, T] (`tokens_last`)
            if cfg.static:
                return [_dot_t(p, planes[n].astype(jnp.float32) * st["v"]["scale"][n][:, None]
                               + st["v"]["zero"][n][:, None]) for n in range(vp)]
            sc = f["scale"][blk, sub].astype(jnp.float32)
            zr = f["zero"][blk, sub].astype(jnp.float32)
            if sc.shape[1] == 1:
                pz = jnp.sum(p * zr[:, 0][None, :], axis=1)[:, None]
                ps16 = _f16(p * sc[:, 0][None, :])
                return [_dot_t(ps16, planes[n]) + pz for n in range(vp)]
            # scales per token and channel group, laid out like the planes ([D/vp, T]; the
            # transposes are of the small [T, D/cg] scale arrays, not of the codes)
            cgp = cfg.channel_group("v", self.d) // vp
            sc = _expand_groups(sc.T, cgp, self.d // vp, axis=0)
            zr = _expand_groups(zr.T, cgp, self.d // vp, axis=0)
            return [_dot_t(p, planes[n].astype(jnp.float32) * sc + zr) for n in range(vp)]
        if cfg.method == "fp8":
            v = _fp8(f["codes"][blk, :, sub])                                 # [D, T] (`tokens_last`)
            if cfg.static:
                return [_dot_t(p, v) * st["v"]["scale"][...].astype(jnp.float32)[0]]
            return [_dot_t(p * f["scale"][blk, sub].astype(jnp.float32)[None, :], v)]
        return [_dot(p, f["values"][blk, sub].astype(jnp.float32))]


# ----------------------------------------------------------------------------- the kernel
def _kernel(*refs, plan, names, static_names, has_hp, has_sid, block_size, tail_len, tiles_per_block,
            num_splits, sm_scale, window, tokens_major, parts, steps, hp_chunk, ids_ahead, gp, q_rows, written,
            normalize):
    d, vp, t_tok = plan.d, plan.vp, plan.t
    # tokens_major: scores [T, Gp] and accumulator [D/vp, Gp] (the matrix unit's N is the head
    # axis, 8 wide); otherwise scores [Gp, T] and accumulator [Gp, D/vp] (M = heads, 16 wide)
    ax = 0 if tokens_major else 1                                          # the token axis
    per_head = (lambda v: v[None, :]) if tokens_major else (lambda v: v[:, None])
    per_token = (lambda v: v[:, None]) if tokens_major else (lambda v: v[None, :])
    it = iter(refs)
    q_ref = next(it)
    qp_ref = next(it) if plan.pk > 1 else None
    bt_ref, len_ref = next(it), next(it)
    sid_ref = next(it) if has_sid else None  # None: sequence b's sink and tail are row b
    pages = {side: {n: next(it) for n in names[side]} for side in ("k", "v")}
    static = {side: {n: next(it) for n in static_names[side]} for side in ("k", "v")}
    if has_hp:
        sink_k, sink_v, tail_k, tail_v = next(it), next(it), next(it), next(it)
    o_ref = next(it)
    m_ref, l_ref = (None, None) if normalize else (next(it), next(it))

    b, split = pl.program_id(0), pl.program_id(2)
    bs, tpb = block_size, tiles_per_block
    # Block-table columns, block ids and sequence ids are clamped into range: with the entry's value
    # checks off, or under jit, bad indices must not address memory outside the table or the cache
    # (a few integer instructions per tile). The length itself is not: clamping it cost 10% at
    # B=32/L=32K on the H200 (a length past the table's capacity re-reads its last block, or with
    # the block ids read ahead page 0; the output of such a row is wrong either way;
    # 2026-12-02_bridge_async_h200.md).
    length = len_ref[b]
    n_pages = pages["k"][names["k"][0]].shape[0]
    page_of = lambda j: jnp.clip(bt_ref[b, jnp.minimum(j, bt_ref.shape[1] - 1)], 0, n_pages - 1)  # noqa: E731
    ws = jnp.maximum(length - window, 0) if window is not None else jnp.int32(0)
    # base-2 softmax: sm_scale * log2(e) folded into the query once, exp2 below
    if q_rows is None:  # q_ref: this kv head's group, padded to Gp outside
        q = q_ref[...]
    else:  # q_ref: the sequence's [Hq, D]; the group's q_rows rows, zeros to Gp (no padding pass outside)
        rows = lax.broadcasted_iota(jnp.int32, (gp, d), 0)
        q = _masked_load(q_ref.at[pl.ds(pl.program_id(1) * q_rows, gp), :], mask=rows < q_rows,
                         other=jnp.zeros((), q_ref.dtype))
    q = q.astype(jnp.float32) * (sm_scale * LOG2E)                            # [Gp, D]
    q_planes = [qp_ref[n] * (sm_scale * LOG2E) for n in range(plan.pk)] if qp_ref is not None else [q]
    if plan.cfg.method == "int":
        # per-token keys add z[t]·Σ_d q to the codes' product with the fp16 query: sum that same
        # fp16 query. Codes sit near their token's zero point, so a sum of the unrounded query is
        # off by an error amplified by code / (code - zero point): int8 keys with outlier channels
        # were 4e-3 of the output's maximum off the reference instead of 4e-4. Rounded once here,
        # not per tile (int4 heads-major: 751 -> 722 loop instructions offline).
        q, q_planes = _f16(q).astype(jnp.float32), [_f16(x).astype(jnp.float32) for x in q_planes]
    # static int parameters [D/planes, planes] -> one [D/planes] vector per plane (Triton cannot
    # slice a loaded block: `_columns`); fp8's [1] scale as it is
    st = {side: {n: (_columns(r[...].astype(jnp.float32)) if plan.cfg.method == "int" else r[...])
                 for n, r in static[side].items()} for side in ("k", "v")}

    def update(carry, ss, poss, value_fn, masked=True):
        """Online softmax (base 2) over score blocks `ss` (positions `poss`), then acc += value_fn(probabilities).
        masked=False: every position is valid (full quantized tiles without a window)."""
        m, l, acc = carry
        if masked:
            ss = [jnp.where(per_token((pos >= ws) & (pos < length)), s, NEG) for s, pos in zip(ss, poss)]
        m_new = m
        for s in ss:
            m_new = jnp.maximum(m_new, jnp.max(s, axis=ax))
        alpha = jnp.exp2(m - m_new)
        # masked logits give exactly 0: m_new is finite, every processed chunk holding a valid position
        ps = [jnp.exp2(s - per_head(m_new)) for s in ss]
        l_new = alpha * l
        for p in ps:
            l_new = l_new + jnp.sum(p, axis=ax)
        contrib = value_fn(ps)
        return m_new, l_new, tuple(per_head(alpha) * a + c for a, c in zip(acc, contrib))

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
    # quantized tiles are whole blocks before the query's own: all valid unless a window cuts one
    # (passthrough caches also read the partial last tile from their pages)
    tiles_partial = window is not None or not has_hp

    # What a tile needs that no matrix product waits on - the key zero points (their fp32 sum
    # with the query, `_Plan.query_t`) and KVarN's value channel scales (they multiply the value
    # products' results) - Triton does not pipeline, so the tile would wait on plain loads. They
    # are loaded one tile ahead instead, through the loop carry (`tile_ahead`). On the H200 this
    # took kvarn_k4v2_g128 at B=32/L=32K from 0.378 to 0.340 ms for the zero points (as fast as
    # the inexact one-product form before: 0.341; benchmarks/results/2026-12-01_decode_zero_term_h200.md),
    # and 6-7% off at B=128/256 for the channel scales (2026-12-01_decode_maxnreg_h200.md).
    ahead = tokens_major and steps == 1 and plan.tiled
    # With the tiles' copies double-buffered (ids_ahead, below) KVarN's key token scales come one
    # tile ahead too: their two copy buffers (512 B) were what kept a one-warp program's shared
    # memory above 28,160 B, the most at which 8 programs fit an SM (7 with them: 0.395 vs 0.325 ms
    # at B=32/L=32K, benchmarks/results/2026-12-03_decode_double_buffer_h200.md). With a single
    # buffer (num_stages=2) carrying them was slower (0.387 vs 0.337).
    tok_ahead = ahead and ids_ahead and plan.cfg.method == "kvarn" and not plan.k_whole and parts == 1
    if tokens_major and not plan.tiled:  # per-token scheme: its query side, once
        qside_pt = plan.query_pt(q_planes)

    def tile_ahead(t, valid):
        """(key zero points [D], KVarN: value channel scales [D/vp, vp] and with `tok_ahead` key
        token scales [T/kc, kc]) of tile t; page 0's where `valid` is false (no read through a
        block-table entry that no tile of this program uses)."""
        tv = jnp.where(valid, t, 0)
        blk, sub = jnp.where(valid, page_of(tv // tpb), 0), tv % tpb
        if tok_ahead:
            return (pages["k"]["zero_chan"][blk, sub], pages["v"]["scale_chan"][blk, sub],
                    pages["k"]["scale_tok"][blk, sub])
        if plan.cfg.method == "kvarn":
            return pages["k"]["zero_chan"][blk, sub], pages["v"]["scale_chan"][blk, sub]
        return (pages["k"]["zero"][blk, sub],)

    def tile_body(i, carry, page_of=page_of):
        t, step = (i // steps, i % steps) if steps > 1 else (i, 0)
        blk = page_of(t // tpb)
        sub = t % tpb
        if tokens_major and not plan.tiled:
            return update(carry, [plan.scores_pt(qside_pt, pages, blk, sub)], [t * t_tok + tok],
                          lambda ps: plan.values_pt(ps[0], pages, blk, sub), masked=tiles_partial)
        if tokens_major:  # softmax per token class; only the probabilities are put in token order
            z, chan, tsc = None, None, None
            if ahead:
                carry, here = carry[:3], carry[3:]
                z, chan = here[0], (here[1] if len(here) > 1 else None)
                tsc = here[2] if tok_ahead else None
                next_tile = tile_ahead(jnp.minimum(t + 1, hi - 1), t + 1 < hi)
            qside = plan.query_t(q, pages, blk, sub, z)
            n_parts = steps * parts
            for k in range(parts):  # parts of a step one after the other: fewer live registers
                part = step * parts + k
                ss = plan.scores_t(qside, pages, blk, sub, part, n_parts, tok_scales=tsc)
                nc, n_tok = len(ss), t_tok // n_parts
                poss = [t * t_tok + part * n_tok + jnp.arange(n_tok // nc, dtype=jnp.int32) * nc + j
                        for j in range(nc)]
                vfn = lambda ps, part=part: plan.values_t(ps[0] if len(ps) == 1 else _tokens_from_planes(ps),
                                                          pages, blk, sub, part, n_parts, chan_tile=chan)
                carry = update(carry, ss, poss, vfn, masked=tiles_partial)
            return carry + next_tile if ahead else carry
        ss = [_token_order(plan.scores(q, q_planes, pages, st, blk, sub), gp)]
        poss = [t * t_tok + tok]
        return update(carry, ss, poss, lambda ps: plan.values(ps, pages, st, blk, sub), masked=tiles_partial)

    acc_shape = (d // vp, gp) if tokens_major else (gp, d // vp)
    carry = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
             tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(vp)))
    if ahead:
        carry = carry + tile_ahead(lo, lo < hi)
    if not ids_ahead:
        carry = lax.fori_loop(lo * steps, jnp.maximum(lo, hi) * steps, tile_body, carry)
    else:
        # The tiles' block ids read ahead, up to `ids` entries at a time, and taken from registers
        # in the loop: with no load of the table inside the tile loop, Triton's pipeliner (num_stages
        # >= 3) double-buffers the tiles' copies, so a tile's codes are in flight while the one
        # before it computes. With the table read in the loop it keeps a single buffer, filled at
        # the end of each iteration and waited on at the start of the next: Nsight Compute put
        # 14% of the warps' stall samples at B=32/L=32K on that wait. (tile_ahead still reads
        # the table: its loads are plain ones a tile ahead, and no copy's address depends on them.)
        mbt = bt_ref.shape[1]
        cmax = pl.cdiv(mbt * tpb, num_splits)                      # tiles of a program, at most
        span = (cmax + tpb - 2) // tpb + 1                           # blocks they touch, at most
        ids = min(1 << (span - 1).bit_length(), IDS_GROUP, 1 << (mbt.bit_length() - 1))
        iota = jnp.arange(ids, dtype=jnp.int32)
        b_first = lo // tpb
        n_groups = jnp.where(hi > lo, pl.cdiv((jnp.maximum(hi, 1) - 1) // tpb - b_first + 1, ids), 0)

        def group(g, carry):
            gb = b_first + g * ids
            start = jnp.clip(gb, 0, mbt - ids)          # the load stays in the row; j - start indexes it
            row = bt_ref[b, pl.ds(start, ids)]
            page_in = lambda j: jnp.clip(jnp.sum(jnp.where(iota == j - start, row, 0)), 0, n_pages - 1)  # noqa: E731
            t_lo, t_hi = jnp.maximum(lo, gb * tpb), jnp.minimum(hi, (gb + ids) * tpb)
            return lax.fori_loop(t_lo * steps, jnp.maximum(t_lo, t_hi) * steps,
                                 functools.partial(tile_body, page_of=page_in), carry)
        carry = lax.fori_loop(0, n_groups, group, carry)
    carry = carry[:3]

    # ---- high-precision sink and partial tail (split 0 only)
    if has_hp:
        sid = jnp.clip(sid_ref[b] if has_sid else b, 0, sink_k.shape[0] - 1)
        hc = min(hp_chunk, bs)
        first = split == 0

        def hp_loop(carry, k_ref, v_ref, base, start_pos, count):
            """Chunks of `hc` tokens from rows [base, base + count) of the sequence's buffer."""
            c_lo = jnp.maximum(ws - start_pos, 0) // hc
            c_hi = jnp.where(first, pl.cdiv(count, hc), 0)

            def body(c, carry):
                rows = pl.ds(pl.multiple_of(base + c * hc, hc), hc)
                kk = k_ref[sid, rows].astype(jnp.float32)                   # [hc, D]
                pos = start_pos + c * hc + jnp.arange(hc, dtype=jnp.int32)
                if tokens_major:
                    vals = lambda ps: [_dot_tn(v_ref[sid, rows, :, n].astype(jnp.float32), ps[0], min_n=8)
                                       for n in range(vp)]
                    return update(carry, [_dot_t(kk, q, min_n=8)], [pos], vals)
                vals = lambda ps: [_dot(ps[0], v_ref[sid, rows, :, n].astype(jnp.float32)) for n in range(vp)]
                return update(carry, [_dot_t(q, kk)], [pos], vals)
            return lax.fori_loop(c_lo, jnp.maximum(c_lo, c_hi), body, carry)

        carry = hp_loop(carry, sink_k, sink_v, 0, 0, jnp.minimum(length, bs))
        tail_count = jnp.where(n_full >= 1, length - n_full * bs, 0)
        carry = hp_loop(carry, tail_k, tail_v, (n_full * bs) % tail_len, n_full * bs, tail_count)

    m, l, acc = carry
    # only the first `written` entries of the Gp axis (the group's heads, up to a power of two) are
    # stored: the padding's partial outputs would double what the merge reads for a GQA group of 4
    keep = (lambda x, axis: x) if written == gp else (lambda x, axis: jnp.split(x, gp // written, axis=axis)[0])  # noqa: E731
    if normalize:
        # one split: this program's output is final - normalized here and stored with the value
        # planes' channels in order (o_ref [heads, D/vp, vp], plane n at [..., n]), so no merge
        # kernel runs after this one
        den = jnp.where(l > 0, l, 1.0)   # no valid position (length 0): the output is 0, as merged
        for n in range(vp):
            o = keep(acc[n] / per_head(den), 1 if tokens_major else 0)
            o_ref[:, :, n] = o.T if tokens_major else o
        return
    for n in range(vp):
        o_ref[n] = keep(acc[n], 1 if tokens_major else 0)
    m_ref[...] = keep(m, 0)
    l_ref[...] = keep(l, 0)


def default_orient(cfg: KVQuantConfig, head_dim: int | None = None) -> str:
    """Layout of the inner products. "tokens": scores [T, Gp] with the codes as the matrix unit's M
    operand and the query heads as its N (8 wide: a GQA group of 4 wastes half instead of 3/4 of
    every score, probability and output element), for the tiled schemes (KVarN, KIVI; on the H200
    kvarn_k4v2_g128 B=32/L=32K 0.645 -> 0.563 ms at 2 warps, 0.542 with `fold`;
    benchmarks/results/2026-12-01_decode_tokens_major_h200.md) and for per-token int schemes with
    one dynamic scale per token (int8, int4, int_k8v2: with their value codes stored tokens-last,
    `paged.tokens_last`, 6-12% faster than heads-major at B=32/32K, B=256/8K, B=8/16K and B=1/128K
    on the H200, even at B=128/4K; benchmarks/results/2026-12-02_decode_value_layout_h200.md). "heads" (scores
    [Gp, T], M = 16 head rows) for fp8 (tokens-major 4-19% slower with its value codes tokens
    last as well, 2026-12-02_decode_value_layout_h200.md), per-channel static and grouped int scales (which
    tokens-major does not take: `tokens_major_unsupported`) and passthrough. head_dim: where the
    scheme's channel group is given explicitly, whether it spans the head (None: only schemes
    without one count as one scale per token)."""
    if cfg.method in ("kvarn", "kivi"):
        return "tokens"
    if cfg.method == "int" and not cfg.static and (
            not cfg.group if head_dim is None else tokens_major_unsupported(cfg, head_dim) is None):
        return "tokens"
    return "heads"


def default_chunk(cfg: KVQuantConfig, head_dim: int | None = None, orient: str | None = None) -> int:
    """Tokens per step of the tile loop for a per-token scheme (KVarN/KIVI step by their tiles).
    128 for int codes with one scale per token tokens-major and for fp8 heads-major: with two warps
    per program (`default_launch`) a step of 128 tokens issued 30-45% fewer instructions per token
    than four warps on 64 (offline SASS: int4 1,036 per warp per step vs 475 per warp per 64) and
    ran 1.2-1.9x faster on the H200 at every shape (B=32/L=32K: int4 0.665 -> 0.364 ms, int8 0.687 ->
    0.502, fp8 0.583 -> 0.509; benchmarks/results/2026-12-02_decode_per_token_chunk_h200.md).
    Otherwise (grouped or static int scales, heads-major int, tokens-major fp8; not measured with
    128) `TOKEN_CHUNK`."""
    if cfg.tile_tokens > 1:
        return cfg.tile_tokens
    o = orient or default_orient(cfg, head_dim)
    if (cfg.method == "int" and o == "tokens") or (cfg.method == "fp8" and o == "heads"):
        return 128
    return TOKEN_CHUNK


def default_launch(cfg: KVQuantConfig, batch: int, num_kv_heads: int, orient: str | None = None,
                   parts: int = 1, steps: int = 1, chunk: int | None = None) -> tuple[int, int | None]:
    """(num_warps, maxnreg) per program, from the H200 sweeps (by span, kvarn_k4v2_g128 unless
    said; benchmarks/results/2026-12-01_decode_zero_term_h200.md):
    - KVarN/KIVI tokens-major, whole tiles (parts = steps = 1), 2- or 4-bit values: two warps
      capped at 128 registers - 4 warps per scheduler where uncapped one-warp programs (~255
      registers) leave 2, for 29% more instructions per tile - win when latency rules: with fewer
      than 132 (sequence, kv head) pairs (the split regime; B=1/128K 0.063 vs 0.070 ms, B=8/16K
      0.065 vs 0.076, kivi_k2v2_g128 0.0615 vs 0.066) and for 4-bit values (kvarn_k4v4_g128
      B=32/32K 0.396 vs 0.439, B=8/16K 0.073 vs 0.088). With 2-bit values and >= 132 pairs, one
      uncapped warp, which owns the whole tile (B=32/32K 0.340 vs 0.359; kivi_k2v2_g128 0.292 vs
      0.337); at B=256/8K an earlier form of the kernel ran 0.736 vs 0.724 ms with two capped
      warps, so that rule rests on B=32.
    - Other tokens-major launches (8-bit values: 104-120 B of spills at 128 registers offline;
      parts or steps > 1; not timed capped) and heads-major KVarN/KIVI: one uncapped warp.
    - Per-token schemes, uncapped (2026-12-02_decode_value_layout_h200.md): 2 warps for heads-major
      8-bit keys and values with grouped or static scales (int8_g16 B=32/L=32K 1.062 vs 1.513 ms
      with 4, B=128/L=4K 0.522 vs 0.725, B=1/L=128K 0.161 vs 0.213: the per-element scales'
      registers), else 4, either layout: int8 tokens-major B=32/L=32K 0.686 ms, heads-major 0.749
      with 4 warps and 0.969 with 2; fp8 heads-major 0.589 vs 0.686 with 2, B=128/L=4K 0.309 vs
      0.365, B=1/L=128K 0.095 vs 0.110. (Two warps won for int8 and fp8 only while value codes
      were stored token by token and gathered byte-wise.) With steps of 128 tokens (`default_chunk`,
      the default for int codes tokens-major and fp8 heads-major; chunk: the step if not that),
      2 warps (2026-12-02_decode_per_token_chunk_h200.md: int4 B=256/L=8K 0.754 ms vs 1.902 with 4;
      one warp was 6% faster for int4 at B=32/L=32K and B=256/L=8K but slower at every other shape
      and for int8)."""
    if cfg.method in ("kvarn", "kivi"):
        whole = (orient or default_orient(cfg)) == "tokens" and parts == 1 and steps == 1
        pairs = batch * num_kv_heads
        if whole and (cfg.v_bits == 4 or (cfg.v_bits <= 2 and pairs < 132)):
            return 2, 128
        return 1, None
    if default_chunk(cfg, None, orient) >= 128 and (chunk or 128) >= 128:
        return 2, None
    heads = (orient or default_orient(cfg)) == "heads"
    grouped_8bit = cfg.method == "int" and cfg.k_bits == 8 and cfg.v_bits == 8 and (cfg.static or bool(cfg.group))
    return (2 if heads and grouped_8bit else 4), None


def default_stages(cfg: KVQuantConfig, batch: int, num_kv_heads: int, head_dim: int, orient: str | None = None,
                   parts: int = 1, steps: int = 1) -> int:
    """Pipeline stages of the default launch: 3 where `default_launch` gives KVarN's whole tiles
    one uncapped warp (2-bit values, >= 132 (sequence, kv head) pairs) at tiles of up to 128 x 128,
    else 2. With 3 stages the tile loop reads its block ids ahead (`_kernel`, `IDS_GROUP`), Triton
    double-buffers the tiles' copies, and the key token scales come through the loop carry, which
    keeps a program at 28,160 B of shared memory (8 per SM). On the H200 (kvarn_k4v2_g128,
    benchmarks/results/2026-12-03_decode_double_buffer_h200.md, run 3): B=32/L=32K 0.339 -> 0.329 ms,
    B=128/L=4K 0.232 -> 0.214, B=256/L=8K 0.770 -> 0.677; the capped two-warp launch of small
    batches was slower with 3 (run 2: B=1/L=128K 0.060 -> 0.073, B=8/L=16K 0.062 -> 0.072). KIVI and
    larger tiles (more shared memory per stage) were not measured with 3 and keep 2."""
    if cfg.method != "kvarn" or cfg.tile_tokens * head_dim > 128 * 128 or parts != 1 or steps != 1:
        return 2
    if (orient or default_orient(cfg, head_dim)) != "tokens":
        return 2
    return 3 if default_launch(cfg, batch, num_kv_heads, orient, parts, steps) == (1, None) else 2


def default_q_in_kernel(cfg: KVQuantConfig) -> bool:
    """Whether the decode kernel reads the query from q_rot itself (`paged_decode_pallas`'s
    q_in_kernel) rather than from a copy padded to Gp rows in XLA. Measured on the H200
    (benchmarks/results/2026-12-03_decode_query_in_kernel_h200.md): KVarN with 2-bit values faster
    at every shape (the padding's zero rows are constants to the compiler, whose folding removed
    ~70 of ~2,060 instructions per tile, and the XLA pass is gone): kvarn_k4v2_g128 B=1/L=128K
    0.0604 -> 0.0566 ms, B=256/L=8K 0.684 -> 0.658; kvarn_k4v4_g128 10% slower at B=32/L=32K
    (0.368 -> 0.405) and 3% at B=1/L=128K, so the other schemes keep the padded copy."""
    return cfg.method == "kvarn" and cfg.v_bits == 2


def default_merge(cfg: KVQuantConfig) -> str:
    """How the splits are merged by default (`paged_decode_pallas`'s merge): "pallas" for KVarN with
    2-bit values, else "xla". (With one split and a GQA group that is a power of two >= 2,
    `paged_decode_pallas` merges nothing instead: merge="kernel".)
    On the H200 (benchmarks/results/2026-12-04_merge_launch_h200.md; 8 kv heads, the merge's
    one-warp launch of that day, span of the kernel entry): kvarn_k4v2_g128 faster with the Pallas
    merge at every batch measured - B=1/L=128K 0.0565 -> 0.0536 ms, B=2/L=64K 0.0553 -> 0.0532,
    B=4/L=32K 0.0556 -> 0.0535, B=8/L=16K 0.0569 -> 0.0551, B=16/L=16K 0.1034 -> 0.1011,
    B=32/L=32K 0.2995 -> 0.2985 - but kvarn_k4v4_g128, int4 and int8 5-14% slower at B=1/L=128K
    and B=8/L=16K (e.g. int4 0.0594 -> 0.0650 ms), so they keep XLA's merge."""
    pallas = cfg.method == "kvarn" and cfg.v_bits == 2
    return "pallas" if pallas else "xla"


def programs_per_sm(num_warps: int, maxnreg: int | None = None) -> int:
    """Programs that fit one H100/H200 SM at once. Uncapped, our kernels take ~255 registers per
    thread: 8 one-warp or 4 two-warp programs (4 for wider ones too: those use fewer registers).
    Capped, the register file decides, up to 11 (the shared memory of one-warp KVarN programs,
    18.9 KB each, fits 11): a warp lives on one of the SM's 4 schedulers, each with 16K registers
    allocated to warps in 8-register steps per thread, so a cap of 184 still leaves 2 warps per
    scheduler (ncu: 8 blocks per SM) and one of 168 fits 3."""
    if maxnreg is None:
        return max(4, 8 // max(1, num_warps))
    per_scheduler = 16384 // (-(-maxnreg // 8) * 8 * 32)
    return max(1, min(4 * per_scheduler // max(1, num_warps), 11))


def default_num_splits(batch: int, num_kv_heads: int, max_tiles: int, num_warps: int = 2,
                       maxnreg: int | None = None) -> int:
    """Splits of each sequence's tiles along the KV length, for an H100/H200-class chip (132 SMs).
    A wave is 132 x `programs_per_sm` programs (1056 for uncapped one-warp programs). Measured on
    the H200 (benchmarks/results/2026-12-01_decode_splits_*_h200.json, 2026-12-01_decode_tokens_major_h200.md):
    - >= 132 (sequence, kv head) pairs: as many splits as still fit one wave (B=32/L=32K, 1 warp:
      4 splits 0.457 ms, 2 splits 0.693; 2 warps: 2 splits 0.63, 3 splits (1.45 waves) 0.85);
    - fewer pairs: a program walks its tiles one after the other, so ~4 waves of programs with at
      least 4 tiles each (B=1/L=128K, 1 warp: 256 splits 0.094-0.103 ms vs 128 splits 0.113-0.117)."""
    wave = 132 * programs_per_sm(num_warps, maxnreg)
    pairs = max(1, batch * num_kv_heads)
    want = max(1, wave // pairs) if pairs >= 132 else -(-4 * wave // pairs)
    return int(max(1, min(want, max_tiles // 4, wave // 4)))


@functools.partial(jax.jit, static_argnames=("scale", "window", "num_splits", "interpret", "num_warps",
                                             "num_stages", "unpack", "orient", "fold", "parts", "sums", "maxnreg",
                                             "steps", "merge", "chunk", "q_in_kernel"))
def paged_decode_pallas(q_rot, cache, block_tables, seq_lens, seq_ids, *, scale: float, window: int | None,
                        num_splits: int | None = None, interpret: bool = False, num_warps: int | None = None,
                        num_stages: int | None = None, unpack: str | None = None, orient: str | None = None,
                        fold: bool | None = None, parts: int = 1, sums: str | None = None,
                        maxnreg: int | None = None, steps: int = 1, merge: str | None = None, chunk: int | None = None,
                        q_in_kernel: bool | None = None):
    """Kernel entry: q_rot [B, Hq, D] in the stored frame -> output [B, Hq, D] fp32 in the stored frame.
    seq_ids: [B] rows of the high-precision sink and tail buffers, or None for row b of sequence b
    (the caller checks the range: `paged.check_read_args`).

    Launch and layout options (defaults from the H200 sweeps; the results are the same up to fp32
    rounding, which the tests check):
      unpack: how codes become fp16 - "asm" (`_planes_asm`, PTX; the default when compiled,
        bit-identical) or "magic" (`_planes`, jnp; the default interpreted, where PTX cannot run).
      orient: "tokens" or "heads" (`default_orient`; tokens-major for per-token schemes needs one
        dynamic scale per token); num_warps (default: `default_launch`), num_stages (default:
        `default_stages` with the default launch, else 2; from 3 on the tile loop reads its block
        ids ahead, so that Triton double-buffers the tiles' copies);
      fold: tokens-major only - feed the planes' biased values (magic + code, one `lop3` per two
        codes; 8-bit codes: none, the byte spread inserts the magic) to the products and subtract
        magic * (sum of the fp16 query / probabilities) from the results instead of one fp16
        subtraction per two codes. Default True for tokens-major products (on the H200, with
        128-token steps, per-token int was even or up to 5% faster with it: int4 B=256/L=8K 0.754
        vs 0.780 ms, B=1/L=128K 0.061 vs 0.064; 2026-12-02_decode_per_token_chunk_h200.md).
      sums: tokens-major only - how the fold's sums and the value zero-point term (sum of p*vz) are
        formed: "mma" (default: products with a ones matrix on the matrix unit, which leaves every
        row holding the sum and needs no cross-lane reduction; per-token int on the H200 1-6%
        faster than "reduce") or "reduce" (jnp sums). The key zero-point term (sum of q*z) is an
        fp32 sum either way (`_Plan.query_t`).
      parts: tokens-major tiled schemes only - walk each tile in this many parts (fewer live registers).
      steps: tokens-major tiled schemes only - walk each tile in this many iterations of the tile loop (a part
        each), so that Triton's pipeline (num_stages - 1 buffers of one iteration's codes) can copy
        a part while the previous one computes. Measured on the H200 with num_stages=3: slower
        (29% more instructions per tile, and the sink/tail loop's buffers set the shared memory).
      maxnreg: registers per thread the compiled kernel may use (None: `default_launch`'s cap when
        num_warps is left to the default, else none - Triton's choice, ~255 for KVarN/KIVI). Fewer registers,
        more programs per SM (`triton_options`, `programs_per_sm`). For one-warp programs every cap
        measured on the H200 was slower (spills); two-warp programs at 128 are the default where
        `default_launch` says.
      chunk: per-token schemes only - tokens per step of the tile loop (default `default_chunk`,
        at most the block size).
      q_in_kernel: read each kv head's query rows from q_rot inside the kernel (masked loads; the
        rows past the group read as zeros) instead of padding the query to Gp rows in XLA first
        (default `default_q_in_kernel`). Either way the kernel stores only the group's heads (rounded
        up to a power of two) of its partial outputs, not the padding's.
      merge: how the splits are merged (`split_merge.py`): "xla" (jnp: several XLA fusions) or
        "pallas" (one kernel, which writes the channels in order; the default split count is then
        rounded down to a power of two, and an explicit one pads the split outputs to the next).
        Default `default_merge`: "pallas" for KVarN's 2-bit values (B=1/L=128K with 8 kv heads
        0.0565 -> 0.0536 ms on the H200, 2-4% at batch 2-16), else "xla" - except
        where the split count is 1 (`default_num_splits`: more than half a wave of (sequence, kv
        head) pairs, e.g. B=128/L=4K and B=256/L=8K at 8 kv heads, or short contexts) and the GQA
        group is a power of two >= 2: "kernel", the decode kernel normalizes its output and stores
        the channels in order itself (no merge kernel; explicit "kernel" needs that case).
    """
    unpack = unpack or ("magic" if interpret else "asm")
    if unpack not in ("magic", "asm") or (unpack == "asm" and interpret):
        raise ValueError(f"unpack must be 'magic' or (compiled only) 'asm', got {unpack!r} (interpret={interpret})")
    cfg = cache.cfg
    nbt, hq, d = q_rot.shape
    orient = orient or default_orient(cfg, d)
    tiled = cfg.method in ("kvarn", "kivi")
    why_not = tokens_major_unsupported(cfg, d) if orient == "tokens" else None
    if orient not in ("heads", "tokens") or why_not:
        raise ValueError(f"orient must be 'heads' or 'tokens', got {orient!r} for {cfg.name}"
                         + (f" ({why_not})" if why_not else ""))
    tokens_major = orient == "tokens"
    if tokens_major and not tiled and (parts != 1 or steps != 1 or (fold and cfg.method == "fp8")):
        raise ValueError(f"parts and steps apply to the tiled schemes' tokens-major products only, fold to "
                         f"integer codes (got fold={fold}, parts={parts}, steps={steps} for {cfg.name})")
    fold = (tokens_major and (tiled or cfg.method == "int")) if fold is None else bool(fold)
    sums = sums or ("mma" if tokens_major else "reduce")
    merge_given = merge
    merge = default_merge(cfg) if merge is None else merge
    if merge not in ("xla", "pallas", "kernel"):
        raise ValueError(f"merge must be 'xla', 'pallas' or 'kernel', got {merge!r}")
    if sums not in ("reduce", "mma"):
        raise ValueError(f"sums must be 'reduce' or 'mma', got {sums!r}")
    if (fold or parts != 1 or steps != 1 or sums != "reduce") and not tokens_major:
        raise ValueError(f"fold, parts, steps and sums apply to orient='tokens' only (got fold={fold}, parts={parts}, steps={steps}, "
                         f"sums={sums!r})")
    n_parts = parts * steps
    if tokens_major and tiled and (parts < 1 or steps < 1 or cfg.tile_tokens % n_parts
                         or (cfg.tile_tokens // n_parts) % (8 // cfg.k_bits)):
        raise ValueError(f"parts={parts} x steps={steps} must divide the {cfg.tile_tokens}-token tile into whole "
                         f"bytes of key codes")
    if chunk is not None and (cfg.tile_tokens > 1 or not _pow2(chunk) or chunk < 16):
        raise ValueError(f"chunk (tokens per step of a per-token scheme) must be a power of two >= 16, for "
                         f"per-token schemes only; got {chunk} for {cfg.name}")
    hk = cache.num_kv_heads
    # tokens per step of the tile loop: a tile, or a chunk of a block for per-token schemes
    t_tok = cfg.tile_tokens if tiled else min(chunk or default_chunk(cfg, d, orient), cache.block_size)
    if num_warps is None:  # the default launch; its register cap applies unless one is given
        warps, cap = default_launch(cfg, nbt, hk, orient, parts, steps, None if tiled else t_tok)
        if cap is not None and (interpret or not triton_options.available()):
            # interpreted, launch options change nothing (and need no lowering hook); without the
            # hook no cap can be set, and uncapped two-warp programs were slower than one warp
            warps, cap = 1, None
        maxnreg = cap if maxnreg is None else maxnreg
    else:
        warps = num_warps
    if num_stages is None:
        num_stages = default_stages(cfg, nbt, hk, d, orient, parts, steps) if num_warps is None else 2
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    grp = hq // hk
    gp, written = group_rows(grp, tokens_major)
    mb = block_tables.shape[1]
    tiles_per_block = cache.block_size // t_tok
    splits = num_splits or default_num_splits(nbt, hk, mb * tiles_per_block, warps, maxnreg)
    if merge == "pallas" and not num_splits:  # a power of two: the merge then reads no padding
        splits = split_merge.unpadded_splits(splits)
    plan = _Plan(cfg, d, t_tok, unpack, fold=fold, sums=sums)
    # Under a register cap the sink/tail is walked 32 tokens at a time: on the H200 the capped
    # two-warp launches then ran 4-12% faster at B=1/L=128K and B=8/L=16K (kvarn_k4v2_g128,
    # kvarn_k4v4_g128) and kvarn_k4v4_g128 7% at B=32/L=32K, while the uncapped one-warp
    # kvarn_k4v2_g128 ran 6% slower at B=32/L=32K (benchmarks/results/2026-12-03_decode_hp_chunk_h200.md).
    # With 3+ stages too: the sink/tail loop's buffers then no longer set the shared memory.
    hp_chunk = HP_CHUNK // 2 if (maxnreg is not None or num_stages >= 3) else HP_CHUNK

    # One split and a GQA group that is a power of two: by default the kernel writes the final
    # output, with no merge kernel after it (merge="kernel"); an explicit merge keeps its own.
    if merge_given is None and splits == 1 and written == grp:
        merge = "kernel"
    if merge == "kernel" and (splits != 1 or written != grp):
        raise ValueError(f"merge='kernel' needs one split and a GQA group that is a power of two >= 2 "
                         f"(got {splits} splits, {grp} query heads per kv head)")
    normalize = merge == "kernel"
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))
    head_spec = lambda a: pl.BlockSpec((a.shape[0], None) + a.shape[2:],
                                       lambda b, h, s, nd=a.ndim - 2: (0, h) + (0,) * nd)
    # q_in_kernel: the kernel reads its group's query rows straight from q_rot (`default_q_in_kernel`).
    # Not for per-token keys split into channel planes (they need the planes' copy) or fewer query
    # heads than Gp (the masked rows would lie past the block).
    if q_in_kernel is None:
        q_in_kernel = default_q_in_kernel(cfg)
    q_rows = grp if q_in_kernel and plan.pk == 1 and hq >= gp else None
    if q_rows is not None:
        operands = [q_rot]
        specs = [pl.BlockSpec((None, hq, d), lambda b, h, s: (b, 0, 0))]
    else:
        qg = jnp.pad(q_rot.astype(jnp.float32).reshape(nbt, hk, grp, d), ((0, 0), (0, 0), (0, gp - grp), (0, 0)))
        operands = [qg]
        specs = [pl.BlockSpec((None, None, gp, d), lambda b, h, s: (b, h, 0, 0))]
    if plan.pk > 1:  # query split into the key channel planes: channels n, n + pk, ...
        qp = qg.reshape(nbt, hk, gp, d // plan.pk, plan.pk).transpose(0, 1, 4, 2, 3)
        operands.append(qp)
        specs.append(pl.BlockSpec((None, None, plan.pk, gp, d // plan.pk), lambda b, h, s: (b, h, 0, 0, 0)))
    operands += [block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32)]
    specs += [full(block_tables.shape), full(seq_lens.shape)]
    # sequence ids only index the sink and tail buffers: none passed, none read. Building the
    # identity (jnp.arange) instead put an iota kernel and its launch gap before every call:
    # kvarn_k4v2_g128 B=32/L=32K 0.306-0.322 -> 0.296-0.300 ms, B=128/L=4K 0.201-0.208 -> 0.190-0.192
    # on the H200, four rounds each (benchmarks/results/2026-12-04_decode_seq_ids_h200.md)
    has_sid = cache.has_hp and seq_ids is not None
    if has_sid:
        operands.append(seq_ids.astype(jnp.int32))
        specs.append(full(seq_ids.shape))
    names = {}
    for side in ("k", "v"):
        names[side] = sorted(cache.pages[side])
        for n in names[side]:
            a = plan.page_view(side, n, cache.pages[side][n])
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
        _kernel, plan=plan, names=names, static_names=static_names, has_hp=cache.has_hp, has_sid=has_sid,
        block_size=cache.block_size, tail_len=max(cache.tail_len, 1), tiles_per_block=tiles_per_block,
        num_splits=splits, sm_scale=scale, window=window, tokens_major=tokens_major, parts=parts,
        steps=steps, hp_chunk=hp_chunk, ids_ahead=num_stages >= 3, gp=gp, q_rows=q_rows, written=written,
        normalize=normalize)
    vp = plan.vp
    acc_shape = (d // vp, written) if tokens_major else (written, d // vp)
    # the Pallas merge loads all splits at once: a power-of-two axis (the padding is never written)
    s_out = split_merge.padded_splits(splits) if merge == "pallas" else splits
    if normalize:  # the final output [B, Hk, heads, D/vp, vp]: channel vp*i + n at [..., i, n]
        out_shape = jax.ShapeDtypeStruct((nbt, hk, grp, d // vp, vp), jnp.float32)
        out_specs = pl.BlockSpec((None, None, grp, d // vp, vp), lambda b, h, s: (b, h, 0, 0, 0))
    else:  # each split's partial output, max and sum
        out_shape = [jax.ShapeDtypeStruct((nbt, hk, s_out, vp) + acc_shape, jnp.float32),
                     jax.ShapeDtypeStruct((nbt, hk, s_out, written), jnp.float32),
                     jax.ShapeDtypeStruct((nbt, hk, s_out, written), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, vp) + acc_shape, lambda b, h, s: (b, h, s, 0, 0, 0)),
                     pl.BlockSpec((None, None, None, written), lambda b, h, s: (b, h, s, 0)),
                     pl.BlockSpec((None, None, None, written), lambda b, h, s: (b, h, s, 0))]
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=num_stages)
    outs = pl.pallas_call(kernel, grid=(nbt, hk, splits), in_specs=specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=interpret,
                          name=triton_options.kernel_name(f"kvarn_paged_decode_{cfg.name}", maxnreg),
                          **params)(*operands)
    if normalize:
        return outs.reshape(nbt, hq, d)
    acc, m, l = outs
    # merge the splits (flash-decoding), then re-interleave the value planes: channel vp*i + n
    heads_axis = -1 if tokens_major else -2
    if merge == "pallas":
        o = split_merge.merge_splits_pallas(acc, m, l, splits=splits, heads_axis=heads_axis, interpret=interpret)
        return o.reshape(nbt, hk, written, d)[:, :, :grp].reshape(nbt, hq, d)  # [.., Gp, D/vp, vp]: channels in order
    # the GQA group's padding dropped first: XLA's merge fusions then write the output in its
    # final layout (no separate slice after them)
    acc = acc[..., :grp] if tokens_major else acc[..., :grp, :]
    o = split_merge.merge_splits_reference(acc, m[..., :grp], l[..., :grp], splits, heads_axis)
    return o.reshape(nbt, hq, d)
