"""Options for our Pallas GPU kernels that jax's Pallas-Triton lowering does not expose: a register
cap per thread, and fused multiply-adds.

jax's `CompilerParams` has only `num_warps` and `num_stages`, so a kernel asks for these through its
name (`kernel_name(base, maxnreg=N, fuse_fma=True)` appends `_fma` and `_maxnreg<N>`), and a wrapper
around jax's lowering of a kernel to a Triton module applies them to modules so named. Nothing else
is changed, and modules without these suffixes are not touched.

Register cap: Triton's `maxnreg` (PTX `.maxnreg`), set as the module attribute `ttg.maxnreg`, which
the conversion to LLVM turns into the kernel's register limit. Why: the decode kernel is
latency-bound at one warp per program with ~255 registers per thread, which leaves 8 warps per SM; a
cap can let more programs share an SM. Measured on the H200: every cap from 216 down to 168 on
one-warp programs was slower (spills; only <= 168 adds a warp per scheduler;
benchmarks/results/2026-12-01_decode_maxnreg_h200.md), but two-warp programs capped at 128 registers
are faster for small batches and 4-bit values, so the decode kernel's default launch uses them there
(`paged_decode_pallas.default_launch`; benchmarks/results/2026-12-01_decode_zero_term_h200.md).
Without this hook that launch falls back to one uncapped warp; an explicit `maxnreg=N` raises instead.

Fused multiply-adds: `fuse_multiply_add`. XLA compiles the Triton kernels it is handed with LLVM's
standard FP contraction, which fuses only operations marked contractable, and Triton's lowering
drops MLIR's fastmath flags - so on the GPU none of our kernels' multiplies and adds became an FFMA
(Nsight Compute: 0 fused instructions), where pip Triton fuses them all. The rewrite makes the
quantize kernels 4-5% faster on the H200; the decode kernel is left unfused (it got 4% slower at
B=32 / 32K, 3% faster at B=128 / 4K; benchmarks/results/2026-12-02_fused_multiply_add_h200.md).
"""

from __future__ import annotations

import re

_SUFFIX = re.compile(r"(_fma)?(?:_maxnreg(\d+))?$")
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


def _product_feeding(value, ir):
    """The `arith.mulf` that defines `value` when the product has no other use, else None."""
    owner = value.owner
    owner = getattr(owner, "operation", owner)
    if isinstance(owner, ir.Operation) and owner.name == "arith.mulf" and len(list(owner.results[0].uses)) == 1:
        return owner
    return None


def _negated(value, ir):
    """-value as `-0.0 - value` (exact, unlike 0 - value for value = +0; LLVM turns it into a
    negation, which ptxas folds into the FFMA's operand)."""
    t = value.type
    zero = ir.Attribute.parse(f"dense<-0.0> : {t}" if "tensor" in str(t) else "-0.0 : f32")
    c = ir.Operation.create("arith.constant", results=[t], attributes={"value": zero}).results[0]
    return ir.Operation.create("arith.subf", results=[t], operands=[c, value]).results[0]


def fuse_multiply_add(module_op) -> int:
    """Rewrite `a * b + c`, `a * b - c` and `c - a * b` (fp32, the product used only there) as
    `math.fma` in a Triton module; returns how many were rewritten.

    `math.fma` lowers to `fma.rn.f32` whatever the contraction setting. Rounding: once instead of
    twice. Products feeding a reduction stay unfused (their sum is inside `tt.reduce`, which LLVM
    would only contract with XLA's global `-fp-contract=fast`)."""
    from jax._src.lib.mlir import ir
    sums = []

    def collect(op):
        if op.name in ("arith.addf", "arith.subf") and \
                str(getattr(op.results[0].type, "element_type", op.results[0].type)) == "f32":
            sums.append(op)
        return ir.WalkResult.ADVANCE

    module_op.walk(collect)
    fused = 0
    for op in sums:
        lhs, rhs = op.operands[0], op.operands[1]
        mul, other, product_first = _product_feeding(lhs, ir), rhs, True
        if mul is None:
            mul, other, product_first = _product_feeding(rhs, ir), lhs, False
        if mul is None or mul.results[0].type != op.results[0].type:
            continue
        with ir.InsertionPoint(op), op.location:
            a, b = mul.operands[0], mul.operands[1]
            if op.name == "arith.subf":
                if product_first:   # a * b - c
                    other = _negated(other, ir)
                else:               # c - a * b
                    a = _negated(a, ir)
            fma = ir.Operation.create("math.fma", results=[op.results[0].type], operands=[a, b, other])
        op.results[0].replace_all_uses_with(fma.results[0])
        op.erase()
        mul.erase()
        fused += 1
    return fused


def install():
    """Wrap jax's lowering once (`kernel_name` does this when an option is asked for)."""
    global _installed
    if _installed:
        return
    lowering = _lowering_module()
    original = lowering.lower_jaxpr_to_triton_module

    def lower_with_options(*args, **kwargs):
        result = original(*args, **kwargs)
        op = result.module.operation
        name = str(op.attributes["sym_name"]).strip('"') if "sym_name" in op.attributes else ""
        fma, cap = _SUFFIX.search(name).groups()
        if fma or cap:
            from jax._src.lib.mlir import ir
            with op.context:
                if cap:
                    op.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), int(cap))
                if fma:
                    fuse_multiply_add(op)
        return result

    lowering.lower_jaxpr_to_triton_module = lower_with_options
    _installed = True


def kernel_name(base: str, maxnreg: int | None = None, fuse_fma: bool = False) -> str:
    """The name that carries these options (`base` unchanged without any).

    Raises if a cap is asked for and this jax's Pallas-Triton lowering is not the one the hook is
    attached to: the kernel would run uncapped, at a speed nobody measured. (Without the hook a
    kernel asking for fused multiply-adds runs unfused: the same results up to rounding.)"""
    if maxnreg is not None:
        if not isinstance(maxnreg, int) or not 24 <= maxnreg <= 255:
            raise ValueError(f"maxnreg must be an int in [24, 255] (registers per thread), got {maxnreg!r}")
        if not available():
            raise RuntimeError("maxnreg: this jax's Pallas-Triton lowering has no lower_jaxpr_to_triton_module to "
                               "attach a register cap to; do not pass maxnreg")
    if (maxnreg is not None or fuse_fma) and available():
        install()
    return base + ("_fma" if fuse_fma else "") + (f"_maxnreg{maxnreg}" if maxnreg is not None else "")


def register_cap(module_asm: str) -> int | None:
    """The cap a lowered Triton module (its text) carries, if any (for tests and tools)."""
    m = re.search(r'"?ttg\.maxnreg"?\s*=\s*(\d+)', module_asm)
    return int(m.group(1)) if m else None
