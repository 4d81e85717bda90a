"""Micro-benchmark: how fast can a Pallas (Triton) decode loop read quantized pages, by layout?

    python benchmarks/load_pattern.py [--batch 32 --ctx 32768]

Each program walks one (sequence, kv head)'s blocks through a shuffled block table and reads
every byte of each kvarn_k4v2_g128 tile (13,824 B), summing them so no load is dead. Layouts:
  fields:  the cache's current layout, 8 arrays per side-field ([nb, Hk, ...] each), some small
           vectors read through strided views as the decode kernel does;
  record:  one uint8 array [nb, Hk, 112, 128] per tile: K codes (64 rows), V codes (32 rows),
           fp16 metadata packed in 16 rows (12 used), read as 3 contiguous 2-D loads;
  record32: the same record viewed as uint32 words.
Prints ms per pass and the effective bandwidth; an upper bound for any decode kernel on that layout.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl


def run(kernel, operands, specs, grid, out_shape, interpret):
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=2)
    f = jax.jit(lambda *ops: pl.pallas_call(kernel, grid=grid, in_specs=specs,
                                            out_specs=pl.BlockSpec((None, None, None, 16), lambda b, h, s: (b, h, s, 0)),
                                            out_shape=out_shape, interpret=interpret, **params)(*ops))
    f(*operands).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        f(*operands).block_until_ready()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--hk", type=int, default=8)
    p.add_argument("--splits", default="1,4,16", help="programs per (sequence, kv head) along the blocks")
    args = p.parse_args()
    interpret = jax.default_backend() == "cpu"
    b, hk, g, d = args.batch, args.hk, 128, 128
    nbps = args.ctx // g
    nb = b * nbps
    key = jax.random.PRNGKey(0)
    rnd = lambda shape, dt: jax.random.randint(key, shape, 0, 255, jnp.int32).astype(dt)
    bt = jnp.asarray(np.random.default_rng(0).permutation(nb).astype(np.int32).reshape(b, nbps))
    full = lambda shape: pl.BlockSpec(shape, lambda i, h, s: (0,) * len(shape))
    head = lambda a: pl.BlockSpec((a.shape[0], None) + a.shape[2:], lambda i, h, s, nd=a.ndim - 2: (0, h) + (0,) * nd)
    tile_bytes = 13824

    # ---- fields layout (as the cache stores kvarn_k4v2_g128 pages, tiles_per_block = 1 squeezed)
    f = {"kc": rnd((nb, hk, d, 64), jnp.uint8), "ksc": rnd((nb, hk, d), jnp.float16),
         "kzc": rnd((nb, hk, d), jnp.float16), "kst": rnd((nb, hk, 64, 2), jnp.float16),
         "vc": rnd((nb, hk, 64, 2, 32), jnp.uint8), "vst": rnd((nb, hk, 64, 2), jnp.float16),
         "vzt": rnd((nb, hk, 64, 2), jnp.float16), "vsc": rnd((nb, hk, 32, 4), jnp.float16)}

    def fields_kernel(bt_ref, kc, ksc, kzc, kst, vc, vst, vzt, vsc, o_ref, *, per):
        i, sp = pl.program_id(0), pl.program_id(2)

        def body(t, acc):
            blk = bt_ref[i, t]
            s = jnp.sum(kc[blk].astype(jnp.float32)) + jnp.sum(ksc[blk].astype(jnp.float32))
            s += jnp.sum(kzc[blk].astype(jnp.float32))
            for j in range(2):
                s += jnp.sum(kst[blk, :, j].astype(jnp.float32)) + jnp.sum(vc[blk, :, j].astype(jnp.float32))
                s += jnp.sum(vst[blk, :, j].astype(jnp.float32)) + jnp.sum(vzt[blk, :, j].astype(jnp.float32))
            for n in range(4):
                s += jnp.sum(vsc[blk, :, n].astype(jnp.float32))
            return acc + s
        o_ref[...] = jnp.zeros((16,), jnp.float32) + lax.fori_loop(sp * per, (sp + 1) * per, body, jnp.float32(0))

    # ---- record layout: one [112, 128] uint8 tile (K codes 64 rows, V codes 32, metadata 16)
    def record_kernel(bt_ref, r, o_ref, *, per, word_mask=None):
        # word_mask: the record viewed as uint32 words (16-byte vector loads need 4 elements per
        # thread instead of 16); the mask keeps one byte per word so the sum stays cheap
        i, sp = pl.program_id(0), pl.program_id(2)
        cast = (lambda x: x.astype(jnp.float32)) if word_mask is None else (lambda x: (x & word_mask).astype(jnp.float32))

        def body(t, acc):
            blk = bt_ref[i, t]
            s = jnp.sum(cast(r[blk, pl.ds(0, 64)])) + jnp.sum(cast(r[blk, pl.ds(64, 32)]))
            return acc + s + jnp.sum(cast(r[blk, pl.ds(96, 16)]))
        o_ref[...] = jnp.zeros((16,), jnp.float32) + lax.fori_loop(sp * per, (sp + 1) * per, body, jnp.float32(0))

    ops = [bt] + list(f.values())
    rec = rnd((nb, hk, 112, 128), jnp.uint8)
    rec32 = lax.bitcast_convert_type(rec.reshape(nb, hk, 112, 32, 4), jnp.uint32)
    total = b * hk * nbps * tile_bytes
    print(f"B={b} L={args.ctx} Hk={hk}: {total / 1e9:.3f} GB of kvarn_k4v2_g128 tiles per pass")
    for ns in (int(x) for x in args.splits.split(",")):
        out_shape = jax.ShapeDtypeStruct((b, hk, ns, 16), jnp.float32)
        per = nbps // ns
        t_fields = run(functools.partial(fields_kernel, per=per), ops,
                       [full(bt.shape)] + [head(a) for a in f.values()], (b, hk, ns), out_shape, interpret)
        t_record = run(functools.partial(record_kernel, per=per), [bt, rec], [full(bt.shape), head(rec)],
                       (b, hk, ns), out_shape, interpret)
        t_record32 = run(functools.partial(record_kernel, per=per, word_mask=0xFF), [bt, rec32], [full(bt.shape), head(rec32)],
                         (b, hk, ns), out_shape, interpret)
        for name, t in (("fields", t_fields), ("record", t_record), ("record32", t_record32)):
            print(f"  splits={ns:<3d} {name:<7s} {t * 1e3:8.3f} ms   {total / t / 1e12:5.2f} TB/s")


if __name__ == "__main__":
    main()
