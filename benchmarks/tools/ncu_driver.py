"""A target for Nsight Compute: the decode kernel (Hq=32, Hk=8, D=128, block 128) or the quantize
kernel (256 blocks x 8 heads x 128 x 128, keys), called three times.

    ncu --clock-control none -k regex:kvarn_paged_decode --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy ... python3 benchmarks/tools/ncu_driver.py decode kvarn_k4v2_g128 --shape 1x131072
    ncu --clock-control none -k regex:kvarn_quantize ... python3 benchmarks/tools/ncu_driver.py quantize
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kvarn_jax as kj  # noqa: E402
from kvarn_jax.attention import paged_decode_pallas as pdp  # noqa: E402
from kvarn_jax.attention.workload import random_cache  # noqa: E402
from kvarn_jax.cache.quantize_pallas import quantize_blocks_pallas  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", choices=["decode", "quantize"])
    p.add_argument("scheme", nargs="?", default="kvarn_k4v2_g128")
    p.add_argument("--shape", default="32x32768", help="decode: BATCHxCONTEXT (default: %(default)s)")
    p.add_argument("--maxnreg", type=int, default=None, help="decode: a register cap per thread")
    args = p.parse_args()
    if args.kernel == "decode":
        batch, ctx = (int(x) for x in args.shape.split("x"))
        cache, tables, lens = random_cache(args.scheme, batch, ctx, 8, 128, 128, jnp.float16)
        q = jax.random.normal(jax.random.PRNGKey(9), (batch, 32, 128), jnp.float16)
        # seq_ids None: sequence b's sink and tail at row b, as paged_decode_attention passes them
        f = jax.jit(lambda q, c, t, l: pdp.paged_decode_pallas(q, c, t, l, None, scale=0.088, window=None,
                                                                launch=pdp.Launch(maxnreg=args.maxnreg)))
        for _ in range(3):
            f(q, cache, tables, lens).block_until_ready()
    else:
        cfg = kj.parse(args.scheme)
        x = jax.random.normal(jax.random.PRNGKey(0), (256, 8, 128, 128), jnp.float16)
        f = jax.jit(lambda x: quantize_blocks_pallas(x, None, cfg=cfg, side="k"))
        for _ in range(3):
            jax.block_until_ready(f(x))
    print("done", args.kernel)


if __name__ == "__main__":
    main()
