"""The evaluation tools end to end on a tiny local model (a few hundred tokens): eval, report-errors, tune,
and the metrics, windows, error and layer-file pieces they are built from, each against an
independent computation."""

import itertools
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvarn_jax as kj
from kvarn_jax.data import load_text
from kvarn_jax.evaluation.agreement import compare_continuations
from kvarn_jax.evaluation.cli import main
from kvarn_jax.evaluation.errors import LayerActivations, error_report, layer_errors
from kvarn_jax.layer_config import load_layer_config, write_layer_config
from kvarn_jax.evaluation.perplexity import _Accumulator, text_token_ids, token_windows
from kvarn_jax.evaluation.tune import bits_per_element, choose_schemes, parse_fraction
from test_eval_support import one_torch_thread, tiny_model_folder

_one_thread = pytest.fixture(autouse=True)(one_torch_thread)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model", num_layers=2, head_dim=32)


def _reference_nll(folder, start_char, window, n):
    """Mean NLL of the unquantized model, computed independently of the evaluation code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = tok(load_text()[start_char:], add_special_tokens=False)["input_ids"]
    total = count = 0.0
    with torch.no_grad():
        for w in range(n):
            x = torch.tensor(ids[w * window:(w + 1) * window])[None]
            lp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
            total += float(-lp.gather(1, x[0, 1:, None]).sum())
            count += window - 1
    return total / count


def test_eval_end_to_end(folder, tmp_path, capsys):
    layers = tmp_path / "mixed.json"
    write_layer_config(layers, ["int8", "int4"], block_size=32, model={"num_layers": 2, "head_dim": 32})
    out, png = tmp_path / "eval.json", tmp_path / "pareto.png"
    rc = main(["eval", "--model", str(folder), "--tokens", "384", "--window", "192", "--block-size", "32",
               "--kv-cache-dtype", f"int8,int2_g32,fp16,{layers}", "--greedy-prompts", "2", "--prompt-tokens", "40",
               "--new-tokens", "24", "--json", str(out), "--plot", str(png), "--no-progress", "--continuation-nll",
               "--position-buckets", "64,128"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "int2_g32" in text and "KL (nats)" in text and "front" in text and "Expect about" in text
    assert "by position in the window" in text and "64-127" in text and "cont. NLL" in text
    doc = json.loads(out.read_text())
    ref = doc["reference"]
    assert ref["tokens"] == 2 * 191
    assert ref["nll"] == pytest.approx(_reference_nll(folder, 5000, 192, 2), rel=1e-5)
    rows = {r["scheme"]: r for r in doc["rows"]}
    assert set(rows) == {"int8", "int2_g32", "fp16", "mixed"}
    assert rows["fp16"]["ppl"] == pytest.approx(ref["ppl"], rel=1e-4)
    assert rows["fp16"]["kl_mean"] < 1e-5 and rows["fp16"]["top1_agreement"] > 0.99
    assert 0 < rows["int8"]["kl_mean"] < rows["int2_g32"]["kl_mean"]
    assert rows["int2_g32"]["top1_agreement"] < rows["int8"]["top1_agreement"]
    for name in ("int8", "int2_g32", "fp16"):
        bpt = kj.bytes_per_token(name, 32)
        assert rows[name]["bits_per_element"] == pytest.approx(8 * bpt / 64)
        assert rows[name]["kv_bytes_per_token"] == pytest.approx(bpt * 2 * 2)
        assert rows[name]["capacity_vs_fp16"] == pytest.approx(128 / bpt)
    assert rows["mixed"]["layers"] == ["int8", "int4"]
    mixed_bits = (bits_per_element("int8", 32) + bits_per_element("int4", 32)) / 2
    assert rows["mixed"]["bits_per_element"] == pytest.approx(mixed_bits)
    assert rows["fp16"]["first_divergence"] == [24, 24] and rows["fp16"]["identical_fraction"] == 1.0
    assert rows["fp16"]["median_first_divergence"] == 24
    assert 0 <= rows["int2_g32"]["identical_fraction"] <= 1
    # by position: buckets [1, 64), [64, 128), [128, 192) whose tokens add up to the whole
    assert [(b["start"], b["end"]) for b in ref["buckets"]] == [(1, 64), (64, 128), (128, 192)]
    for r in rows.values():
        assert sum(b["tokens"] for b in r["buckets"]) == r["tokens"]
        assert sum(b["kl_mean"] * b["tokens"] for b in r["buckets"]) / r["tokens"] == pytest.approx(r["kl_mean"], rel=1e-6, abs=1e-12)
    # an fp16 cache continues exactly as the reference: the same NLL under the unquantized model
    assert rows["fp16"]["mean_continuation_nll"] == pytest.approx(rows["fp16"]["reference_continuation_nll"], rel=1e-6)
    assert all(r["reference_continuation_nll"] == rows["fp16"]["reference_continuation_nll"] for r in rows.values())
    assert all(len(r["continuation_nll"]) == 2 and r["mean_continuation_nll"] > 0 for r in rows.values())
    pareto = tmp_path / "both.png"
    assert main(["pareto", str(out), "--out", str(pareto)]) == 0
    assert pareto.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pareto.stat().st_size > 5000
    assert main(["pareto", str(layers), "--out", str(pareto)]) == 2
    assert "is not an `eval --json` file" in capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    for name, r in rows.items():   # the Pareto front of bits vs KL, computed independently
        assert r["kl_mean"] >= 0
        dominated = any(o["bits_per_element"] <= r["bits_per_element"] and o["kl_mean"] < r["kl_mean"]
                        for o in rows.values() if o is not r)
        assert r["pareto_front"] == (not dominated), name


def test_eval_rejects_bad_arguments(folder, capsys):
    assert main(["eval", "--model", str(folder), "--tokens", "300", "--window", "192"]) == 2
    assert "multiple of --window" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder), "--kv-cache-dtype", "int3"]) == 2
    assert main(["eval", "--model", str(folder), "--kv-cache-dtype", "int8,kvarn_k4v2_g128", "--block-size", "64"]) == 2
    assert "kvarn_k4v2_g128: --block-size=64" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder / "nope")]) == 2
    assert f"--model '{folder / 'nope'}' does not exist" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder), "--kv-cache-dtype", "int8_static"]) == 2
    assert "int8_static needs a calibration" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder), "--text", str(folder / "none.txt")]) == 2
    assert "--text" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder), "--window", "192", "--tokens", "192", "--position-buckets", "500"]) == 2
    assert "--position-buckets" in capsys.readouterr().err
    three = folder.parent / "three.json"
    write_layer_config(three, ["int8"] * 3, block_size=32)
    assert main(["eval", "--model", str(folder), "--kv-cache-dtype", str(three), "--block-size", "32", "--tokens",
                 "192", "--window", "192"]) == 2
    assert "three: the layer-scheme file has 3 layers but the model has 2" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder), "--tokens", "99999744", "--window", "192"]) == 2
    assert "tokens" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [256, 7])   # one step, and several steps with a ragged last one
def test_accumulator_matches_numpy(rng, rows, monkeypatch):
    monkeypatch.setattr(_Accumulator, "ROWS", rows)
    ref = rng.standard_normal((50, 11)) * 2
    got = ref + rng.standard_normal((50, 11)) * 0.5
    tgt = rng.integers(0, 11, 50)
    acc = _Accumulator((1, 20, 37, 51))
    ref_lp = torch.log_softmax(torch.tensor(ref, dtype=torch.float32), -1)
    pos = torch.tensor(rng.permutation(np.arange(1, 51)))     # predicted positions, in any order
    acc.add(torch.tensor(got, dtype=torch.float32), torch.tensor(tgt), ref_lp, ref_lp.argmax(-1), pos)
    r = acc.result("x")

    def logsm(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = logsm(ref), logsm(got)
    nll, kl = -lq[np.arange(50), tgt], (np.exp(lp) * (lp - lq)).sum(-1)
    agree = ref.argmax(-1) == got.argmax(-1)
    assert r.nll == pytest.approx(nll.mean(), rel=1e-5)
    assert r.ppl == pytest.approx(math.exp(r.nll))
    assert r.kl_mean == pytest.approx(kl.mean(), rel=1e-4)
    assert r.top1_agreement == pytest.approx(agree.mean())
    assert r.tokens == 50
    assert [(b.start, b.end, b.tokens) for b in r.buckets] == [(1, 20, 19), (20, 37, 17), (37, 51, 14)]
    for b in r.buckets:
        sel = ((pos >= b.start) & (pos < b.end)).numpy()
        assert b.nll == pytest.approx(nll[sel].mean(), rel=1e-5)
        assert b.kl_mean == pytest.approx(kl[sel].mean(), rel=1e-4)
        assert b.top1_agreement == pytest.approx(agree[sel].mean())


def test_windows_and_text():
    ids = list(range(1000))
    w = token_windows(ids, 128, 3)
    assert w.shape == (3, 128) and w[2, 0] == 256 and w.dtype == torch.long
    with pytest.raises(ValueError, match="need 1024"):
        token_windows(ids, 256, 4)
    with pytest.raises(ValueError, match="window"):
        token_windows(ids, 1, 1)

    class Tok:
        def __call__(self, text, add_special_tokens):
            assert add_special_tokens is False
            return {"input_ids": [ord(c) for c in text]}

    text = load_text()
    assert len(text) <= 300_000 and text.startswith("Persuasion")
    assert text_token_ids(Tok(), text, 5000)[:5] == [ord(c) for c in text[5000:5005]]
    with pytest.raises(ValueError, match="start_char"):
        text_token_ids(Tok(), text, len(text))


def test_compare_continuations():
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    got = torch.tensor([[1, 2, 9, 4], [5, 6, 7, 8]])
    r = compare_continuations("x", got, ref)
    assert r.first_divergence == (2, 4) and r.identical_fraction == pytest.approx(7 / 8)
    assert r.mean_first_divergence == 3
    with pytest.raises(ValueError, match="shape"):
        compare_continuations("x", got[:, :3], ref)


def _acts(rng, layers=2, t=128, hk=2, d=32):
    out = []
    for _ in range(layers):
        q = torch.from_numpy(rng.standard_normal((1, 4, t, d)).astype(np.float32))
        k = torch.from_numpy(rng.standard_normal((1, hk, t, d)).astype(np.float32))
        v = torch.from_numpy(rng.standard_normal((1, hk, t, d)).astype(np.float32))
        out.append(LayerActivations(q, k, v, scaling=d ** -0.5))
    return out


def test_error_report_flags_planted_outlier_and_matches_direct_errors(rng):
    acts = _acts(rng)
    acts[1].k[:, 1, :, 5] *= 50.0      # layer 1, kv head 1, channel 5
    rep = error_report(acts, ["int2_g32", "int8"], block_size=32, outlier_ratio=8.0, progress=False)
    assert [(o["layer"], o["kv_head"], o["channel"]) for o in rep["outliers"]] == [(1, 1, 5)]
    assert rep["outliers"][0]["ratio"] > 20
    assert max(max(r) for r in rep["key_channel_ratio_max"][:1]) < 8
    for key in ("k", "v", "attn"):
        for li in range(2):
            for h in range(2):
                assert rep["schemes"]["int2_g32"][key][li][h] > 5 * rep["schemes"]["int8"][key][li][h] > 0
    # K error computed directly: kvarn_jax round trip of the quantized region of one sequence
    e = layer_errors(acts[0], "int2_g32", block_size=32)
    k = acts[0].k[0, :, 32:128].permute(1, 0, 2).numpy()
    kh, _ = kj.dequantize(kj.quantize((jnp.asarray(k), jnp.asarray(k)), "int2_g32"))
    direct = np.linalg.norm(np.asarray(kh) - k, axis=(0, 2)) / np.linalg.norm(k, axis=(0, 2))
    np.testing.assert_allclose(e["k"], direct, rtol=1e-5)
    with pytest.raises(ValueError, match="at least 3"):
        layer_errors(_acts(rng, layers=1, t=64)[0], "int8", block_size=32)


def test_report_errors_cli(folder, tmp_path):
    out, png, text = tmp_path / "err.json", tmp_path / "err.png", tmp_path / "text.txt"
    text.write_text(load_text()[20000:40000], encoding="utf-8")
    assert main(["report-errors", "--model", str(folder), "--tokens", "256", "--window", "128", "--block-size", "32",
                 "--text", str(text), "--start-char", "0", "--kv-cache-dtype", "int8,int2_g32", "--json", str(out),
                 "--plot", str(png), "--no-progress"]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["schemes"]) == {"int8", "int2_g32"}
    assert np.array(rep["schemes"]["int8"]["attn"]).shape == (2, 2)
    assert rep["tokens"] == 256 and len(rep["summary"]) == 4
    assert png.read_bytes()[:4] == b"\x89PNG"


COSTLY = ("int2_g32", "int4", "int8")   # 3.0, 5.0 and 9.0 bits per element at head_dim 32


@given(costs=st.lists(st.lists(st.floats(0, 10), min_size=3, max_size=3), min_size=1, max_size=5),
       budget=st.floats(3.0, 9.5))
def test_choose_schemes_is_optimal(costs, budget):
    costs = np.array(costs)
    bits = [bits_per_element(c, 32) for c in COSTLY]
    assert bits == [3.0, 5.0, 9.0]
    picks = choose_schemes(costs, COSTLY, 32, budget, block_size=32)
    idx = [COSTLY.index(p) for p in picks]
    assert np.mean([bits[i] for i in idx]) <= budget + 1e-9
    best = min(sum(costs[li, c] for li, c in enumerate(combo))
               for combo in itertools.product(range(3), repeat=len(costs))
               if np.mean([bits[c] for c in combo]) <= budget + 1e-9)
    assert sum(costs[li, c] for li, c in enumerate(idx)) == pytest.approx(best, abs=1e-9)


def test_choose_schemes_rejects():
    with pytest.raises(ValueError, match="below the cheapest"):
        choose_schemes(np.ones((2, 3)), COSTLY, 32, 2.5, block_size=32)
    with pytest.raises(ValueError, match="costs"):
        choose_schemes(np.ones((2, 2)), COSTLY, 32, 5.0, block_size=32)
    assert parse_fraction("1%") == pytest.approx(0.01) and parse_fraction("0.02") == 0.02
    with pytest.raises(ValueError, match="max_ppl_increase"):
        parse_fraction("lots")


def test_layer_config_round_trip_and_validation(tmp_path):
    p = tmp_path / "l.json"
    doc = write_layer_config(p, ["KVARN", "int4"], block_size=128, model={"head_dim": 64}, budget_bits=4.0)
    assert doc["layers"] == ["kvarn_k4v2_g128", "int4"] and doc["model"]["num_layers"] == 2
    assert load_layer_config(p) == ["kvarn_k4v2_g128", "int4"]
    assert load_layer_config(p, num_layers=2) == ["kvarn_k4v2_g128", "int4"]
    with pytest.raises(ValueError, match="num_layers=3"):
        load_layer_config(p, num_layers=3)

    def bad(obj, match):
        q = tmp_path / "bad.json"
        q.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        with pytest.raises(ValueError, match=match):
            load_layer_config(q)

    base = {"format": "kvarn-jax/layer-schemes", "version": 1, "layers": ["int8"]}
    bad("{not json", "not valid JSON")
    bad({**base, "format": "x"}, "format")
    bad({**base, "version": 2}, "version 2")
    bad({**base, "layers": []}, "non-empty")
    bad({**base, "layers": ["int3"]}, r"layers\[0\]")
    bad({**base, "layers": ["int8_static"]}, "calibration")
    bad({**base, "layers": ["kvarn_k4v2_g128"], "block_size": 64}, "block_size")
    bad({**base, "layers": ["kvarn_k4v2_g128"], "model": {"head_dim": 48}}, "head_dim")
    bad({**base, "model": {"num_layers": 4}}, "num_layers is 4")


def _fake_check(ppl_of):
    """A stand-in for evaluate_perplexity whose perplexities are fixed per config name (on a random
    model quantization noise moves perplexity either way, so the outcomes are set here)."""
    from kvarn_jax.evaluation import perplexity

    def check(model, windows, schemes, **kw):
        res = {perplexity.REFERENCE: perplexity.PerplexityResult(perplexity.REFERENCE, 10, 2.0, math.exp(2.0), 0, 1)}
        for name in schemes:
            ppl = ppl_of(name) * math.exp(2.0)
            res[name] = perplexity.PerplexityResult(name, 10, math.log(ppl), ppl, 0.1, 0.9)
        return res
    return check


def test_tune_cli(folder, tmp_path, capsys):
    out = tmp_path / "tuned.json"
    common = ["tune", "--model", str(folder), "--candidates", ",".join(COSTLY), "--window", "128", "--block-size", "32",
              "--calib-tokens", "128", "--tokens", "256", "--no-progress"]
    assert main(common + ["--budget-bits", "7.0", "--out", str(out)]) == 0
    layers = load_layer_config(out, num_layers=2)
    doc = json.loads(out.read_text())
    assert np.mean([bits_per_element(s, 32) for s in layers]) <= 7.0
    assert doc["mean_bits_per_element"] <= 7.0 and np.array(doc["layer_costs"]).shape == (2, 3)
    # every uniform candidate within the budget was checked on the same tokens, and the best was written
    check = doc["check"]
    assert check["reference"]["ppl_increase"] == 0
    assert {"uniform int2_g32", "uniform int4"} <= set(check) and "uniform int8" not in check
    assert doc["chosen"] == min((n for n in check if n != "reference"), key=lambda n: check[n]["ppl"])
    text = capsys.readouterr().out
    assert "wins" in text and "<- written" in text

    from kvarn_jax.evaluation import perplexity
    strict = tmp_path / "strict.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(perplexity, "evaluate_perplexity", _fake_check(lambda name: 1.05))
        assert main(common + ["--budget-bits", "3.0", "--max-ppl-increase", "4%", "--out", str(strict)]) == 1
        assert "FAILED" in capsys.readouterr().err and not strict.exists()
        assert main(common + ["--budget-bits", "3.0", "--max-ppl-increase", "6%", "--out", str(strict)]) == 0
    assert load_layer_config(strict) == ["int2_g32", "int2_g32"]
    assert json.loads(strict.read_text())["max_ppl_increase"] == pytest.approx(0.06)
    assert main(common + ["--budget-bits", "2.0", "--out", str(tmp_path / "x.json")]) == 2
    assert "--budget-bits 2.0 is below the cheapest candidate" in capsys.readouterr().err


def test_tune_never_writes_a_config_worse_than_a_uniform_one(folder, tmp_path, capsys):
    """The per-layer choice loses to uniform int4 on the check: the file holds uniform int4 and the
    output says by how much; when the per-layer choice wins, it is written and the margin is given."""
    from kvarn_jax.evaluation import perplexity

    common = ["tune", "--model", str(folder), "--candidates", ",".join(COSTLY), "--window", "128", "--block-size", "32",
              "--calib-tokens", "128", "--tokens", "256", "--no-progress", "--budget-bits", "7.0"]
    lost, won = tmp_path / "lost.json", tmp_path / "won.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(perplexity, "evaluate_perplexity",
                   _fake_check(lambda n: {"per-layer": 1.02, "uniform int4": 1.01}.get(n, 1.5)))
        assert main(common + ["--out", str(lost)]) == 0
        text = capsys.readouterr().out
        mp.setattr(perplexity, "evaluate_perplexity",
                   _fake_check(lambda n: {"per-layer": 1.01, "uniform int4": 1.02}.get(n, 1.5)))
        assert main(common + ["--out", str(won)]) == 0
        text_won = capsys.readouterr().out
    doc = json.loads(lost.read_text())
    assert doc["layers"] == ["int4", "int4"] and doc["chosen"] == "uniform int4"
    assert doc["per_layer_choice"] != ["int4", "int4"]   # what the knapsack picked, kept for the record
    assert doc["mean_bits_per_element"] == pytest.approx(bits_per_element("int4", 32))
    assert "uniform int4 wins" in text and "(0.99% higher): writing uniform int4 for every layer" in text
    doc = json.loads(won.read_text())
    assert doc["chosen"] == "per-layer" and doc["layers"] == doc["per_layer_choice"]
    assert "the per-layer choice wins" in text_won and "int4 (0.99% higher)" in text_won


def test_tune_no_verify_says_what_was_not_checked(folder, tmp_path, capsys):
    out = tmp_path / "nv.json"
    assert main(["tune", "--model", str(folder), "--candidates", ",".join(COSTLY), "--window", "128", "--block-size",
                 "32", "--calib-tokens", "128", "--tokens", "256", "--no-progress", "--budget-bits", "7.0",
                 "--no-verify", "--out", str(out)]) == 0
    assert "not checked (--no-verify)" in capsys.readouterr().out
    assert json.loads(out.read_text())["chosen"] == "per-layer (not checked)"
    assert main(["tune", "--model", str(folder), "--budget-bits", "4", "--no-verify", "--max-ppl-increase", "1%"]) == 2
    assert "drop --no-verify" in capsys.readouterr().err


def test_continuation_nll_matches_full_forward(folder):
    """`continuation_nll` against log-probs of one plain forward over prompt + continuation."""
    from transformers import AutoModelForCausalLM

    from kvarn_jax.evaluation.agreement import continuation_nll

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompts, cont = torch.randint(0, vocab, (3, 11), generator=g), torch.randint(0, vocab, (3, 300), generator=g)
    got = continuation_nll(model, prompts, cont, max_batch_tokens=500)   # 1 row per forward, 2 head chunks
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.cat([prompts, cont], 1)).logits.double(), -1)
    want = -lp[:, 10:-1].gather(2, cont[..., None])[..., 0].mean(1)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)
