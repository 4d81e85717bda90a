"""Decode-attention workloads for benchmarks and their tests: a paged cache of random contents, and
the bytes one decode call over it must read (the numerator of the byte roofline)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..cache.memory import bytes_per_token
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
    """Bytes one decode call must read for `batch` sequences of `ctx` tokens: the quantized pages of
    the full blocks between the sink and the query's own block, and the high-precision sink and the
    query's block. As `gather_dense` serves it, the block holding position ctx - 1 is read from the
    tail ring even when it is full, so at ctx a multiple of the block size that is a whole block in
    high precision, not none. The query and the output are left out (16 KB a sequence at Hq = 32,
    D = 128: 0.4% of 4K tokens)."""
    cfg, bs = cache.cfg, cache.block_size
    per_token = bytes_per_token(cfg, cache.head_dim) * cache.num_kv_heads
    hp_tokens = 0 if cfg.is_passthrough else ctx if ctx <= bs else bs + (ctx - 1) % bs + 1
    quant_tokens = ctx - hp_tokens
    hp_bytes = hp_tokens * cache.num_kv_heads * cache.head_dim * 2 * jnp.dtype(cache.dtype).itemsize
    return batch * (quant_tokens * per_token + hp_bytes)
