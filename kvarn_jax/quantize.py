"""`quantize` / `dequantize`: whole tensors of K and V in and out, in the un-rotated frame.

The result is a pytree (`QuantizedKV`) whose leaves are the stored fields and whose static aux data
is the config, so it passes through `jax.jit`, `jax.vmap` (e.g. over layers) and `jax.tree_util`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Union

import jax
import jax.numpy as jnp

from . import schemes
from .config import KVQuantConfig
from .hadamard import unrotate
from .schemes.arith import saturate
from .storage import QUANT_MAX, storage_values
from .validation import check_array, check_finite, is_concrete


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """Quantized K and V of `tokens` x `num_kv_heads` x `head_dim`.

    fields: {"k": {name: array}, "v": {...}}; each array is [num_tiles, Hk, *field shape] where a
      tile is `cfg.tile_tokens` tokens (tiled schemes) or one token (per-token schemes).
    static: calibrated per-head parameters of static schemes ({"k": {...}, "v": {...}}), else None.
    cfg / dtype: the scheme and the dtype `dequantize` returns (static aux data).
    """

    fields: dict
    static: Union[dict, None]
    cfg: KVQuantConfig = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))


def _static_params(cfg: KVQuantConfig, calibration, num_kv_heads: int, head_dim: int, dtype="float16"):
    if not cfg.static:
        if calibration is not None:
            raise ValueError(f"calibration was given but {cfg.name} computes its scales dynamically; "
                             "use a static scheme (e.g. int8_static, fp8_static) to apply it")
        return None
    if calibration is None:
        raise ValueError(f"calibration is required by {cfg.name} (its scales are fixed): "
                         "pass calibration=kvarn_jax.calibrate(samples, cfg) (one layer's)")
    return calibration.params(cfg, num_kv_heads, head_dim, dtype)


def _tiles(x: jnp.ndarray, g: int) -> jnp.ndarray:
    """[T, Hk, D] -> [T/G, Hk, G, D] (tiled) or unchanged (per-token)."""
    if g == 1:
        return x
    t, h, d = x.shape
    return x.reshape(t // g, g, h, d).transpose(0, 2, 1, 3)


def _untiles(x: jnp.ndarray, g: int) -> jnp.ndarray:
    if g == 1:
        return x
    n, h, _, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(n * g, h, d)


def quantize(kv, cfg: Union[str, KVQuantConfig], *, calibration=None, rotated: bool = False) -> QuantizedKV:
    """Quantize `kv = (k, v)`, each [tokens, num_kv_heads, head_dim] float16/bfloat16/float32 (one dtype).

    Tiled schemes need `tokens` to be a multiple of the tile (`cfg.tile_tokens`). Static schemes need
    `calibration` (a one-layer `Calibration`). `rotated=True`: k and v are already in the Hadamard
    frame (KVarN only; e.g. values read back from a cache). Scales and zero points are stored in the
    input's dtype. Jit-able; `cfg` is static. Called eagerly, values that cannot be stored as given
    raise ValueError: NaN/Inf, and values beyond the storage range (`kvarn_jax.storage`). Traced,
    such a token is stored altered instead (a NaN/Inf token as zeros, out-of-range values
    saturated), so that it never changes the other tokens of its tile; the paged cache's `write`
    counts these, this function cannot report them.
    """
    cfg = KVQuantConfig.parse(cfg)
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ValueError("kv must be a pair (k, v) of arrays [tokens, num_kv_heads, head_dim]")
    k, v = kv
    check_array(k, "k", ndim=3, floating=True)
    check_array(v, "v", ndim=3, floating=True)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k and v must have the same shape and dtype, got k {tuple(k.shape)} {k.dtype} "
                         f"and v {tuple(v.shape)} {v.dtype}")
    t, h, d = k.shape
    cfg.check_head_dim(d, "head_dim (k.shape[2])")
    g = cfg.tile_tokens
    if t % g:
        raise ValueError(f"tokens (k.shape[0]) = {t} is not a whole number of {cfg.name} tiles: it must be a "
                         f"multiple of {g} (use the paged cache for streams that end mid-tile)")
    check_finite(k, "k")
    check_finite(v, "v")
    static = _static_params(cfg, calibration, h, d, k.dtype)
    q, saturated = _quantize(k, v, static, cfg=cfg, rotated=rotated)
    if is_concrete(k, v) and int(saturated):
        raise ValueError(f"{int(saturated)} token(s) of k/v hold values {cfg.name} cannot store in {k.dtype}: "
                         f"beyond ±{QUANT_MAX:.3g} or, after the Hadamard rotation, beyond the dtype's range "
                         "(a KVarN token whose L2 norm exceeds it); a wider dtype (bfloat16, float32) holds them")
    return q


@functools.partial(jax.jit, static_argnames=("cfg", "rotated"))
def _quantize(k, v, static, *, cfg, rotated):
    # Jitted once per (cfg, shape): eager callers get one fused computation, not op-by-op dispatch.
    k_s, v_s, _, saturated = storage_values(cfg, k, v, k.dtype, rotated=rotated)
    fields = {}
    for side, x in (("k", k_s), ("v", v_s)):
        st = schemes.expand_static(cfg, static[side], 0) if static else None
        fields[side] = schemes.quantize_side(_tiles(x, cfg.tile_tokens), cfg, side, st, dtype=k.dtype)
    q = QuantizedKV(fields=fields, static=static, cfg=cfg, dtype=jnp.dtype(k.dtype).name)
    return q, jnp.sum(saturated, dtype=jnp.int32)


def dequantize(q: QuantizedKV, *, rotated: bool = False):
    """(k_hat, v_hat), each [tokens, num_kv_heads, head_dim] in `q.dtype`.

    Values are returned in the un-rotated frame unless `rotated=True` (the stored frame of KVarN).
    """
    if not isinstance(q, QuantizedKV):
        raise ValueError(f"q must be a QuantizedKV (from kvarn_jax.quantize), got {type(q).__name__}")
    return _dequantize(q, rotated=rotated)


@functools.partial(jax.jit, static_argnames=("rotated",))
def _dequantize(q: QuantizedKV, *, rotated: bool):
    cfg = q.cfg
    out = []
    for side in ("k", "v"):
        f = q.fields[side]
        head_dim = _head_dim(cfg, side, f)
        st = schemes.expand_static(cfg, q.static[side], 0) if q.static else None
        x = _untiles(schemes.dequantize_side(f, cfg, side, head_dim, st), cfg.tile_tokens)
        if cfg.rotated and not rotated:
            x = unrotate(x)
        out.append(saturate(x, q.dtype))  # a value rounded past the dtype's largest stays finite
    return tuple(out)


def _head_dim(cfg: KVQuantConfig, side: str, f: dict) -> int:
    """head_dim from the stored fields (no shape is kept in aux data, so vmap over layers works)."""
    if cfg.method == "passthrough":
        return f["values"].shape[-1]
    if cfg.method == "fp8":
        return f["codes"].shape[-1]
    if cfg.method == "int":
        return f["codes"].shape[-1] * 8 // cfg.bits(side)
    # kvarn / kivi: K codes [D, G*b/8]; V codes [G, D*b/8]
    c = f["codes"]
    return c.shape[-2] if side == "k" else c.shape[-1] * 8 // cfg.bits(side)
