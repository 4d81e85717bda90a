"""Quantize-on-write throughput: the Pallas kernel vs the jnp (XLA) path, in token-heads per second.

    python benchmarks/quantize.py [--schemes kvarn_k4v2_g128,...] [--blocks 1024] [--json out.json]

Quantizes `blocks` full blocks of 128 tokens x 8 kv heads x D=128 (fp16, random) per call, the
work a write does for the blocks it completes, and reports millions of token-heads per second for
both implementations plus how many stored codes differ between them (0 = bit-identical).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kvarn_jax as kj  # noqa: E402
from kvarn_jax.cache import paged  # noqa: E402
from kvarn_jax.cache.quantize_pallas import quantize_blocks_pallas  # noqa: E402


def timed(f, *args, reps=10):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--schemes", default="kvarn_k4v2_g128,kvarn_k4v4_g128,int8,int4,fp8")
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--json", default="")
    args = p.parse_args()
    interpret = jax.default_backend() == "cpu"
    hk, bs, d = 8, 128, 128
    x = jax.random.normal(jax.random.PRNGKey(0), (args.blocks, hk, bs, d), jnp.float16)
    th = args.blocks * hk * bs
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "blocks": args.blocks,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rows": []}
    print(f"device {res['device']}; {th / 1e6:.2f} M token-heads per call")
    for s in args.schemes.split(","):
        cfg = kj.parse(s)
        cache = kj.PagedKVCache.create(cfg, num_blocks=1, block_size=bs, num_kv_heads=hk, head_dim=d, max_seqs=1)
        ref = jax.jit(lambda x: {side: paged._quantize_blocks(cache, side, x) for side in ("k", "v")})
        ker = jax.jit(lambda x: {side: quantize_blocks_pallas(x, None, cfg=cfg, side=side, interpret=interpret)
                                 for side in ("k", "v")})
        a, b = ref(x), ker(x)
        diff = sum(int(jnp.sum(a[sd]["codes"] != b[sd]["codes"])) for sd in ("k", "v"))
        t_ref, t_ker = timed(ref, x), timed(ker, x)
        row = {"scheme": s, "kernel_s": t_ker, "xla_s": t_ref, "kernel_Mtokheads_per_s": th / t_ker / 1e6,
               "xla_Mtokheads_per_s": th / t_ref / 1e6, "differing_code_bytes": diff}
        res["rows"].append(row)
        print(f"  {s:<18s} kernel {t_ker * 1e3:8.3f} ms = {row['kernel_Mtokheads_per_s']:8.0f} M tok-heads/s | "
              f"XLA {t_ref * 1e3:8.3f} ms = {row['xla_Mtokheads_per_s']:8.0f} M/s | differing code bytes {diff}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
