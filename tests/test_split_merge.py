"""The decode kernel's split merge: the Pallas kernel against the jnp reference (`paged_decode_pallas/merge.py`),
and the whole decode kernel with each merge against the attention reference.

The Pallas merge reads a split axis padded to a power of two whose padding the decode kernel never
writes; here the padding holds NaN and inf, so a merge that let it into any sum fails. Tolerance:
the two merges run the same fp32 formula, summing in other orders: <= 1e-5 relative.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import kvarn_jax as kj
from kvarn_jax.attention import paged_decode_pallas as pdp
from kvarn_jax.attention.paged_decode_pallas import merge as sm
from kvarn_jax.hadamard import rotate, unrotate
from test_paged_decode_kernel import INTERPRET, build


def partials(rng, b, hk, splits, vp, width, gp, heads_axis, empty=()):
    """Random partial results with `splits` valid splits, the padding poisoned; (b, h) in `empty`
    hold what the decode kernel leaves for a sequence with nothing to attend to (m = NEG, l = 0)."""
    sp = sm.padded_splits(splits)
    inner = (width, gp) if heads_axis == -1 else (gp, width)
    acc = rng.standard_normal((b, hk, sp, vp) + inner).astype(np.float32)
    m = (rng.standard_normal((b, hk, sp, gp)) * 8).astype(np.float32)
    l = rng.uniform(0.1, 4.0, (b, hk, sp, gp)).astype(np.float32)
    if splits >= 2:  # a split that saw no tile
        m[:, :, splits // 2], l[:, :, splits // 2], acc[:, :, splits // 2] = pdp.NEG, 0.0, 0.0
    for i, h in empty:
        m[i, h], l[i, h], acc[i, h] = pdp.NEG, 0.0, 0.0
    acc[:, :, splits:], m[:, :, splits:], l[:, :, splits:] = np.nan, np.inf, np.nan
    return jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l)


def channel_order_merge(acc, m, l, splits, heads_axis):
    """The merge written out in NumPy (float64), per (sequence, kv head, query head, channel)."""
    acc, m, l = (np.asarray(a, np.float64)[:, :, :splits] for a in (acc, m, l))
    if heads_axis == -1:                                     # [.., vp, D/vp, Gp] -> [.., vp, Gp, D/vp]
        acc = np.swapaxes(acc, -1, -2)
    b, hk, _, vp, gp, width = acc.shape
    w = np.exp2(m - m.max(axis=2, keepdims=True))            # [B, Hk, S, Gp]
    den = (w * l).sum(axis=2)
    o = np.einsum("bhsg,bhsngi->bhgin", w, acc) / np.where(den > 0, den, 1.0)[:, :, :, None, None]
    return o.reshape(b, hk, gp, width * vp)                  # channel i*vp + n


@settings(max_examples=10)
@given(b=st.integers(1, 3), hk=st.sampled_from([1, 2, 8]), splits=st.integers(1, 70), vp=st.sampled_from([1, 2, 4]),
       width=st.sampled_from([8, 16, 32, 64]), gp=st.sampled_from([8, 16]), heads_axis=st.sampled_from([-1, -2]),
       seed=st.integers(0, 2 ** 16))
@example(b=1, hk=2, splits=1, vp=4, width=32, gp=8, heads_axis=-1, seed=1)      # one split, nothing padded
@example(b=2, hk=1, splits=16, vp=2, width=16, gp=16, heads_axis=-2, seed=2)    # a power of two: no padding
@example(b=1, hk=2, splits=256, vp=1, width=8, gp=8, heads_axis=-1, seed=3)     # B=1 / 128K's 256 splits
@example(b=1, hk=1, splits=200, vp=1, width=16, gp=32, heads_axis=-2, seed=4)   # padded; 16 warps, GQA 32
def test_pallas_merge_equals_reference(b, hk, splits, vp, width, gp, heads_axis, seed):
    rng = np.random.default_rng(seed)
    empty = [(b - 1, hk - 1)] if b * hk > 1 else []
    acc, m, l = partials(rng, b, hk, splits, vp, width, gp, heads_axis, empty=empty)
    want = channel_order_merge(acc, m, l, splits, heads_axis)
    ref = np.asarray(sm.merge_splits_reference(acc, m, l, splits, heads_axis)).reshape(want.shape)
    out = np.asarray(sm.merge_splits_pallas(acc, m, l, splits=splits, heads_axis=heads_axis, interpret=INTERPRET))
    out = out.reshape(want.shape)
    assert np.isfinite(ref).all() and np.isfinite(out).all()
    if empty:
        assert (out[b - 1, hk - 1] == 0).all()  # nothing to attend to: zeros, as the reference
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_merge_launch_spreads_over_the_chip():
    """B=1 / 128K on the H200 (256 splits of 8 kv heads, 4 value planes of 32 channels, 4 heads
    stored): 256 one-warp programs of 4 channels (4K elements each), 2 channels at Gp 8; B=8 / 16K
    (32 splits) whole planes; large batches keep whole planes; heads-major chunks stay >= 4
    contiguous channels, with more warps for the larger blocks that makes."""
    assert sm.merge_launch(1, 8, 4, 256, 4, 32, -1) == (256, 4, 1)
    assert sm.merge_launch(1, 8, 4, 256, 8, 32, -1) == (256, 2, 1)
    assert sm.merge_launch(8, 8, 4, 32, 4, 32, -1) == (32, 32, 1)
    assert sm.merge_launch(32, 8, 4, 4, 8, 32, -1) == (4, 32, 1)
    assert sm.merge_launch(1, 1, 1, 1024, 16, 128, -1) == (1024, 1, 4)  # one channel of all splits: 16K
    assert sm.merge_launch(1, 8, 1, 256, 16, 128, -2) == (256, 4, 8)
    assert sm.merge_launch(1, 1, 1, 300, 32, 64, -2) == (512, 4, 16)
    assert [sm.padded_splits(s) for s in (1, 2, 3, 7, 8, 200)] == [1, 2, 4, 8, 8, 256]
    assert [sm.unpadded_splits(s) for s in (1, 2, 3, 7, 8, 264)] == [1, 2, 2, 4, 8, 256]


def test_pallas_merge_rejects_unpadded_partials(rng):
    acc, m, l = partials(rng, 1, 2, 5, 2, 16, 8, -1)
    with pytest.raises(ValueError, match="do not hold 16 \\(padded\\) splits of 9"):
        sm.merge_splits_pallas(acc, m, l, splits=9, heads_axis=-1, interpret=True)
    with pytest.raises(ValueError, match="heads_axis=-2 does not name acc's Gp=8 axis"):
        sm.merge_splits_pallas(acc, m, l, splits=5, heads_axis=-2, interpret=True)
    acc, m, l = partials(rng, 1, 2, 4, 2, 24, 8, -1)
    with pytest.raises(ValueError, match="channels per value plane \\(24\\) and Gp \\(8\\) must be powers of two"):
        sm.merge_splits_pallas(acc, m, l, splits=4, heads_axis=-1, interpret=True)


@pytest.mark.parametrize("cfg, orient", [("kvarn_k4v2_g32", "tokens"), ("int4", "heads")])
def test_decode_with_the_pallas_merge(cfg, orient, rng):
    """The decode kernel with merge='pallas' against the attention reference, with many splits
    (more than some sequences have tiles), the default split count, a sequence of length zero and a
    window; and equal to the kernel with the XLA merge up to the merges' own rounding."""
    cache, bt, sl, _ = build(cfg, [9 * 32 + 5, 40, 3 * 32], 2, 64, 32, rng)
    bt = jnp.concatenate([bt, bt[:1]])
    sl = jnp.concatenate([sl, jnp.zeros(1, jnp.int32)])
    q = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.float32)
    sid = jnp.array([0, 1, 2, 0], jnp.int32)
    rot = kj.parse(cfg).rotated
    for window, splits in ((None, 5), (50, 3), (None, None)):  # None: the default split count
        ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, seq_ids=sid, impl="reference", window=window))
        outs = {}
        for merge in ("xla", "pallas") if splits == 5 else ("pallas",):
            o = pdp.paged_decode_pallas(rotate(q) if rot else q, cache, bt, sl, sid, scale=0.125, window=window,
                                        interpret=INTERPRET,
                                        launch=pdp.Launch(num_splits=splits, orient=orient, merge=merge))
            outs[merge] = np.asarray(unrotate(o) if rot else o)
        np.testing.assert_allclose(outs["pallas"], ref, rtol=0, atol=4e-3 * np.abs(ref).max())
        if "xla" in outs:
            np.testing.assert_allclose(outs["pallas"], outs["xla"], rtol=0, atol=1e-5 * np.abs(ref).max())
        assert (outs["pallas"][3] == 0).all()
    with pytest.raises(ValueError, match="merge must be 'xla', 'pallas' or 'kernel'"):
        pdp.paged_decode_pallas(q, cache, bt, sl, sid, scale=0.125, window=None, interpret=True,
                                launch=pdp.Launch(merge="host"))
    with pytest.raises(ValueError, match="merge='kernel' needs one split"):
        pdp.paged_decode_pallas(q, cache, bt, sl, sid, scale=0.125, window=None, interpret=True,
                                launch=pdp.Launch(merge="kernel", num_splits=2))


def pallas_call_outputs(fn, *args):
    """Shapes of the outputs of every pallas_call `fn` traces to (through nested jaxprs)."""
    import jax
    from jax.extend import core as jex_core

    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                shapes.append([tuple(v.aval.shape) for v in eqn.outvars])
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes


@pytest.mark.parametrize("cfg, orient, q_heads", [("kvarn_k4v2_g32", "tokens", 8), ("int4", "heads", 8),
                                                  ("int8", "tokens", 4), ("kvarn_k4v4_g32", "tokens", 16)])
def test_one_split_is_finished_in_the_kernel(cfg, orient, q_heads, rng):
    """One split and a GQA group of a power of two: the decode kernel normalizes its output and
    stores the channels in order itself (merge='kernel', the default there) - against the
    attention reference, equal to the XLA merge of the same partials up to its rounding, a
    sequence of length zero giving zeros, a window; and no merge runs after the kernel (its only
    output is the final [B, Hk, group, D/vp, vp] array)."""
    cache, bt, sl, _ = build(cfg, [9 * 32 + 5, 40, 3 * 32, 7], 2, 64, 32, rng, max_seqs=5)
    bt = jnp.concatenate([bt, bt[:1]])
    sl = jnp.concatenate([sl, jnp.zeros(1, jnp.int32)])
    q = jnp.asarray(rng.standard_normal((5, q_heads, 64)), jnp.float32)
    rot = kj.parse(cfg).rotated
    qr = rotate(q) if rot else q
    for window in (None, 50):
        ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference", window=window))
        outs = {}
        for merge in ("xla", "kernel", None):
            o = pdp.paged_decode_pallas(qr, cache, bt, sl, None, scale=0.125, window=window, interpret=INTERPRET,
                                        launch=pdp.Launch(num_splits=1, orient=orient, merge=merge))
            outs[merge] = np.asarray(unrotate(o) if rot else o)
        np.testing.assert_allclose(outs["kernel"], ref, rtol=0, atol=4e-3 * np.abs(ref).max())
        np.testing.assert_allclose(outs["kernel"], outs["xla"], rtol=0, atol=1e-6 * np.abs(ref).max())
        np.testing.assert_array_equal(outs[None], outs["kernel"])
        assert (outs["kernel"][4] == 0).all()
    vp = pdp.LayoutPlan(kj.parse(cfg), 64, max(kj.parse(cfg).tile_tokens, 32)).vp   # value planes (4 for 2-bit values)
    for window in (None, 50):
        shapes = pallas_call_outputs(lambda q: pdp.paged_decode_pallas(q, cache, bt, sl, None, scale=0.125, window=window,
                                                                       interpret=True, launch=pdp.Launch(num_splits=1, orient=orient)), qr)
        assert shapes == [[(5, 2, q_heads // 2, 64 // vp, vp)]]


def test_one_split_merges_outside_for_other_groups(rng):
    """GQA groups that are not a power of two (1, 3) keep a merge after the kernel (the kernel's
    Gp axis is a power of two); merge='kernel' is refused for them."""
    cache, bt, sl, _ = build("kvarn_k4v2_g32", [100, 40], 2, 64, 32, rng)
    for q_heads in (2, 6):
        q = rotate(jnp.asarray(rng.standard_normal((2, q_heads, 64)), jnp.float32))
        ref = np.asarray(kj.paged_decode_attention(unrotate(q), cache, bt, sl, impl="reference"))
        o = np.asarray(unrotate(pdp.paged_decode_pallas(q, cache, bt, sl, None, scale=0.125, window=None,
                                                        interpret=INTERPRET, launch=pdp.Launch(num_splits=1))))
        np.testing.assert_allclose(o, ref, rtol=0, atol=4e-3 * np.abs(ref).max())
        with pytest.raises(ValueError, match="a GQA group that is a power of two"):
            pdp.paged_decode_pallas(q, cache, bt, sl, None, scale=0.125, window=None, interpret=True,
                                    launch=pdp.Launch(num_splits=1, merge="kernel"))


def test_group_rows_and_value_planes():
    """The partial outputs' geometry the entry and the merge share: Gp rows a program computes
    (8 tokens-major, 16 heads-major, else the group's power of two) and the heads stored (the
    group's power of two, at least 2); value planes = codes per byte for the integer schemes."""
    assert pdp.group_rows(4, tokens_major=True) == (8, 4)
    assert pdp.group_rows(7, tokens_major=False) == (16, 8)
    assert pdp.group_rows(1, tokens_major=True) == (8, 2)
    assert pdp.group_rows(12, tokens_major=True) == (16, 16)
    assert [pdp.value_planes(kj.parse(c)) for c in ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "int8", "fp8")] == [4, 2, 1, 1]


@pytest.mark.parametrize("cfg, want", [("kvarn_k4v2_g128", "pallas"), ("kvarn_k4v2_g64", "pallas"),
                                       ("kvarn_k4v4_g128", "xla"), ("kivi_k2v2_g128", "xla"), ("int8", "xla")])
def test_default_merge(cfg, want):
    assert pdp.default_merge(kj.parse(cfg)) == want


def test_pallas_merge_lowers_for_cuda():
    """Both layouts lower to Triton for CUDA, at B=1 / 128K's 256 splits and a padded 200."""
    from helpers import lower_for_cuda
    for heads_axis, inner, splits in ((-1, (32, 8), 256), (-2, (16, 128), 200)):
        gp = inner[1] if heads_axis == -1 else inner[0]
        sp = sm.padded_splits(splits)
        text = lower_for_cuda(lambda a, m, l: sm.merge_splits_pallas(a, m, l, splits=splits, heads_axis=heads_axis),
                              jnp.zeros((1, 8, sp, 2) + inner), jnp.zeros((1, 8, sp, gp)), jnp.zeros((1, 8, sp, gp)))
        assert "kvarn_decode_split_merge" in text
