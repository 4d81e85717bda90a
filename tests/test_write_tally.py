"""A decode step's writes staged into every layer (`LayerCaches.stage`, counted once per step by
`open_tally` / `close_tally`, or per call) store what `paged.stage_tokens` stores into a one-layer
cache, and count exactly the tokens it counts: NaN/Inf tokens, values beyond the storage range and
invalid slots, over several scheme groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvarn_jax.cache import LayerCaches, PagedKVCache
from kvarn_jax.cache import paged

BS, HK, D, NS, NB = 32, 2, 32, 4, 8


def _tokens(rng, n):
    k = rng.standard_normal((n, HK, D)).astype(np.float32)
    v = rng.standard_normal((n, HK, D)).astype(np.float32)
    k[1, 0, 3] = np.nan          # non-finite: stored as zeros, counted in nonfinite and dropped_tokens
    v[2, 1, 0] = np.inf
    v[3, 0, 5] = 1e30             # beyond float16 (and QUANT_MAX): stored saturated, counted
    return jnp.asarray(k), jnp.asarray(v)


@pytest.mark.parametrize("tallied", [True, False])
@pytest.mark.parametrize("schemes", [["kvarn_k4v2_g32", "int8", "kvarn_k4v2_g32"], ["fp16", "int4"]])
def test_staged_layers_equal_one_layer_caches(schemes, tallied, rng):
    layers = len(schemes)
    caches = LayerCaches.create(schemes, layers, num_blocks=NB, block_size=BS, num_kv_heads=HK, head_dim=D,
                                max_seqs=NS, dtype=jnp.float32)
    n = 5
    # rows: 4 sequences at various positions (one at a block's last slot) and one invalid slot
    seq = jnp.array([0, 1, 2, 3, 1], jnp.int32)
    pos = jnp.array([3, BS - 1, 2 * BS + 4, 0, 7], jnp.int32)
    slots = jnp.array([1 * BS + 3, 2 * BS + BS - 1, 5 * BS + 4, 6 * BS + 0, 99 * BS], jnp.int32)
    kv = [_tokens(rng, n) for _ in range(layers)]

    def step(c):
        c = c.open_tally(n) if tallied else c
        for i, (k, v) in enumerate(kv):
            c = c.stage(i, k, v, slots, seq, pos)
        return c.close_tally(slots, seq) if tallied else c

    got = jax.jit(step)(caches)
    assert got.tally is None
    dropped = [0] * len(got.groups)
    for i, (k, v) in enumerate(kv):  # the reference: each layer on its own one-layer cache
        ref = paged.stage_tokens(PagedKVCache.create(schemes[i], num_blocks=NB, block_size=BS, num_kv_heads=HK,
                                                     head_dim=D, max_seqs=NS, dtype=jnp.float32),
                                 k, v, slots, seq_ids=seq, positions=pos)
        mine = got.layer(i)
        for part in ("pages", "sink", "tail"):
            for a, b in zip(jax.tree.leaves(getattr(ref, part)), jax.tree.leaves(getattr(mine, part))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        dropped[got.layer_group[i]] += int(ref.dropped_tokens)
    assert [int(c.dropped_tokens) for c in got.groups] == dropped and sum(dropped) > 0
    # rows 1 and 2 (sequences 1 and 2) hold a NaN / Inf in every layer; the invalid row is not counted
    np.testing.assert_array_equal(np.asarray(got.nonfinite), [0, layers, layers, 0])


def test_tally_misuse_is_refused():
    c = LayerCaches.create("int8", 1, num_blocks=2, block_size=BS, num_kv_heads=HK, head_dim=D, max_seqs=NS)
    with pytest.raises(ValueError, match="no tally is open"):
        c.close_tally(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="already open"):
        c.open_tally(1).open_tally(1)
