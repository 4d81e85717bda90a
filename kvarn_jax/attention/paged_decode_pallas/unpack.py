"""Packed codes -> fp16 inside the kernel, without int -> float conversions (docs/kernels.md,
"Products on raw codes"): a jnp version that runs anywhere and a PTX version for NVIDIA GPUs that
gives the same bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def f16(x):
    return x.astype(jnp.float16)


def magic(bits: int, j: int) -> int:
    """fp16 bit pattern of 2^(10 - j*bits). OR-ing bit plane j of a code byte *in place* (no shift)
    into it gives exactly 2^(10 - j*bits) + code: those bits then sit in the mantissa where one unit
    is worth 1. One logic op and one fp16 subtraction per two codes; int -> float conversions run at
    a fraction of the rate of integer logic on NVIDIA GPUs."""
    return (25 - j * bits) << 10


def planes(c, bits: int, biased: bool = False):
    """Bit planes of packed codes as fp16: plane j holds element j of every byte (bit shift j*bits),
    i.e. elements j, j + 8/bits, ... of the packed axis. Working plane by plane avoids re-interleaving
    codes in registers; the order is restored outside the inner products. biased: return
    magic + code (the caller removes magic times the other operand's sum)."""
    out = []
    for j in range(8 // bits):
        mask = ((1 << bits) - 1) << (j * bits)
        v = jnp.bitwise_or(jnp.bitwise_and(c, jnp.uint8(mask)).astype(jnp.uint16), jnp.uint16(magic(bits, j)))
        v = lax.bitcast_convert_type(v, jnp.float16)
        out.append(v if biased else v - jnp.float16(2.0 ** (10 - j * bits)))
    return out


def planes_ptx(c, bits: int, biased: bool = False):
    """`planes` in PTX (NVIDIA GPUs only; bit-identical). One asm spreads 4 code bytes into the
    16-bit halves of two registers (two `prmt`, once for all planes); then per plane and pair of
    codes one `lop3` ((t & mask) | magic) and one `sub.f16x2` removing the magic. Triton's inline
    asm returns one result per call, hence the two steps."""
    from jax.experimental.pallas import triton as plgpu
    # 8-bit codes (one plane): the spread itself puts the magic's high byte 0x64 above each code
    # (fp16 0x64cc = 1024 + c), so no `lop3` is needed
    whole = bits == 8
    fill = 0x64646464 if whole else 0
    spread = ("{ .reg .b32 z; " + f"mov.b32 z, {fill:#x}; "
              + "prmt.b32 $0, $2, z, 0x4140; prmt.b32 $1, $2, z, 0x4342; }")
    (wide,) = plgpu.elementwise_inline_asm(spread, args=[c], constraints="=r,=r,r", pack=4,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(
                                               c.shape, jnp.float16 if whole else jnp.int16)])
    out = []
    for j in range(8 // bits):
        mask16 = ((1 << bits) - 1) << (j * bits)
        mg = magic(bits, j)
        if whole and biased:  # already magic + code
            out.append(wide)
            continue
        if whole:
            asm = "{ .reg .b32 m; " + f"mov.b32 m, {mg | (mg << 16)}; sub.rn.f16x2 $0, $1, m; " + "}"
        elif biased:  # magic + code: the caller removes magic * (sum of the other operand)
            asm = f"lop3.b32 $0, $1, {mask16 | (mask16 << 16)}, {mg | (mg << 16)}, 0xEA;"
        else:
            asm = ("{ .reg .b32 t, m; " + f"mov.b32 m, {mg | (mg << 16)}; "
                   + f"lop3.b32 t, $1, {mask16 | (mask16 << 16)}, m, 0xEA; sub.rn.f16x2 $0, t, m; " + "}")
        (v,) = plgpu.elementwise_inline_asm(asm, args=[wide], constraints="=r,r", pack=2,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float16)])
        out.append(v)
    return out


def fp8_codes(c):
    """e4m3 codes -> fp16 (exact: every e4m3 value is an fp16 value), the products' input type."""
    return lax.bitcast_convert_type(c, jnp.float8_e4m3fn).astype(jnp.float16)
