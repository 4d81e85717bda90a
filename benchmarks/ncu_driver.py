"""A target for Nsight Compute: the decode kernel (B=32/L=32K unless a BxL shape is given; Hq=32/Hk=8/D=128)
or the quantize kernel (256 blocks x 8 heads x 128 x 128, keys of kvarn_k4v2_g128), called three times.

    ncu --clock-control none -k regex:kvarn_paged_decode --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy ... python3 benchmarks/ncu_driver.py decode kvarn_k4v2_g128 [1x131072 [maxnreg]]
    ncu --clock-control none -k regex:kvarn_quantize ... python3 benchmarks/ncu_driver.py quantize
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np, jax, jax.numpy as jnp
import kvarn_jax as kj
from decode import random_cache
from kvarn_jax.attention import paged_decode_pallas as pdp
from kvarn_jax.cache.quantize_pallas import quantize_blocks_pallas

what = sys.argv[1]
if what == "decode":
    scheme = sys.argv[2]
    batch, ctx = (int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "32x32768").split("x"))
    cache, tables, lens = random_cache(scheme, batch, ctx, 8, 128, 128, jnp.float16)
    q = jax.random.normal(jax.random.PRNGKey(9), (batch, 32, 128), jnp.float16)
    sid = None  # sequence b's sink and tail at row b, as paged_decode_attention passes them
    cap = int(sys.argv[4]) if len(sys.argv) > 4 else None
    f = jax.jit(lambda q, c, t, l: pdp.paged_decode_pallas(q, c, t, l, sid, scale=0.088, window=None, maxnreg=cap))
    for _ in range(3):
        f(q, cache, tables, lens).block_until_ready()
else:
    cfg = kj.parse("kvarn_k4v2_g128")
    x = jax.random.normal(jax.random.PRNGKey(0), (256, 8, 128, 128), jnp.float16)
    f = jax.jit(lambda x: quantize_blocks_pallas(x, None, cfg=cfg, side="k"))
    for _ in range(3):
        jax.block_until_ready(f(x))
print("done", what)
