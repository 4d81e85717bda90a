"""The decode benchmark's byte count (the numerator of its roofline, `workload.decode_bytes`) against
what the cache really serves from its quantized pages and from its high-precision sink and tail."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import kvarn_jax as kj
from kvarn_jax.attention.workload import decode_bytes, random_cache

MARK = 1000.0  # no dequantized random page comes near it


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g64", "int8"])
@pytest.mark.parametrize("ctx", [1, 37, 64, 65, 128, 129, 200, 256])
def test_kernel_bytes_count_the_blocks_gather_dense_reads_in_high_precision(cfg, ctx):
    hk, d, bs = 2, 64, 64
    cache, tables, lens = random_cache(cfg, 2, ctx, hk, d, bs, jnp.float16)
    mark = lambda bufs: {s: jnp.full_like(a, MARK) for s, a in bufs.items()}  # noqa: E731
    cache = dataclasses.replace(cache, sink=mark(cache.sink), tail=mark(cache.tail))
    k, v = kj.gather_dense(cache, tables, lens)                     # [B, Hk, L, D]
    from_hp = np.all(np.asarray(k[:, :, :ctx]) == MARK, axis=-1)    # [B, Hk, ctx]
    assert (from_hp == from_hp[:1, :1]).all()
    hp = int(from_hp[0, 0].sum())
    expected = 2 * (hp * hk * d * 2 * 2 + (ctx - hp) * kj.bytes_per_token(kj.parse(cfg), d) * hk)
    assert decode_bytes(cache, 2, ctx) == expected
    # a whole block (the query's own) is read from the ring when the context ends on a block boundary
    if ctx > bs and ctx % bs == 0:
        assert hp == 2 * bs
