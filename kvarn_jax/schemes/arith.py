"""The float primitives of the scheme math that a kernel may swap for its own instructions.

The reference (XLA) and the Pallas quantize kernel run the same scheme functions; where Triton
lowers a primitive differently from XLA, the kernel passes its own `Arith`:
  - div: Triton lowers an fp32 division to `div.full.f32` (approximate, up to 2 ulp); NumPy and
    XLA's CPU backend divide in IEEE. With fp16 data many quotients (x - min) / scale fall exactly
    on .5, where round-half-even decides, so an approximate division changes codes. The GPU kernel
    passes an IEEE division in inline PTX (`div.rn.f32`) for the non-KVarN schemes, and its codes
    then come within 0.001-0.008% of the CPU reference's (on the H200: 99 of 8.4 M int8 codes
    differed, for a reason not found; XLA's own GPU build of the reference differed in 186 K).
    KVarN keeps the fast division (`quantize_pallas.GPU_ARITH_KVARN`).
  - log2: the GPU kernel passes the one-instruction `lg2.approx.f32` (KVarN's Sinkhorn takes ~2
    logs per row and column per iteration; libdevice's polynomial costs ~20 instructions).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Arith:
    log2: Callable = jnp.log2
    div: Callable = jnp.divide


JNP = Arith()


def saturate(x: jnp.ndarray, dtype) -> jnp.ndarray:
    """x rounded to `dtype` with values beyond its largest finite magnitude clipped to it (a plain
    cast turns them into inf). NaN stays NaN. Exact where x is already within range."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return x.astype(dtype)
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -big, big).astype(dtype)


def meta_dtype(dtype) -> jnp.dtype:
    """The dtype of the scales and zero points stored beside the codes of a cache of `dtype` (the
    model dtype): the same one, so their range covers the data's (fp16 scales under bf16 data
    overflowed at 65,504)."""
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    return d


def exponent(x: jnp.ndarray) -> jnp.ndarray:
    """floor(log2(x)) of positive normal fp32 x, exactly (its exponent bits; a log2 instruction is
    approximate on the GPU), clamped to [-120, 120]."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.clip(((bits >> 23) & 0xFF) - 127, -120, 120)


def pow2(e: jnp.ndarray) -> jnp.ndarray:
    """2^e in fp32 for integer e in [-126, 127], exactly (built from its exponent bits)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)
