"""The normalized Sylvester Hadamard rotation used by KVarN (docs/design.md §1.1).

H is symmetric and orthonormal (H @ H = I), so the same matrix rotates and un-rotates: stored K/V
are `x @ H`, the query is rotated once (`q @ H`) and the attention output un-rotated once (`o @ H`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from .schemes.arith import saturate


@functools.lru_cache(maxsize=None)
def hadamard_matrix_np(n: int) -> np.ndarray:
    """[n, n] float64 Sylvester Hadamard matrix divided by sqrt(n); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"head_dim={n} has no Sylvester Hadamard matrix: it must be a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def hadamard_matrix(n: int, dtype=jnp.float32) -> jnp.ndarray:
    return jnp.asarray(hadamard_matrix_np(n), dtype=dtype)


# Tokens whose largest magnitude exceeds this are rotated scaled down by a power of two (exactly):
# |x @ H| <= sqrt(D) * max|x| could overflow fp32 on the way, and a row with both signs of overflow
# would come out NaN.
_SCALE_DOWN_ABOVE = 2.0 ** 100


def _matmul(x: jnp.ndarray, h: jnp.ndarray) -> jnp.ndarray:
    """x [..., D] (fp32) @ h in fp32, safe from intermediate overflow."""
    big = jnp.max(jnp.abs(x), axis=-1, keepdims=True) > _SCALE_DOWN_ABOVE
    s = jnp.where(big, 2.0 ** -16, 1.0)
    return jnp.matmul(x * s, h, precision="highest") / s


def rotate(x: jnp.ndarray, out_dtype=None) -> jnp.ndarray:
    """Rotate along the last axis: `x @ H`, accumulated in fp32 and rounded to `out_dtype`, with
    results beyond its range saturated to its largest finite value (`schemes.arith.saturate`).

    For fp16 inputs the matrix itself is rounded to fp16 first, as the KVarN reference does
    (`fp16(x_fp16 @ fp16(H))`); this reproduces its rotated tiles bit for bit. Other dtypes use the
    fp32 matrix, which is exactly orthonormal up to fp32 rounding.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    h_dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.float32
    h = hadamard_matrix(x.shape[-1], h_dtype).astype(jnp.float32)
    return saturate(_matmul(x.astype(jnp.float32), h), out_dtype)


def unrotate(x: jnp.ndarray, out_dtype=None) -> jnp.ndarray:
    """Inverse of `rotate` (H is its own inverse), in fp32 with the exact matrix."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return saturate(_matmul(x.astype(jnp.float32), hadamard_matrix(x.shape[-1], jnp.float32)), out_dtype)
