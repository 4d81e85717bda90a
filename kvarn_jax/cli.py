"""`kvarn-jax` command line.

    kvarn-jax schemes [--head-dim 128] [--kv-cache-dtype a,b,...] [--json FILE]
        Table of schemes: bytes per token, capacity vs fp16, and round-trip error of K, V and of the
        attention output on synthetic keys with outlier channels (an embedded default workload).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

DEFAULT_SCHEMES = ("fp16,fp8,int8,int4,int4_g32,int2_g32,kivi_k4v4_g64,kivi_k2v2_g32,"
                   "kvarn_k4v4_g128,kvarn_k4v2_g128,kvarn_k4v2_g64,kvarn_k2v2_g32")


def _synthetic_kv(tokens: int, heads: int, dim: int, seed: int = 0):
    """Keys with a few large-offset outlier channels and varied token scales, like real LLM keys."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((tokens, heads, dim))
    ch = rng.choice(dim, max(1, dim // 32), replace=False)
    k[..., ch] = k[..., ch] * 15 + 10
    v = rng.standard_normal((tokens, heads, dim)) * rng.choice([0.5, 1.0, 2.0], (tokens, 1, 1))
    q = rng.standard_normal((1, heads * 4, dim))
    return k.astype(np.float16), v.astype(np.float16), q.astype(np.float32)


def _schemes_table(args) -> int:
    import jax.numpy as jnp

    import kvarn_jax as kj
    from kvarn_jax.hadamard import rotate

    d, tokens, heads = args.head_dim, args.tokens, 2
    k, v, q = _synthetic_kv(tokens, heads, d)
    rows = []
    for name in [s for s in args.kv_cache_dtype.split(",") if s]:
        cfg = kj.parse(name)
        cfg.check_head_dim(d)
        bs = max(128, cfg.tile_tokens)
        nb = tokens // bs
        cache = kj.PagedKVCache.create(cfg, num_blocks=nb, block_size=bs, num_kv_heads=heads, head_dim=d,
                                       max_seqs=1)
        cache = kj.write(cache, jnp.asarray(k), jnp.asarray(v), jnp.arange(tokens, dtype=jnp.int32),
                         seq_ids=jnp.zeros(tokens, jnp.int32), positions=jnp.arange(tokens, dtype=jnp.int32))
        table, lens = jnp.arange(nb, dtype=jnp.int32)[None], jnp.array([tokens], jnp.int32)
        kd, vd = kj.gather_dense(cache, table, lens)
        kref = rotate(jnp.asarray(k), jnp.float32) if cfg.rotated else jnp.asarray(k, jnp.float32)
        vref = rotate(jnp.asarray(v), jnp.float32) if cfg.rotated else jnp.asarray(v, jnp.float32)
        err = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        ek = err(kd[0].transpose(1, 0, 2), kref)
        ev = err(vd[0].transpose(1, 0, 2), vref)
        out = kj.paged_decode_attention_reference(jnp.asarray(q), cache, table, lens)
        exact = kj.paged_decode_attention_reference(jnp.asarray(q), _fp32_cache(kj, k, v, nb, bs, heads, d), table, lens)
        bpt = kj.bytes_per_token(cfg, d)
        rows.append({"scheme": cfg.name, "bits_per_element": 8 * bpt / (2 * d), "bytes_per_token_per_head": bpt,
                     "capacity_vs_fp16": 4 * d / bpt, "k_rel_err": ek, "v_rel_err": ev,
                     "attn_out_rel_err": err(out, exact)})
    hdr = f"{'scheme':<18}{'bits/elem':>10}{'B/token/head':>14}{'x fp16':>8}{'K err':>9}{'V err':>9}{'attn err':>10}"
    print(f"synthetic K/V: {tokens} tokens x {heads} kv heads x head_dim {d}, keys with outlier channels")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['scheme']:<18}{r['bits_per_element']:>10.2f}{r['bytes_per_token_per_head']:>14.1f}"
              f"{r['capacity_vs_fp16']:>8.2f}{r['k_rel_err']:>9.4f}{r['v_rel_err']:>9.4f}{r['attn_out_rel_err']:>10.4f}")
    print("(the first block of a sequence stays in high precision and is included in the errors)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head_dim": d, "tokens": tokens, "rows": rows}, f, indent=2)
    return 0


def _fp32_cache(kj, k, v, nb, bs, heads, d):
    import jax.numpy as jnp
    c = kj.PagedKVCache.create("fp32", num_blocks=nb, block_size=bs, num_kv_heads=heads, head_dim=d)
    t = k.shape[0]
    return kj.write(c, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.arange(t, dtype=jnp.int32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvarn-jax", description="KV-cache quantization for LLM serving in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("schemes", help="bytes, capacity and round-trip error of each scheme")
    s.add_argument("--kv-cache-dtype", default=DEFAULT_SCHEMES, help="comma-separated scheme strings")
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--tokens", type=int, default=1024, help="multiple of 256")
    s.add_argument("--json", help="also write the table as JSON to this file")
    args = p.parse_args(argv)
    try:
        return _schemes_table(args)
    except ValueError as e:
        print(f"kvarn-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
