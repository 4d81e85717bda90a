import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvarn_jax as kj
from helpers import random_kv


def layered_samples(rng, batches=3, layers=2, tokens=64, heads=2, dim=64):
    out = []
    for _ in range(batches):
        k, v = zip(*(random_kv(rng, tokens, heads, dim, dtype=np.float32, outliers=2) for _ in range(layers)))
        out.append((jnp.asarray(np.stack(k)), jnp.asarray(np.stack(v))))
    return out


def test_statistics_are_min_max_over_all_samples(rng):
    samples = layered_samples(rng)
    cal = kj.calibrate(samples, "int8_static")
    allk = np.concatenate([np.asarray(k) for k, _ in samples], axis=1)
    np.testing.assert_array_equal(np.asarray(cal.k_min), allk.min(1))
    np.testing.assert_array_equal(np.asarray(cal.k_max), allk.max(1))
    assert cal.num_layers == 2 and cal.tokens == 3 * 64


def test_save_load_round_trip(tmp_path, rng):
    cal = kj.calibrate(layered_samples(rng), "fp8_static")
    path = tmp_path / "cal.kvcal"
    cal.save(path)
    back = kj.Calibration.load(path)
    for a, b in zip(jax.tree_util.tree_leaves(cal), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.tokens == cal.tokens
    bad = tmp_path / "other.npz"
    np.savez(bad, x=np.zeros(3))
    with pytest.raises(ValueError, match="not a readable kvarn_jax calibration: it holds no calibration metadata"):
        kj.Calibration.load(bad)


@pytest.mark.parametrize("cfg", ["int8_static", "int4_static", "int_k8v4_static", "fp8_static"])
def test_static_schemes_use_fixed_scales(cfg, rng):
    samples = layered_samples(rng)
    cal = kj.calibrate(samples, cfg)
    k, v = samples[0][0][1], samples[0][1][1]
    q = kj.quantize((k, v), cfg, calibration=cal.layer(1))
    # fixed scales: no per-token metadata is stored, only codes
    assert set(q.fields["k"]) == {"codes"}
    kh, vh = kj.dequantize(q)
    bound = {"int8_static": 0.02, "int_k8v4_static": 0.02, "int4_static": 0.3, "fp8_static": 0.04}[cfg]
    assert np.linalg.norm(kh - k) / np.linalg.norm(k) < bound
    # the scales really are fixed: scaling one token up does not change the other tokens' codes
    k2 = k.at[0].multiply(3.0)
    q2 = kj.quantize((k2, v), cfg, calibration=cal.layer(1))
    np.testing.assert_array_equal(np.asarray(q2.fields["k"]["codes"][1:]), np.asarray(q.fields["k"]["codes"][1:]))
    dyn = kj.quantize((k2, v), cfg.replace("_static", ""))
    assert not np.array_equal(np.asarray(dyn.fields["k"]["scale"][0]), np.asarray(kj.quantize((k, v), cfg.replace("_static", "")).fields["k"]["scale"][0]))


def test_static_int8_reconstructs_within_calibrated_range(rng):
    samples = layered_samples(rng, batches=1, layers=1)
    cal = kj.calibrate(samples)
    k, v = samples[0][0][0], samples[0][1][0]
    kh, _ = kj.dequantize(kj.quantize((k, v), "int8_static", calibration=cal))
    step = (np.asarray(cal.k_max[0]) - np.asarray(cal.k_min[0])) / 255
    assert (np.abs(np.asarray(kh, np.float32) - np.asarray(k)) <= step[None] * 0.5 + 2e-3 * np.abs(np.asarray(k)) + 1e-6).all()


def test_compare_reports_static_vs_dynamic(rng):
    samples = layered_samples(rng)
    cal = kj.calibrate(samples, "int8_static")
    rep = cal.compare(samples, "int8_static")
    assert rep["static"] == "int8_static" and rep["dynamic"] == "int8"
    for side in ("k", "v"):
        assert 0 < rep[side]["dynamic"] < 0.02 and 0 < rep[side]["static"] < 0.05


def test_vmap_over_layers_with_calibration(rng):
    samples = layered_samples(rng, batches=1)
    cal = kj.calibrate(samples, "fp8_static")
    k, v = samples[0]
    q = jax.vmap(lambda k, v, c: kj.quantize((k, v), "fp8_static", calibration=c))(k, v, cal)
    for layer in range(2):
        ql = kj.quantize((k[layer], v[layer]), "fp8_static", calibration=cal.layer(layer))
        np.testing.assert_array_equal(np.asarray(q.fields["k"]["codes"][layer]), np.asarray(ql.fields["k"]["codes"]))


def test_calibration_errors(rng):
    samples = layered_samples(rng)
    with pytest.raises(ValueError, match="does not use a calibration"):
        kj.calibrate(samples, "kvarn_k4v2_g128")
    with pytest.raises(ValueError, match="samples is empty"):
        kj.calibrate([])
    cal = kj.calibrate(samples)
    k, v = samples[0][0][0], samples[0][1][0]
    with pytest.raises(ValueError, match=r"calibration has 2 layers; pass one layer's"):
        kj.quantize((k, v), "int8_static", calibration=cal)
    with pytest.raises(ValueError, match="layer index 5 is out of range"):
        cal.layer(5)
    with pytest.raises(ValueError, match=r"calibration is for \[kv_heads, head_dim\]"):
        kj.quantize((k[:, :1], v[:, :1]), "int8_static", calibration=cal.layer(0))
    bad = np.asarray(samples[0][0]).copy()
    bad[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match=r"samples\[0\] k contains 1 non-finite"):
        kj.calibrate([(jnp.asarray(bad), samples[0][1])])
