"""Asymmetric round-to-nearest along the last axis, shared by every integer scheme."""

from __future__ import annotations

import jax.numpy as jnp

from .arith import JNP, Arith, saturate

# Smallest positive fp16 (subnormal): the scale floor, so that no stored scale flushes to zero.
SCALE_FLOOR = 2.0 ** -24


def round_half_even(x: jnp.ndarray) -> jnp.ndarray:
    """Round to nearest, ties to even (as jnp.round), from floor only.

    Pallas' Triton lowering has no round primitive; using this in the reference and the kernels
    alike keeps them bit-identical. Exact for |x| < 2**22 (codes are at most 255).
    """
    r = jnp.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return jnp.where(tie & odd, r - 1.0, r)


def rtn_params(x: jnp.ndarray, bits: int, floor: float = 1e-10, ar: Arith = JNP):
    """(min, scale) of rows of `x` (fp32) over the last axis; `scale = max((max-min)/(2^b-1), floor)`.
    Finite for |x| up to `storage.QUANT_MAX`, where every path that quantizes clips its input."""
    mn = jnp.min(x, axis=-1)
    mx = jnp.max(x, axis=-1)
    scale = jnp.maximum(ar.div(mx - mn, jnp.asarray(2 ** bits - 1, mx.dtype)), floor)
    return mn, scale


# Clip search: CLIP_CANDIDATES ratios r = 1, 1 - s, 1 - 2s, ... of a row's range, shrunk about its
# midpoint, with the step s per code width. On Gaussian and heavier-tailed rows of 128 values these
# 8 candidates get within 1-2% of the best ratio on a fine grid (whose median is ~0.6 at 2 bits,
# ~0.8 at 3, ~0.93 at 4 and 1.0 at 8). Keys search half the step (ranges down to ~0.93 at 4 bits):
# clipping a key row cuts the tokens that stand out in a channel, the ones a query may single out,
# and on SmolLM2 and Qwen2.5 the milder key grid gave a lower KL than the squared-error-optimal one.
CLIP_CANDIDATES = 8
CLIP_STEP = {2: 0.07, 3: 0.045, 4: 0.02, 8: 0.002}
KEY_CLIP_STEP_FACTOR = 0.5


def clip_ratios(bits: int, side: str = "v") -> tuple[float, ...]:
    """The fractions of a row's min..max range `clip_search` tries for `side` ("k" or "v"), largest
    (1: no clipping) first."""
    if side not in ("k", "v"):
        raise ValueError(f"side must be 'k' or 'v', got {side!r}")
    step = CLIP_STEP[bits] * (KEY_CLIP_STEP_FACTOR if side == "k" else 1.0)
    return tuple(1.0 - k * step for k in range(CLIP_CANDIDATES))


def _unbiased_fit(x, c, w):
    """(zero, scale) making the error c * scale + zero - x of a row orthogonal to x and to 1 (weighted
    by w): the dequantized row then neither shrinks nor shifts the row, so its error does not add up
    coherently over the tokens an attention output averages. The least-squares fit (or an MSE-optimal
    clipped range) instead shrinks it: at 2 bits on Gaussian rows x_hat ~ 0.87 x. Returns also
    whether the fit exists (codes that vary with x)."""
    n = jnp.sum(jnp.broadcast_to(w, x.shape), axis=-1) if w is not None else x.shape[-1]
    wx, wc = (x, c) if w is None else (x * w, c * w)
    sx, sc = jnp.sum(wx, -1), jnp.sum(wc, -1)
    mx, mc = sx / n, sc / n
    cov = jnp.sum(wx * c, -1) - sx * mc
    var = jnp.sum(wx * x, -1) - sx * mx
    ok = (cov > 0.0) & (var > 0.0)
    scale = jnp.where(ok, var / jnp.where(ok, cov, 1.0), 1.0)
    return mx - scale * mc, scale, ok


def clip_search(x: jnp.ndarray, bits: int, floor: float = 1e-10, ar: Arith = JNP, weights=None, stored=None,
                ratios=None, power: int = 2):
    """(codes, zero, scale) per row of `x` (fp32) over the last axis, dequantized as codes * scale + zero.

    Candidates: RTN over min..max (`rtn_params`), and for each ratio of `clip_ratios(bits)`, RTN over
    that fraction of the range about the row's midpoint followed by the unbiased refit of zero and
    scale (`_unbiased_fit`). The candidate with the least squared error sum(weights * err^2)
    (weights broadcast against x; None: 1) wins; min..max is first and keeps ties, so no row does
    worse than without the search. stored: the dtype zero and scale are stored in (the grid is rounded
    to it before its codes are chosen, the refit before ranking). The codes are the winning candidate's: a refit grid is not re-rounded.
    ratios: the clip ratios to try after min..max (None: `clip_ratios(bits)`); power: the error's
    exponent in the ranking (2: squared error; 4 weighs a few large errors, as clipping makes, more)."""
    mn = jnp.min(x, axis=-1)
    mx = jnp.max(x, axis=-1)
    levels = jnp.asarray(2 ** bits - 1, mx.dtype)
    half = (mx - mn) * 0.5
    mid = mn + half

    def as_stored(a):
        return a if stored is None else saturate(a, stored).astype(jnp.float32)

    best = None
    for k, r in enumerate((1.0,) + tuple(clip_ratios(bits) if ratios is None else ratios)):
        if k == 0:   # min..max, as without the search
            lo, scale = mn, jnp.maximum(ar.div(mx - mn, levels), floor)
        else:
            lo = mid - half * r
            scale = jnp.maximum(ar.div(half * (2.0 * r), levels), floor)
        lo, scale = as_stored(lo), as_stored(scale)   # codes against the grid as stored (`rtn_stored`)
        # one division per row, not per value
        inv = ar.div(jnp.ones_like(scale), scale)
        codes = jnp.clip(round_half_even((x - lo[..., None]) * inv[..., None]), 0, 2 ** bits - 1)
        if k:
            zero, fit, ok = _unbiased_fit(x, codes, weights)
            lo = jnp.where(ok, zero, lo)
            scale = jnp.where(ok, jnp.maximum(fit, floor), scale)
        lo, scale = as_stored(lo), as_stored(scale)
        e = codes * scale[..., None] + lo[..., None] - x
        e2 = e * e if power == 2 else (e * e) ** (power // 2)
        err = jnp.sum(e2 if weights is None else e2 * (weights if power == 2 else weights ** (power // 2)), axis=-1)
        if best is None:
            best = (codes, lo, scale, err)
        else:
            better = err < best[3]
            best = (jnp.where(better[..., None], codes, best[0]), jnp.where(better, lo, best[1]),
                    jnp.where(better, scale, best[2]), jnp.where(better, err, best[3]))
    return best[0].astype(jnp.uint8), best[1], best[2]


def rtn_codes(x: jnp.ndarray, mn: jnp.ndarray, scale: jnp.ndarray, bits: int, ar: Arith = JNP) -> jnp.ndarray:
    """`clip(round_half_even((x - mn) / scale), 0, 2^b - 1)` with mn/scale broadcast over the last axis."""
    q = round_half_even(ar.div(x - mn[..., None], scale[..., None]))
    return jnp.clip(q, 0, 2 ** bits - 1).astype(jnp.uint8)


def rtn_stored(x: jnp.ndarray, bits: int, dtype=jnp.float16, ar: Arith = JNP, clip=None):
    """RTN (over the `clip_search` range among the ratios `clip`, if not None) whose codes are computed against the (min, scale) rounded to `dtype`, as they get stored.

    Rounding the metadata first and then choosing codes against it makes the stored triple
    self-consistent (strictly lower error than rounding scales after choosing codes).
    Returns codes [..., n] uint8, scale [...] and zero [...] in `dtype` (saturated to its range).
    """
    if clip is not None:
        codes, mn, scale = clip_search(x, bits, floor=SCALE_FLOOR, ar=ar, stored=dtype, ratios=clip)
        return codes, saturate(scale, dtype), saturate(mn, dtype)
    mn, scale = rtn_params(x, bits, floor=SCALE_FLOOR, ar=ar)
    scale_s = saturate(scale, dtype)
    zero_s = saturate(mn, dtype)
    codes = rtn_codes(x, zero_s.astype(jnp.float32), scale_s.astype(jnp.float32), bits, ar)
    return codes, scale_s, zero_s


def rtn_dequant(codes: jnp.ndarray, scale: jnp.ndarray, zero: jnp.ndarray) -> jnp.ndarray:
    """codes [..., n] with per-row scale/zero [...] -> fp32 values."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]
