"""A decode step's writes counted once for all layers (`LayerCaches.open_tally` / `close_tally`) leave
exactly the caches that counting each layer's write gives: same pages, sink, tail and counters, with
NaN/Inf tokens, values beyond the storage range, invalid slots and several scheme groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvarn_jax.cache import LayerCaches

BS, HK, D, NS = 32, 2, 32, 4


def _tokens(rng, n):
    k = rng.standard_normal((n, HK, D)).astype(np.float32)
    v = rng.standard_normal((n, HK, D)).astype(np.float32)
    k[1, 0, 3] = np.nan          # non-finite: stored as zeros, counted in nonfinite and dropped_tokens
    v[2, 1, 0] = np.inf
    v[3, 0, 5] = 1e30             # beyond float16 (and QUANT_MAX): stored saturated, counted
    return jnp.asarray(k), jnp.asarray(v)


@pytest.mark.parametrize("schemes", [["kvarn_k4v2_g32", "int8", "kvarn_k4v2_g32"], ["fp16", "int4"]])
def test_tally_gives_the_caches_per_layer_counting_gives(schemes, rng):
    layers = len(schemes)
    caches = LayerCaches.create(schemes, layers, num_blocks=8, block_size=BS, num_kv_heads=HK, head_dim=D,
                                max_seqs=NS, dtype=jnp.float32)
    n = 5
    # rows: 4 sequences at various positions (one at a block's last slot) and one invalid slot
    seq = jnp.array([0, 1, 2, 3, 1], jnp.int32)
    pos = jnp.array([3, BS - 1, 2 * BS + 4, 0, 7], jnp.int32)
    slots = jnp.array([1 * BS + 3, 2 * BS + BS - 1, 5 * BS + 4, 6 * BS + 0, 99 * BS], jnp.int32)
    kv = [_tokens(rng, n) for _ in range(layers)]

    def per_layer(c):
        for i, (k, v) in enumerate(kv):
            c = c.stage(i, k, v, slots, seq, pos)
        return c

    def tallied(c):
        c = c.open_tally(n)
        for i, (k, v) in enumerate(kv):
            c = c.stage(i, k, v, slots, seq, pos)
        return c.close_tally(slots, seq)

    want, got = jax.jit(per_layer)(caches), jax.jit(tallied)(caches)
    assert got.tally is None
    assert int(want.dropped_tokens) > 0 and int(jnp.sum(want.nonfinite)) == 2 * layers
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tally_misuse_is_refused():
    c = LayerCaches.create("int8", 1, num_blocks=2, block_size=BS, num_kv_heads=HK, head_dim=D, max_seqs=NS)
    with pytest.raises(ValueError, match="no tally is open"):
        c.close_tally(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="already open"):
        c.open_tally(1).open_tally(1)
