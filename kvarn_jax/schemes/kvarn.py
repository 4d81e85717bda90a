"""KVarN tile quantization, exactly as docs/design.md §1.2-1.5 describes (pure jnp; the oracle for the kernels).

A tile is G tokens x D channels of one head, already rotated (`hadamard.rotate`). Keys are
normalized as a [D x G] matrix (rows = channels), values as [G x D] (rows = tokens); the RTN runs per
row of the balanced tile and the Sinkhorn row scale is folded into the stored scale and zero (in
the cache's dtype: fp16 for fp16 data, as the reference stores them).

Codes are packed as the reference packs them (K along tokens, V along channels) but stored with the
byte axes swapped: K codes [G*b/8, D], V codes [D*b/8, G] (see `packing.store_tiled`): the decode
kernel contracts keys over channels and values over tokens, and reads codes along that axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..packing import code_planes, load_tiled, store_tiled
from .arith import JNP, Arith, exponent, pow2, saturate
from .rtn import SCALE_FLOOR, clip_search, rtn_codes, rtn_params


TIE_RTOL = 1e-6


def _var_from_sums(s1, s2, n: int):
    """Unbiased single-pass variance from Σx and Σx², means not subtracted first:
    max((E[x²]-E[x]²)·n/(n-1), 0) = max((Σx² - (Σx)²/n)/(n-1), 0) (the reference's std, squared;
    constant factors as products, not divisions)."""
    return jnp.maximum((s2 - s1 * s1 * (1.0 / n)) * (1.0 / (n - 1)), 0.0)


def _var(x: jnp.ndarray, axis: int) -> jnp.ndarray:
    return _var_from_sums(jnp.sum(x, axis=axis), jnp.sum(x * x, axis=axis), x.shape[axis])


def _imbalance(col_var: jnp.ndarray, row_var: jnp.ndarray, ar: Arith = JNP) -> jnp.ndarray:
    """max/min of the column stds + max/min of the row stds (min floored at 1e-8), from variances:
    sqrt(max var / max(min var, 1e-16)) is the same number with two square roots instead of 2 x 128."""
    return (jnp.sqrt(ar.div(jnp.max(col_var, -1), jnp.maximum(jnp.min(col_var, -1), 1e-16)))
            + jnp.sqrt(ar.div(jnp.max(row_var, -1), jnp.maximum(jnp.min(row_var, -1), 1e-16))))


def _weighted_var(t, t2, w, w2, scale2, axis: int):
    """`_var` along `axis` of t·w·scale, from t and t² (w, w2: the summed axis's weight and its
    square, broadcast against t; scale2: the other axis's weight squared)."""
    return scale2 * _var_from_sums(jnp.sum(t * w, axis=axis), jnp.sum(t2 * w2, axis=axis), t.shape[axis])


LN2 = 0.6931471805599453
LOG_LO, LOG_HI = -0.3 / LN2, 10.0 / LN2   # the reference's log-scale clip [-0.3, 10], in base 2


def _log2_std(var, log2):
    """log2(clip(std, 1e-3, 1e3)) of a variance, without the square root."""
    return 0.5 * log2(jnp.clip(var, 1e-6, 1e6))


def sinkhorn_log_scales(t: jnp.ndarray, iters: int, ar: Arith = JNP):
    """Log-domain variance normalization of `t` [..., R, C] (fp32).

    Returns (lc [..., C], lr [..., R]), the base-2 logs of the column and row scales of the iterate
    with the lowest imbalance, the all-zero start included, ties going to the later iterate. The
    reference works in natural logs; base 2 is the same iteration (clip bounds divided by ln 2) with
    exp2/log2, which GPUs evaluate in one instruction each instead of a libm polynomial.

    The normalized iterate is t / 2^lc[c] / 2^lr[r] = t·a[c]·b[r]. Its row and column
    variances are computed from t and t² weighted by a, b (exp on vectors only): the same quantities
    as forming the normalized matrix and taking stds, up to float rounding, at a fraction of the
    per-element work (no divisions; this loop dominates the cost of quantizing a tile). Stds enter
    only through log(std) = log(var)/2 and ratios, so no square root is taken per row or column.
    `ar`: the log2 and division to use (`arith.Arith`; the GPU quantize kernel passes its own).
    """
    t2 = t * t
    lc = jnp.zeros(t.shape[:-2] + t.shape[-1:], jnp.float32)
    lr = jnp.zeros(t.shape[:-1], jnp.float32)

    def row_var(a, b2):  # variance over columns of t·a·b, per row (b2 = b²)
        return _weighted_var(t, t2, a[..., None, :], (a * a)[..., None, :], b2, -1)

    def col_var(a2, b):  # variance over rows of t·a·b, per column (a2 = a²)
        return _weighted_var(t, t2, b[..., :, None], (b * b)[..., :, None], a2, -2)

    # The column variances an iterate's imbalance needs are the ones the next column update starts
    # from: computed once and carried. The row moments of an iteration serve both its row update
    # and its imbalance (they depend on a only): 2 weighted passes over the tile per iteration.
    col = _var(t, -2)
    best_lc, best_lr, best_imb = lc, lr, _imbalance(col, _var(t, -1), ar)
    def step(_, carry):
        lc, lr, col, best_lc, best_lr, best_imb = carry
        lc = jnp.clip(lc + _log2_std(col, ar.log2), LOG_LO, LOG_HI)
        a = jnp.exp2(-lc)
        lr = jnp.clip(lr + _log2_std(row_var(a, jnp.exp2(-2.0 * lr)), ar.log2), LOG_LO, LOG_HI)
        b = jnp.exp2(-lr)
        col = col_var(a * a, b)
        imb = _imbalance(col, row_var(a, b * b), ar)
        # Ties go to the later iterate. Iterates that differ by a uniform factor moved between rows
        # and columns have the same imbalance up to float rounding, so "tie" means equal within
        # TIE_RTOL; otherwise summation order (device, library) would decide which one is kept.
        better = imb <= best_imb * (1.0 + TIE_RTOL)
        best_lc = jnp.where(better[..., None], lc, best_lc)
        best_lr = jnp.where(better[..., None], lr, best_lr)
        best_imb = jnp.where(better, imb, best_imb)
        return lc, lr, col, best_lc, best_lr, best_imb

    carry = (lc, lr, col, best_lc, best_lr, best_imb)
    if ar is JNP:
        carry = jax.lax.fori_loop(0, iters, step, carry)
    else:
        for i in range(iters):
            carry = step(i, carry)
    best_lc, best_lr = carry[3], carry[4]
    return best_lc, best_lr


def _quantize_matrix(t: jnp.ndarray, bits: int, iters: int, ar: Arith = JNP, meta=jnp.float16, clip=None):
    """Balance `t` [..., R, C], RTN per row. Returns codes [..., R, C], row scale/zero (folded), col scale
    (in `meta`, saturated to its range: a folded fp16 zero point can exceed the data's own range).
    clip: None (min..max), or the ratios (`rtn.clip_ratios`) among which each row's codes, zero and
    scale come from `rtn.clip_search`, minimizing the squared error of `t` itself."""
    lc, lr = sinkhorn_log_scales(t, iters, ar)
    s_col, s_row = jnp.exp2(lc), jnp.exp2(lr)
    if clip is not None:
        # The search ranks a row's candidates by their error relative to the row, the same with or
        # without the Sinkhorn row scale: it runs on t over the stored column scales, so that its
        # zero and scale are the stored (folded) ones and its codes are chosen against them as
        # rounded to `meta`. Rounding them after (bf16 keeps 8 bits) put a bias on every key
        # channel whose rotated values sit far from zero: 1.2x the error of the codes alone.
        col = saturate(s_col, meta)
        c = col.astype(jnp.float32)[..., None, :]
        codes, zero, scale = clip_search(ar.div(t, c), bits, floor=SCALE_FLOOR, ar=ar, weights=c * c,
                                         stored=meta, ratios=clip)
        return codes, saturate(scale, meta), saturate(zero, meta), col
    bal = t * jnp.exp2(-lc)[..., None, :] * jnp.exp2(-lr)[..., :, None]
    mn, scale = rtn_params(bal, bits, ar=ar)
    row_scale, row_zero, col = saturate(s_row * scale, meta), saturate(s_row * mn, meta), saturate(s_col, meta)
    if jnp.dtype(meta) == jnp.dtype(jnp.float16):
        # the reference's order: codes of the unrounded scales, which are rounded to fp16 after
        codes = rtn_codes(bal, mn, scale, bits, ar)
    else:
        # bf16 keeps 8 bits of a scale (fp16: 11): codes chosen against the stored scales, as
        # `rtn.rtn_stored` does, else their rounding adds to every value (8-bit codes: 1.4x the error)
        u = ar.div(t, col.astype(jnp.float32)[..., None, :])
        codes = rtn_codes(u, row_zero.astype(jnp.float32), row_scale.astype(jnp.float32), bits, ar)
    return codes, row_scale, row_zero, col


def fields(side: str, bits: int, group: int, head_dim: int, meta=jnp.float16):
    g, d = group, head_dim
    if side == "k":
        return {"codes": ((g * bits // 8, d), jnp.uint8), "scale_chan": ((d,), meta),
                "zero_chan": ((d,), meta), "scale_tok": ((g,), meta)}
    return {"codes": ((d * bits // 8, g), jnp.uint8), "scale_chan": ((d,), meta),
            "scale_tok": ((g,), meta), "zero_tok": ((g,), meta)}


# Where `balance` puts a tile's scales (powers of two): the largest key channel scale in [1, 2), the
# largest value token scale or zero point in [2^12, 2^13).
K_CHAN_EXP, V_TOK_EXP = 0, 12


def balance(f: dict, side: str, meta) -> dict:
    """The same tiles with their scales moved by a power of two between the factors, so that the
    ones the decode kernel multiplies into its fp16 products are bounded: keys' channel scales at
    most 2 (the query is brought into range once per program), values' token scales and zero points
    below 2^13 (probabilities are at most 1). Keys are (c·s_chan + z_chan)·s_tok and values
    (c·s_tok + z_tok)·s_chan: the other factor takes the inverse power, so every dequantized value is
    the same bits. Caches wider than fp16 get this (`quantize`); an fp16 cache keeps KVarN's own
    scales, which its range already bounds."""
    def peak(*names):  # the largest magnitude of these fields, per tile
        return functools.reduce(jnp.maximum, [jnp.max(jnp.abs(f[n].astype(jnp.float32)), -1, keepdims=True)
                                              for n in names])

    if side == "k":
        e, down, up = exponent(peak("scale_chan")) - K_CHAN_EXP, ("scale_chan", "zero_chan"), ("scale_tok",)
    else:
        e, down, up = exponent(peak("scale_tok", "zero_tok")) - V_TOK_EXP, ("scale_tok", "zero_tok"), ("scale_chan",)
    out = dict(f)
    for names, p in ((down, pow2(-e)), (up, pow2(e))):
        for n in names:
            out[n] = saturate(f[n].astype(jnp.float32) * p, meta)
    return out


def quantize(x: jnp.ndarray, side: str, bits: int, iters: int, ar: Arith = JNP, meta=jnp.float16,
             clip=None) -> dict:
    """x: rotated tiles [..., G, D] -> stored fields (see `fields`), `balance`d unless `meta` is
    fp16. ar: see `sinkhorn_log_scales`; clip: see `_quantize_matrix`."""
    if x.ndim > 3:  # XLA's CPU code runs the Sinkhorn loop on [M, H, 1, G, D] tiles ~14x slower than on [M*H, G, D]
        out = quantize(x.reshape((-1,) + x.shape[-2:]), side, bits, iters, ar, meta, clip)
        return {n: f.reshape(x.shape[:-2] + f.shape[1:]) for n, f in out.items()}
    t = x.astype(jnp.float32)
    if side == "k":
        codes, scale_chan, zero_chan, scale_tok = _quantize_matrix(jnp.swapaxes(t, -1, -2), bits, iters, ar, meta, clip)
        f = {"codes": store_tiled(codes, bits), "scale_chan": scale_chan, "zero_chan": zero_chan,
             "scale_tok": scale_tok}
    else:
        codes, scale_tok, zero_tok, scale_chan = _quantize_matrix(t, bits, iters, ar, meta, clip)
        f = {"codes": store_tiled(codes, bits), "scale_chan": scale_chan, "scale_tok": scale_tok,
             "zero_tok": zero_tok}
    return f if jnp.dtype(meta) == jnp.dtype(jnp.float16) else balance(f, side, meta)


def dequantize(f: dict, side: str, bits: int) -> jnp.ndarray:
    """Stored fields -> rotated tiles [..., G, D] in fp32."""
    c = load_tiled(f["codes"], bits).astype(jnp.float32)
    if side == "k":  # c: [..., D, G]
        kt = (c * f["scale_chan"].astype(jnp.float32)[..., :, None]
              + f["zero_chan"].astype(jnp.float32)[..., :, None]) * f["scale_tok"].astype(jnp.float32)[..., None, :]
        return jnp.swapaxes(kt, -1, -2)
    # c: [..., G, D]
    return ((c * f["scale_tok"].astype(jnp.float32)[..., :, None] + f["zero_tok"].astype(jnp.float32)[..., :, None])
            * f["scale_chan"].astype(jnp.float32)[..., None, :])


def key_scores(f: dict, q: jnp.ndarray, bits: int) -> jnp.ndarray:
    """q . k for every token of stored key tiles, on the codes. A stored key is
    k[t, d] = (c[d, t] * scale_chan[d] + zero_chan[d]) * scale_tok[t] (`dequantize`), so
    q . k_t = scale_tok[t] * ((q * scale_chan) . c[:, t] + q . zero_chan): the channel scales fold into
    the query, the token scales into the scores, and the codes are read as stored.
    f: key fields of tiles [..., R, ...]; q [..., G, D] fp32 (the same leading dims, without R).
    Returns [..., R, G, T] fp32."""
    c = code_planes(f["codes"], bits).astype(jnp.float32)                           # [..., R, J, M, D]
    qs = q[..., None, :, :] * f["scale_chan"].astype(jnp.float32)[..., None, :]       # [..., R, G, D]
    s = jnp.einsum("...rgd,...rjmd->...rgmj", qs, c, precision="highest")
    s = s.reshape(s.shape[:-2] + (-1,))                                               # token m * J + j
    qz = jnp.einsum("...gd,...rd->...rg", q, f["zero_chan"].astype(jnp.float32), precision="highest")
    return (s + qz[..., None]) * f["scale_tok"].astype(jnp.float32)[..., None, :]


def value_sums(f: dict, p: jnp.ndarray, bits: int) -> jnp.ndarray:
    """sum_t p[t] v_t over stored value tiles, on the codes. A stored value is
    v[t, d] = (c[t, d] * scale_tok[t] + zero_tok[t]) * scale_chan[d], so the sum is
    scale_chan[d] * ((p * scale_tok) . c[:, d] + p . zero_tok).
    f: value fields of tiles [..., R, ...]; p [..., R, G, T] fp32. Returns [..., R, G, D] fp32."""
    c = code_planes(f["codes"], bits).astype(jnp.float32)                           # [..., R, J, M, T]
    ps = p * f["scale_tok"].astype(jnp.float32)[..., None, :]
    o = jnp.einsum("...rgt,...rjmt->...rgmj", ps, c, precision="highest")
    o = o.reshape(o.shape[:-2] + (-1,))                                               # channel m * J + j
    pz = jnp.einsum("...rgt,...rt->...rg", p, f["zero_tok"].astype(jnp.float32), precision="highest")
    return (o + pz[..., None]) * f["scale_chan"].astype(jnp.float32)[..., None, :]
