"""Scheme dispatch: what each scheme stores per tile and how it (de)quantizes one side (K or V).

Every function here is pure `jnp` and vectorized over leading axes. A tile is `cfg.tile_tokens`
tokens of one head: tiled schemes (kvarn, kivi) take x as [..., G, D]; per-token schemes take [..., D].
Values are in the storage frame (Hadamard-rotated for kvarn; see `hadamard.py`).

Static schemes (int*_static, fp8_static) take per-head parameters from a `Calibration`, in canonical
shapes (int: scale/zero [Hk, D]; fp8: scale [Hk]). `expand_static` lines them up with a data layout
whose head axis is followed by `between` token axes and then the channel axis.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..config import KVQuantConfig
from . import kivi, kvarn, per_token
from .arith import JNP, Arith, meta_dtype, saturate
from .rtn import clip_ratios

SIDES = ("k", "v")


def side_fields(cfg: KVQuantConfig, side: str, head_dim: int, dtype="float16") -> dict:
    """{field name: (shape per tile, dtype)} stored for one side of a cache of model dtype `dtype`
    (scales and zero points are stored in it: `arith.meta_dtype`)."""
    b = cfg.bits(side)
    meta = meta_dtype(dtype)
    if cfg.method == "kvarn":
        return kvarn.fields(side, b, cfg.group, head_dim, meta)
    if cfg.method == "kivi":
        return kivi.fields(side, b, cfg.group, head_dim, meta)
    if cfg.method == "int":
        if cfg.static:
            return per_token.int_static_fields(b, head_dim)
        return per_token.int_fields(b, cfg.channel_group(side, head_dim), head_dim, meta)
    if cfg.method == "fp8":
        return per_token.fp8_fields(head_dim, cfg.static, meta)
    return per_token.passthrough_fields(head_dim, cfg.dtype)


def static_param_shapes(cfg: KVQuantConfig, num_kv_heads: int, head_dim: int) -> dict:
    """{name: shape} of the calibrated parameters a static scheme needs for one side."""
    if not cfg.static:
        return {}
    if cfg.method == "int":
        return {"scale": (num_kv_heads, head_dim), "zero": (num_kv_heads, head_dim)}
    return {"scale": (num_kv_heads,)}


def expand_static(cfg: KVQuantConfig, params: dict | None, between: int) -> dict | None:
    """Reshape canonical static params to broadcast against [Hk, (between token axes), D]."""
    if params is None:
        return None
    out = {}
    for name, a in params.items():
        if cfg.method == "int":  # [Hk, D]
            out[name] = a.reshape(a.shape[:1] + (1,) * between + a.shape[1:])
        else:  # fp8: [Hk]
            out[name] = a.reshape(a.shape + (1,) * (between + 1))
    return out


def quantize_side(x: jnp.ndarray, cfg: KVQuantConfig, side: str, static: dict | None = None,
                  ar: Arith = JNP, dtype="float16") -> dict:
    """Fields of tiles x (storage frame) of a cache of model dtype `dtype` (`side_fields`).
    ar: the log2 and division the math uses (`arith.Arith`; a kernel may pass its own)."""
    b = cfg.bits(side)
    meta = meta_dtype(dtype)
    clip = clip_ratios(b, side) if cfg.clip and (side == "v" or cfg.clip_keys) else None
    if cfg.method == "kvarn":
        return kvarn.quantize(x, side, b, cfg.sinkhorn_iters, ar, meta, clip)
    if cfg.method == "kivi":
        return kivi.quantize(x, side, b, cfg.group, ar, meta, clip)
    if cfg.method == "int":
        if cfg.static:
            return per_token.int_static_quantize(x, b, static["scale"], static["zero"], ar)
        return per_token.int_quantize(x, b, cfg.channel_group(side, x.shape[-1]), ar, meta, clip)
    if cfg.method == "fp8":
        return per_token.fp8_quantize(x, static["scale"] if cfg.static else None, ar, meta)
    return {"values": saturate(x, cfg.dtype)}


def dequantize_side(f: dict, cfg: KVQuantConfig, side: str, head_dim: int,
                    static: dict | None = None) -> jnp.ndarray:
    """Fields -> fp32 values in the storage frame, [..., G, D] (tiled) or [..., D] (per token)."""
    b = cfg.bits(side)
    if cfg.method == "kvarn":
        return kvarn.dequantize(f, side, b)
    if cfg.method == "kivi":
        return kivi.dequantize(f, side, b, cfg.group)
    if cfg.method == "int":
        if cfg.static:
            return per_token.int_static_dequantize(f, b, static["scale"], static["zero"])
        return per_token.int_dequantize(f, b, cfg.channel_group(side, head_dim))
    if cfg.method == "fp8":
        return per_token.fp8_dequantize(f, static["scale"] if cfg.static else None)
    return f["values"].astype(jnp.float32)
