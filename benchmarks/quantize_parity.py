"""Where do the Pallas quantize kernel and the jnp (XLA) path disagree on this device, and who is right?

    PYTHONPATH=. python benchmarks/quantize_parity.py

For int8 and kvarn_k4v2_g128 keys of 64 random blocks it counts differing stored fields, and for
int8 recomputes the codes in numpy (IEEE division, round half to even) from the kernel's scales.
"""
import jax, jax.numpy as jnp, numpy as np, kvarn_jax as kj
from kvarn_jax.cache import paged
from kvarn_jax.cache.quantize_pallas import quantize_blocks_pallas
x = jax.random.normal(jax.random.PRNGKey(0), (64, 8, 128, 128), jnp.float16)
for s in ["int8", "kvarn_k4v2_g128"]:
    cfg = kj.parse(s)
    cache = kj.PagedKVCache.create(cfg, num_blocks=1, block_size=128, num_kv_heads=8, head_dim=128, max_seqs=1)
    for side in "k":
        a = jax.jit(lambda x: paged._quantize_blocks(cache, side, x))(x)
        b = jax.jit(lambda x: quantize_blocks_pallas(x, None, cfg=cfg, side=side))(x)
        for n in a:
            fa, fb = np.asarray(a[n]).astype(np.float64), np.asarray(b[n]).astype(np.float64)
            d = fa != fb
            print(s, side, n, "differ", int(d.sum()), "of", d.size, "max|diff|", float(np.abs(fa - fb).max()))
        # int8: recompute codes from the kernel's own stored scale/zero in numpy
        if s == "int8":
            xs = np.asarray(x, np.float32)
            sc, z = np.asarray(b["scale"], np.float32), np.asarray(b["zero"], np.float32)
            q = np.clip(np.round((xs - z) / sc), 0, 255)
            print("numpy codes from kernel scales vs kernel codes differ:", int((q != np.asarray(b["codes"])).sum()),
                  " vs XLA codes differ:", int((q != np.asarray(a["codes"])).sum()))
