"""`paged_decode_attention(new_kv=...)`: one more token per row, attended before it is written.

The oracle is the cache itself: a row's last token written into the cache and attended with
seq_lens, against the same token passed as new_kv (as `storage_values` stores it) with seq_lens - 1.
Caches with a high-precision sink and tail keep a row's own block exactly as written, so the two
agree to fp32 rounding (rtol 1e-5 of the output scale). The GPU kernel (interpreted on CPU) is then
held to the reference with new_kv at `test_paged_decode_kernel`'s tolerance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvarn_jax as kj
from kvarn_jax.storage import storage_values
from test_paged_decode_kernel import build, compare


def last_tokens(cache, seqs):
    """Each row's last token as the cache stores it: (k, v) [B, Hk, D]."""
    k = jnp.stack([jnp.asarray(s[0][-1], jnp.float32) for s in seqs])
    v = jnp.stack([jnp.asarray(s[1][-1], jnp.float32) for s in seqs])
    k_s, v_s, _, _ = storage_values(cache.cfg, k, v, cache.value_dtype)
    return k_s, v_s


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g32", "fp16", "int8", "kivi_k2v2_g32"])
def test_new_token_equals_writing_it_first(cfg, rng):
    c = kj.parse(cfg)
    bs = max(c.tile_tokens, 16)
    # a first token; one completing a block; the first of a block after the sink, after a page; others
    lens = [1, bs, bs + 1, 2 * bs + 1, 3 * bs - 1, 2 * bs + 5]
    cache, bt, sl, seqs = build(cfg, lens, 2, 64, bs, rng)
    q = jnp.asarray(rng.standard_normal((len(lens), 8, 64)), jnp.float32)
    written = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference"))
    new = np.asarray(kj.paged_decode_attention(q, cache, bt, sl - 1, impl="reference",
                                               new_kv=last_tokens(cache, seqs)))
    assert np.isfinite(new).all()
    assert cache.has_hp or c.is_passthrough  # the written token kept exactly: in the ring, the sink or its page
    np.testing.assert_allclose(new, written, rtol=0, atol=1e-5 * np.abs(written).max())


@settings(max_examples=6, deadline=None)  # each example compiles anew
@given(cfg=st.sampled_from(["kvarn_k4v2_g32", "kvarn_k2v4_g64", "kivi_k2v2_g32", "int4", "int8_g16", "fp8", "fp16",
                            "bf16"]),
       ratio=st.sampled_from([1, 4, 7]), lens=st.lists(st.integers(0, 140), min_size=1, max_size=3),
       splits=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2 ** 16))
def test_kernel_takes_the_new_token_like_the_reference(cfg, ratio, lens, splits, seed):
    check_kernel(cfg, ratio, lens, splits, seed)


@pytest.mark.parametrize("cfg,ratio,splits", [
    ("kvarn_k4v2_g32", 4, 1),      # one split and a power-of-two group: the kernel would finish its output
    ("kvarn_k4v2_g32", 4, None),   # the Pallas merge (2-bit values), its split axis padded again
    ("int8", 7, 3),                # XLA's merge; a group of 7 stored as 8 heads
])
def test_each_merge_takes_the_new_token(cfg, ratio, splits):
    check_kernel(cfg, ratio, [0, 64, 130], splits, 7)   # 64: the new token opens a block after a page


def check_kernel(cfg, ratio, lens, splits, seed):
    """The kernel with new_kv against the reference with new_kv; rows with no cached token see the
    new one only."""
    rng = np.random.default_rng(seed)
    bs = max(kj.parse(cfg).tile_tokens, 16)
    cache, bt, sl, seqs = build(cfg, [max(n, 1) for n in lens], 2, 64, bs, rng)
    sl = jnp.asarray(lens, jnp.int32)   # rows of length 0 keep a written block, read by no position
    q = jnp.asarray(rng.standard_normal((len(lens), 2 * ratio, 64)), jnp.float32)
    # a key along its group's queries (weighty among outlier keys), a random value
    k = 4 * q.reshape(len(lens), 2, ratio, 64).mean(2)
    v = jnp.asarray(rng.standard_normal((len(lens), 2, 64)) * 3, jnp.float32)
    new_kv = storage_values(cache.cfg, k, v, cache.value_dtype)[:2]
    out, ref = compare(q, cache, bt, sl, num_splits=splits, new_kv=new_kv)
    # the token counts: leaving it out moves every row
    without = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference"), np.float32)
    assert (np.abs(without - ref).max(axis=(1, 2)) > 1e-3 * np.abs(ref).max()).all()


def test_new_kv_errors(rng):
    cache, bt, sl, _ = build("kvarn_k4v2_g32", [40], 2, 64, 32, rng)
    q = jnp.zeros((1, 4, 64), jnp.float32)
    kv = jnp.zeros((1, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="new_kv must be a"):
        kj.paged_decode_attention(q, cache, bt, sl, new_kv=kv)
    with pytest.raises(ValueError, match=r"new_kv\[1\] \(v\) must be \[B, Hk, D\]"):
        kj.paged_decode_attention(q, cache, bt, sl, new_kv=(kv, jnp.zeros((1, 4, 64))))
    with pytest.raises(ValueError, match="window"):
        kj.paged_decode_attention(q, cache, bt, sl, new_kv=(kv, kv), window=8)
    with pytest.raises(ValueError, match="kernel='tpu'"):
        kj.paged_decode_attention(q, cache, bt, sl, new_kv=(kv, kv), impl="pallas", kernel="tpu", interpret=True)


def test_new_token_under_jit(rng):
    """Inside a jitted caller (the vLLM bridge's step) with traced arrays."""
    cache, bt, sl, seqs = build("kvarn_k4v2_g32", [70, 33], 2, 64, 32, rng)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    new_kv = last_tokens(cache, seqs)
    f = jax.jit(lambda q, c, b, s, kv: kj.paged_decode_attention(q, c, b, s - 1, new_kv=kv, check_values=False))
    np.testing.assert_allclose(np.asarray(f(q, cache, bt, sl, new_kv)),
                               np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference")),
                               rtol=0, atol=1e-5 * 4)
