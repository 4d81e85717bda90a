"""Where do the Pallas quantize kernel and the jnp path disagree on this device, and who is right?

    python3 benchmarks/tools/quantize_parity.py [--json out.json]

For keys of 64 random blocks (fp16, 8 kv heads x 128 tokens x D=128, per-channel magnitudes
spread over e^N(0,1)) it quantizes with the kernel (compiled on this device), with the jnp path
jitted for this device (XLA) and with the jnp path jitted for the CPU (IEEE division), and counts
the differing stored values pairwise per field. On the H200 (2026-12-01) XLA's GPU division was
the odd one out: int8 codes kernel vs CPU 99 of 8.4 M, XLA vs CPU 186 K
(benchmarks/results/2026-12-01_quantize_parity_h200.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository
import kvarn_jax as kj  # noqa: E402
from kvarn_jax import schemes  # noqa: E402
from kvarn_jax.cache.quantize_pallas import quantize_blocks_pallas  # noqa: E402


def bits_of(a):
    a = np.asarray(a).reshape(-1)
    return a.view(np.uint8 if a.dtype == np.uint8 else np.uint16)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--schemes", default="int8,int4,kivi_k2v4_g32,fp8")
    p.add_argument("--json", default="")
    args = p.parse_args()
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 8, 128, 128)) * np.exp(rng.standard_normal((1, 8, 1, 128)))).astype(np.float16)
    out = {"device": jax.devices()[0].device_kind, "rows": []}
    for name in args.schemes.split(","):
        cfg = kj.parse(name)
        g = cfg.tile_tokens
        xs = jnp.asarray(x)
        tiles = xs if g == 1 else xs.reshape(64, 8, 128 // g, g, 128)
        side_fn = jax.jit(lambda t: schemes.quantize_side(t, cfg, "k"))
        f_ker = quantize_blocks_pallas(xs, None, cfg=cfg, side="k", interpret=jax.default_backend() == "cpu")
        f_xla = side_fn(tiles)
        f_cpu = side_fn(jax.device_put(tiles, cpu))
        for n in sorted(f_ker):
            a, b, c = bits_of(f_ker[n]), bits_of(f_xla[n]), bits_of(f_cpu[n])
            row = {"scheme": name, "field": n, "n": int(a.size), "kernel_vs_xla": int((a != b).sum()),
                   "kernel_vs_cpu": int((a != c).sum()), "xla_vs_cpu": int((b != c).sum())}
            out["rows"].append(row)
            print(f"{name:14s} {n:6s} n={row['n']} kernel!=xla {row['kernel_vs_xla']} "
                  f"kernel!=cpu {row['kernel_vs_cpu']} xla!=cpu {row['xla_vs_cpu']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
