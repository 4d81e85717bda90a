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


# Rows within this magnitude rotate in fp32 without overflow (|x @ H| <= sqrt(D) * max|x|); larger
# ones are rotated scaled down by a power of two (exactly), as a row with both signs of overflow would
# come out NaN.
SAFE_ABS = 2.0 ** 100


def _product(x: jnp.ndarray, h: jnp.ndarray, one_token: bool) -> jnp.ndarray:
    if one_token:
        # One token's rows (decode at batch 1): the fusion XLA builds in front of the rotation's
        # matrix product took ~9 us a call there on an H100 (~2 us at 32 sequences; at batch 1 its
        # inputs are projections that XLA computes as reductions). As a product and a sum over D the
        # rotation is a reduction of its own: the query's and output's at SmolLM2 batch 1, 364 -> 423
        # tokens/s. At batch 32 the matrix product is the faster; stored K/V keep it, so their bits
        # do not depend on how many tokens a write holds.
        return jnp.sum(x[..., :, None] * h, axis=-2)
    return jnp.matmul(x, h, precision="highest", preferred_element_type=jnp.float32)


def _matmul(x: jnp.ndarray, h: jnp.ndarray, max_abs: float | None, one_token: bool = False) -> jnp.ndarray:
    """x [..., D] (fp32, or bf16 against a bf16 h) @ h with fp32 sums, safe from intermediate
    overflow. With `max_abs` (at most `SAFE_ABS`) x is clipped to it, which needs no reduction over
    D: on GPUs the test of each row's largest value is a kernel of its own per call. Without, rows
    beyond SAFE_ABS are scaled down by a power of two (exact in either dtype) and back."""
    if max_abs is not None:
        if not 0 < max_abs <= SAFE_ABS:
            raise ValueError(f"max_abs must be in (0, 2^100], got {max_abs}")
        return _product(jnp.clip(x, -max_abs, max_abs), h, one_token)
    big = jnp.max(jnp.abs(x), axis=-1, keepdims=True) > SAFE_ABS
    s = jnp.where(big, 2.0 ** -16, 1.0).astype(x.dtype)
    return _product(x * s, h, one_token) / s.astype(jnp.float32)


def rotate(x: jnp.ndarray, out_dtype=None, *, max_abs: float | None = None,
           one_token: bool = False) -> jnp.ndarray:
    """Rotate along the last axis: `x @ H`, accumulated in fp32 and rounded to `out_dtype`, with
    results beyond its range saturated to its largest finite value (`schemes.arith.saturate`).

    For fp16 inputs the matrix itself is rounded to fp16 first, as the KVarN reference does
    (`fp16(x_fp16 @ fp16(H))`); this reproduces its rotated tiles bit for bit. bf16 inputs are
    multiplied by H's signs in one bf16 product with fp32 sums, then by 1/sqrt(D) (every product
    exact: the fp32 rotation up to the order of the sums). Other dtypes use the fp32 matrix, which
    is exactly orthonormal up to fp32 rounding. max_abs: clip x to ±max_abs first
    (exact where x is within it; the cheaper overflow guard for hot paths, e.g. `storage.QUANT_MAX`).
    one_token: x holds one token's rows (decode at batch 1): the same sums as a product and a
    reduction over D instead of a matrix product, faster there on GPUs; equal up to fp32 rounding.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.dtype == jnp.bfloat16 and not one_token:
        return saturate(_signs_product(x, max_abs), out_dtype)
    h_dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.float32
    h = hadamard_matrix(x.shape[-1], h_dtype).astype(jnp.float32)
    return saturate(_matmul(x.astype(jnp.float32), h, max_abs, one_token), out_dtype)


def _signs_product(x: jnp.ndarray, max_abs: float | None) -> jnp.ndarray:
    """bf16 x [..., D] @ H in fp32: x times the matrix's signs (+-1, exact in bf16) with fp32 sums,
    then one multiply by 1/sqrt(D). Every product is exact, so this is the fp32 rotation up to the
    order of its sums, in one single-pass bf16 product where the fp32 one at full precision takes
    several (the query/K/V rotation of a Llama-3-8B decode step at 32 x 8K on an H100: 0.094 against
    0.173 ms, benchmarks/results/2026-12-06_engine_gpu.md)."""
    n = x.shape[-1]
    signs = jnp.asarray(np.sign(hadamard_matrix_np(n)), jnp.bfloat16)
    return _matmul(x, signs, max_abs) * np.float32(1.0 / np.sqrt(n))


def unrotate(x: jnp.ndarray, out_dtype=None, *, max_abs: float | None = None,
             one_token: bool = False) -> jnp.ndarray:
    """Inverse of `rotate` (H is its own inverse), in fp32 with the exact matrix; max_abs and one_token
    as in `rotate`."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    h = hadamard_matrix(x.shape[-1], jnp.float32)
    return saturate(_matmul(x.astype(jnp.float32), h, max_abs, one_token), out_dtype)


def rotate_rows(w: jnp.ndarray, head_dim: int) -> jnp.ndarray:
    """w [heads * head_dim, n] -> the matrix whose rows are each head's rows rotated (block-diagonal H
    times w), in fp32, rounded to w.dtype: `rotate(x) @ rotate_rows(w)` equals `x @ w` up to rounding
    (x [..., heads, head_dim] flattened to heads * head_dim). A product that follows an output left in
    the rotated frame thus needs no unrotation of its own."""
    rows, n = w.shape
    if rows % head_dim:
        raise ValueError(f"w has {rows} rows, not a multiple of head_dim={head_dim}")
    h = hadamard_matrix(head_dim, jnp.float32)
    blocks = w.astype(jnp.float32).reshape(rows // head_dim, head_dim, n)
    return jnp.einsum("ij,hjn->hin", h, blocks, precision="highest").reshape(rows, n).astype(w.dtype)
