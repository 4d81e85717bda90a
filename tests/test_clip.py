"""Clipped-range RTN (the `_clip` suffix): grammar, the search itself, and the schemes that use it.

The search must never do worse than the row's min..max (ratio 1 is a candidate and wins ties), must
find the known gain on Gaussian rows, and the schemes with `_clip` must store the same fields as
without (only the values change). The quantize kernel runs the same math: `test_quantize_kernel.py`
and `test_kernels_lower_for_gpu.py` include `_clip` schemes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvarn_jax as kj
from kvarn_jax import schemes
from kvarn_jax.schemes import kivi as kivi_scheme
from kvarn_jax.schemes import kvarn as kvarn_scheme
from kvarn_jax.schemes import per_token
from kvarn_jax.schemes.rtn import clip_ratios, clip_search, rtn_codes, rtn_params


def _err(x, q, lo, scale, w=None):
    e = (q.astype(jnp.float32) * scale[..., None] + lo[..., None] - x) ** 2
    return jnp.sum(e if w is None else e * w, axis=-1)


def _rtn_err(x, lo, scale, bits, w=None):
    return _err(x, rtn_codes(x, lo, scale, bits), lo, scale, w)


@pytest.mark.parametrize("text,name", [("kvarn_k4v2_g128_clip", "kvarn_k4v2_g128_clip"), ("KVARN_CLIP", "kvarn_k4v2_g128_clip"),
                                       ("kivi_k2v2_g32_clip", "kivi_k2v2_g32_clip"), ("int4_clip", "int4_clip"),
                                       ("int2_g32_clip", "int2_g32_clip"), ("int_k8v4_g64_clip", "int_k8v4_g64_clip"),
                                       ("kvarn_k4v2_g128_clipv", "kvarn_k4v2_g128_clipv"), ("int4_clipv", "int4_clipv")])
def test_grammar_round_trip(text, name):
    cfg = kj.parse(text)
    assert cfg.clip and cfg.name == name and kj.parse(cfg.name) == cfg
    assert cfg.clip_keys == name.endswith("_clip")
    base = kj.parse(name.rsplit("_clip", 1)[0])
    assert cfg != base and hash(cfg) != hash(base)
    # same stored fields, so the same bytes per token
    for side in ("k", "v"):
        assert schemes.side_fields(cfg, side, 128) == schemes.side_fields(base, side, 128)
    assert kj.bytes_per_token(cfg, 128) == kj.bytes_per_token(base, 128)


@pytest.mark.parametrize("text", ["int8_static_clip", "fp8_clip", "fp8_static_clip", "fp16_clip", "kvarn_k4v2_g128_clip_clip",
                                  "clip", "kvarn_k3v2_g128_clip", "fp8_clipv", "int4_clipv_clip", "kvarn_clip_clipv"])
def test_grammar_refuses(text):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kj.parse(text)


def test_hand_built_config_refuses_clip_where_it_does_not_apply():
    with pytest.raises(ValueError, match="clip"):
        kj.KVQuantConfig("fp8", 8, 8, clip=True)
    with pytest.raises(ValueError, match="clip"):
        kj.KVQuantConfig("int", 8, 8, static=True, clip=True)
    with pytest.raises(ValueError, match="clip must be a bool"):
        kj.KVQuantConfig("int", 8, 8, clip=1)
    with pytest.raises(ValueError, match="clip_keys"):
        kj.KVQuantConfig("int", 8, 8, clip_keys=False)


def test_values_only_clip_leaves_keys_as_without(rng):
    k, v = (jnp.asarray(rng.standard_normal((256, 2, 64)), jnp.float16) for _ in range(2))
    for scheme in ("kvarn_k4v2_g128", "kivi_k2v2_g32", "int4"):
        base, v_only, both = (kj.quantize((k, v), scheme + s) for s in ("", "_clipv", "_clip"))
        for a, b in zip(jax.tree_util.tree_leaves(base.fields["k"]), jax.tree_util.tree_leaves(v_only.fields["k"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree_util.tree_leaves(both.fields["v"]), jax.tree_util.tree_leaves(v_only.fields["v"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ratios_start_at_one_and_decrease():
    for b in (2, 3, 4, 8):
        r = clip_ratios(b)
        assert r[0] == 1.0 and all(a > c > 0 for a, c in zip(r, r[1:]))


def test_key_grid_is_the_milder_one():
    for b in (2, 3, 4, 8):
        k, v = clip_ratios(b, "k"), clip_ratios(b, "v")
        assert len(k) == len(v) and k[0] == v[0] == 1.0 and min(k) > min(v)
        assert clip_ratios(b) == v
    with pytest.raises(ValueError, match="side"):
        clip_ratios(4, "q")


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g128_clip", "kivi_k2v2_g32_clip", "int_k4v4_g32_clip"])
def test_each_side_searches_its_own_grid(scheme, rng):
    # heavy-tailed tiles, so that the two grids pick differently somewhere
    cfg = kj.parse(scheme)
    x = jnp.asarray(rng.standard_t(3, (2, 128, 64)), jnp.float32)
    if cfg.method == "int":
        x = x.reshape(-1, 64)
    for side in ("k", "v"):
        got = schemes.quantize_side(x, cfg, side)
        b = cfg.bits(side)
        own, other = ({"kvarn": kvarn_scheme.quantize(x, side, b, cfg.sinkhorn_iters, clip=r),
                       "kivi": kivi_scheme.quantize(x, side, b, cfg.group, clip=r),
                       "int": per_token.int_quantize(x, b, cfg.channel_group(side, 64), clip=r)}[cfg.method]
                      for r in (clip_ratios(b, side), clip_ratios(b, "v" if side == "k" else "k")))
        for name in got:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(own[name]), err_msg=f"{side} {name}")
        assert any(not np.array_equal(np.asarray(got[n]), np.asarray(other[n])) for n in got), side


@settings(max_examples=15, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 6), n=st.sampled_from([8, 32, 128]),
       seed=st.integers(0, 2 ** 31 - 1), weighted=st.booleans(), heavy=st.booleans())
def test_search_never_worse_than_min_max(bits, rows, n, seed, weighted, heavy):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, (rows, n)) if heavy else rng.standard_normal((rows, n)) * rng.uniform(0.01, 100)
    x = jnp.asarray(x + rng.normal(size=(rows, 1)) * 3, jnp.float32)
    w = jnp.asarray(rng.uniform(0.1, 10, (1, n)), jnp.float32) if weighted else None
    q, lo, scale = clip_search(x, bits, weights=w)
    assert q.dtype == jnp.uint8 and int(q.max()) <= 2 ** bits - 1
    mn, s0 = rtn_params(x, bits)
    got, full = _err(x, q, lo, scale, w), _rtn_err(x, mn, s0, bits, w)
    # min..max's codes here come from a division, in the search from a reciprocal product
    assert bool(jnp.all(got <= full * (1 + 1e-5) + 1e-30)), (got, full)
    assert bool(jnp.all(jnp.isfinite(lo))) and bool(jnp.all(scale > 0))


def test_search_keeps_min_max_where_clipping_cannot_help():
    # 4 distinct values on a 2-bit grid: min..max represents them exactly
    x = jnp.asarray(np.random.default_rng(0).integers(0, 4, (5, 64)) * 0.5 - 1.0, jnp.float32)
    x = x.at[:, 0].set(-1.0).at[:, 1].set(0.5)
    q, lo, scale = clip_search(x, 2)
    mn, s0 = rtn_params(x, 2)
    np.testing.assert_array_equal(np.asarray(lo), np.asarray(mn))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(s0))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(rtn_codes(x, mn, s0, 2)))
    # a constant row: nothing to clip, exact and finite
    q, lo, scale = clip_search(jnp.full((2, 16), 3.0), 4)
    assert np.all(np.asarray(_err(jnp.full((2, 16), 3.0), q, lo, scale)) == 0) and np.all(np.isfinite(np.asarray(scale)))


@pytest.mark.parametrize("bits,gain", [(2, 1.7), (4, 1.05)])
def test_gaussian_rows_gain(bits, gain):
    # 2-bit RTN over min..max of 128 Gaussian values: ~0.25 sigma^2; best clipped range ~0.118
    x = jax.random.normal(jax.random.PRNGKey(bits), (4000, 128))
    q, lo, scale = clip_search(x, bits)
    mn, s0 = rtn_params(x, bits)
    ratio = float(jnp.mean(_rtn_err(x, mn, s0, bits)) / jnp.mean(_err(x, q, lo, scale)))
    assert ratio > gain, ratio
    # unbiased: the dequantized rows are not shrunk (an MSE-optimal 2-bit range gives ~0.87 x)
    xh = q.astype(jnp.float32) * scale[:, None] + lo[:, None]
    slope = float(jnp.sum(xh * x) / jnp.sum(x * x))
    assert abs(slope - 1) < 0.01, slope


@pytest.mark.parametrize("scheme,dtype", [("kvarn_k4v2_g128", jnp.float16), ("kvarn_k2v2_g64", jnp.bfloat16),
                                          ("kivi_k2v2_g32", jnp.float32), ("kivi_k4v4_g128", jnp.float16),
                                          ("int4", jnp.bfloat16), ("int2_g32", jnp.float16), ("int_k8v4", jnp.bfloat16)])
def test_clip_scheme_lowers_round_trip_error(scheme, dtype, rng):
    t, h, d = 256, 2, 64
    k = rng.standard_normal((t, h, d)) * rng.uniform(0.2, 3, (1, 1, d))
    k[:, :, 3] += 8.0                                   # an outlier key channel
    v = rng.standard_normal((t, h, d))
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    base, clip = kj.quantize((k, v), scheme), kj.quantize((k, v), scheme + "_clip")
    assert jax.tree_util.tree_structure(base.fields) == jax.tree_util.tree_structure(clip.fields)
    for a, b in zip(jax.tree_util.tree_leaves(base.fields), jax.tree_util.tree_leaves(clip.fields)):
        assert a.shape == b.shape and a.dtype == b.dtype
    errs = {}
    for name, q in (("base", base), ("clip", clip)):
        kh, vh = kj.dequantize(q)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in (kh, vh))
        errs[name] = [float(jnp.mean((a.astype(jnp.float32) - b.astype(jnp.float32)) ** 2)) for a, b in ((kh, k), (vh, v))]
    # per side: never clearly worse (the search ranks before the scales are rounded to `dtype`), and
    # the 2-bit side clearly better
    for side in (0, 1):
        assert errs["clip"][side] <= errs["base"][side] * 1.02, (errs, side)
    cfg = kj.parse(scheme)
    for side, b in ((0, cfg.k_bits), (1, cfg.v_bits)):
        if b == 2:
            assert errs["clip"][side] < 0.75 * errs["base"][side], (errs, side)


def test_kvarn_clip_codes_against_stored_bf16_scales(rng):
    # Rotated keys far from zero (outlier channels with a bias, as Qwen2.5's): bf16 keeps 8 bits of
    # a folded zero point, so codes must be chosen against it as stored, or every such channel is
    # shifted by its rounding (the error then exceeded min..max's: 1.02x, and 1.22x float32's).
    t, h, d = 512, 2, 128
    off = np.zeros(d)
    idx = rng.choice(d, 12, replace=False)
    off[idx] = rng.uniform(8, 80, 12) * rng.choice([-1, 1], 12)
    k = rng.standard_normal((t, h, d)) + off
    v = rng.standard_normal((t, h, d))

    def key_err(scheme, dtype):
        kk, vv = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        kh, _ = kj.dequantize(kj.quantize((kk, vv), scheme))
        return float(jnp.mean((kh.astype(jnp.float32) - kk.astype(jnp.float32)) ** 2))

    clip16, base16 = key_err("kvarn_k4v2_g128_clip", jnp.bfloat16), key_err("kvarn_k4v2_g128", jnp.bfloat16)
    clip32 = key_err("kvarn_k4v2_g128_clip", jnp.float32)
    assert clip16 < 0.95 * base16 and clip16 < 1.12 * clip32, (clip16, base16, clip32)


def test_ascend_refuses_clip():
    cache = pytest.importorskip("kvarn_ascend.cache")
    with pytest.raises(ValueError, match="clipped-range"):
        cache.scheme_kind(kj.parse("kvarn_k4v2_g128_clip"), 128)
