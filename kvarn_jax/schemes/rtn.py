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
# ~0.8 at 3, ~0.93 at 4 and 1.0 at 8).
CLIP_CANDIDATES = 8
CLIP_STEP = {2: 0.07, 3: 0.045, 4: 0.02, 8: 0.002}


def clip_ratios(bits: int) -> tuple[float, ...]:
    """The fractions of a row's min..max range `clip_search` tries, largest (1: no clipping) first."""
    return tuple(1.0 - k * CLIP_STEP[bits] for k in range(CLIP_CANDIDATES))


def clip_search(x: jnp.ndarray, bits: int, floor: float = 1e-10, ar: Arith = JNP, weights=None, stored=None):
    """(lo, scale) per row of `x` (fp32) over the last axis: of the ranges `clip_ratios(bits)` x
    (max - min) about the row's midpoint, the one whose RTN codes have the least squared error,
    sum(weights * (codes * scale + lo - x)^2) (weights broadcast against x; None: 1). Ratio 1 is
    exactly `rtn_params`, and a smaller ratio must do strictly better to be chosen, so a row that
    clipping cannot help keeps its min..max. stored: the dtype lo and scale are stored in, if the
    codes are chosen against the stored values (`rtn_stored`): candidates are ranked as stored.
    Values beyond the chosen range get the end codes (`rtn_codes` clips)."""
    mn = jnp.min(x, axis=-1)
    mx = jnp.max(x, axis=-1)
    levels = jnp.asarray(2 ** bits - 1, mx.dtype)
    half = (mx - mn) * 0.5
    mid = mn + half
    best_lo = best_scale = best_err = None
    for r in clip_ratios(bits):
        if r == 1.0:
            lo, scale = mn, jnp.maximum(ar.div(mx - mn, levels), floor)
        else:
            lo = mid - half * r
            scale = jnp.maximum(ar.div(half * (2.0 * r), levels), floor)
        if stored is not None:
            lo, scale = saturate(lo, stored).astype(jnp.float32), saturate(scale, stored).astype(jnp.float32)
        # the search ranks candidates by a reciprocal product (one division per row, not per
        # value); the stored codes are then computed by `rtn_codes`, exactly as without a search
        inv = ar.div(jnp.ones_like(scale), scale)
        q = jnp.clip(round_half_even((x - lo[..., None]) * inv[..., None]), 0, 2 ** bits - 1)
        e = q * scale[..., None] + lo[..., None] - x
        e2 = e * e if weights is None else e * e * weights
        err = jnp.sum(e2, axis=-1)
        if best_err is None:
            best_lo, best_scale, best_err = lo, scale, err
        else:
            better = err < best_err
            best_lo = jnp.where(better, lo, best_lo)
            best_scale = jnp.where(better, scale, best_scale)
            best_err = jnp.where(better, err, best_err)
    return best_lo, best_scale


def rtn_codes(x: jnp.ndarray, mn: jnp.ndarray, scale: jnp.ndarray, bits: int, ar: Arith = JNP) -> jnp.ndarray:
    """`clip(round_half_even((x - mn) / scale), 0, 2^b - 1)` with mn/scale broadcast over the last axis."""
    q = round_half_even(ar.div(x - mn[..., None], scale[..., None]))
    return jnp.clip(q, 0, 2 ** bits - 1).astype(jnp.uint8)


def rtn_stored(x: jnp.ndarray, bits: int, dtype=jnp.float16, ar: Arith = JNP, clip: bool = False):
    """RTN (over the `clip_search` range if `clip`) whose codes are computed against the (min, scale) rounded to `dtype`, as they get stored.

    Rounding the metadata first and then choosing codes against it makes the stored triple
    self-consistent (strictly lower error than rounding scales after choosing codes).
    Returns codes [..., n] uint8, scale [...] and zero [...] in `dtype` (saturated to its range).
    """
    if clip:
        mn, scale = clip_search(x, bits, floor=SCALE_FLOOR, ar=ar, stored=dtype)
    else:
        mn, scale = rtn_params(x, bits, floor=SCALE_FLOOR, ar=ar)
    scale_s = saturate(scale, dtype)
    zero_s = saturate(mn, dtype)
    codes = rtn_codes(x, zero_s.astype(jnp.float32), scale_s.astype(jnp.float32), bits, ar)
    return codes, scale_s, zero_s


def rtn_dequant(codes: jnp.ndarray, scale: jnp.ndarray, zero: jnp.ndarray) -> jnp.ndarray:
    """codes [..., n] with per-row scale/zero [...] -> fp32 values."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]
