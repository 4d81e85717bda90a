"""`kvarn-jax tune` aimed at KL: layer costs scaled by each layer's own KL (--costs kl), the written
config chosen by KL (--select kl), schemes of any size reported beside it (--compare), costs reused
(--costs-from). The pieces against independent computations, the command on a tiny local model."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn_jax.evaluation.cli import main
from kvarn_jax.evaluation.tune import (bits_per_element, candidate_scaled_costs, choose_schemes, costs_from_file,
                                       kl_scaled_costs, one_layer_configs, pick_winner)
from kvarn_jax.layer_config import load_layer_config, write_layer_config
from test_eval_support import one_torch_thread, tiny_model_folder

_one_thread = pytest.fixture(autouse=True)(one_torch_thread)

CANDIDATES = ("int2_g32", "int4", "int8")   # 3.0, 5.0 and 9.0 bits per element at head_dim 32


def _cost_shapes(test):
    """Run `test(layers, cands, seed)` on cost tables of random shapes (values drawn from the seed)."""
    shapes = given(layers=st.integers(1, 6), cands=st.integers(1, 4), seed=st.integers(0, 2 ** 31 - 1))
    return settings(max_examples=30, deadline=None)(shapes(test))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model", num_layers=2, head_dim=32)


@_cost_shapes
def test_kl_scaled_costs_puts_each_layer_on_its_kl_scale(layers, cands, seed):
    rng = np.random.default_rng(seed)
    attn = rng.uniform(0.01, 1.0, (layers, cands))
    kl = rng.uniform(0.0, 0.1, layers)
    probe = int(rng.integers(cands))
    out = kl_scaled_costs(attn, probe, kl)
    for li in range(layers):
        # the probe's cost is that layer's measured KL; the other candidates keep their ratio to it
        assert out[li, probe] == pytest.approx(kl[li], rel=1e-12, abs=1e-15)
        for ci in range(cands):
            assert out[li, ci] == pytest.approx(kl[li] * attn[li, ci] / attn[li, probe], rel=1e-12, abs=1e-15)


def test_kl_scaled_costs_change_the_choice():
    """Layer 1 has the smaller attention error but is 10x as sensitive: with KL costs it gets the bits."""
    attn = np.array([[1.0, 0.1], [0.8, 0.08]])
    cands = CANDIDATES[:2]
    budget = (bits_per_element("int2_g32", 32) + bits_per_element("int4", 32)) / 2   # one layer may take int4
    assert choose_schemes(attn, cands, 32, budget, block_size=32) == ["int4", "int2_g32"]
    scaled = kl_scaled_costs(attn, 0, [0.01, 0.1])
    assert choose_schemes(scaled, cands, 32, budget, block_size=32) == ["int2_g32", "int4"]


def test_kl_scaled_costs_rejects():
    with pytest.raises(ValueError, match="no attention error in layers \\[1\\]"):
        kl_scaled_costs(np.array([[1.0, 0.5], [0.0, 0.2]]), 0, [0.1, 0.2])
    with pytest.raises(ValueError, match="one value per layer"):
        kl_scaled_costs(np.ones((2, 2)), 0, [0.1])
    with pytest.raises(ValueError, match="probe 2"):
        kl_scaled_costs(np.ones((2, 2)), 2, [0.1, 0.1])
    with pytest.raises(ValueError, match="finite"):
        kl_scaled_costs(np.ones((2, 2)), 0, [0.1, np.nan])
    # a hair below zero (float rounding of an almost exact layer) costs nothing, never a negative cost
    assert kl_scaled_costs(np.ones((1, 2)), 0, [-1e-12]).min() == 0.0


@_cost_shapes
def test_candidate_scaled_costs_match_each_candidates_measured_kl(layers, cands, seed):
    rng = np.random.default_rng(seed)
    costs = rng.uniform(0.01, 1.0, (layers, cands))
    kl = rng.uniform(0.0, 0.1, cands)
    out = candidate_scaled_costs(costs, kl)
    np.testing.assert_allclose(out.sum(axis=0), kl, rtol=1e-12, atol=1e-15)   # each column sums to its KL
    np.testing.assert_allclose(out * costs.sum(axis=0), costs * kl, rtol=1e-12, atol=1e-15)   # its shape is kept


def test_candidate_scaled_costs_edge_cases():
    # an exact candidate (no cost anywhere) stays free; a KL a hair below zero counts as zero
    out = candidate_scaled_costs(np.array([[0.0, 1.0], [0.0, 3.0]]), [0.5, -1e-12])
    assert np.array_equal(out, np.zeros((2, 2)))
    with pytest.raises(ValueError, match="one value per candidate"):
        candidate_scaled_costs(np.ones((2, 2)), [0.1])
    with pytest.raises(ValueError, match="finite"):
        candidate_scaled_costs(np.ones((2, 2)), [0.1, np.inf])


def test_pick_winner_by_kl_or_perplexity():
    check = {"a": {"ppl": 10.0, "kl_mean": 0.02, "bits_per_element": 3.0},
             "b": {"ppl": 10.5, "kl_mean": 0.01, "bits_per_element": 3.0},
             "c": {"ppl": 10.5, "kl_mean": 0.01, "bits_per_element": 2.5}}
    assert pick_winner(check) == "a" and pick_winner(check, "ppl") == "a"
    assert pick_winner(check, "kl") == "c"            # ties on KL go to fewer bits
    with pytest.raises(ValueError, match="select"):
        pick_winner(check, "nll")


def test_one_layer_configs():
    cfgs = one_layer_configs("int4", 3)
    assert cfgs == {"layer 0": ["int4", None, None], "layer 1": [None, "int4", None], "layer 2": [None, None, "int4"]}


def test_costs_from_file_checks_what_it_reuses(tmp_path):
    p = tmp_path / "t.json"
    costs = np.random.default_rng(1).uniform(size=(2, 3))
    write_layer_config(p, ["int4", "int4"], block_size=32, model={"head_dim": 32}, candidates=list(CANDIDATES),
                       layer_costs=costs.tolist(), costs="kl")
    got, kind = costs_from_file(p, CANDIDATES, 2)
    assert kind == "kl" and np.array_equal(got, costs)
    with pytest.raises(ValueError, match="--costs-from .*same --candidates"):
        costs_from_file(p, CANDIDATES[::-1], 2)
    with pytest.raises(ValueError, match=r"--costs-from .*\(3, 3\)"):
        costs_from_file(p, CANDIDATES, 3)
    q = tmp_path / "q.json"
    q.write_text(json.dumps({"layers": ["int4"]}))
    with pytest.raises(ValueError, match="no layer_costs"):
        costs_from_file(q, CANDIDATES, 1)


def _common(folder):
    return ["tune", "--model", str(folder), "--candidates", ",".join(CANDIDATES), "--window", "128", "--block-size",
            "32", "--calib-tokens", "128", "--tokens", "256", "--no-progress"]


def test_tune_kl_end_to_end(folder, tmp_path, capsys):
    import torch

    from kvarn_jax.evaluation import errors
    from kvarn_jax.evaluation.cli import _windows
    from kvarn_jax.evaluation.loading import load_model_and_tokenizer
    from kvarn_jax.evaluation.perplexity import evaluate_perplexity

    out = tmp_path / "kl.json"
    assert main(_common(folder) + ["--budget-bits", "5.0", "--costs", "kl", "--select", "kl",
                                   "--compare", "int8,int4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["costs"] == "kl" and doc["select"] == "kl" and doc["compare"] == ["int8", "int4"]

    # probe_kl[i]: KL with only layer i quantized by the cheapest candidate, on the calibration windows
    model, tok, _ = load_model_and_tokenizer(str(folder))
    args = type("A", (), {"text": None, "start_char": 5000, "window": 128})()
    calib, _, _ = _windows(args, tok, 128, offset_windows=2)
    res = evaluate_perplexity(model, calib, {"0": ["int2_g32", None], "1": [None, "int2_g32"],
                                             **{c: c for c in CANDIDATES}}, block_size=32, progress=False)
    assert doc["probe_kl"] == pytest.approx([res["0"].kl_mean, res["1"].kl_mean], rel=1e-6)
    assert res["0"].kl_mean != pytest.approx(res["1"].kl_mean, rel=1e-3)
    uniform = [res[c].kl_mean for c in CANDIDATES]
    assert doc["uniform_kl"] == pytest.approx(uniform, rel=1e-6)
    # costs: the attention errors, each layer scaled by its KL under the probe, each candidate by its KL
    attn = np.array([[np.mean(np.square(errors.layer_errors(a, c, block_size=32)["attn"])) for c in CANDIDATES]
                     for a in errors.capture_activations(model, calib, block_size=32)])
    by_layer = attn * (np.array(doc["probe_kl"]) / attn[:, 0])[:, None]
    np.testing.assert_allclose(doc["layer_costs"], by_layer * (np.array(uniform) / by_layer.sum(0))[None, :],
                               rtol=1e-6)
    np.testing.assert_allclose(np.sum(doc["layer_costs"], axis=0), uniform, rtol=1e-6)

    check = doc["check"]
    # int8 is over the budget: measured as a comparison only, never a candidate for the file
    assert "compare int8" in check and "uniform int8" not in check
    # int4 is within the budget: measured once, as a candidate
    assert "compare int4" not in check
    assert "uniform int4" in check or doc["per_layer_choice"] == ["int4", "int4"]
    eligible = [n for n in check if n == "per-layer" or n.startswith("uniform ")]
    assert doc["chosen"] == min(eligible, key=lambda n: (check[n]["kl_mean"], check[n]["bits_per_element"]))
    for n, v in check.items():
        assert v["kl_vs_compare"] == pytest.approx(v["kl_mean"] / check["compare int8"]["kl_mean"])
    assert "KL / int8's" in text and "x int8's" in text
    assert doc["mean_bits_per_element"] <= 5.0 + 1e-9

    # the same costs, reused at another budget: no activations are recorded
    again = tmp_path / "again.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(errors, "capture_activations", lambda *a, **k: pytest.fail("costs were measured again"))
        assert main(_common(folder) + ["--budget-bits", "3.0", "--costs-from", str(out), "--no-verify",
                                       "--out", str(again)]) == 0
    reused = json.loads(again.read_text())
    assert reused["layer_costs"] == doc["layer_costs"] and reused["costs"] == "kl" and reused["costs_from"] == str(out)
    assert load_layer_config(again) == ["int2_g32", "int2_g32"]
    assert torch.get_num_threads() == 1


def test_tune_kl_flag_errors(folder, tmp_path, capsys):
    out = str(tmp_path / "x.json")
    assert main(_common(folder) + ["--budget-bits", "4", "--no-verify", "--compare", "int8", "--out", out]) == 2
    assert "--compare is measured in the check" in capsys.readouterr().err
    assert main(_common(folder) + ["--budget-bits", "4", "--no-verify", "--select", "kl", "--out", out]) == 2
    assert "--select kl chooses on the check" in capsys.readouterr().err
    assert main(_common(folder) + ["--budget-bits", "4", "--compare", "int3", "--out", out]) == 2
    assert "--compare 'int3'" in capsys.readouterr().err
    assert main(_common(folder) + ["--budget-bits", "4", "--costs-from", str(tmp_path / "none.json"), "--out", out]) == 2
    assert "--costs-from" in capsys.readouterr().err
    other = tmp_path / "other.json"
    write_layer_config(other, ["int4", "int4"], block_size=32, candidates=["int4", "int8"], layer_costs=[[1, 2], [1, 2]])
    assert main(_common(folder) + ["--budget-bits", "4", "--costs-from", str(other), "--out", out]) == 2
    assert "same --candidates" in capsys.readouterr().err
