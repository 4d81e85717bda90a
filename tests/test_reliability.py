"""Finite input never comes back NaN, a bad token never spreads past itself, and nothing is dropped
without a word: properties over schemes x dtypes x magnitudes up to the dtype's max x NaN/Inf
positions x eager/jit, plus the cases found by probing the public API (issue 38)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvarn_jax as kj
from kvarn_jax.storage import QUANT_MAX

BS, HK, D, T = 32, 2, 32, 80  # two full blocks (sink + one quantized) and a partial one
SCHEMES = ["kvarn_k4v2_g32", "kvarn_k8v8_g32", "kivi_k2v4_g32", "int8", "int4_g16", "int2", "fp8", "fp16", "bf16",
           "fp32", "int8_static", "fp8_static"]
DTYPES = ["float16", "bfloat16", "float32"]
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def _calibration(cfg, scale):
    if not kj.parse(cfg).static:
        return None
    z = jnp.full((HK, D), scale, jnp.float32)
    return kj.Calibration(-z, z, -z, z, tokens=1)


def _data(seed, dtype, magnitude, constant_tokens):
    """Random K/V of `magnitude` (the dtype's max at the top: finite, clipped there), with some tokens
    constant over their channels: the vectors that KVarN's rotation concentrates into one channel."""
    rng = np.random.default_rng(seed)
    big = float(jnp.finfo(jnp.dtype(dtype)).max)
    x = rng.standard_normal((2, T, HK, D)) * magnitude
    for t in constant_tokens:
        x[:, t] = magnitude * rng.choice([-1.0, 1.0])
    return np.clip(x, -big, big)


def _cache(cfg, dtype, scale):
    return kj.PagedKVCache.create(cfg, num_blocks=3, block_size=BS, num_kv_heads=HK, head_dim=D, max_seqs=1,
                                  dtype=dtype, calibration=_calibration(cfg, scale))


def _write_args(x, dtype):
    pos = jnp.arange(T, dtype=jnp.int32)
    return (jnp.asarray(x[0], dtype), jnp.asarray(x[1], dtype), pos, jnp.zeros(T, jnp.int32), pos)


_jit_write = jax.jit(lambda c, k, v, s, i, p: kj.write(c, k, v, s, seq_ids=i, positions=p))


@settings(max_examples=16)
@given(cfg=st.sampled_from(SCHEMES), dtype=st.sampled_from(DTYPES),
       exponent=st.sampled_from([-6, 0, 2, 4, 5, 15, 16, 17, 40, 60, 128]),
       bad=st.lists(st.tuples(st.integers(0, T - 1), st.integers(0, 1), st.integers(0, HK - 1), st.integers(0, D - 1),
                              st.sampled_from(sorted(BAD))), max_size=2),
       constant=st.lists(st.integers(0, T - 1), max_size=2), seed=st.integers(0, 2 ** 16))
def test_finite_in_finite_out_and_bad_tokens_stay_alone(cfg, dtype, exponent, bad, constant, seed):
    """Jitted: every value attention can read is finite; each NaN/Inf token is stored as zeros and
    counted, and the cache is bit for bit the one a write with those tokens zeroed gives (no other
    token, of its tile or elsewhere, changes). Eager: a call either stores every token as given
    (nothing counted) or raises ValueError saying why, leaving nothing written."""
    magnitude = 2.0 ** exponent
    x = _data(seed, dtype, magnitude, constant)
    clean = x.copy()
    for t, side, h, d, kind in bad:
        x[side, t, h, d] = BAD[kind]
        clean[:, t] = 0.0  # a bad token is stored as zeros, K and V
    bad_tokens = {t for t, *_ in bad}
    cache = _cache(cfg, dtype, scale=min(magnitude, 1e4))
    tables, lens = jnp.arange(3, dtype=jnp.int32)[None], jnp.array([T], jnp.int32)

    got = _jit_write(cache, *_write_args(x, dtype))
    ref = _jit_write(cache, *_write_args(clean, dtype))
    for a, b in zip(jax.tree.leaves(dataclasses.replace(got, dropped_tokens=0)),
                    jax.tree.leaves(dataclasses.replace(ref, dropped_tokens=0))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(got.dropped_tokens) >= len(bad_tokens) and int(got.dropped_tokens) - int(ref.dropped_tokens) == len(bad_tokens)
    kd, vd = kj.gather_dense(got, tables, lens)
    assert np.isfinite(np.asarray(kd)).all() and np.isfinite(np.asarray(vd)).all()
    for t in bad_tokens:  # the bad token itself reads back as zeros where it is kept exactly
        if t < BS or t >= 2 * BS:
            assert not np.asarray(kd[0, :, t]).any() and not np.asarray(vd[0, :, t]).any()

    if bad_tokens:
        with pytest.raises(ValueError, match="non-finite"):
            kj.write(cache, *_write_args(x, dtype)[:3], seq_ids=jnp.zeros(T, jnp.int32), positions=jnp.arange(T))
    try:
        eager = kj.write(cache, *_write_args(clean, dtype)[:3], seq_ids=jnp.zeros(T, jnp.int32), positions=jnp.arange(T))
    except ValueError as e:  # only for values the cache cannot hold, which the jitted write counted
        assert "cannot hold" in str(e) or "exceed" in str(e), e
        assert int(ref.dropped_tokens) > 0
    else:
        assert int(eager.dropped_tokens) == 0 == int(ref.dropped_tokens)
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # attention over it: finite at every magnitude (stored values are within ±2^50, so fp32 scores are too)
    q = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((1, 2 * HK, D)), jnp.float32)
    out = kj.paged_decode_attention(q, got, tables, lens, impl="reference")
    assert np.isfinite(np.asarray(out)).all()


@settings(max_examples=12)
@given(cfg=st.sampled_from([s for s in SCHEMES if "static" not in s]), dtype=st.sampled_from(DTYPES),
       exponent=st.sampled_from([-6, 0, 5, 15, 16, 17, 60, 128]),
       bad=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 1), st.sampled_from(sorted(BAD))), max_size=2),
       jit=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_quantize_never_returns_non_finite(cfg, dtype, exponent, bad, jit, seed):
    """Whole tensors: dequantize(quantize(x)) is finite; under jit a NaN/Inf token changes only
    itself (the fields equal those of the input with it zeroed); eagerly it is refused."""
    rng = np.random.default_rng(seed)
    big = float(jnp.finfo(jnp.dtype(dtype)).max)
    x = np.clip(rng.standard_normal((2, 64, HK, D)) * 2.0 ** exponent, -big, big)
    clean = x.copy()
    for t, side, kind in bad:
        x[side, t, 0, 3] = BAD[kind]
        clean[:, t] = 0.0  # a bad token is stored as zeros, K and V
    kv = (jnp.asarray(x[0], dtype), jnp.asarray(x[1], dtype))
    kv_clean = (jnp.asarray(clean[0], dtype), jnp.asarray(clean[1], dtype))
    if not jit:
        if bad:
            with pytest.raises(ValueError, match="non-finite"):
                kj.quantize(kv, cfg)
        try:
            q = kj.quantize(kv_clean, cfg)
        except ValueError as e:
            assert "cannot store" in str(e), e
            return
        out = kj.dequantize(q)
    else:
        f = jax.jit(lambda k, v: kj.quantize((k, v), cfg))
        q, q_clean = f(*kv), f(*kv_clean)
        for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(q_clean)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        out = jax.jit(kj.dequantize)(q)
    assert all(np.isfinite(np.asarray(o, np.float32)).all() for o in out)


# --------------------------------------------------------------------------------- the probed cases
@pytest.mark.parametrize("value", [5800.0, 1e4, 65504.0])
def test_float16_kvarn_token_beyond_the_rotated_range(value):
    """One fp16 token whose 128 channels are all 5,800 has a rotated channel of 65,612 (1e4: 113,137),
    beyond fp16: it was stored as inf, and its whole key tile and decode output became NaN. Now it
    is stored saturated and counted (jitted), or refused (eager); the rest of its tile is unchanged."""
    d, bs = 128, 32
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3 * bs, 1, d)).astype(np.float16)
    v = rng.standard_normal((3 * bs, 1, d)).astype(np.float16)
    k[40], v[40] = value, value
    cache = kj.PagedKVCache.create("kvarn_k4v2_g32", num_blocks=3, block_size=bs, num_kv_heads=1, head_dim=d,
                                   max_seqs=1, dtype=jnp.float16)
    pos = jnp.arange(3 * bs, dtype=jnp.int32)
    args = (cache, jnp.asarray(k), jnp.asarray(v), pos, jnp.zeros(3 * bs, jnp.int32), pos)
    out = _jit_write(*args)
    assert int(out.dropped_tokens) == (1 if value * np.sqrt(d) > 65504 else 0)
    tables, lens = jnp.arange(3, dtype=jnp.int32)[None], jnp.array([3 * bs], jnp.int32)
    kd, vd = kj.gather_dense(out, tables, lens)
    assert np.isfinite(np.asarray(kd)).all() and np.isfinite(np.asarray(vd)).all()
    q = jnp.asarray(rng.standard_normal((1, 4, d)), jnp.float16)
    assert np.isfinite(np.asarray(kj.paged_decode_attention(q, out, tables, lens, impl="reference"))).all()
    if value * np.sqrt(d) > 65504:
        with pytest.raises(ValueError, match="L2 norm exceeds 65,504"):
            kj.write(*args[:4], seq_ids=args[4], positions=args[5])


@pytest.mark.parametrize("cfg", ["int8", "int4", "int2", "kivi_k2v2_g32", "kvarn_k4v2_g32", "fp8"])
def test_bfloat16_values_beyond_float16_are_kept(cfg, rng):
    """Scales are stored in the cache's dtype: bf16 data beyond 65,504 (a 7e4 token, a constant 1e4
    tile) round-trips as accurately as small data did, where fp16 scales made it all NaN."""
    x = rng.standard_normal((2, 64, 2, 64)) * 3
    x[:, 5] = 7e4            # one large token
    x[:, 32:64, 1] = 1e4     # a constant tile of head 1
    k, v = (jnp.asarray(a, jnp.bfloat16) for a in x)
    kh, vh = kj.dequantize(kj.quantize((k, v), cfg))
    for a, b in ((kh, k), (vh, v)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all()
        bound = {"int8": 0.01, "fp8": 0.07}.get(cfg, 0.6)  # relative error of the large values
        np.testing.assert_allclose(a[5], b[5], rtol=bound, atol=bound * 7e4)
        np.testing.assert_allclose(a[32:64, 1], b[32:64, 1], rtol=bound, atol=bound * 1e4)
    # and through the cache, decode attention dominated by the large token stays finite and right
    cache = kj.PagedKVCache.create(cfg, num_blocks=2, block_size=32, num_kv_heads=2, head_dim=64, max_seqs=1,
                                   dtype=jnp.bfloat16)
    pos = jnp.arange(64, dtype=jnp.int32)
    cache = kj.write(cache, k, v, pos, seq_ids=jnp.zeros(64, jnp.int32), positions=pos)
    out = kj.paged_decode_attention(jnp.ones((1, 2, 64), jnp.float32), cache, jnp.array([[0, 1]], jnp.int32),
                                    jnp.array([64], jnp.int32), impl="reference")
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("scheme, stored", [("int8_hpfp32", QUANT_MAX), ("int8", 65504.0)])
def test_values_beyond_the_quantization_bound_are_clipped_and_counted(scheme, stored):
    """A float32 cache clips at QUANT_MAX; its default sink (float16) saturates at float16's maximum."""
    x = jnp.full((32, 1, 32), 1e30, jnp.float32)
    cache = kj.PagedKVCache.create(scheme, num_blocks=2, block_size=32, num_kv_heads=1, head_dim=32, max_seqs=1,
                                   dtype=jnp.float32)
    pos = jnp.arange(32, dtype=jnp.int32)
    out = _jit_write(cache, x, x, pos, jnp.zeros(32, jnp.int32), pos)
    assert int(out.dropped_tokens) == 32
    assert float(jnp.max(out.sink["k"])) == stored
    with pytest.raises(ValueError, match="beyond"):
        kj.write(cache, x, x, pos, seq_ids=jnp.zeros(32, jnp.int32), positions=pos)


def test_eager_write_quantizes_every_block_it_completes():
    """Three tokens that fill the last slots of three blocks of one sequence (max_seqs=1): the static
    bound of such a write is one block, so the jitted write quantizes one and counts the others; the
    eager call quantizes all three (it was silently dropping two)."""
    bs = 32
    cache = kj.PagedKVCache.create("int8", num_blocks=4, block_size=bs, num_kv_heads=1, head_dim=32, max_seqs=1)
    pos = jnp.array([2 * bs - 1, 3 * bs - 1, 4 * bs - 1], jnp.int32)
    k = jnp.ones((3, 1, 32), jnp.float16) * jnp.arange(1, 4, dtype=jnp.float16)[:, None, None]
    args = (k, k, pos, )
    jitted = _jit_write(cache, *args, jnp.zeros(3, jnp.int32), pos)
    assert int(jitted.dropped_tokens) == 2 * bs
    eager = kj.write(cache, *args, seq_ids=jnp.zeros(3, jnp.int32), positions=pos)
    assert int(eager.dropped_tokens) == 0
    tables, lens = jnp.arange(4, dtype=jnp.int32)[None], jnp.array([4 * bs], jnp.int32)
    for c, pages in ((eager, (1, 2)), (jitted, (1,))):  # blocks 1, 2 read from their pages (3: the query's)
        kd, _ = kj.gather_dense(c, tables, lens)
        for j in (1, 2):
            got = float(kd[0, 0, (j + 1) * bs - 1, 0])
            assert (abs(got - j) < 0.05) == (j in pages), (j, got)


def test_small_argument_errors(tmp_path):
    cache = kj.PagedKVCache.create("int8", num_blocks=np.int64(4), block_size=np.int32(32), num_kv_heads=1,
                                   head_dim=32, max_seqs=np.int64(2))  # NumPy ints are ints
    assert cache.num_blocks == 4 and isinstance(cache.num_blocks, int)
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        kj.PagedKVCache.create("int8", num_blocks=True, block_size=32, num_kv_heads=1, head_dim=32, max_seqs=1)
    with pytest.raises(ValueError, match="max_seqs must be a positive int"):
        kj.PagedKVCache.create("int8", num_blocks=2, block_size=32, num_kv_heads=1, head_dim=32, max_seqs=2.0)
    with pytest.raises(ValueError, match="cache must be a PagedKVCache"):
        kj.memory_report(None)
    pos = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="same shape and dtype"):
        kj.write(cache, jnp.ones((4, 1, 32), jnp.float32), jnp.ones((4, 1, 32), jnp.float16), pos,
                 seq_ids=jnp.zeros(4, jnp.int32), positions=pos)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = -5 .*>= 0"):
        kj.paged_decode_attention(jnp.ones((1, 1, 32)), cache, jnp.zeros((1, 2), jnp.int32),
                                  jnp.array([-5], jnp.int32))
    bad = tmp_path / "bad.kvcal"
    bad.write_bytes(b"not a calibration")
    with pytest.raises(ValueError, match="bad.kvcal"):
        kj.Calibration.load(bad)
    with pytest.raises(ValueError, match="missing.kvcal.*does not exist"):
        kj.Calibration.load(tmp_path / "missing.kvcal")
    np.savez(tmp_path / "other.npz", meta=np.frombuffer(b'{"format": "x"}', np.uint8))
    with pytest.raises(ValueError, match="other.npz.*does not name"):
        kj.Calibration.load(tmp_path / "other.npz")


def test_bytes_per_token_follows_the_metadata_dtype():
    assert kj.bytes_per_token("kvarn_k4v2_g128", 128) == 108.0
    assert kj.bytes_per_token("kvarn_k4v2_g128", 128, "bfloat16") == 108.0
    assert kj.bytes_per_token("kvarn_k4v2_g128", 128, "float32") == 120.0
    for dtype in DTYPES:
        c = kj.PagedKVCache.create("int4", num_blocks=2, block_size=32, num_kv_heads=2, head_dim=64, max_seqs=1,
                                   dtype=dtype)
        assert kj.memory_report(c)["bytes_per_token_per_head"] == kj.bytes_per_token("int4", 64, dtype)
        assert c.pages["k"]["scale"].dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("fn", [kj.rotate, kj.unrotate])
def test_rotation_bound_clips_instead_of_testing_rows(fn, rng):
    """`max_abs` (the hot paths' overflow guard): exact where the row is within it, the clipped row's
    rotation beyond it, finite for any finite input; the default (per-row test) also stays finite."""
    x = jnp.asarray(rng.standard_normal((5, 64)) * 10.0 ** rng.uniform(-3, 6, (5, 1)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(fn(x, max_abs=QUANT_MAX)), np.asarray(fn(x)))
    huge = x.at[2, 7].set(3e38).at[3].set(-3e38)
    got = fn(huge, max_abs=QUANT_MAX)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(jnp.clip(huge, -QUANT_MAX, QUANT_MAX))))
    assert bool(jnp.all(jnp.isfinite(got))) and bool(jnp.all(jnp.isfinite(fn(huge))))
    with pytest.raises(ValueError, match="max_abs"):
        fn(x, max_abs=2.0 ** 101)


@pytest.mark.parametrize("fn", [kj.rotate, kj.unrotate])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_rotation_is_the_same_rotation(fn, dtype, rng):
    """`one_token` (decode at batch 1: a product and a sum over D, not a matrix product) gives the
    matrix product's values up to fp32 rounding, with either overflow guard, and stays finite."""
    d = 128
    x = jnp.asarray(rng.standard_normal((1, 3, d)) * 10.0 ** rng.uniform(-3, 4, (1, 3, 1)), dtype)
    for kw in ({}, {"max_abs": QUANT_MAX}):
        got = np.asarray(fn(x, jnp.float32, one_token=True, **kw), np.float64)
        want = np.asarray(fn(x, jnp.float32, **kw), np.float64)
        scale = np.abs(want).max(axis=-1, keepdims=True)
        assert (np.abs(got - want) / scale).max() < 1e-6  # per row: rows differ by 10^7 in size
        assert not np.array_equal(got, np.zeros_like(got))
    huge = jnp.asarray(x, jnp.float32).at[0, 1, 5].set(3e38).at[0, 2].set(-3e38)
    assert bool(jnp.all(jnp.isfinite(fn(huge, one_token=True)))) and bool(
        jnp.all(jnp.isfinite(fn(huge, one_token=True, max_abs=QUANT_MAX))))
