"""Decode kernel vs reference at full context: relative L2 of the output, every scheme, every shape.

    python benchmarks/tools/decode_accuracy.py [--shapes 32x32768,128x4096,...] [--schemes a,b,...]
        [--dtype float16|bfloat16|float32] [--old-fold kvarn_k4v2_g128,int8] [--time kvarn_k4v2_g128,...] [--target 0.005]
        [--json out.json] [--md out.md]

For each scheme one cache pool is filled, per shape, with B sequences of `ctx` tokens of random
normal K/V in the cache's dtype (`--dtype`, fp16 by default) through `write_reference` (completed
blocks quantized as serving quantizes them), and a random query [B, 32, 128] in that dtype attends
over it twice: `paged_decode_attention(impl="pallas")` (the default launch) and the reference
(`impl="reference"`, fp32 everywhere, computed a few rows at a time). Reported per (scheme, shape):
||kernel - reference|| / ||reference|| over the whole batch and the worst row's. `--old-fold`: the
same schemes also with the value products fed biased codes (`Launch(fold="all")`, the launch before
the fix that this script was written for), to show the drift it caused. `--time`: device time per
call (scan of dependent calls) of the default launch and of fold="all" for those schemes, so the
fix's cost is measured in the same run. Exit status 1 if any default launch is above `--target`. On
a CPU the kernel runs interpreted: use tiny shapes (`--shapes 2x1024 --chunk 1024`), a smoke run of
the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
import kvarn_jax as kj  # noqa: E402
from kvarn_jax.attention import paged_decode_pallas as pdp  # noqa: E402
from kvarn_jax.attention.reference import attend  # noqa: E402
from kvarn_jax.cache import paged  # noqa: E402
from kvarn_jax.hadamard import rotate, unrotate  # noqa: E402
from timing import device_time, markdown_table, run_info  # noqa: E402

SHAPES = "32x32768,128x4096,256x8192,8x16384,1x131072"
SCHEMES = ("kvarn_k4v2_g128,kvarn_k4v4_g128,kvarn_k4v2_g64,kvarn_k2v2_g32,kvarn_k8v8_g128,kivi_k2v2_g128,"
           "kivi_k4v4_g64,int8,int4,int2,int8_g32,int_k8v4,int8_static,fp8,fp8_static,fp16")
HQ, HK, D, BS = 32, 8, 128, 128


def parse_shapes(text):
    out = []
    for s in text.split(","):
        b, c = s.lower().split("x")
        out.append((int(b), int(c)))
    return out


def calibration_for(cfg, key, dtype):
    """Static schemes: ranges of a sample of the same distribution the cache is filled with."""
    if not cfg.static:
        return None
    k = jax.random.normal(key, (4096, HK, D), jnp.float32).astype(dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), (4096, HK, D), jnp.float32).astype(dtype)
    return kj.calibrate([(k, v)], cfg)


def make_writer(chunk, dtype):
    @jax.jit
    def gen(key):
        k = jax.random.normal(key, (chunk, HK, D), jnp.float32).astype(dtype)
        v = jax.random.normal(jax.random.fold_in(key, 1), (chunk, HK, D), jnp.float32).astype(dtype)
        return k, v
    return gen


def fill(cache, batch, ctx, chunk, seed, gen, write):
    """B sequences of ctx tokens (sequence b in sink/tail row b), `chunk` tokens per write call."""
    nblk = batch * ctx // BS
    rng = np.random.default_rng(seed)
    tables = rng.permutation(cache.num_blocks)[:nblk].astype(np.int32).reshape(batch, ctx // BS)
    rows = max(1, chunk // ctx)                    # sequences per call
    span = min(ctx, chunk)                         # positions per sequence per call
    key = jax.random.PRNGKey(seed)
    for r0 in range(0, batch, rows):
        for p0 in range(0, ctx, span):
            seq = np.repeat(np.arange(r0, r0 + rows), span)
            pos = np.tile(np.arange(p0, p0 + span), rows)
            slots = tables[seq, pos // BS] * BS + pos % BS
            key, sub = jax.random.split(key)
            k, v = gen(sub)
            cache = write(cache, k, v, jnp.asarray(slots, jnp.int32), jnp.asarray(seq, jnp.int32),
                          jnp.asarray(pos, jnp.int32))
    return cache, jnp.asarray(tables)


def reference(q, cache, tables, lens, rows_per_call):
    outs = []
    for i in range(0, q.shape[0], rows_per_call):
        j = min(q.shape[0], i + rows_per_call)
        outs.append(attend(q[i:j].astype(jnp.float32), cache, tables[i:j], lens[i:j], 1.0 / np.sqrt(D),
                           jnp.arange(i, j, dtype=jnp.int32), None, False))
    return jnp.concatenate(outs)


def kernel_fn(cfg, launch, interpret):
    """q [B, Hq, D] -> output [B, Hq, D] fp32: the kernel entry with a given launch (rotation around it)."""
    def fn(q, cache, tables, lens):
        qf = q.astype(jnp.float32)
        qr = rotate(qf) if cfg.rotated else qf
        o = pdp.paged_decode_pallas(qr, cache, tables, lens, None, scale=1.0 / np.sqrt(D), window=None,
                                    interpret=interpret, launch=launch)
        return unrotate(o) if cfg.rotated else o
    return jax.jit(fn)


def rel_l2(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    total = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    per_row = np.linalg.norm((out - ref).reshape(out.shape[0], -1), axis=1) / np.linalg.norm(
        ref.reshape(ref.shape[0], -1), axis=1)
    return total, float(per_row.max()), bool(np.isfinite(out).all())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="comma list of BATCHxCONTEXT (default: %(default)s)")
    p.add_argument("--schemes", default=SCHEMES, help="comma list of schemes (default: %(default)s)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                   help="the cache's dtype, and the K/V and query written to it (default: %(default)s)")
    p.add_argument("--old-fold", default="kvarn_k4v2_g128,int8",
                   help="schemes also measured with Launch(fold='all'), the biased value products ('' for none)")
    p.add_argument("--time", default="", help="schemes whose default and fold='all' launches are also timed")
    p.add_argument("--target", type=float, default=0.005, help="largest relative L2 accepted (default 0.5%%)")
    p.add_argument("--chunk", type=int, default=65536, help="tokens per cache write call")
    p.add_argument("--ref-tokens", type=int, default=262144, help="sequence tokens per reference call")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args()
    shapes = parse_shapes(args.shapes)
    schemes = [s for s in args.schemes.split(",") if s]
    old = {s for s in args.old_fold.split(",") if s}
    timed = {s for s in args.time.split(",") if s}
    interpret = jax.default_backend() == "cpu"
    for b, c in shapes:
        if c % BS or (b * c) % args.chunk or (c > args.chunk and c % args.chunk) or (c <= args.chunk and args.chunk % c):
            raise SystemExit(f"shape {b}x{c}: the context must be a multiple of {BS} and the tokens of whole "
                             f"write chunks of {args.chunk}")
    info = run_info()
    print(json.dumps(info))
    doc = {**info, "argv": sys.argv, "dtype": args.dtype, "target": args.target, "rows": []}
    dtype = jnp.dtype(args.dtype)
    gen = make_writer(args.chunk, dtype)
    pool_blocks = max(b * c // BS for b, c in shapes)
    pool_seqs = max(b for b, _ in shapes)
    table = []
    for name in schemes:
        cfg = kj.parse(name)
        cal = calibration_for(cfg, jax.random.PRNGKey(99), dtype)
        cache = kj.PagedKVCache.create(cfg, num_blocks=pool_blocks, block_size=BS, num_kv_heads=HK, head_dim=D,
                                       max_seqs=pool_seqs, dtype=dtype, calibration=cal)
        quantizer = paged.auto_quantizer(cache)
        write = jax.jit(lambda c, k, v, s, i, pos, q=quantizer: paged.write_reference(
            c, k, v, s, i, pos, quantizer=q, max_completed=args.chunk // BS), donate_argnums=0)
        variants = {"default": pdp.Launch()}
        if name in old and not cfg.is_passthrough and cfg.method != "fp8":
            variants["fold_all"] = pdp.Launch(fold="all")
        fns = {v: kernel_fn(cfg, launch, interpret) for v, launch in variants.items()}
        for b, c in shapes:
            t0 = time.perf_counter()
            cache, tables = fill(cache, b, c, args.chunk, seed=b * 7919 + c, gen=gen, write=write)
            lens = jnp.full((b,), c, jnp.int32)
            q = jax.random.normal(jax.random.PRNGKey(b + c), (b, HQ, D), jnp.float32).astype(dtype)
            ref = reference(q, cache, tables, lens, max(1, args.ref_tokens // c))
            row = {"scheme": name, "batch": b, "ctx": c, "dropped_tokens": int(cache.dropped_tokens)}
            for v, fn in fns.items():
                out = fn(q, cache, tables, lens)
                total, worst, finite = rel_l2(out, ref)
                row[v] = {"rel_l2": total, "worst_row_rel_l2": worst, "finite": finite}
                if name in timed:
                    row[v]["ms"] = device_time(fn, (q, cache, tables, lens)) * 1e3
            row["seconds"] = time.perf_counter() - t0
            doc["rows"].append(row)
            ok = row["default"]["rel_l2"] <= args.target and row["default"]["finite"] and row["dropped_tokens"] == 0
            line = (f"{name:18s} {b:4d} x {c:6d}: rel L2 {row['default']['rel_l2']:.2e} "
                    f"(worst row {row['default']['worst_row_rel_l2']:.2e})" + ("" if ok else "  ABOVE TARGET"))
            if "fold_all" in row:
                line += f"; fold='all' {row['fold_all']['rel_l2']:.2e}"
            if "ms" in row["default"]:
                line += f"; {row['default']['ms']:.4f} ms" + (
                    f" (fold='all' {row['fold_all']['ms']:.4f} ms)" if "fold_all" in row else "")
            print(line + f"  [{row['seconds']:.1f} s]", flush=True)
            table.append([name, f"{b} x {c}", f"{row['default']['rel_l2'] * 100:.3f}%",
                          f"{row['default']['worst_row_rel_l2'] * 100:.3f}%",
                          f"{row['fold_all']['rel_l2'] * 100:.3f}%" if "fold_all" in row else "-",
                          "yes" if ok else "NO"])
        del cache
    md = markdown_table(["scheme", "shape", "rel L2", "worst row", "fold='all' (before)", f"<= {args.target:.1%}"],
                        table)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    bad = [r for r in doc["rows"] if not (r["default"]["rel_l2"] <= args.target and r["default"]["finite"]
                                          and r["dropped_tokens"] == 0)]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
