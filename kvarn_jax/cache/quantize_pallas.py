"""Quantize-on-write in Pallas: the tiles of the blocks a write completes -> their page fields.

Reference: `paged._quantize_blocks` (pure jnp), which calls the same scheme math
(`kvarn_jax.schemes.quantize_side`). Here that math runs inside a Pallas kernel, one program per
(completed block, kv head, tile), so the Hadamard-rotated tile, its Sinkhorn scales, codes and
packed bytes stay in registers and only the stored fields are written. The write path then stores
the fields into the (donated) cache pages, in place.

On NVIDIA GPUs it lowers through Triton; `interpret=True` runs it anywhere (how CI checks it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import schemes, triton_options
from ..schemes.arith import JNP, Arith
from ..config import KVQuantConfig
from ..validation import is_power_of_two as _pow2

TOKEN_CHUNK = 64  # tokens per program for per-token schemes


def supports(cfg: KVQuantConfig, block_size: int, head_dim: int) -> str | None:
    """None if the kernel can quantize this cache's blocks, else the reason."""
    if not _pow2(block_size) or not _pow2(head_dim):
        return f"block_size={block_size}, head_dim={head_dim} (the kernel needs powers of two)"
    return None


def default_num_warps(cfg: KVQuantConfig) -> int:
    """Warps per program, from the H200 sweep (benchmarks/results/2026-11-29_quantize_warps_h200.md):
    a 128x128 fp32 tile held by 4 warps spills registers; 16 warps quantize KVarN 3x faster."""
    return 8 if cfg.method == "int" else 16


def _lg2_approx(x):
    """log2 in one PTX instruction (`lg2.approx.f32`, abs. error ~2^-22 on [1e-6, 1e6]) instead of
    libdevice's logf polynomial: KVarN's Sinkhorn takes ~2 logs per row and column per iteration."""
    from jax.experimental.pallas import triton as plgpu
    (y,) = plgpu.elementwise_inline_asm("lg2.approx.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return y


def _div_rn(a, b):
    """IEEE fp32 division (`div.rn.f32`, as NumPy and XLA's CPU backend divide): Triton lowers `/`
    to the approximate `div.full.f32`, whose codes differed from the CPU reference's at exact .5
    quotients on the H200. Blocks only: Triton rejects inline asm on scalars (no scheme divides
    scalars with it; `tests/test_kernels_lower_for_gpu.py` checks)."""
    from jax.experimental.pallas import triton as plgpu
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    (y,) = plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return y


GPU_ARITH = Arith(log2=_lg2_approx, div=_div_rn)
# KVarN keeps Triton's approximate division: its codes are compared with the reference's allowing
# near-tie flips anyway (its Sinkhorn sums run in another order), and `div.rn` there cost 8% more
# instructions offline (5.06 ms on the H200 for the benchmark's 1.05 M token-heads, against 4.50
# ms the session before: benchmarks/results/2026-12-01_quantize_parity_h200.md).
GPU_ARITH_KVARN = Arith(log2=_lg2_approx)


def _kernel(*refs, cfg, side, names, has_static, gpu_arith, dtype):
    x_ref = refs[0]
    static = {n: r[...] for n, r in zip(has_static, refs[1:1 + len(has_static)])}
    outs = refs[1 + len(has_static):]
    # the loaded per-head params ([D] int, [1] fp8) line up with the tile like canonical ones do
    fields = schemes.quantize_side(x_ref[...], cfg, side, schemes.expand_static(cfg, static, 0) if cfg.static else None,
                                   ar=(GPU_ARITH_KVARN if cfg.method == "kvarn" else GPU_ARITH) if gpu_arith else JNP,
                                   dtype=dtype)
    for n, o in zip(names, outs):
        o[...] = fields[n].astype(o.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "side", "interpret", "num_warps", "maxnreg", "dtype"))
def quantize_blocks_pallas(blocks: jnp.ndarray, static: dict | None, *, cfg: KVQuantConfig, side: str,
                           interpret: bool = False, num_warps: int | None = None, maxnreg: int | None = None,
                           dtype: str = "float16") -> dict:
    """blocks [M, Hk, block_size, D] (storage frame) -> fields {name: [M, Hk, tiles_per_block, ...]}.
    dtype: the cache's model dtype (its scales' dtype, `schemes.side_fields`)."""
    m, hk, bs, d = blocks.shape
    g = cfg.tile_tokens
    tiled = g > 1
    t = g if tiled else min(TOKEN_CHUNK, bs)
    n_t = bs // t
    x = blocks.reshape(m, hk, n_t, t, d)
    fields = schemes.side_fields(cfg, side, d, dtype)
    names = sorted(fields)
    # per-token schemes: one program quantizes t tokens, so each field gets a token axis
    out_tile = {n: (fields[n][0] if tiled else (t,) + fields[n][0]) for n in names}
    out_shape = [jax.ShapeDtypeStruct((m, hk, n_t) + out_tile[n], fields[n][1]) for n in names]
    out_specs = [pl.BlockSpec((None, None, None) + out_tile[n],
                              lambda i, h, j, nd=len(out_tile[n]): (i, h, j) + (0,) * nd) for n in names]
    operands = [x]
    in_specs = [pl.BlockSpec((None, None, None, t, d), lambda i, h, j: (i, h, j, 0, 0))]
    has_static = sorted(static) if static else []
    for n in has_static:
        a = static[n].reshape(hk, -1)  # int: [Hk, D]; fp8: [Hk] -> [Hk, 1]
        operands.append(a)
        in_specs.append(pl.BlockSpec((None, a.shape[1]), lambda i, h, j: (h, 0)))
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps or default_num_warps(cfg), num_stages=1)
    kernel = functools.partial(_kernel, cfg=cfg, side=side, names=names, has_static=has_static,
                               gpu_arith=not interpret, dtype=dtype)
    outs = pl.pallas_call(kernel,
                          grid=(m, hk, n_t), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, name=triton_options.kernel_name(f"kvarn_quantize_{cfg.name}_{side}", maxnreg),
                          **params)(*operands)
    res = {}
    for n, o in zip(names, outs):
        res[n] = o if tiled else o.reshape((m, hk, bs) + fields[n][0])
    return res
