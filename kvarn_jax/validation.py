"""Argument checks shared by the public functions.

Checks on values (NaN, out-of-range indices) need concrete arrays: they run when a function is
called eagerly and are skipped while tracing under `jax.jit` (a traced value has no value yet). The
jit-safe code paths never write out of bounds: invalid entries are dropped and counted (see
`PagedKVCache.dropped_tokens`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def require_compiled_backend(interpret: bool, what: str, platform: str = "gpu") -> None:
    """A Pallas kernel compiles for its platform only (the GPU kernels lower through Triton, the TPU
    kernels through Mosaic) and runs interpreted anywhere else."""
    if not interpret and jax.default_backend() != platform:
        names = {"gpu": "NVIDIA GPUs", "tpu": "TPUs"}
        raise ValueError(f"{what}: this Pallas kernel compiles for {names.get(platform, platform)} only (backend "
                         f"here: {jax.default_backend()}); pass interpret=True or use impl='reference'")


def check_count(x, name: str, what: str = "") -> int:
    """A positive integer argument (Python or NumPy int; not a bool) as an int, else ValueError."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x <= 0:
        raise ValueError(f"{name} must be a positive int{what}, got {x!r}")
    return int(x)


def is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_array(x, name: str, ndim: int | None = None, floating: bool = False, integer: bool = False):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if floating and jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if integer and not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {x.dtype}")


def check_finite(x, name: str):
    if not is_concrete(x):
        return
    ok = jnp.all(jnp.isfinite(x))  # on the device: only a scalar comes back
    if isinstance(ok, jax.core.Tracer):  # x is concrete but closed over by a jitted caller
        ok = bool(np.isfinite(np.asarray(x, dtype=np.float32)).all())
    if not bool(ok):
        bad = int(np.sum(~np.isfinite(np.asarray(x, dtype=np.float32))))
        raise ValueError(f"{name} contains {bad} non-finite value(s) (NaN or Inf); refusing to quantize them")


def check_range(x, name: str, lo: int, hi: int, what: str, allow: tuple = ()):
    """Every element of integer array x must be in [lo, hi) or one of `allow`."""
    if not is_concrete(x):
        return
    a = np.asarray(x)
    ok = (a >= lo) & (a < hi)
    for v in allow:
        ok |= a == v
    if not ok.all():
        i = tuple(int(j) for j in np.argwhere(~ok)[0])
        raise ValueError(f"{name}{list(i)} = {int(a[i])} is out of range: {what}")
