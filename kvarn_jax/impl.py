"""What `impl="auto"` means: one rule for every entry point that takes an `impl` (decode attention,
the cache's write path, the serving engine, `kvarn-jax generate`, the vLLM bridge, the benchmarks).

A Pallas kernel runs where it is compiled for the platform and takes the cache; for the write path
only for the schemes where it beats XLA's build of the jnp path (docs/performance.md, quantize-on-
write). On CPUs decode attention over a KVarN cache runs the C++ kernel ("native",
`attention/paged_decode_cpu`), built on first use. Everything else runs the jnp reference, compiled
by XLA. Asking for "pallas" or "native" where the kernel cannot take the cache is an error at the
entry point, never a silent switch.
"""

from __future__ import annotations

import jax

from .config import KVQuantConfig

IMPLS = ("auto", "pallas", "native", "reference")
# backends on which each operation's Pallas kernel is compiled (elsewhere it runs only interpreted)
KERNEL_BACKENDS = {"decode": ("gpu", "tpu"), "write": ("gpu",)}
# backends on which an op has a compiled C++ kernel ("native")
NATIVE_BACKENDS = {"decode": ("cpu",)}
# the write path's kernel only for the schemes where it is faster than XLA
WRITE_KERNEL_METHODS = ("kvarn", "fp8")


def check_impl(impl: str, name: str = "impl") -> str:
    if impl not in IMPLS:
        raise ValueError(f"{name} must be one of {list(IMPLS)}, got {impl!r}")
    return impl


def resolve_impl(impl: str, op: str, cfg: KVQuantConfig, kernel_refusal: str | None,
                 backend: str | None = None, native_refusal: str | None = "not asked") -> str:
    """"pallas", "native" or "reference": the implementation `impl` stands for.

    op: "decode" or "write". kernel_refusal: why the op's Pallas kernel cannot take this cache (the
    kernel module's `supports(cfg, block_size, head_dim)`), None if it can. native_refusal: on a
    backend with a native kernel for the op, why it cannot run this cache (not supported, or not
    buildable here), None if it can. backend: jax's backend name (default: `jax.default_backend()`).
    An explicit "pallas", "native" or "reference" is returned as it is.
    """
    check_impl(impl)
    if op not in KERNEL_BACKENDS:
        raise ValueError(f"op must be one of {list(KERNEL_BACKENDS)}, got {op!r}")
    if impl == "native" and op not in NATIVE_BACKENDS:
        raise ValueError(f"impl='native' is a decode attention kernel; the {op} path has none")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    if backend in NATIVE_BACKENDS.get(op, ()):
        return "native" if native_refusal is None else "reference"
    if backend not in KERNEL_BACKENDS[op] or kernel_refusal is not None:
        return "reference"
    if op == "write" and cfg.method not in WRITE_KERNEL_METHODS:
        return "reference"
    return "pallas"
