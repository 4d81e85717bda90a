"""Quantize-on-write throughput: the Pallas kernel vs the jnp (XLA) path, in token-heads per second.

    python benchmarks/quantize.py [--schemes kvarn_k4v2_g128,...] [--blocks 1024] [--json out.json]

Quantizes `blocks` full blocks of 128 tokens x 8 kv heads x D=128 (fp16, random) per call, the
work a write does for the blocks it completes, and reports millions of token-heads per second for
both implementations plus how many stored code bytes differ between them (0 = bit-identical), as
a line per scheme and a markdown table at the end. `--write-seqs N` also times the public write
path (`kvarn_jax.write`, impl auto vs reference) prefilling N sequences. On CPU the kernel runs
interpreted: use a few blocks (a smoke run).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kvarn_jax as kj  # noqa: E402
from kvarn_jax import schemes  # noqa: E402
from kvarn_jax.cache.quantize_pallas import quantize_blocks_pallas, supports as quantize_supports  # noqa: E402
from kvarn_jax.impl import resolve_impl  # noqa: E402
from timing import markdown_table, run_info  # noqa: E402


def timed(f, *args, reps=10):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", default="kvarn_k4v2_g128,kvarn_k4v4_g128,int8,int4,fp8",
                   help="comma list of dynamic schemes (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=1024, help="blocks of 128 tokens x 8 kv heads per call (default: %(default)s)")
    p.add_argument("--warps", default="", help="comma list of launches to sweep, each num_warps or num_warps:maxnreg "
                                            "(a register cap per thread; default: the kernel's per-scheme default)")
    p.add_argument("--write-seqs", type=int, default=0,
                   help="also time kvarn_jax.write (impl auto vs reference) prefilling this many sequences")
    p.add_argument("--write-len", type=int, default=2048, help="tokens per sequence for --write-seqs")
    p.add_argument("--json", default="", help="write the measurements here")
    args = p.parse_args()
    interpret = jax.default_backend() == "cpu"
    hk, bs, d = 8, 128, 128
    x = jax.random.normal(jax.random.PRNGKey(0), (args.blocks, hk, bs, d), jnp.float16)
    th = args.blocks * hk * bs
    res = {**run_info(), "blocks": args.blocks, "rows": []}
    print(f"device {res['device']}; {th / 1e6:.2f} M token-heads per call")
    for s in args.schemes.split(","):
        cfg = kj.parse(s)
        if cfg.static or cfg.is_passthrough:
            p.error(f"--schemes: {s} has no write-time quantization to time (dynamic schemes only)")
        g = cfg.tile_tokens
        # the write path's jnp quantizer: blocks [M, Hk, bs, D] as tiles [M, Hk, bs/G, G, D] (G > 1)
        ref = jax.jit(lambda x, g=g: {side: schemes.quantize_side(
            x if g == 1 else x.reshape(x.shape[:2] + (bs // g, g, d)), cfg, side) for side in ("k", "v")})
        t_ref = timed(ref, x)
        by_launch = {}
        a = ref(x)
        for w in [v for v in args.warps.split(",") if v] or [None]:
            nw, cap = (int(w.split(":")[0]), int(w.split(":")[1]) if ":" in w else None) if w else (None, None)
            ker = jax.jit(lambda x, nw=nw, cap=cap: {side: quantize_blocks_pallas(
                x, None, cfg=cfg, side=side, interpret=interpret, num_warps=nw, maxnreg=cap) for side in ("k", "v")})
            b = ker(x)
            diff = sum(int(jnp.sum(a[sd]["codes"] != b[sd]["codes"])) for sd in ("k", "v"))
            by_launch[w] = (timed(ker, x), diff)
            print(f"    {s} kernel launch {w or 'default'}: {by_launch[w][0] * 1e3:.3f} ms, differing code bytes {diff}")
        best = min(by_launch, key=lambda w: by_launch[w][0])
        t_ker, diff = by_launch[best]
        row = {"scheme": s, "kernel_s": t_ker, "kernel_launch": best,
               "kernel_s_by_launch": {str(k or "default"): v[0] for k, v in by_launch.items()},
               "differing_code_bytes_by_launch": {str(k or "default"): v[1] for k, v in by_launch.items()},
               "xla_s": t_ref, "kernel_Mtokheads_per_s": th / t_ker / 1e6,
               "xla_Mtokheads_per_s": th / t_ref / 1e6, "differing_code_bytes": diff}
        res["rows"].append(row)
        print(f"  {s:<18s} kernel {t_ker * 1e3:8.3f} ms = {row['kernel_Mtokheads_per_s']:8.0f} M tok-heads/s | "
              f"XLA {t_ref * 1e3:8.3f} ms = {row['xla_Mtokheads_per_s']:8.0f} M/s | differing code bytes {diff}")
    print()
    print(markdown_table(["scheme", "Pallas kernel", "XLA (jnp path)", "code bytes differing"],
                         [[r["scheme"], f"{r['kernel_s'] * 1e3:.2f} ms = {r['kernel_Mtokheads_per_s']:,.0f} M token-heads/s",
                           f"{r['xla_s'] * 1e3:.2f} ms = {r['xla_Mtokheads_per_s']:,.0f} M/s", r["differing_code_bytes"]]
                          for r in res["rows"]]))
    if args.write_seqs:
        res["write"] = write_path(args, th_unit=hk)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


def write_path(args, th_unit):
    """Prefill through the public write path: impl="auto" vs "reference", time and differing pages."""
    hk, bs, d, n, length = th_unit, 128, 128, args.write_seqs, args.write_len
    blocks_per_seq = length // bs
    rows = []
    for s in args.schemes.split(","):
        cache = kj.PagedKVCache.create(s, num_blocks=n * blocks_per_seq, block_size=bs, num_kv_heads=hk,
                                       head_dim=d, max_seqs=n, dtype=jnp.float16)
        key = jax.random.PRNGKey(1)
        k = jax.random.normal(key, (n * length, hk, d), jnp.float16)
        v = jax.random.normal(jax.random.fold_in(key, 1), (n * length, hk, d), jnp.float16)
        perm = np.random.default_rng(0).permutation(n * blocks_per_seq).reshape(n, blocks_per_seq)
        pos = np.tile(np.arange(length), n)
        seq = np.repeat(np.arange(n), length)
        slots = jnp.asarray(perm[seq, pos // bs] * bs + pos % bs, jnp.int32)
        seq, pos = jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32)
        out, times = {}, {}
        auto = resolve_impl("auto", "write", kj.parse(s), quantize_supports(kj.parse(s), bs, d))
        for impl in ("auto", "reference"):
            f = jax.jit(lambda c, impl=impl: kj.write(c, k, v, slots, seq_ids=seq, positions=pos, impl=impl))
            out[impl] = f(cache)
            times[impl] = timed(f, cache)
        diff = sum(int(jnp.sum(out["auto"].pages[sd]["codes"] != out["reference"].pages[sd]["codes"]))
                   for sd in ("k", "v") if "codes" in out["auto"].pages[sd])
        row = {"scheme": s, "tokens": n * length, "auto_is": auto, "auto_s": times["auto"],
               "reference_s": times["reference"], "differing_code_bytes": diff}
        rows.append(row)
        print(f"  write {n}x{length} {s:<18s} auto ({auto}) {times['auto'] * 1e3:8.3f} ms | reference "
              f"{times['reference'] * 1e3:8.3f} ms | {n * length * hk / times['auto'] / 1e6:7.0f} M tok-heads/s (auto)"
              f" | differing code bytes {diff}")
    return rows


if __name__ == "__main__":
    main()
