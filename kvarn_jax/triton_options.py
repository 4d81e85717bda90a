"""A register cap per thread for our Pallas GPU kernels, which jax's Pallas-Triton lowering does not expose.

Triton itself has the option (`maxnreg`, PTX `.maxnreg`): its compiler sets it as the module
attribute `ttg.maxnreg`, which the conversion to LLVM turns into the kernel's register limit. jax's
`CompilerParams` has only `num_warps` and `num_stages`, so a kernel asks for a cap through its name
(`kernel_name(base, maxnreg)` appends `_maxnreg<N>`), and a wrapper around jax's lowering of a
kernel to a Triton module sets the attribute on modules so named. Nothing else is changed, and only
modules whose name ends that way are touched.

Why: at ~255 registers per thread the decode kernel fits few warps per SM; a cap lets more programs
share one. The decode kernel's launch rules use a cap where it measured faster
(`paged_decode_pallas.launch`, docs/kernels.md "Launch rules"). Without this hook that launch runs
one uncapped warp instead; an explicit `maxnreg=N` raises.
"""

from __future__ import annotations

import re

_SUFFIX = re.compile(r"_maxnreg(\d+)$")
_installed = False


def _lowering_module():
    from jax._src.pallas.triton import lowering
    return lowering


def available() -> bool:
    """Whether this jax lowers Pallas kernels through the function the cap is attached to."""
    try:
        return callable(getattr(_lowering_module(), "lower_jaxpr_to_triton_module", None))
    except ImportError:
        return False


def install():
    """Wrap jax's lowering once (kernel_name does this on first use)."""
    global _installed
    if _installed:
        return
    lowering = _lowering_module()
    original = lowering.lower_jaxpr_to_triton_module

    def lower_with_register_cap(*args, **kwargs):
        result = original(*args, **kwargs)
        op = result.module.operation
        name = str(op.attributes["sym_name"]).strip('"') if "sym_name" in op.attributes else ""
        m = _SUFFIX.search(name)
        if m:
            from jax._src.lib.mlir import ir
            with op.context:
                op.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), int(m.group(1)))
        return result

    lowering.lower_jaxpr_to_triton_module = lower_with_register_cap
    _installed = True


def kernel_name(base: str, maxnreg: int | None) -> str:
    """The kernel name that carries a register cap (`base` unchanged for None).

    Raises if a cap is asked for and this jax's Pallas-Triton lowering is not the one the cap is
    attached to: the kernel would run uncapped, at a speed nobody measured."""
    if maxnreg is None:
        return base
    if not isinstance(maxnreg, int) or not 24 <= maxnreg <= 255:
        raise ValueError(f"maxnreg must be an int in [24, 255] (registers per thread), got {maxnreg!r}")
    if not available():
        raise RuntimeError("maxnreg: this jax's Pallas-Triton lowering has no lower_jaxpr_to_triton_module to "
                           "attach a register cap to; do not pass maxnreg")
    install()
    return f"{base}_maxnreg{maxnreg}"


def register_cap(module_asm: str) -> int | None:
    """The cap a lowered Triton module (its text) carries, if any (for tests and tools)."""
    m = re.search(r'"?ttg\.maxnreg"?\s*=\s*(\d+)', module_asm)
    return int(m.group(1)) if m else None
