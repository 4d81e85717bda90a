"""Probe: KVarN's Sinkhorn for one 128 x 128 tile per warpgroup in Mosaic GPU (`plgpu.kernel`).

    python benchmarks/quantize_mosaic_probe.py [--tiles 16384] [--variants compact,hybrid-rolled] [--json out.json]  # H100/H200
    python benchmarks/quantize_mosaic_probe.py --lower        # any machine: lower for CUDA only
    python benchmarks/quantize_mosaic_probe.py --interpret    # any machine: the GPU interpreter, 8 tiles

The Pallas-Triton quantize kernel (`kvarn_jax/cache/quantize_pallas.py`) is 4.3x short of the speed
issue's 1,000 M token-heads/s because Triton replicates the Sinkhorn's 128-long row and column
statistics over the threads that share them, a layout Pallas' Triton lowering gives no say over
(`benchmarks/results/2026-12-02_quantize_sinkhorn_layout_offline.md`). Mosaic GPU takes explicit
register layouts. This probe is the Sinkhorn alone (`kvarn.sinkhorn_log_scales`: the part that
costs), one warpgroup holding a tile in the WGMMA register layout, before any product kernel is
built on it: it checks the log-scales against the reference and times the kernel, so a session with
a GPU can tell whether the path reaches the target. Variants (`build`): the statistics' vector
math in the layouts the reductions leave (a column statistic on 32 threads, 32 values a thread),
each statistic moved through shared memory to one value per thread and back, or only the column
ones (hybrid); each also as a rolled loop. On the H200 (jax 0.11.2) the best, hybrid-rolled, does
346 M token-heads/s for the Sinkhorn alone, against 239 M for the whole Triton kernel: too little
for the 1,000 M target (`benchmarks/results/2026-12-04_quantize_mosaic_gpu_probe_h200.md`).

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


def _identity2(s1, s2, side):
    return s1, s2


def sinkhorn_tile(t, iters: int, compact=_identity2, spread=_identity, fused_squares=False, rolled=False):
    """`kvarn.sinkhorn_log_scales` of one [R, C] fp32 tile, written with the broadcasts Mosaic GPU
    lowers (`broadcast_in_dim`, not `x[:, None]`) and t^2 formed inside each reduction.
    compact(s1, s2, side): a row ("r") or column ("c") statistic's two sums as the reductions left
    them -> the layout its vector math runs in; spread(v, side): back, for the broadcast over the
    tile. fused_squares: the weighted second moments as sums of (t a)^2 over the product t a the
    first moments take (one multiply an element less and only a, not a^2, broadcast; equal to
    sum t^2 a^2 up to rounding). rolled: the iterations as a loop, not unrolled (8 unrolled
    iterations of 128-element tile passes overflow the instruction cache)."""
    rows = lambda v: lax.broadcast_in_dim(spread(v, "r"), (R, C), (0,))  # noqa: E731  [R] over the tile
    cols = lambda v: lax.broadcast_in_dim(spread(v, "c"), (R, C), (1,))  # noqa: E731  [C] over the tile

    def var(x, x2, axis):
        side = "c" if axis == 0 else "r"
        s1, s2 = compact(jnp.sum(x, axis=axis), jnp.sum(x2, axis=axis), side)
        return _var(s1, s2, R if axis == 0 else C)

    col = var(t, t * t, 0)
    row = var(t, t * t, 1)
    # zeros in the statistics' own layouts (a loop carries each value in one layout)
    lc, lr = col - col, row - row
    state = (lc, lr, col, lc, lr, _imbalance(col, row))

    def step(_, state):
        lc, lr, col, best_lc, best_lr, best_imb = state
        lc = jnp.clip(lc + _log2_std(col), kvarn.LOG_LO, kvarn.LOG_HI)
        a = jnp.exp2(-lc)
        if fused_squares:
            ta = t * cols(a)
            r_var = var(ta, ta * ta, 1)  # rows' moments: a only
        else:
            r_var = var(t * cols(a), t * t * cols(a * a), 1)
        lr = jnp.clip(lr + _log2_std(jnp.exp2(-2.0 * lr) * r_var), kvarn.LOG_LO, kvarn.LOG_HI)
        b = jnp.exp2(-lr)
        if fused_squares:
            tb = t * rows(b)
            col = (a * a) * var(tb, tb * tb, 0)
        else:
            col = (a * a) * var(t * rows(b), t * t * rows(b * b), 0)
        imb = _imbalance(col, (b * b) * r_var)
        better = imb <= best_imb * (1.0 + kvarn.TIE_RTOL)
        return (lc, lr, col, jnp.where(better, lc, best_lc), jnp.where(better, lr, best_lr),
                jnp.where(better, imb, best_imb))

    if rolled:
        state = lax.fori_loop(0, iters, step, state)
    else:
        for i in range(iters):
            state = step(i, state)
    best_lc, best_lr = state[3], state[4]
    return best_lc, best_lr


VARIANTS = ("replicated", "compact", "hybrid", "hybrid-auto", "compact-rolled", "hybrid-rolled")


def _reduced_layout(axis: int):
    """The layout `sum(axis)` of a WGMMA-layout tile leaves, as a Pallas layout (for loads)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu
    r = mgpu.WGMMA_LAYOUT.reduce((axis,))
    return plgpu.Layout.TILED(r.tiling, r.warp_dims, r.lane_dims, r.vector_dim)


def build(n_tiles: int, iters: int, interpret: bool, variant: str = "replicated", scratch_bytes: int = 0):
    """variant: "replicated" - the statistics' vector math in the layouts the reductions leave (a
    column statistic: 32 values a thread, each on 32 threads; a row one: 4); "compact" - every
    statistic through shared memory into one value per thread for its vector math and back for the
    broadcast (Mosaic GPU converts between these register layouts only that way; each store
    carries the lowering's automatic barriers, one before and one after); "hybrid" - row
    statistics where the reductions leave them (4 a thread), the two column sums through shared
    memory together and the column scale back, behind one explicit barrier each
    (`commit_smem`, no automatic barriers; two buffers so that a write never races the other
    buffer's reads), and `fused_squares`; "hybrid-auto" - the same with the automatic barriers.
    scratch_bytes: shared memory for the cross-warp (column) reductions, 0 for the default."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    hybrid = variant.startswith("hybrid")
    explicit = variant in ("hybrid", "hybrid-rolled")
    rolled = variant.endswith("-rolled")

    def load(ref, layout):
        if interpret:  # the 0.10.2 interpreter runs no layout-annotated load
            return ref[...]
        return plgpu.load(ref, (), layout=layout, optimized=False)

    def kvarn_sinkhorn_probe(x_gmem, lc_gmem, lr_gmem, x_smem, v_smem, sums_smem, bar):
        i = lax.axis_index("tiles")
        plgpu.copy_gmem_to_smem(x_gmem.at[i], x_smem, bar)
        plgpu.barrier_wait(bar)
        t = load(x_smem, plgpu.Layout.WGMMA)
        hooks = {}
        if variant.startswith("compact"):
            def compact(s1, s2, side):
                out = []
                for v in (s1, s2):
                    v_smem[...] = v
                    out.append(v_smem[...])   # the default (strided) layout: one value a thread
                return tuple(out)

            def spread(v, side):
                v_smem[...] = v
                return load(v_smem, _reduced_layout(1 if side == "r" else 0))
            hooks = dict(compact=compact, spread=spread, rolled=rolled)
        elif hybrid:
            def sync():
                if explicit and not interpret:
                    plgpu.commit_smem()

            def compact(s1, s2, side):
                if side == "r":
                    return s1, s2
                sums_smem[0] = s1
                sums_smem[1] = s2
                sync()
                return sums_smem[0], sums_smem[1]

            def spread(v, side):
                if side == "r":
                    return v
                v_smem[...] = v
                sync()
                return load(v_smem, _reduced_layout(0))
            hooks = dict(compact=compact, spread=spread, fused_squares=True, rolled=rolled)
        lc, lr = sinkhorn_tile(t, iters, **hooks)
        lc_gmem[i] = lc
        lr_gmem[i] = lr

    # Lane semantics: the layouts written here are the kernel's (jax 0.11 defaults to Warpgroup
    # semantics, whose layout inference takes no select of a scalar over a vector).
    params = dict(lowering_semantics=mgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=explicit)
    if scratch_bytes:
        params["reduction_scratch_bytes"] = scratch_bytes
    kw = dict(compiler_params=plgpu.CompilerParams(**params))
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not public in 0.10.2
        kw["interpret"] = InterpretGPUParams()
    return plgpu.kernel(kvarn_sinkhorn_probe, out_type=(jax.ShapeDtypeStruct((n_tiles, C), jnp.float32),
                                        jax.ShapeDtypeStruct((n_tiles, R), jnp.float32)),
                        scratch_types=[plgpu.SMEM((R, C), jnp.float32), plgpu.SMEM((R,), jnp.float32),
                                       plgpu.SMEM((2, C), jnp.float32), plgpu.Barrier()],
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
    p.add_argument("--scratch-bytes", default="0", help="comma list of reduction_scratch_bytes to time (0: default)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    n = 8 if a.interpret else a.tiles
    x = tiles(n)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tiles": n, "iters": a.iters,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "variants": {}}
    rlc, rlr = jax.jit(lambda x: kvarn.sinkhorn_log_scales(x, a.iters))(x)
    runs = [(v, int(sb)) for v in a.variants.split(",") for sb in a.scratch_bytes.split(",")]
    for v, sb in runs:
        var = v if sb == 0 else f"{v}/scratch{sb}"
        f = build(n, a.iters, a.interpret, v, sb)
        if a.lower:
            jax.jit(f).trace(jax.ShapeDtypeStruct(x.shape, x.dtype)).lower(lowering_platforms=("cuda",))
            print(f"{var}: lowered for CUDA")
            continue
        try:
            lc, lr = jax.jit(f)(x)
        except Exception as e:  # a probe: record what this jax's lowering refuses and try the next
            res["variants"][var] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{var}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
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
