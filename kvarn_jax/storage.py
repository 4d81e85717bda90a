"""What a token becomes when it is stored: the one place that turns given K/V into the values a cache
(or `quantize`) keeps, so that finite input never comes back non-finite and a bad token never
spreads past itself.

- A token with any non-finite value (NaN or Inf) in its K or V is stored as zeros: quantized
  with others of its tile, a NaN would make the whole tile's scales NaN (an Inf, every key of it).
- Values are clipped to ±`QUANT_MAX` (2^50) first: the tile arithmetic squares values (KVarN's
  variances) and must stay finite in fp32, and attention (fp32 scores q.k) stays finite over any
  cache for queries within the same bound. Only bf16/fp32 data can reach it; no model's K/V does.
- KVarN's rotation accumulates in fp32 (`hadamard.rotate`); its result, like every stored value, is
  rounded to the storage dtype with saturation: a token whose rotated values exceed the dtype's
  range (fp16: L2 norm above ~65,504) is stored saturated.
Callers count the tokens changed this way (`PagedKVCache.dropped_tokens`) or, eagerly, raise.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from .config import KVQuantConfig
from .hadamard import rotate
from .schemes.arith import saturate

QUANT_MAX = 2.0 ** 50


def _per_token(mask: jnp.ndarray) -> jnp.ndarray:
    return jnp.any(mask.reshape(mask.shape[0], -1), axis=1)


def token_absmax(k: jnp.ndarray, v: jnp.ndarray) -> jnp.ndarray:
    """float32 [..., tokens]: the largest |value| of each token's K and V (over the last two axes),
    +inf where any value is NaN or Inf. One reduction gives both tests a write needs (non-finite,
    beyond `QUANT_MAX`); callers that compute it on the same k, v share it after XLA's CSE."""
    # k and v side by side: one reduction (on GPUs one kernel) instead of two
    a = jnp.abs(jnp.concatenate([k.astype(jnp.float32), v.astype(jnp.float32)], axis=-2))
    return jnp.max(jnp.where(jnp.isnan(a), jnp.inf, a), axis=(-1, -2))


def _reach(x_dtype, rotated: bool, head_dim: int) -> float:
    """The largest magnitude a stored value can have before rounding to the storage dtype: the input
    dtype's range, clipped at QUANT_MAX, times what a Hadamard rotation can grow a value by (sqrt(D),
    with margin for the fp16-rounded matrix and fp32 accumulation)."""
    bound = min(float(jnp.finfo(x_dtype).max), QUANT_MAX)
    return bound * math.sqrt(head_dim) * (1 + 2.0 ** -10) if rotated else bound


def storage_values(cfg: KVQuantConfig, k: jnp.ndarray, v: jnp.ndarray, dtype, rotated: bool = False):
    """(k, v) [tokens, Hk, D] -> (stored k, stored v, nonfinite [tokens] bool, saturated [tokens] bool).

    Stored values are in the storage frame (rotated for KVarN unless `rotated`: already in it) and
    in `dtype`. nonfinite: the token was stored as zeros; saturated: some value of a finite token was
    clipped (to ±QUANT_MAX before quantization, or to the dtype's range)."""
    m = token_absmax(k, v)
    nonfinite = m == jnp.inf
    saturated = m > QUANT_MAX
    big = float(jnp.finfo(jnp.dtype(dtype)).max)
    rotate_here = cfg.rotated and not rotated
    ys = []
    for x in (k, v):
        x = jnp.where(nonfinite[:, None, None], jnp.zeros((), x.dtype), x)
        if float(jnp.finfo(x.dtype).max) > QUANT_MAX:
            x = jnp.clip(x, -QUANT_MAX, QUANT_MAX)
        # in fp32 first (for fp16 input KVarN's rotation keeps the reference's fp16 matrix), then
        # rounded once to the storage dtype
        ys.append(rotate(x, jnp.float32, max_abs=QUANT_MAX) if rotate_here else x.astype(jnp.float32))
    if max(_reach(x.dtype, rotate_here, x.shape[-1]) for x in (k, v)) > big:  # else no value can exceed it
        # unrotated, a stored value is an input value clipped below QUANT_MAX > big: the input's
        # largest already tells; rotated, one more reduction (K and V together)
        saturated |= (_per_token(jnp.abs(jnp.concatenate(ys, axis=-2)) > big) if rotate_here else m > big)
    return saturate(ys[0], dtype), saturate(ys[1], dtype), nonfinite, saturated & ~nonfinite
