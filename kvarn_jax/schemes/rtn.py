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


def rtn_codes(x: jnp.ndarray, mn: jnp.ndarray, scale: jnp.ndarray, bits: int, ar: Arith = JNP) -> jnp.ndarray:
    """`clip(round_half_even((x - mn) / scale), 0, 2^b - 1)` with mn/scale broadcast over the last axis."""
    q = round_half_even(ar.div(x - mn[..., None], scale[..., None]))
    return jnp.clip(q, 0, 2 ** bits - 1).astype(jnp.uint8)


def rtn_stored(x: jnp.ndarray, bits: int, dtype=jnp.float16, ar: Arith = JNP):
    """RTN whose codes are computed against the (min, scale) rounded to `dtype`, as they get stored.

    Rounding the metadata first and then choosing codes against it makes the stored triple
    self-consistent (strictly lower error than rounding scales after choosing codes).
    Returns codes [..., n] uint8, scale [...] and zero [...] in `dtype` (saturated to its range).
    """
    mn, scale = rtn_params(x, bits, floor=SCALE_FLOOR, ar=ar)
    scale_s = saturate(scale, dtype)
    zero_s = saturate(mn, dtype)
    codes = rtn_codes(x, zero_s.astype(jnp.float32), scale_s.astype(jnp.float32), bits, ar)
    return codes, scale_s, zero_s


def rtn_dequant(codes: jnp.ndarray, scale: jnp.ndarray, zero: jnp.ndarray) -> jnp.ndarray:
    """codes [..., n] with per-row scale/zero [...] -> fp32 values."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]
