"""The decode-step write split in two (`stage_tokens` + `commit_blocks`) stores exactly what `write` stores."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvarn_jax as kj
from kvarn_jax.cache import paged

SCHEMES = ["kvarn_k4v2_g32", "kivi_k2v2_g32", "int4", "fp8", "fp16"]
BS, HK, D, NS = 32, 2, 32, 3
MAX_START, MAX_STEPS = 3 * BS, 2 * BS + 3
PER_SEQ = -(-(MAX_START + MAX_STEPS) // BS)  # blocks per sequence: one cache shape for every example
# compiled once per scheme (as a serving step compiles them), not op by op for every shape
_stage = jax.jit(paged.stage_tokens, static_argnames="one_per_sequence")
_commit = jax.jit(paged.commit_blocks)


def _poisoned(scheme, num_blocks, seed):
    # fp16: scales stored in fp16, so the comparison is bit for bit (fp32 scales would show XLA's
    # reduction order, which differs with the number of blocks quantized together, in their last bit)
    cache = kj.PagedKVCache.create(scheme, num_blocks=num_blocks, block_size=BS, num_kv_heads=HK, head_dim=D,
                                   max_seqs=NS, dtype=jnp.float16)
    key = [jax.random.PRNGKey(seed)]

    def junk(a):
        if a.ndim == 0:
            return a
        key[0], sub = jax.random.split(key[0])
        if jnp.issubdtype(a.dtype, jnp.floating):
            return (jax.random.normal(sub, a.shape) * 50).astype(a.dtype)
        return jax.random.randint(sub, a.shape, 0, 100).astype(a.dtype)
    return jax.tree.map(junk, cache)


@settings(max_examples=6, deadline=None)
@given(scheme=st.sampled_from(SCHEMES), starts=st.lists(st.integers(0, MAX_START), min_size=NS, max_size=NS),
       steps=st.integers(1, MAX_STEPS), seed=st.integers(0, 2 ** 16), one=st.booleans())
def test_stage_then_commit_equals_write(scheme, starts, steps, seed, one):
    # one: the decode steps' writes declare one token per sequence (the ring write without its
    # per-sequence max), as the engine's decode step does
    rng = np.random.default_rng(seed)
    num_blocks = NS * PER_SEQ
    tables = rng.permutation(num_blocks).reshape(NS, PER_SEQ).astype(np.int32)
    a = b = _poisoned(scheme, num_blocks, seed)
    # prompts first (one write each, padded to MAX_START rows with slot -1), then one token per
    # sequence per step
    for s, n in enumerate(starts):
        if n:
            pos = np.arange(MAX_START, dtype=np.int32)
            k, v = (jnp.asarray(rng.normal(size=(MAX_START, HK, D)), jnp.float32) for _ in range(2))
            slots = jnp.asarray(np.where(pos < n, tables[s, pos // BS] * BS + pos % BS, -1))
            pos = jnp.asarray(np.where(pos < n, pos, 0))
            a = kj.write(a, k, v, slots, seq_ids=jnp.full(MAX_START, s), positions=pos)
            b = kj.write(b, k, v, slots, seq_ids=jnp.full(MAX_START, s), positions=pos)
    lens = np.array(starts, np.int32)
    seq = jnp.arange(NS, dtype=jnp.int32)
    for _ in range(steps):
        k, v = (jnp.asarray(rng.normal(size=(NS, HK, D)), jnp.float32) for _ in range(2))
        slots = tables[np.arange(NS), lens // BS] * BS + lens % BS
        a = kj.write(a, k, v, jnp.asarray(slots), seq_ids=seq, positions=jnp.asarray(lens))
        b = _stage(b, k, v, jnp.asarray(slots), seq_ids=seq, positions=jnp.asarray(lens), one_per_sequence=one)
        done = (lens % BS == BS - 1) & (lens >= BS)
        blk = np.where(done, tables[np.arange(NS), lens // BS], -1)
        # a fixed batch of 4 entries, padding included
        pad = lambda x, fill: jnp.asarray(np.concatenate([x, np.full(4 - NS, fill)]).astype(np.int32))  # noqa: E731
        b = _commit(b, pad(blk, -1), pad(np.arange(NS), 0), pad(lens - BS + 1, 0))
        lens = lens + 1
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(b.dropped_tokens) == 0


def test_commit_counts_invalid_entries_and_skips_padding():
    cache = _poisoned("int8", 4, 0)
    before = jax.tree.leaves(cache.pages)
    out = paged.commit_blocks(cache, jnp.array([-1, 7, 1], jnp.int32), jnp.array([0, 0, 9], jnp.int32),
                              jnp.array([BS, BS, BS], jnp.int32))
    for x, y in zip(before, jax.tree.leaves(out.pages)):  # nothing stored: padding, bad block, bad sequence
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(out.dropped_tokens) == 2 * BS


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "int8"])
def test_write_with_a_static_completion_bound_equals_write(scheme, rng):
    n = 3 * BS + 5
    a = b = _poisoned(scheme, 8, 1)
    k, v = (jnp.asarray(rng.normal(size=(n, HK, D)), jnp.float32) for _ in range(2))
    pos = jnp.arange(n, dtype=jnp.int32)
    slots = pos  # blocks 0..3 in order
    a = kj.write(a, k, v, slots, seq_ids=jnp.zeros(n, jnp.int32), positions=pos)
    b = paged.write_reference(b, k, v, slots, jnp.zeros(n, jnp.int32), pos, max_completed=3)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # a bound too small drops (and counts) the blocks it cannot hold
    c = paged.write_reference(_poisoned(scheme, 8, 1), k, v, slots, jnp.zeros(n, jnp.int32), pos, max_completed=1)
    assert int(c.dropped_tokens) == BS
