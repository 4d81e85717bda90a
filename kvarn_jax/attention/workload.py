"""Decode-attention workloads for benchmarks and their tests: a paged cache of random contents, and
the bytes one decode call over it must read (the numerator of the byte roofline)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..cache.memory import decode_read_bytes
from ..cache.paged import PagedKVCache
from ..config import KVQuantConfig


def random_cache(cfg: str | KVQuantConfig, batch: int, ctx: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype=jnp.float16, seed: int = 0):
    """(cache, block_tables, seq_lens): `batch` sequences of `ctx` tokens whose pages hold random codes
    and plausible scales (uniform in [0.02, 0.2]; zero points ~ N(0, 0.1)), sink and tail random
    normal values, and block tables that are a random permutation of the pool. Random codes are
    fine for timing: the kernels do the same work whatever the values."""
    cfg = KVQuantConfig.parse(cfg)
    blocks_per_seq = -(-ctx // block_size)
    nb = batch * blocks_per_seq
    cache = PagedKVCache.create(cfg, num_blocks=nb, block_size=block_size, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, max_seqs=batch, dtype=dtype)
    key = jax.random.PRNGKey(seed)

    def fill(path, a):
        nonlocal key
        key, sub = jax.random.split(key)
        name = str(path[-1])
        if a.dtype == jnp.uint8:
            r = jax.random.randint(sub, a.shape, 0, 256, jnp.int32).astype(jnp.uint8)
            if cfg.method == "fp8":  # no e4m3 NaN patterns (x1111111)
                r = jnp.where((r & 0x7F) == 0x7F, r & 0xFE, r)
            return r
        if a.dtype == jnp.int32:
            return a
        if "scale" in name:
            return jax.random.uniform(sub, a.shape, jnp.float32, 0.02, 0.2).astype(a.dtype)
        return (jax.random.normal(sub, a.shape, jnp.float32) * (0.1 if "zero" in name else 1.0)).astype(a.dtype)

    cache = jax.tree_util.tree_map_with_path(fill, cache)
    perm = np.random.default_rng(seed).permutation(nb).astype(np.int32)
    tables = jnp.asarray(perm.reshape(batch, blocks_per_seq))
    lens = jnp.full((batch,), ctx, jnp.int32)
    return cache, tables, lens


def decode_bytes(cache: PagedKVCache, batch: int, ctx: int) -> float:
    """Bytes one decode call must read for `batch` sequences of `ctx` tokens (`decode_read_bytes` of
    the cache's scheme and sizes). The query and the output are left out (16 KB a sequence at
    Hq = 32, D = 128: 0.4% of 4K tokens)."""
    return batch * decode_read_bytes(cache.cfg, ctx, block_size=cache.block_size, num_kv_heads=cache.num_kv_heads,
                                     head_dim=cache.head_dim, dtype=cache.dtype)
