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
LONG_PROMPT = ("The history of the Roman Empire spans more than a thousand years, from the founding of the city to the "
               "fall of Constantinople. Historians divide it into the Republic, the Principate and the Dominate, and "
               "each period had its own institutions, wars and culture. Write a summary of the main events.")
MIB = 2 ** 20
# SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64
LAYERS, HEADS, D = 30, 3, 64
MEMORY_RE = re.compile(r"^memory \(pool sized to these requests, (\d+) pages?\): (\S+): ([\d.]+) MiB for ([\d,]+) tokens x "
                       r"(\d+) layer\(s\) \(pages ([\d.]+) MiB, high-precision sink\+tail ([\d.]+) MiB(?: in (\w+))? for "
                       r"(\d+) seqs?\); fp16 would need ([\d.]+) MiB: (?:the same|([\d.]+)x (less|more))$", re.M)
LONG_RE = re.compile(r"^  long sequences: one of 8,192 tokens \(the model's context\) takes ([\d.]+) MiB, fp16 ([\d.]+) MiB: "
                     r"([\d.]+)x less \(the pages alone: ([\d.]+)x\)$", re.M)
RATE_RE = re.compile(r"^prefill: (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\); decode: (\d+) tokens in [\d.]+ s "
                     r"\(([\d.]+) tokens/s\)", re.M)


def _run_cli(scheme, path, extra=()):
    buf = io.StringIO()
    flags = ["--kv-cache-dtype", scheme] if scheme else []
    with contextlib.redirect_stdout(buf):
        rc = main(["generate", *PROMPTS, "--max-new-tokens", "8", *flags, "--quiet", "--json", str(path), *extra])
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

    # the memory line, checked against bytes computed here: each prompt fits one 128-token block, which
    # a quantized pool keeps in its sink only (no page; the pool still has one), fp16 in a page
    m = MEMORY_RE.search(text)
    assert m, text
    pool_pages, name, total, tokens, layers, pages, hp, fmt, seqs, fp16, ratio, way = m.groups()
    assert int(pool_pages) == (len(PROMPTS) if scheme == "fp16" else 1)
    hp_seqs = 0 if scheme == "fp16" else len(PROMPTS)  # passthrough caches have no high-precision storage
    cached = sum(r["prompt_tokens"] + 8 - 1 for r in js["results"])
    assert (name, int(tokens.replace(",", "")), int(layers), int(seqs)) == (scheme, cached, LAYERS, hp_seqs)
    fp16_bytes = 128 * len(PROMPTS) * HEADS * D * 2 * 2 * LAYERS
    page_bytes = kj.bytes_per_token(scheme, D, "float32") * 128 * int(pool_pages) * HEADS * LAYERS
    # quantized schemes keep each sequence's sink block and tail block in 16 bits (float16 for a float32 model)
    hp_bytes = 0 if scheme == "fp16" else len(PROMPTS) * 2 * 128 * HEADS * D * 2 * 2 * LAYERS
    assert fmt == (None if scheme == "fp16" else "float16")
    assert float(fp16) == pytest.approx(fp16_bytes / MIB, abs=0.006)
    assert float(pages) == pytest.approx(page_bytes / MIB, abs=0.006)
    assert float(hp) == pytest.approx(hp_bytes / MIB, abs=0.006)
    assert float(total) == pytest.approx((page_bytes + hp_bytes) / MIB, abs=0.006)
    long = LONG_RE.search(text)
    if scheme == "fp16":
        assert ratio is None and ": the same" in m.group(0) and long is None
    else:   # short prompts: the sink and tail blocks dominate, and the line says which way the ratio runs
        assert way == "more" and float(ratio) == pytest.approx((page_bytes + hp_bytes) / fp16_bytes, abs=0.006)
        # the steady state: a sequence of the model's 8,192 tokens (64 blocks) holds 62 pages and its sink and tail
        seq = (62 * 128 * kj.bytes_per_token(scheme, D, "float32") + 2 * 128 * D * 2 * 2) * HEADS * LAYERS
        assert float(long.group(1)) == pytest.approx(seq / MIB, abs=0.06)
        assert float(long.group(3)) == pytest.approx(8192 * HEADS * D * 4 * LAYERS / seq, abs=0.006)
    assert js["memory"]["total_bytes"] == page_bytes + hp_bytes
    assert js["memory"]["requests_fp16_bytes"] == fp16_bytes


def test_generate_prints_text_rates_and_memory(tmp_path):
    # one test for both schemes (not a shared fixture): pytest-xdist would run a module fixture per worker
    outputs, memory = {}, {}
    for scheme in ("fp16", "kvarn_k4v2_g128"):
        rc, text, js = _run_cli(scheme, tmp_path / f"{scheme}.json")
        _check_run(scheme, rc, text, js)
        outputs[scheme] = [r["output_ids"] for r in js["results"]]
        memory[scheme] = js["memory"]
    # 12 tokens never fill the first (sink) block, which KVarN keeps in 16 bits: the same greedy tokens as fp16
    assert outputs["kvarn_k4v2_g128"] == outputs["fp16"]

    # --layer-config (a `kvarn-jax tune` file), in this test to share its compiled functions
    from kvarn_jax.layer_config import write_layer_config
    uniform = tmp_path / "uniform.json"
    write_layer_config(uniform, ["kvarn_k4v2_g128"] * LAYERS, model={"num_layers": LAYERS})
    rc, text, js = _run_cli(None, tmp_path / "uniform_run.json", ["--layer-config", str(uniform)])
    assert rc == 0 and f"kv cache: per layer from {uniform} ({LAYERS} x kvarn_k4v2_g128)" in text
    # one scheme in every layer is that scheme: exactly the tokens and memory of --kv-cache-dtype
    assert [r["output_ids"] for r in js["results"]] == outputs["kvarn_k4v2_g128"]
    assert js["memory"] == memory["kvarn_k4v2_g128"]

    layers = ["fp16" if i % 3 == 0 else "kvarn_k4v2_g128" for i in range(LAYERS)]  # 10 fp16, 20 kvarn
    mixed = tmp_path / "mixed.json"
    write_layer_config(mixed, layers, model={"num_layers": LAYERS})
    rc, text, js = _run_cli(None, tmp_path / "mixed_run.json", ["--layer-config", str(mixed)])
    assert rc == 0 and f"kv cache: per layer from {mixed} (10 x fp16, 20 x kvarn_k4v2_g128)" in text
    assert js["kv_cache_dtype"] == layers and js["layer_config"] == str(mixed)
    assert [r["output_ids"] for r in js["results"]] == outputs["fp16"]  # still within the sink block
    # each layer holds its own scheme's bytes: the fp16 layers' pages and no sink/tail, KVarN's pages and
    # sink/tail; with a passthrough layer every block has a page (one page table serves all layers)
    m = js["memory"]
    tokens = 128 * len(PROMPTS)
    assert m["layer_schemes"] == layers and m["scheme"] == "per-layer: 10 x fp16, 20 x kvarn_k4v2_g128"
    assert m["page_bytes"] == sum(kj.bytes_per_token(s, D, "float32") for s in layers) * tokens * HEADS
    assert m["sink_bytes"] + m["tail_bytes"] == 20 * len(PROMPTS) * 2 * 128 * HEADS * D * 2 * 2
    assert f"): {m['scheme']}: " in text

    # one new token is the prefill's: no decode step ran, and the rate line says so instead of "nan tokens/s"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", PROMPTS[0], "--max-new-tokens", "1", "--quiet"]) == 0
    text = buf.getvalue()
    assert "nan" not in text and "decode: none (every sequence ended with the token prefill produced)" in text
    assert "(1 token, finish: length)" in text and "stopped at the model's end-of-sequence" not in text

    # a bare instruction without --chat: SmolLM2-Instruct answers with its end-of-text token at once;
    # the output says so and what to do instead of reporting a rate of nothing
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", LONG_PROMPT, "--max-new-tokens", "8", "--quiet"]) == 0
    text = buf.getvalue()
    assert "(1 token, finish: stop)" in text and "nan" not in text
    assert "decode: none" in text and "[0] stopped at the model's end-of-sequence token right away; try --chat" in text


def test_layer_config_and_kv_cache_dtype_together_are_refused(tmp_path, capsys):
    from kvarn_jax.layer_config import write_layer_config
    path = tmp_path / "layers.json"
    write_layer_config(path, ["int8"] * 2, model={"num_layers": 2})
    assert main(["generate", "hi", "--layer-config", str(path), "--kv-cache-dtype", "int8"]) == 2
    assert "not both" in capsys.readouterr().err
    # checked against the model once it is loaded: the file and both layer counts are named
    assert main(["generate", "hi", "--layer-config", str(path), "--quiet", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "has 2 layers but the model has num_layers=30" in err
    write_layer_config(path, ["kvarn_k4v2_g128"] * 2, model={"num_layers": 2})
    assert main(["generate", "hi", "--layer-config", str(path), "--block-size", "64"]) == 2  # before loading
    assert "layers[0] = kvarn_k4v2_g128" in capsys.readouterr().err
    assert main(["generate", "hi", "--layer-config", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


def _no_model_load(monkeypatch):
    """Make any model load fail loudly: the checks under test must come first."""
    import kvarn_jax.models as models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(models, "load_model", refuse)


@pytest.mark.parametrize("argv, message", [
    (["", "--quiet"], "PROMPT '' is empty"),
    (["--quiet"], "give a PROMPT or --prompt-file"),
    (["--prompt-file", "/none/p.txt"], "--prompt-file '/none/p.txt' does not exist"),
    (["hi", "--prompt-chars", "5:9"], "--prompt-chars selects characters of --prompt-file"),
    (["--prompt-file", "persuasion", "--prompt-chars", "999999:1000000"], "starts past the end of --prompt-file"),
    (["--prompt-file", "persuasion", "--prompt-chars", "9:5"], "argument --prompt-chars: '9:5': need 0 <= START < END"),
    (["hi", "   "], "PROMPT 1 ('   ') is empty"),
    (["hi", "--kv-cache-dtype", "nf4"], "--kv-cache-dtype 'nf4' is not a known scheme"),
    (["hi", "--model", "/nonexistent.gguf"], "--model '/nonexistent.gguf' does not exist"),
    (["hi", "--model", str(ROOT / "README.md")], "is a file but not a .gguf"),
    (["hi", "--model", str(ROOT / "docs")], "a folder without config.json"),
    (["hi", "--kv-cache-dtype", "kvarn_k4v2_g128", "--block-size", "64"], "--block-size=64 cannot be used with "
                                                                          "kvarn_k4v2_g128"),
    (["hi", "--layer-config", "/none/layers.json"], "--layer-config '/none/layers.json' does not exist"),
    (["hi", "--json", "/none/out.json"], "--json '/none/out.json': the folder '/none' does not exist"),
    (["hi", "there", "--seed", str(2 ** 32 - 1)], "--seed"),
    # argparse-level: the flag, not the Python argument, is named
    (["hi", "--top-p", "0"], "argument --top-p: must be a number in (0, 1]"),
    (["hi", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got '0'"),
    (["hi", "--temperature", "-1"], "argument --temperature"),
    (["hi", "--block-size", "x"], "argument --block-size: must be an integer from 1 to 1024"),
])
def test_bad_arguments_fail_before_loading(argv, message, capsys, monkeypatch):
    _no_model_load(monkeypatch)
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "max_new_tokens" not in err and "top_p" not in err   # never a Python argument name


def test_block_size_examples_are_distinct():
    with pytest.raises(ValueError, match=r"e\.g\. 128, 256, 512\)"):
        kj.parse("kvarn_k4v2_g128").check_block_size(64)
    with pytest.raises(ValueError, match=r"e\.g\. 64, 128, 256\)"):
        kj.parse("kivi_k2v2_g32").check_block_size(48)


def test_generation_benchmark_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "benchmarks" / "generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gen.json"
    rc = bench.main(["--config", "smollm2-135m", "--num-layers", "2", "--prompt-len", "64", "--batch", "1,2",
                     "--new-tokens", "4", "--kv-cache-dtype", "int8,fp16", "--repeats", "2", "--json", str(out),
                     "--bandwidth", "4.3e12"])
    assert rc == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert "random weights" in res["env"]["weights"] and "random weights" in text
    rows = {(r["batch"], r["scheme"]): r for r in res["rows"]}
    assert set(rows) == {(1, "fp16"), (1, "int8"), (2, "fp16"), (2, "int8")}
    assert [r["scheme"] for r in res["rows"]][:2] == ["fp16", "int8"]  # the baseline runs first
    for (b, s), r in rows.items():
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["compiles_during_timed_run"] == 0  # the warm-up compiled every shape
        assert r["decode_steps"] == 3 and r["dropped_tokens"] == 0
        assert len(r["decode_ms_per_step_runs"]) == 2 and r["decode_ms_per_step"] == min(r["decode_ms_per_step_runs"])
        assert 0 < r["floor_ms_per_step"] and r["floor_share"] == pytest.approx(r["floor_ms_per_step"]
                                                                                / r["decode_ms_per_step"])
        assert r["decode_seqs_per_step"] == b  # the whole batch prefilled at once: every decode step holds it
        base = rows[(b, "fp16")]["decode_tokens_per_s"]
        assert r["decode_vs_fp16"] == pytest.approx(r["decode_tokens_per_s"] / base)
        # 2 layers x b sequences x 68 tokens: one 128-token page each in fp16; an int8 pool holds them in
        # each slot's sink (its tail block adds capacity) and keeps the one page a pool has at least
        blocks = b if s == "fp16" else 1 + 2 * b
        assert r["kv_fp16_bytes"] == 2 * blocks * 128 * HEADS * D * 2 * 2
    assert rows[(2, "int8")]["kv_total_bytes"] != rows[(2, "fp16")]["kv_total_bytes"]
    assert res["env"]["bandwidth_Bps"] == 4.3e12
    # without --bandwidth a CPU run has no floor, and the table says so rather than printing a number
    assert bench._floor({"floor_ms_per_step": None}, "", " | ") == "- | -" and bench._floor({"floor_ms_per_step": None}, ", floor ") == ""
