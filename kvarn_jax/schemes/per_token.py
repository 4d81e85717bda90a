"""Per-token schemes: int{8,4,2} asymmetric RTN (dynamic or static scales), fp8 e4m3, passthrough.

Here a "tile" is one token of one head: x is [..., D]. Dynamic int scales are per token and per
group of channels; static int scales are per head and channel (fixed from a `Calibration`, like
Ascend's C8 per-channel scale/offset); fp8 uses one scale per token (dynamic) or per head (static).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..config import FP8_E4M3_MAX
from ..packing import pack, unpack
from .arith import JNP, Arith, saturate
from .rtn import SCALE_FLOOR, round_half_even, rtn_dequant, rtn_stored

FP8 = jnp.float8_e4m3fn


# ------------------------------------------------------------------ int, dynamic
def int_fields(bits: int, channel_group: int, head_dim: int, meta=jnp.float16):
    n = head_dim // channel_group
    return {"codes": ((head_dim * bits // 8,), jnp.uint8), "scale": ((n,), meta), "zero": ((n,), meta)}


def int_quantize(x: jnp.ndarray, bits: int, channel_group: int, ar: Arith = JNP, meta=jnp.float16,
                 clip=None) -> dict:
    t = x.astype(jnp.float32)
    d = t.shape[-1]
    rows = t.reshape(*t.shape[:-1], d // channel_group, channel_group)
    codes, scale, zero = rtn_stored(rows, bits, meta, ar, clip)
    return {"codes": pack(codes.reshape(t.shape), bits), "scale": scale, "zero": zero}


def int_dequantize(f: dict, bits: int, channel_group: int) -> jnp.ndarray:
    c = unpack(f["codes"], bits)
    d = c.shape[-1]
    rows = c.reshape(*c.shape[:-1], d // channel_group, channel_group)
    return rtn_dequant(rows, f["scale"], f["zero"]).reshape(c.shape)


# ------------------------------------------------------------------ int, static (per head and channel)
def int_static_fields(bits: int, head_dim: int):
    return {"codes": ((head_dim * bits // 8,), jnp.uint8)}


def int_static_params(lo: jnp.ndarray, hi: jnp.ndarray, bits: int, meta=jnp.float16):
    """Calibrated per-channel range [lo, hi] -> (scale, zero) in `meta`, same rule as dynamic RTN."""
    scale = jnp.maximum((hi - lo) / (2 ** bits - 1), SCALE_FLOOR)
    return saturate(scale, meta), saturate(lo, meta)


def int_static_quantize(x: jnp.ndarray, bits: int, scale: jnp.ndarray, zero: jnp.ndarray, ar: Arith = JNP) -> dict:
    """scale/zero broadcast against x [..., D] (per channel). Values outside the calibrated range clip."""
    q = round_half_even(ar.div(x.astype(jnp.float32) - zero.astype(jnp.float32), scale.astype(jnp.float32)))
    return {"codes": pack(jnp.clip(q, 0, 2 ** bits - 1).astype(jnp.uint8), bits)}


def int_static_dequantize(f: dict, bits: int, scale: jnp.ndarray, zero: jnp.ndarray) -> jnp.ndarray:
    c = unpack(f["codes"], bits).astype(jnp.float32)
    return c * scale.astype(jnp.float32) + zero.astype(jnp.float32)


# ------------------------------------------------------------------ fp8 e4m3
def fp8_fields(head_dim: int, static: bool, meta=jnp.float16):
    f = {"codes": ((head_dim,), jnp.uint8)}  # e4m3 bit patterns; uint8 so pages are plain bytes
    if not static:
        f["scale"] = ((), meta)
    return f


def fp8_scale_from_amax(amax: jnp.ndarray, ar: Arith = JNP, meta=jnp.float16) -> jnp.ndarray:
    return saturate(jnp.maximum(ar.div(amax, jnp.asarray(FP8_E4M3_MAX, amax.dtype)), SCALE_FLOOR), meta)


def _to_fp8_bits(y: jnp.ndarray) -> jnp.ndarray:
    y = jnp.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX)  # e4m3fn has no inf: saturate
    return lax.bitcast_convert_type(y.astype(FP8), jnp.uint8)


def fp8_quantize(x: jnp.ndarray, scale: jnp.ndarray | None = None, ar: Arith = JNP, meta=jnp.float16) -> dict:
    """Dynamic (scale=None: per-token amax/448, stored in `meta`) or static (scale broadcast against
    x[..., :1])."""
    t = x.astype(jnp.float32)
    if scale is None:
        s = fp8_scale_from_amax(jnp.max(jnp.abs(t), axis=-1), ar, meta)
        return {"codes": _to_fp8_bits(ar.div(t, s.astype(jnp.float32)[..., None])), "scale": s}
    return {"codes": _to_fp8_bits(ar.div(t, scale.astype(jnp.float32)))}


def fp8_dequantize(f: dict, scale: jnp.ndarray | None = None) -> jnp.ndarray:
    v = lax.bitcast_convert_type(f["codes"], FP8).astype(jnp.float32)
    s = f["scale"].astype(jnp.float32)[..., None] if scale is None else scale.astype(jnp.float32)
    return v * s


# ------------------------------------------------------------------ passthrough
def passthrough_fields(head_dim: int, dtype: str):
    return {"values": ((head_dim,), jnp.dtype(dtype))}
