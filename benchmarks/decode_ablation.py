"""Where does the quantized decode kernel spend its time? Time it with parts removed.

    python benchmarks/decode_ablation.py [--scheme kvarn_k4v2_g128] [--shape 32x32768]

Variants (monkeypatched into the kernel's per-scheme plan; numbers are for diagnosis only, the
ablated kernels compute wrong attention, except convert_unpack): full; convert_unpack (codes
turned into fp16 with an int->float conversion instead of the magic-number OR, correct, the
kernel before 2026-11-29 evening); no_values (V never read); no_unpack (code bytes converted to
fp16 whole, no plane extraction); loads_only (codes and scales read and summed, no matrix
products). Compiled runs only (the ablations replace the PTX unpack). The patched methods are
those of the heads-major layout, so the kernel is run with orient="heads" (the default for
tiled schemes is now tokens-major; see paged_decode_pallas.default_orient).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from decode import device_time, kernel_bytes, random_cache  # noqa: E402

from kvarn_jax.attention import paged_decode_pallas as pdp  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scheme", default="kvarn_k4v2_g128", help="comma list")
    p.add_argument("--shape", default="32x32768")
    p.add_argument("--variant", default="w2s2")
    args = p.parse_args()
    for scheme in args.scheme.split(","):
        ablate(scheme, args.shape, args.variant)


def convert_planes(c, bits):
    """Bit planes by shift, mask and an int->float conversion (correct; slower than the magic number)."""
    if bits == 8:
        return [c.astype(jnp.float16)]
    return [jnp.bitwise_and(jnp.right_shift(c, j * bits), (1 << bits) - 1).astype(jnp.float16)
            for j in range(8 // bits)]


def ablate(scheme, shape, variant):
    batch, ctx = (int(x) for x in shape.split("x"))
    w, st = (int(x) for x in variant[1:].split("s"))
    cache, tables, lens = random_cache(scheme, batch, ctx, 8, 128, 128, jnp.float16)
    q = jax.random.normal(jax.random.PRNGKey(9), (batch, 32, 128), jnp.float16)
    sid = jnp.arange(batch, dtype=jnp.int32)
    # the plan picks its unpack from these module globals when it is built
    orig = (pdp._Plan.scores, pdp._Plan.values, pdp._planes_asm)

    def no_values(self, ps, pages, st, blk, sub):
        return [jnp.zeros((ps[0].shape[0], self.d // self.vp), jnp.float32) + jnp.sum(ps[0], axis=1)[:, None]
                for _ in range(self.vp)]

    def loads_only_scores(self, q, q_planes, pages, st, blk, sub):
        tot = sum(jnp.sum(r[blk, sub].astype(jnp.float32)) for r in pages["k"].values())
        return [jnp.zeros((q.shape[0], self.t // self.kc), jnp.float32) + tot for _ in range(self.kc)]

    def loads_only_values(self, ps, pages, st, blk, sub):
        tot = sum(jnp.sum(r[blk, sub].astype(jnp.float32)) for r in pages["v"].values())
        return [jnp.zeros((ps[0].shape[0], self.d // self.vp), jnp.float32) + tot for _ in range(self.vp)]

    variants = {
        "full": orig,
        "convert_unpack": (orig[0], orig[1], convert_planes),
        "no_values": (orig[0], no_values, orig[2]),
        "no_unpack": (orig[0], orig[1], lambda c, bits: [c.astype(jnp.float16)] * (8 // bits)),
        "loads_only": (loads_only_scores, loads_only_values, orig[2]),
    }
    nbytes = kernel_bytes(cache, batch, ctx)
    print(f"{scheme} B={batch} L={ctx} {variant}: {nbytes / 1e9:.3f} GB per call")
    for name, (sc, va, planes) in variants.items():
        pdp._Plan.scores, pdp._Plan.values, pdp._planes_asm = sc, va, planes
        fn = lambda q, c, t, l: pdp.paged_decode_pallas(q, c, t, l, sid, scale=0.088, window=None,
                                                        num_warps=w, num_stages=st, orient="heads",
                                                        interpret=jax.default_backend() == "cpu")
        try:
            jax.clear_caches()
            t = device_time(fn, (q, cache, tables, lens))
            print(f"  {name:<11s} {t * 1e3:7.3f} ms  ({nbytes / t / 1e12:.2f} TB/s effective)")
        except Exception as e:  # noqa: BLE001
            print(f"  {name:<11s} failed: {type(e).__name__}: {str(e)[:300]}")
    pdp._Plan.scores, pdp._Plan.values, pdp._planes_asm = orig


if __name__ == "__main__":
    main()
