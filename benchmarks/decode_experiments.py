"""Kernel experiments for the GPU decode kernel: each variant (a dict of `paged_decode_pallas.EXP`
switches + warps) is checked against the reference and timed at a few shapes, in one process.

    python benchmarks/decode_experiments.py --variants 'base={};t={"tcodes":2}' --shapes 32x32768 \
        --schemes kvarn_k4v2_g128 --warps 2,4 --json out.json

A variant with "tcodes" is timed on a cache whose tiled code fields are already stored transposed
(tcodes=2) and checked through the public entry with the transpose done in the wrapper (tcodes=1).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import kvarn_jax as kj  # noqa: E402
from kvarn_jax.attention import paged_decode_pallas as pdp  # noqa: E402
from decode import copy_bandwidth, device_time, kernel_bytes, random_cache  # noqa: E402


def transposed(cache):
    pages = {side: {n: (jnp.swapaxes(a, -1, -2) if n == "codes" else a) for n, a in f.items()}
             for side, f in cache.pages.items()}
    return dataclasses.replace(cache, pages=pages)


INTERPRET = jax.default_backend() == "cpu"


def check(cfg, exp, warps, hq=32, hk=8, d=128, bs=128):
    errs = []
    for seed, lens in ((7, [4 * bs + 37, 3 * bs, bs - 5, 2 * bs + 1]), (8, [9 * bs + 1, 2 * bs + 100, 5 * bs, 130])):
        cache, tables, _ = random_cache(cfg, 4, max(lens), hk, d, bs, jnp.float16, seed=seed)
        lens = jnp.array(lens, jnp.int32)
        q = jax.random.normal(jax.random.PRNGKey(seed), (4, hq, d), jnp.float32)
        ref = kj.paged_decode_attention(q, cache, tables, lens, impl="reference")
        pdp.EXP.clear()
        pdp.EXP.update({k: (1 if k == "tcodes" else v) for k, v in exp.items()})
        qr = kj.hadamard.rotate(q) if kj.parse(cfg).rotated else q
        o = pdp.paged_decode_pallas(qr, cache, tables, lens, jnp.arange(4, dtype=jnp.int32), scale=1 / np.sqrt(d),
                                    window=None, num_warps=warps, interpret=INTERPRET)
        o = kj.hadamard.unrotate(o) if kj.parse(cfg).rotated else o
        pdp.EXP.clear()
        jax.clear_caches()
        errs.append(float(jnp.max(jnp.abs(o - ref)) / jnp.max(jnp.abs(ref))))
    return max(errs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True)
    p.add_argument("--shapes", default="32x32768,1x131072")
    p.add_argument("--schemes", default="kvarn_k4v2_g128")
    p.add_argument("--warps", default="2")
    p.add_argument("--json", default="")
    args = p.parse_args()
    variants = [(v.split("=", 1)[0], json.loads(v.split("=", 1)[1])) for v in args.variants.split(";") if v]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    warps = [int(w) for w in args.warps.split(",")]
    bw = copy_bandwidth()
    dev = jax.devices()[0]
    out = {"device": dev.device_kind, "jax": jax.__version__, "copy_bandwidth_Bps": bw,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rows": []}
    print(f"device {dev.device_kind}, jax {jax.__version__}, copy {bw / 1e12:.2f} TB/s", flush=True)
    for scheme in args.schemes.split(","):
        for name, exp in variants:
            for w in warps:
                err = check(scheme, exp, w)
                row = {"scheme": scheme, "variant": name, "exp": exp, "warps": w, "max_err_rel": err, "times": {}}
                for batch, ctx in shapes:
                    cache, tables, lens = random_cache(scheme, batch, ctx, 8, 128, 128, jnp.float16)
                    nbytes = kernel_bytes(cache, batch, ctx)
                    if exp.get("tcodes"):
                        cache = transposed(cache)
                    q = jax.random.normal(jax.random.PRNGKey(9), (batch, 32, 128), jnp.float16)
                    sid = jnp.arange(batch, dtype=jnp.int32)
                    pdp.EXP.clear()
                    pdp.EXP.update(exp)
                    fn = lambda q, c, t, l: pdp.paged_decode_pallas(q, c, t, l, sid, scale=1 / np.sqrt(128), window=None,
                                                                     num_warps=w, interpret=INTERPRET)
                    t = device_time(fn, (q, cache, tables, lens))
                    pdp.EXP.clear()
                    jax.clear_caches()
                    row["times"][f"{batch}x{ctx}"] = {"s": t, "roofline_frac": nbytes / bw / t}
                    del cache
                out["rows"].append(row)
                ts = "  ".join(f"{k}: {v['s'] * 1e3:.3f} ms ({100 * v['roofline_frac']:.0f}%)" for k, v in row["times"].items())
                print(f"{scheme:<16s} {name:<10s} w{w}  err {err:.1e}  {ts}", flush=True)
                if args.json:  # after every row, so a run cut short still leaves its numbers
                    with open(args.json, "w") as f:
                        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
