"""The layout plan of the kernel's inner loop: for one scheme, how page fields are viewed, how codes
become scores and value products in each layout, and the block-shape helpers they share. The
kernel (`kernel.py`) calls the plan's methods; docs/kernels.md explains the layouts.

Layouts: heads-major (scores [Gp, T] = q @ codes^T, the GQA group padded to 16 rows; methods
`scores_heads_major` / `values_heads_major`) and tokens-major (scores [T, Gp] = codes @ q^T, the group
as the matrix unit's 8-wide N), which tiled schemes walk a tile at a time (`tile_query`, `tile_scores`,
`tile_values`) and per-token schemes a chunk of tokens at a time (`chunk_query`, `chunk_scores`,
`chunk_values`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...cache.paged import tokens_last
from ...config import KVQuantConfig
from ...schemes import kvarn
from ...schemes.arith import exponent, pow2
from .unpack import f16, fp8_codes, planes as jnp_planes, planes_ptx


# ----------------------------------------------------------------------------- block helpers
F16_MAX = 65504.0


def f16_sat(x):
    """x as fp16, values beyond its range clipped to ±65,504 (a plain conversion gives inf)."""
    return x if x.dtype == jnp.float16 else f16(jnp.clip(x, -F16_MAX, F16_MAX))


def bound_scale(bound):
    """A power of two that brings magnitudes up to `bound` (a scalar) below 2^15, where fp16 holds
    them; 1 if they already are."""
    return jnp.exp2(jnp.minimum(0.0, 14.0 - jnp.floor(jnp.log2(jnp.maximum(bound, 1.0)))))


def chunk_scale(x):
    """`bound_scale` of max|x|."""
    return bound_scale(jnp.max(jnp.abs(x)))


class Narrowed:
    """An operand brought into fp16 once for several products: x16 = fp16(x * scale), `scale` a
    power of two (None: x16 is x itself, rounded). A bf16/fp32 cache's operand used by more than one
    product (the scaled query of a tile's token classes, the scaled probabilities of its value
    planes) is narrowed here once instead of by each product (`_operands`), which costs a
    reduction over the whole operand per product."""

    __slots__ = ("x16", "scale", "x")

    def __init__(self, x16, scale=None, x=None):
        self.x16, self.scale, self.x = x16, scale, x16 if x is None else x

    @property
    def shape(self):
        return self.x16.shape

    def rounded(self):
        """The operand in fp32 as the matrix products see it (rounded, the scale removed)."""
        return _unscale(self.x16.astype(jnp.float32), self.scale)


def narrow_operand(x) -> Narrowed:
    """x as an fp16 operand scaled by `chunk_scale` (values beyond fp16's range kept, see `_operands`)."""
    if x.dtype == jnp.float16:
        return Narrowed(x)
    s = chunk_scale(x)
    return Narrowed(f16_sat(x * s), s, x)


def _operand(x, wide: bool):
    """(x as fp16, its scale or None) for a product; `Narrowed` operands as they are."""
    if isinstance(x, Narrowed):
        return x.x16, x.scale
    if not wide:
        return f16(x), None
    if x.dtype == jnp.float16:
        return x, None
    n = narrow_operand(x)
    return n.x16, n.scale


def _operands(a, b, wide: bool):
    """(a, b) as fp16 and the factor to divide their product by (None: 1). wide (a bf16/fp32 cache,
    whose values may exceed fp16): an operand not already fp16 (codes are) enters scaled by
    `chunk_scale`, so that its largest values keep fp16's precision instead of becoming inf; exact
    otherwise. A `Narrowed` operand brings its own scale."""
    (a, sa), (b, sb) = _operand(a, wide), _operand(b, wide)
    s = sa if sb is None else (sb if sa is None else sa * sb)
    return a, b, s


class Halves:
    """An fp32 operand as two bf16 parts, hi + lo (16 significant bits), for products with a bf16
    operand (a bf16 cache's high-precision rows), which the matrix unit then takes as they are: two
    bf16 products instead of bringing both into fp16, which needs the rows' maximum per chunk."""

    __slots__ = ("hi", "lo", "x")

    def __init__(self, x):
        self.x = x.astype(jnp.float32)
        self.hi = self.x.astype(jnp.bfloat16)
        self.lo = (self.x - self.hi.astype(jnp.float32)).astype(jnp.bfloat16)

    @property
    def shape(self):
        return self.x.shape


def _halves_product(product, a, b):
    """product(a, b) with one operand `Halves` and the other bf16: the sum of the two parts' products."""
    if isinstance(a, Halves):
        return product(a.hi, b) + product(a.lo, b)
    return product(a, b.hi) + product(a, b.lo)


def _f32(x):
    """fp32 operand of a small product (a broadcast multiply and sum: no rounding to fp16)."""
    return (x.x if isinstance(x, (Narrowed, Halves)) else x).astype(jnp.float32)


def _rounded(x):
    """fp32 of an operand as the matrix products see it (fp16, or `Narrowed`)."""
    return x.rounded() if isinstance(x, Narrowed) else x.astype(jnp.float32)


def _unscale(y, s):
    # times the reciprocal, computed once: exact for a power of two, and a product costs one
    # multiply per element where a division costs a sequence of instructions
    return y if s is None else y * (1.0 / s)


def dot(a, b, min_n: int = 16, wide: bool = False):
    """[M, K] @ [K, N] in fp16 with fp32 accumulation (wide: see `_operands`; a `Halves` operand
    against a bf16 one: two bf16 products).

    Triton's matrix instructions need M, K >= 16 and N >= 8 (mma m16n8k16; N >= 16 unless `min_n`
    says otherwise); smaller products are computed as a broadcast multiply and sum instead.
    """
    if min(a.shape[0], a.shape[1]) < 16 or b.shape[1] < min_n:
        return jnp.sum(_f32(a)[:, :, None] * _f32(b)[None, :, :], axis=1)
    product = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    if isinstance(a, Halves) or isinstance(b, Halves):
        return _halves_product(product, a, b)
    a, b, s = _operands(a, b, wide)
    return _unscale(product(a, b), s)


def dot_t(a, b, min_n: int = 16, wide: bool = False):
    """[M, K] @ [N, K]^T in fp16 with fp32 accumulation (see `dot` for small shapes and `wide`)."""
    if min(a.shape[0], a.shape[1]) < 16 or b.shape[0] < min_n:
        return jnp.sum(_f32(a)[:, None, :] * _f32(b)[None, :, :], axis=2)
    product = functools.partial(lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    if isinstance(a, Halves) or isinstance(b, Halves):
        return _halves_product(product, a, b)
    a, b, s = _operands(a, b, wide)
    return _unscale(product(a, b), s)


def dot_tn(a, b, min_n: int = 16, wide: bool = False):
    """[K, M]^T @ [K, N] in fp16 with fp32 accumulation (see `dot` for small shapes and `wide`)."""
    if min(a.shape[0], a.shape[1]) < 16 or b.shape[1] < min_n:
        return jnp.sum(_f32(a)[:, :, None] * _f32(b)[:, None, :], axis=0)
    product = functools.partial(lax.dot_general, dimension_numbers=(((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
    if isinstance(a, Halves) or isinstance(b, Halves):
        return _halves_product(product, a, b)
    a, b, s = _operands(a, b, wide)
    return _unscale(product(a, b), s)


def columns(x):
    """[R, n] -> the n columns [R] each, by masked sums along the (in-thread) minor axis. Loading a
    small strided vector (one plane's scales, x[:, j]) reads 2-byte elements, which Triton cannot
    copy asynchronously, so it was a plain load waited on in every tile; the whole [R, n] block is
    contiguous and is pipelined with the codes."""
    col = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return [jnp.sum(jnp.where(col == j, x, 0.0), axis=1) for j in range(x.shape[1])]


def interleave(cs):
    """Classes [..., n] (class j: elements j, j + len(cs), ...) -> [..., n, 2, ..., 2] by nested
    joins (Triton joins along a new last axis only): index (i, bits of j) holds element i of class j."""
    if len(cs) == 1:
        return cs[0]
    return jnp.stack([interleave(cs[0::2]), interleave(cs[1::2])], axis=-1)


def token_order(classes, rows: int):
    """Key scores per token class (class j holds tokens j, j + kc, ... of a tile: bit plane j of the
    packed key codes) -> one [rows, T] block in token order, by Triton's join (an interleave):
    token i*kc + j is element i of class j. Joining the scores once lets the softmax and the value
    products work on whole tiles (4 value products per tile for 2-bit values instead of 8)."""
    return interleave(classes).reshape(rows, classes[0].shape[1] * len(classes))


def tokens_from_planes(planes):
    """Key code planes (plane j: tokens j, j + kc, ... of a tile, [G/kc, D] each) -> the tile [G, D] in
    token order (nested joins, as `token_order`, then the plane axes moved before the channels)."""
    x = interleave(planes)                                  # [G/kc, D, 2, ..., 2]
    nd = x.ndim
    x = jnp.transpose(x, (0,) + tuple(range(2, nd)) + (1,))  # [G/kc, 2, ..., 2, D]
    return x.reshape(planes[0].shape[0] * len(planes), planes[0].shape[1])


def expand_groups(x, cg: int, d: int, axis: int = 1):
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


# ----------------------------------------------------------------------------- geometry
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


# ----------------------------------------------------------------------------- the plan
class LayoutPlan:
    """Static facts of one scheme's inner loop.

    kc: token classes of a tile - keys of tiled schemes are packed along tokens, so bit plane j of
        the key codes ([G*b/8, D]) holds tokens j, j + kc, ...; the scores are put back in token
        order once per tile (`token_order`), so values and softmax see whole tiles.
    pk: channel planes of per-token keys (packed along channels); the query is split to match.
    vp: channel planes of values (packed along channels); the accumulator and output are kept as
        vp planes [Gp, D / vp] and re-interleaved outside the kernel.
    """

    def __init__(self, cfg: KVQuantConfig, head_dim: int, tile_tokens: int, unpack: str = "magic",
                 fold: str = "none", sums: str = "reduce", wide: bool = False, narrow: str = "bound"):
        self.cfg, self.d, self.t = cfg, head_dim, tile_tokens
        # wide: the cache's data may exceed fp16 (a bf16 or fp32 cache): operands made of it (the
        # query times scales, probabilities times scales, fp32 or int8 high-precision values) stay
        # fp32 up to the products, which bring each into fp16's range by a power of two
        # (`_operands`); bf16 high-precision values enter bf16 products as they are (`Halves`). The
        # query itself is rounded as always (`f16_sat`). fp16 caches: every operand rounded to fp16.
        # narrow="bound": KVarN's tiles are `kvarn.balance`d at write (their factors of the products
        # bounded), so only the query is brought into range, once per program (`balanced`); KIVI's
        # operands by a bound per tile (`bounded`)
        self.wide = wide
        self.balanced = wide and narrow == "bound" and cfg.method == "kvarn"
        self.bounded = wide and narrow == "bound" and not self.balanced
        self.f16 = narrow_operand if wide else f16
        self.dot, self.dot_t, self.dot_tn = (functools.partial(fn, wide=wide) for fn in (dot, dot_t, dot_tn))
        # fold: which products take biased codes (`launch.Launch`: "none", "keys" or "all")
        self.fold, self.value_fold, self.sums = fold in ("keys", "all"), fold == "all", sums
        self.planes = planes_ptx if unpack == "asm" else jnp_planes
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

    def program_bound(self, q):
        """What `scaled` needs of the query, once per program: with `balanced` tiles the power of two
        s that puts max|q|·s in [2^(13-K), 2^(14-K)) (key channel scales < 2^(K+1), K =
        `kvarn.K_CHAN_EXP`: every product operand stays below 2^15, and small ones far from fp16's
        subnormals); with `bounded` ones max|q|; else None."""
        if self.balanced:
            e = 13 - kvarn.K_CHAN_EXP - exponent(jnp.max(jnp.abs(q)))
            return pow2(jnp.clip(e, -100, 100))
        return jnp.max(jnp.abs(q)) if self.bounded else None

    def scaled(self, x, vec, axis: int, x_bound=None):
        """The fp16 operand of x times `vec` broadcast along `axis` (a tile's scale vector). x_bound:
        the query's `program_bound`, None for probabilities (<= 1). fp16 caches: `f16`. Wide caches:
        `balanced` tiles (the vector bounded at write) scaled by the query's power of two only;
        `bounded` ones by the power of two of x_bound·max|vec| >= max|x·vec|, folded into the vector
        (no pass over the product for its maximum)."""
        v = jnp.expand_dims(vec, axis)
        if self.balanced:
            xv = x * v
            return Narrowed(f16(xv if x_bound is None else x * (v * x_bound)), x_bound, xv)
        if not self.bounded:
            return self.f16(x * v)
        s = bound_scale((1.0 if x_bound is None else x_bound) * jnp.max(jnp.abs(vec)))
        return Narrowed(f16(x * (v * s)), s, x * v)

    def probs(self, p):
        """Probabilities (<= 1) as a product operand: with a wide cache already in fp16's range, so
        narrowed without a scale (what `chunk_scale` would give) and without a pass for their maximum."""
        return Narrowed(f16(p), None, p) if self.wide else p

    # ---------------------------------------------------------------- keys
    def scores_heads_major(self, q, q_planes, pages, st, blk, sub, q_bound=None, q_ops=None):
        """List over token classes j of raw scores [Gp, T / kc] (tokens j, j + kc, ... of the tile).
        Per-token int keys: q and q_planes come rounded to fp16 (`kernel.decode_kernel`), so Σ_d q below is the
        sum of the query the code products see. q_ops: (q, q_planes) as product operands, narrowed once
        per program for a wide cache (default: q, q_planes)."""
        cfg, kc = self.cfg, self.kc
        f = pages["k"]
        qo, qpo = (q, q_planes) if q_ops is None else q_ops
        if cfg.method in ("kvarn", "kivi"):
            codes = f["codes"][blk, sub]                                   # [G*b/8, D]
            sc, zc = ("scale_chan", "zero_chan") if cfg.method == "kvarn" else ("scale", "zero")
            qs = self.scaled(q, f[sc][blk, sub].astype(jnp.float32), 0, q_bound)
            zq = jnp.sum(q * f[zc][blk, sub].astype(jnp.float32)[None, :], axis=1)
            # unpack after the query side is ready: the planes' registers then live only as long as
            # the products need them (unpacking first cost ~45 registers per thread)
            planes = self.planes(codes, cfg.k_bits)                         # kc x [G/kc, D]
            if self.k_whole:  # one product over the tile reassembled in token order
                s = self.dot_t(qs, tokens_from_planes(planes)) + zq[:, None]
                if cfg.method == "kvarn":
                    s = s * f["scale_tok"][blk, sub].astype(jnp.float32)[None, :]
                return [s]
            out = []
            for j in range(kc):
                s = self.dot_t(qs, planes[j]) + zq[:, None]
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
                    s = s + self.dot_t(qpo[n], k)
                return [s]
            sc = f["scale"][blk, sub].astype(jnp.float32)                  # [T, D/cg]
            zr = f["zero"][blk, sub].astype(jnp.float32)
            if sc.shape[1] == 1:  # one scale per token: factor it out of the product
                raw = 0.0
                for n in range(self.pk):
                    raw = raw + self.dot_t(qpo[n], planes[n])
                return [raw * sc[:, 0][None, :] + jnp.sum(q, axis=1)[:, None] * zr[:, 0][None, :]]
            cgp = cfg.channel_group("k", self.d) // self.pk
            s = 0.0
            for n in range(self.pk):
                k = (planes[n].astype(jnp.float32) * expand_groups(sc, cgp, self.d // self.pk)
                     + expand_groups(zr, cgp, self.d // self.pk))
                s = s + self.dot_t(qpo[n], k)
            return [s]
        if cfg.method == "fp8":
            raw = self.dot_t(qo, fp8_codes(f["codes"][blk, sub]))                     # [Gp, T]
            if cfg.static:
                return [raw * st["k"]["scale"].astype(jnp.float32)[0]]
            return [raw * f["scale"][blk, sub].astype(jnp.float32)[None, :]]
        return [self.dot_t(qo, f["values"][blk, sub].astype(jnp.float32))]

    # ---------------------------------------------------------------- tokens-major (per-token schemes)
    def chunk_query(self, q_planes):
        """Per-program query side of a per-token scheme's tokens-major products, (q16, qsum, bias):
        the query's fp16 channel planes [Gp, D/pk] (one for 8-bit codes and fp8), Σ_d q as [1, Gp]
        (fp32) for the zero points, and with `fold` Σ_n 2^(10 - n·b)·Σ_d q16_n as [1, Gp], which the
        biased planes (2^(10 - n·b) + code, `unpack.magic`) add to every raw score (else None). The query is
        the same for every chunk of the sequence, so unlike the tiled schemes' this costs nothing
        per chunk. Int keys: q_planes come rounded to fp16 (`kernel.decode_kernel`), so qsum is the sum of
        the query the code products see."""
        q16 = [f16_sat(x) for x in q_planes]
        qsum = sum(jnp.sum(x, axis=1) for x in q_planes)[None, :]
        if not self.fold:
            return q16, qsum, None
        bias = sum((2.0 ** (10 - n * self.cfg.k_bits)) * jnp.sum(x.astype(jnp.float32), axis=1)
                   for n, x in enumerate(q16))
        return q16, qsum, bias[None, :]

    def chunk_scores(self, qside, pages, blk, sub):
        """Tokens-major scores [T, Gp] of a chunk of a per-token scheme (codes as the matrix unit's
        M operand, the heads its 8-wide N), with K[t, d] = c[t, d]·s[t] + z[t]:
            q·K[t] = s[t]·Σ_d q[d]·c[t, d] + z[t]·Σ_d q[d]
        qside: `chunk_query`."""
        cfg = self.cfg
        f = pages["k"]
        q16, qsum, bias = qside
        if cfg.method == "fp8":
            raw = self.dot_t(fp8_codes(f["codes"][blk, sub]), q16[0], min_n=8)        # [T, Gp]
            return raw * f["scale"][blk, sub].astype(jnp.float32)[:, None]
        planes = self.planes(f["codes"][blk, sub], cfg.k_bits, biased=bias is not None)  # pk x [T, D/pk]
        raw = 0.0
        for n in range(self.pk):
            raw = raw + self.dot_t(planes[n], q16[n], min_n=8)
        if bias is not None:
            raw = raw - bias
        return (raw * f["scale"][blk, sub].astype(jnp.float32)
                + f["zero"][blk, sub].astype(jnp.float32) * qsum)           # [T, 1] scale and zero

    def chunk_values(self, p, pages, blk, sub):
        """Tokens-major values of a per-token scheme: probabilities [T, Gp] -> list over channel planes
        of [D / vp, Gp], with V[t, d] = c[t, d]·s[t] + z[t]:
            Σ_t p[t]·V[t, d] = Σ_t (p[t]·s[t])·c[t, d] + Σ_t p[t]·z[t]
        (with `value_fold`, the biased planes' 2^(10 - n·b)·Σ_t p16 removed as well)."""
        cfg, vp = self.cfg, self.vp
        f = pages["v"]
        sc = f["scale"][blk, sub].astype(jnp.float32)
        if cfg.method == "fp8":                                             # [T] scales
            return [self.dot(fp8_codes(f["codes"][blk, :, sub]), self.scaled(p, sc, 1), min_n=8)]  # codes [D, T]
        p16 = self.scaled(p, sc[:, 0], 1)                                       # [T, 1] scales; p <= 1
        planes = self.planes(f["codes"][blk, :, sub], cfg.v_bits, biased=self.value_fold)  # vp x [D/vp, T]
        zr = f["zero"][blk, sub].astype(jnp.float32)                            # [T, 1] zero points
        corr = self.value_corrections(p, zr[:, 0], p16, planes[0].shape[0])
        return [self.dot(planes[n], p16, min_n=8) + corr[n] for n in range(vp)]

    def value_corrections(self, p, z, p16, rows: int):
        """What the tokens-major value products [rows, Gp] of a tile leave out, per channel plane n:
        Σ_t p·z (p: probabilities [T, Gp], z: the tokens' zero points [T]), and with `value_fold` minus
        2^(10 - n·b)·Σ_t p16 (the biased planes' magic times the fp16 probabilities the products saw).
        sums="mma": as products ones [rows, T] @ x, which leave every row holding the sum in the
        outputs' layout; "reduce": jnp sums as [1, Gp]."""
        magic = [2.0 ** (10 - n * self.cfg.v_bits) for n in range(self.vp)]
        if self.sums == "mma":
            ones = jnp.ones((rows, p.shape[0]), jnp.float16)
            zrows = self.dot(ones, self.scaled(p, z, 1), min_n=8)
            srows = self.dot(ones, p16, min_n=8) if self.value_fold else None
            return [zrows - m * srows if self.value_fold else zrows for m in magic]
        zp = jnp.sum(p * z[:, None], axis=0)[None, :]
        psum = jnp.sum(_rounded(p16), axis=0)[None, :] if self.value_fold else None
        return [zp - m * psum if self.value_fold else zp for m in magic]

    # ---------------------------------------------------------------- tokens-major (tiled schemes)
    def tile_query(self, q, pages, blk, sub, z=None, q_bound=None):
        """Per-tile query side of the tokens-major key product, shared by the tile's parts:
        (qs, zero, bias). qs: the query scaled by the tile's channel scales, fp16 [Gp, D].
        zero: the key zero-point term sum_d q[g, d] * z[d] as [1, Gp], an fp32 sum (z: the tile's
        zero points [D] if already loaded). As a product with a ones matrix it would be a sum of
        fp16 roundings of q*z, which for 8-bit keys with outlier channels put the kernel 1.5x
        outside the tests' tolerance; as a product of z with the query's two fp16 halves it is exact
        but keeps those halves live in the loop, where they spill.
        bias (with `fold`, else None): sums="reduce": sum(qs) as [1, Gp]; sums="mma": qs itself,
        which `tile_scores` sums as a product with a ones matrix (exact: qs is the fp16 operand of
        the score product)."""
        f = pages["k"]
        sc, zc = ("scale_chan", "zero_chan") if self.cfg.method == "kvarn" else ("scale", "zero")
        qs = self.scaled(q, f[sc][blk, sub].astype(jnp.float32), 0, q_bound)
        z = f[zc][blk, sub] if z is None else z
        zero = jnp.sum(q * z.astype(jnp.float32)[None, :], axis=1)[None, :]
        # planes fed as 2^(10 - j*b) + code (fold): remove 2^(10 - j*b) * sum(qs) per score instead
        # (wide with sums="reduce": qs is rounded inside the product only, so Σ qs would not be the
        # operand's sum; the product's own `sums="mma"` form is)
        if not (self.fold and not self.k_whole) or (self.wide and self.sums == "reduce"):
            return qs, zero, None
        return qs, zero, qs if self.sums == "mma" else jnp.sum(_rounded(qs), axis=1)[None, :]

    def tile_scores(self, qside, pages, blk, sub, part=0, parts: int = 1, tok_scales=None):
        """Tokens-major scores of a tiled scheme: list over token classes j of [T / kc, Gp] (tokens
        j, j + kc, ... of the tile; one class in token order when `k_whole`). With parts > 1 only
        tokens [part * T/parts, (part + 1) * T/parts) of the tile (classes within that part).
        qside: `tile_query` of the tile. tok_scales: KVarN's key token scales of the (whole) tile
        [T/kc, kc] if already loaded."""
        cfg = self.cfg
        f = pages["k"]
        rows = self.t * cfg.k_bits // 8 // parts
        codes = f["codes"][blk, sub, pl.ds(part * rows, rows)]             # [G*b/8 / parts, D]
        qs, zero, bias = qside
        planes = self.planes(codes, cfg.k_bits, biased=bias is not None)   # kc x [G/kc, D]
        ks = [tokens_from_planes(planes)] if self.k_whole else planes     # short planes: one tile
        if self.sums == "mma" and bias is not None:  # every row of ones @ qs^T holds sum(qs), in the scores' layout
            bias = self.dot_t(jnp.ones(ks[0].shape, jnp.float16), bias, min_n=8)
        n_tok = ks[0].shape[0]
        if cfg.method == "kvarn":  # token scales per class: [T/kc] each (whole-block load, `columns`)
            st = f["scale_tok"]
            sts = ([st[blk, sub, pl.ds(part * n_tok, n_tok)].astype(jnp.float32)] if self.k_whole
                   else columns((st[blk, sub, pl.ds(part * rows, rows)] if tok_scales is None
                                  else tok_scales).astype(jnp.float32)))
        out = []
        for j, k in enumerate(ks):
            s = self.dot_t(k, qs, min_n=8) + zero
            if bias is not None:
                s = s - (2.0 ** (10 - j * cfg.k_bits)) * bias
            if cfg.method == "kvarn":
                s = s * sts[j][:, None]
            out.append(s)
        return out

    def tile_values(self, p, pages, blk, sub, part=0, parts: int = 1, chan_tile=None):
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
            planes = self.planes(codes, cfg.v_bits, biased=self.value_fold)  # vp x [D/vp, G/parts]
            p16 = self.scaled(p, st.astype(jnp.float32), 1)                    # p <= 1
            corr = self.value_corrections(p, zt.astype(jnp.float32), p16, planes[0].shape[0])
            out = [self.dot(planes[n], p16, min_n=8) + corr[n] for n in range(vp)]
            if chan is not None:  # channel scales per plane (whole-block load, `columns`)
                block = chan[blk, sub] if chan_tile is None else chan_tile
                out = [o * c[:, None] for o, c in zip(out, columns(block.astype(jnp.float32)))]
            return out
        planes = self.planes(codes, cfg.v_bits)                             # vp x [D/vp, G/parts]
        cgp = cfg.channel_group("v", self.d) // vp
        sc = expand_groups(f["scale"][blk, sub, toks].astype(jnp.float32).T, cgp, self.d // vp, axis=0)
        zr = expand_groups(f["zero"][blk, sub, toks].astype(jnp.float32).T, cgp, self.d // vp, axis=0)
        return [self.dot(planes[n].astype(jnp.float32) * sc + zr, self.probs(p), min_n=8) for n in range(vp)]

    # ---------------------------------------------------------------- values
    def values_heads_major(self, ps, pages, st, blk, sub):
        """[probabilities [Gp, T]] of a tile in token order -> list over channel planes of [Gp, D / vp]."""
        cfg, vp = self.cfg, self.vp
        f = pages["v"]
        p = ps[0]
        if self.tiled:  # probabilities of a whole tile in token order (see `token_order`)
            codes = f["codes"][blk, sub]                                    # [D*b/8, G]
            if cfg.method == "kvarn":
                zp = jnp.sum(p * f["zero_tok"][blk, sub].astype(jnp.float32)[None, :], axis=1)
                p16 = self.scaled(p, f["scale_tok"][blk, sub].astype(jnp.float32), 0)  # p <= 1
                planes = self.planes(codes, cfg.v_bits)                     # vp x [D/vp, G]
                return [(self.dot_t(p16, planes[n]) + zp[:, None])
                        * f["scale_chan"][blk, sub, :, n].astype(jnp.float32)[None, :] for n in range(vp)]
            # KIVI: per-token scales in channel groups, laid out like the planes ([D/vp, G]; the
            # transposes are of the small [G, D/cg] scale arrays, not of the codes)
            cgp = cfg.channel_group("v", self.d) // vp
            planes = self.planes(codes, cfg.v_bits)
            sc = expand_groups(f["scale"][blk, sub].astype(jnp.float32).T, cgp, self.d // vp, axis=0)
            zr = expand_groups(f["zero"][blk, sub].astype(jnp.float32).T, cgp, self.d // vp, axis=0)
            return [self.dot_t(self.probs(p), planes[n].astype(jnp.float32) * sc + zr) for n in range(vp)]
        if cfg.method == "int":
            planes = self.planes(f["codes"][blk, :, sub], cfg.v_bits)       # vp x [D/vp, T] (`tokens_last`)
            if cfg.static:
                return [self.dot_t(self.probs(p), planes[n].astype(jnp.float32) * st["v"]["scale"][n][:, None]
                               + st["v"]["zero"][n][:, None]) for n in range(vp)]
            sc = f["scale"][blk, sub].astype(jnp.float32)
            zr = f["zero"][blk, sub].astype(jnp.float32)
            if sc.shape[1] == 1:
                pz = jnp.sum(p * zr[:, 0][None, :], axis=1)[:, None]
                ps16 = self.scaled(p, sc[:, 0], 0)                             # p <= 1
                return [self.dot_t(ps16, planes[n]) + pz for n in range(vp)]
            # scales per token and channel group, laid out like the planes ([D/vp, T]; the
            # transposes are of the small [T, D/cg] scale arrays, not of the codes)
            cgp = cfg.channel_group("v", self.d) // vp
            sc = expand_groups(sc.T, cgp, self.d // vp, axis=0)
            zr = expand_groups(zr.T, cgp, self.d // vp, axis=0)
            return [self.dot_t(self.probs(p), planes[n].astype(jnp.float32) * sc + zr) for n in range(vp)]
        if cfg.method == "fp8":
            v = fp8_codes(f["codes"][blk, :, sub])                                 # [D, T] (`tokens_last`)
            if cfg.static:
                return [self.dot_t(self.probs(p), v) * st["v"]["scale"][...].astype(jnp.float32)[0]]
            return [self.dot_t(self.scaled(p, f["scale"][blk, sub].astype(jnp.float32), 0), v)]
        return [self.dot(self.probs(p), f["values"][blk, sub].astype(jnp.float32))]
