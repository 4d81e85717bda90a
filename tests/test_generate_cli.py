"""`kvarn-jax generate` on the default model (SmolLM2-135M-Instruct) and the generation benchmark's CPU smoke run."""

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest

import kvarn_jax as kj
from kvarn_jax.cli import main

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time", "The capital of France is"]
MIB = 2 ** 20
# SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64
LAYERS, HEADS, D = 30, 3, 64
MEMORY_RE = re.compile(r"^memory: (\S+): ([\d.]+) MiB for (\d+) tokens x (\d+) layer\(s\) \(pages ([\d.]+) MiB, "
                       r"high-precision sink\+tail ([\d.]+) MiB for (\d+) seqs\); fp16 would need ([\d.]+) MiB "
                       r"-> ([\d.]+)x", re.M)
RATE_RE = re.compile(r"^prefill: (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\); decode: (\d+) tokens in [\d.]+ s "
                     r"\(([\d.]+) tokens/s\)", re.M)


def _run_cli(scheme, path):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["generate", *PROMPTS, "--max-new-tokens", "8", "--kv-cache-dtype", scheme, "--quiet",
                   "--json", str(path)])
    return rc, buf.getvalue(), json.loads(path.read_text())


def _check_run(scheme, rc, text, js):
    assert rc == 0
    assert f"kv cache: {scheme}, block size 128" in text and "SmolLM2-135M-Instruct" in text
    for prompt, row in zip(PROMPTS, js["results"]):
        assert row["prompt"] == prompt and row["text"].strip() and row["text"] in text
        assert len(row["output_ids"]) == 8 or row["finish_reason"] == "stop"
    m = RATE_RE.search(text)
    assert m, text
    prompt_tokens = sum(r["prompt_tokens"] for r in js["results"])
    generated = sum(len(r["output_ids"]) for r in js["results"])
    assert int(m.group(1)) == prompt_tokens and int(m.group(3)) == generated - len(PROMPTS)  # first token: prefill
    assert float(m.group(2)) > 0 and float(m.group(4)) > 0

    # the memory line, checked against bytes computed here: one 128-token page per prompt
    m = MEMORY_RE.search(text)
    assert m, text
    name, total, tokens, layers, pages, hp, seqs, fp16, ratio = m.groups()
    hp_seqs = 0 if scheme == "fp16" else len(PROMPTS)  # passthrough caches have no high-precision storage
    assert (name, int(tokens), int(layers), int(seqs)) == (scheme, 128 * len(PROMPTS), LAYERS, hp_seqs)
    fp16_bytes = int(tokens) * HEADS * D * 2 * 2 * LAYERS
    page_bytes = kj.bytes_per_token(scheme, D) * int(tokens) * HEADS * LAYERS
    # quantized schemes keep the sink and the tail block of each sequence in the model dtype (float32 on CPU)
    hp_bytes = 0 if scheme == "fp16" else len(PROMPTS) * 2 * 128 * HEADS * D * 2 * 4 * LAYERS
    assert float(fp16) == pytest.approx(fp16_bytes / MIB, abs=0.006)
    assert float(pages) == pytest.approx(page_bytes / MIB, abs=0.006)
    assert float(hp) == pytest.approx(hp_bytes / MIB, abs=0.006)
    assert float(total) == pytest.approx((page_bytes + hp_bytes) / MIB, abs=0.006)
    assert float(ratio) == pytest.approx(fp16_bytes / (page_bytes + hp_bytes), abs=0.006)
    assert js["memory"]["total_bytes"] == page_bytes + hp_bytes


def test_generate_prints_text_rates_and_memory(tmp_path):
    # one test for both schemes (not a shared fixture): pytest-xdist would run a module fixture per worker
    outputs = {}
    for scheme in ("fp16", "kvarn_k4v2_g128"):
        rc, text, js = _run_cli(scheme, tmp_path / f"{scheme}.json")
        _check_run(scheme, rc, text, js)
        outputs[scheme] = [r["output_ids"] for r in js["results"]]
    # 12 tokens never fill the first (sink) block, which KVarN keeps in float32: the same greedy tokens as fp16
    assert outputs["kvarn_k4v2_g128"] == outputs["fp16"]


def test_bad_arguments_fail_before_loading(capsys):
    assert main(["generate", "hi", "--kv-cache-dtype", "nf4"]) == 2
    assert "not a known scheme" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nonexistent"]) == 2
    assert "neither" in capsys.readouterr().err
    assert main(["generate", "hi", "--kv-cache-dtype", "kvarn_k4v2_g128", "--block-size", "64"]) == 2
    assert "block_size=64" in capsys.readouterr().err
    assert main(["generate", "hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_generation_benchmark_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "benchmarks" / "generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gen.json"
    rc = bench.main(["--random-weights", "--num-layers", "2", "--prompt-len", "64", "--batch", "1,2",
                     "--new-tokens", "4", "--kv-cache-dtype", "fp16,int8", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert "random weights" in res["env"]["weights"] and "random weights" in text
    rows = {(r["batch"], r["scheme"]): r for r in res["rows"]}
    assert set(rows) == {(1, "fp16"), (1, "int8"), (2, "fp16"), (2, "int8")}
    for (b, _), r in rows.items():
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["compiles_during_timed_run"] == 0  # the warm-up compiled every shape
        # 2 layers x b sequences x 68 tokens -> one 128-token page each
        assert r["kv_fp16_bytes"] == 2 * b * 128 * HEADS * D * 2 * 2
    assert rows[(2, "int8")]["kv_total_bytes"] != rows[(2, "fp16")]["kv_total_bytes"]
