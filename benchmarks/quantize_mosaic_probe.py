"""Probe: KVarN's Sinkhorn for one 128 x 128 tile per warpgroup in Mosaic GPU (`plgpu.kernel`).

    python benchmarks/quantize_mosaic_probe.py [--tiles 16384] [--variants replicated,compact] [--json out.json]  # H100/H200
    python benchmarks/quantize_mosaic_probe.py --lower        # any machine: lower for CUDA only
    python benchmarks/quantize_mosaic_probe.py --interpret    # any machine: the GPU interpreter, 8 tiles

The Pallas-Triton quantize kernel (`kvarn_jax/cache/quantize_pallas.py`) is 4.3x short of the speed
issue's 1,000 M token-heads/s because Triton replicates the Sinkhorn's 128-long row and column
statistics over the threads that share them, a layout Pallas' Triton lowering gives no say over
(`benchmarks/results/2026-12-02_quantize_sinkhorn_layout_offline.md`). Mosaic GPU takes explicit
register layouts. This probe is the Sinkhorn alone (`kvarn.sinkhorn_log_scales`: the part that
costs), one warpgroup holding a tile in the WGMMA register layout, before any product kernel is
built on it: it checks the log-scales against the reference and times the kernel, so a session with
a GPU can tell whether the path reaches the target. Two variants (`build`): the statistics' vector
math in the layouts the reductions leave (a column statistic on 32 threads, 32 values a thread), or
each statistic moved through shared memory to one value per thread and back.

The GPU interpreter of jax 0.10.2 runs no layout-annotated load, so interpreted the tile is read
with a plain load (same arithmetic, no layouts); `--lower` checks the layouts on any machine.
Nothing in the library calls this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvarn_jax.schemes import kvarn  # noqa: E402

R = C = 128


_var = kvarn._var_from_sums


def _sqrt(x):
    return jnp.exp2(0.5 * jnp.log2(x))  # Mosaic GPU lowers no scalar sqrt (jax 0.10.2)


def _imbalance(col, row):
    """`kvarn._imbalance` with the square roots above."""
    return (_sqrt(jnp.max(col) / jnp.maximum(jnp.min(col), 1e-16))
            + _sqrt(jnp.max(row) / jnp.maximum(jnp.min(row), 1e-16)))


def _log2_std(var):
    return kvarn._log2_std(var, jnp.log2)


def _identity(v, side):
    return v


def sinkhorn_tile(t, iters: int, compact=_identity, spread=_identity):
    """`kvarn.sinkhorn_log_scales` of one [R, C] fp32 tile, written with the broadcasts Mosaic GPU
    lowers (`broadcast_in_dim`, not `x[:, None]`) and t^2 formed inside each reduction.
    compact(v, side): a row ("r") or column ("c") statistic as the reduction left it -> the layout
    its vector math runs in; spread(v, side): back, for the broadcast over the tile."""
    rows = lambda v: lax.broadcast_in_dim(spread(v, "r"), (R, C), (0,))  # noqa: E731  [R] over the tile
    cols = lambda v: lax.broadcast_in_dim(spread(v, "c"), (R, C), (1,))  # noqa: E731  [C] over the tile
    csum = lambda x: compact(jnp.sum(x, axis=0), "c")  # noqa: E731
    rsum = lambda x: compact(jnp.sum(x, axis=1), "r")  # noqa: E731
    col = _var(csum(t), csum(t * t), R)
    row = _var(rsum(t), rsum(t * t), C)
    lc = jnp.zeros((C,), jnp.float32)
    lr = jnp.zeros((R,), jnp.float32)
    best_lc, best_lr, best_imb = lc, lr, _imbalance(col, row)
    for _ in range(iters):
        lc = jnp.clip(lc + _log2_std(col), kvarn.LOG_LO, kvarn.LOG_HI)
        a = jnp.exp2(-lc)
        ab, a2b = cols(a), cols(a * a)
        r_var = _var(rsum(t * ab), rsum(t * t * a2b), C)  # rows' moments: a only
        lr = jnp.clip(lr + _log2_std(jnp.exp2(-2.0 * lr) * r_var), kvarn.LOG_LO, kvarn.LOG_HI)
        b = jnp.exp2(-lr)
        bb, b2b = rows(b), rows(b * b)
        col = (a * a) * _var(csum(t * bb), csum(t * t * b2b), R)
        imb = _imbalance(col, (b * b) * r_var)
        better = imb <= best_imb * (1.0 + kvarn.TIE_RTOL)
        best_lc = jnp.where(better, lc, best_lc)
        best_lr = jnp.where(better, lr, best_lr)
        best_imb = jnp.where(better, imb, best_imb)
    return best_lc, best_lr


VARIANTS = ("replicated", "compact")


def _reduced_layout(axis: int):
    """The layout `sum(axis)` of a WGMMA-layout tile leaves, as a Pallas layout (for loads)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu
    r = mgpu.WGMMA_LAYOUT.reduce((axis,))
    return plgpu.Layout.TILED(r.tiling, r.warp_dims, r.lane_dims, r.vector_dim)


def build(n_tiles: int, iters: int, interpret: bool, variant: str = "replicated"):
    """variant: "replicated" - the statistics' vector math in the layouts the reductions leave (a
    column statistic: 32 values a thread, each on 32 threads; a row one: 4); "compact" - every
    statistic through shared memory into one value per thread for its vector math and back for the
    broadcast (Mosaic GPU converts between these register layouts only that way; the stores carry
    the lowering's automatic barriers)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")

    def body(x_gmem, lc_gmem, lr_gmem, x_smem, v_smem, bar):
        i = lax.axis_index("tiles")
        plgpu.copy_gmem_to_smem(x_gmem.at[i], x_smem, bar)
        plgpu.barrier_wait(bar)
        t = x_smem[...] if interpret else plgpu.load(x_smem, (), layout=plgpu.Layout.WGMMA, optimized=False)
        hooks = {}
        if variant == "compact":
            def compact(v, side):
                v_smem[...] = v
                return v_smem[...]          # the default (strided) layout: one value a thread

            def spread(v, side):
                v_smem[...] = v
                if interpret:
                    return v_smem[...]
                return plgpu.load(v_smem, (), layout=_reduced_layout(1 if side == "r" else 0), optimized=False)
            hooks = dict(compact=compact, spread=spread)
        lc, lr = sinkhorn_tile(t, iters, **hooks)
        lc_gmem[i] = lc
        lr_gmem[i] = lr

    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not public in 0.10.2
        kw["interpret"] = InterpretGPUParams()
    return plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct((n_tiles, C), jnp.float32),
                                        jax.ShapeDtypeStruct((n_tiles, R), jnp.float32)),
                        scratch_types=[plgpu.SMEM((R, C), jnp.float32), plgpu.SMEM((R,), jnp.float32),
                                       plgpu.Barrier()],
                        grid=(n_tiles,), grid_names=("tiles",), **kw)


def tiles(n: int, seed: int = 0):
    """Tiles like rotated keys: normal values with per-channel (row) and per-token (column) scales."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k[0], (n, R, C), jnp.float32)
    return x * jnp.exp(jax.random.normal(k[1], (n, R, 1))) * jnp.exp(0.3 * jax.random.normal(k[2], (n, 1, C)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", type=int, default=16384, help="tiles per call (16384 = the quantize benchmark's K and V)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--lower", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default="")
    a = p.parse_args()
    n = 8 if a.interpret else a.tiles
    x = tiles(n)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tiles": n, "iters": a.iters,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "variants": {}}
    rlc, rlr = jax.jit(lambda x: kvarn.sinkhorn_log_scales(x, a.iters))(x)
    for var in a.variants.split(","):
        f = build(n, a.iters, a.interpret, var)
        if a.lower:
            jax.jit(f).trace(jax.ShapeDtypeStruct(x.shape, x.dtype)).lower(lowering_platforms=("cuda",))
            print(f"{var}: lowered for CUDA")
            continue
        lc, lr = jax.jit(f)(x)
        d = np.maximum(np.abs(np.asarray(lc - rlc)).max(-1), np.abs(np.asarray(lr - rlr)).max(-1))  # per tile
        row = res["variants"][var] = {"max_log2_scale_diff": float(d.max()), "tiles_within_1e-3": float(np.mean(d <= 1e-3))}
        print(f"{var}: log2-scale difference vs the reference: max {d.max():.2e}, "
              f"tiles within 1e-3: {np.mean(d <= 1e-3):.4f}", flush=True)
        if not a.interpret:
            from decode import profile_span
            span = profile_span(f, (x,))
            if span is not None:
                s = span[0]
                row.update(span_ms=s * 1e3, tiles_per_s=n / s, token_heads_per_s=n / 2 * 128 / s)
                print(f"{var}: {n} tiles {s * 1e3:.3f} ms = {n / s / 1e6:.2f} M tiles/s "
                      f"= {n / 2 * 128 / s / 1e6:.0f} M token-heads/s (K and V tiles; Sinkhorn only)", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
