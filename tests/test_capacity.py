"""Capacity planner: hand-computed cases, agreement with memory_report of a real cache, model specs
from folders and GGUF files, the CLI."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import kvarn_jax as kj
from kvarn_jax.evaluation.capacity import (MODEL_PRESETS, ModelSpec, model_spec, parse_bytes, plan_capacity,
                                           static_bytes_per_layer)
from kvarn_jax.evaluation.cli import main

GIB = 2 ** 30
TOY = ModelSpec("toy", num_layers=2, num_kv_heads=2, head_dim=128, params=1_000_000)


def test_hand_computed_kvarn_and_fp16():
    p = plan_capacity(TOY, "kvarn_k4v2_g128", gpu_mem="1GiB", context=1000, utilization=1.0)
    # weights: 1e6 params x 2 B (bf16) = 2,000,000; budget = 1,073,741,824 - 2,000,000 = 1,071,741,824
    assert p.weight_bytes == 2_000_000 and p.kv_budget_bytes == 1_071_741_824
    # pages: 108 B/token/head x 2 heads x 2 layers = 432 B per token
    assert p.page_bytes_per_token == 432
    # sink + tail per sequence: 2 layers x (1 + 1) blocks x 128 tokens x 2 heads x 128 x 2 (K, V) x 2 B = 524,288
    assert p.hp_bytes_per_seq == 524_288
    # 1000 tokens use ceil(1000/128) = 8 pages = 1024 tokens (24 padding): 1024 x 432 + 524,288 = 966,656 per seq
    assert p.padding_tokens_per_seq == 24 and p.bytes_per_seq == 966_656
    # 1,071,741,824 // 966,656 = 1108 sequences
    assert p.max_batch == 1108
    # pages left with 1108 sinks/tails: (1,071,741,824 - 1108 x 524,288) // (128 x 432) = 8876 blocks
    assert p.tokens_that_fit == 8876 * 128
    # fp16: 512 B/token/head -> 2048 B/token, no sink/tail; 1024 x 2048 = 2,097,152 per seq -> 511 seqs;
    # 1,071,741,824 // (128 x 2048) = 4088 blocks
    f = plan_capacity(TOY, "fp16", gpu_mem="1GiB", context=1000, utilization=1.0)
    assert (f.max_batch, f.tokens_that_fit, f.hp_bytes_per_seq) == (511, 4088 * 128, 0)
    assert p.batch_vs_fp16 == pytest.approx(1108 / 511)
    assert p.tokens_vs_fp16 == pytest.approx(8876 / 4088)


def test_hand_computed_utilization_reserve_tail_and_dtypes():
    # 10 GB x 0.8 = 8e9; weights 1e6 x 0.5 (int4) = 500,000; reserve 1 GB -> budget 6,999,500,000
    p = plan_capacity(TOY, "int8_hpfp32", gpu_mem="10GB", context=256, utilization=0.8, reserve="1GB",
                      weight_dtype="int4", kv_dtype="fp32", tail_blocks=2)
    assert p.kv_budget_bytes == 6_999_500_000
    # int8: (128 codes + fp16 scale + zero) x (K, V) = 264 B/token/head -> 1056 B/token
    assert p.page_bytes_per_token == 1056
    # fp32 sink + 2 tail blocks: 2 x 3 x 128 x 2 x 128 x 2 x 4 = 1,572,864
    assert p.hp_bytes_per_seq == 1_572_864
    # 256 tokens = 2 pages exactly: 256 x 1056 + 1,572,864 = 1,843,200 -> 6,999,500,000 // 1,843,200 = 3797
    assert p.padding_tokens_per_seq == 0 and p.max_batch == 3797
    # at this short context the fp32 sink/tail outweigh the pages: fewer sequences than fp16 (no sink/tail)
    assert p.batch_vs_fp16 < 1
    # without _hpfp32 a float32 model keeps them in bfloat16; int8 per-token rows: (128 + 2 + 2) x 2 B
    assert plan_capacity(TOY, "int8", gpu_mem="10GB", context=256, kv_dtype="fp32",
                         tail_blocks=2).hp_bytes_per_seq == 1_572_864 // 2
    assert plan_capacity(TOY, "int8_hpint8_sink16", gpu_mem="10GB", context=256,
                         tail_blocks=2).hp_bytes_per_seq == 2 * (16 + 2 * 128) * 2 * 264


def test_weights_that_do_not_fit():
    p = plan_capacity(MODEL_PRESETS["llama3-70b"], "kvarn_k4v2_g128", gpu_mem="24GiB", context=4096)
    assert p.kv_budget_bytes < 0 and p.max_batch == 0 and p.tokens_that_fit == 0 and not p.weights_fit
    # nothing fits fp16 either: the ratios are undefined, not NaN
    assert p.batch_vs_fp16 is None and p.tokens_vs_fp16 is None


def test_cli_says_plainly_when_the_weights_do_not_fit(tmp_path, capsys):
    out = tmp_path / "cap.json"
    # Llama-3-70B in bf16 is 131.4 GiB; 141 GiB x 0.9 leaves 126.9 GiB
    assert main(["capacity", "--preset", "llama3-70b", "--gpu-mem", "141GiB", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "llama3-70b: the weights alone (70.55 B params x bf16 = 131.42 GiB) exceed the 126.90 GiB usable" in text
    assert "no KV cache fits" in text and "int4 32.9 GiB" in text
    assert "nan" not in text and "-4.52" not in text and "┃ model" not in text   # no table of zeros
    assert json.loads(out.read_text())["weights_do_not_fit"] == ["llama3-70b"]
    # with a model that fits, its rows are printed and the one that does not is named
    assert main(["capacity", "--preset", "llama3-70b,llama3-8b", "--gpu-mem", "141GiB",
                 "--kv-cache-dtype", "fp16,kvarn_k4v2_g128"]) == 0
    text = capsys.readouterr().out
    assert "llama3-8b" in text and "exceed" in text and "nan" not in text
    assert text.count("│ llama3-70b") == 0 and text.count("│ llama3-8b") == 2
    # fp8 weights fit: the same model now gets its table
    assert main(["capacity", "--preset", "llama3-70b", "--gpu-mem", "141GiB", "--weight-dtype", "fp8",
                 "--kv-cache-dtype", "fp16,kvarn_k4v2_g128"]) == 0
    assert "│ llama3-70b" in capsys.readouterr().out
    # weights fit but no sequence of --context tokens does
    assert main(["capacity", "--preset", "llama3-8b", "--gpu-mem", "16GiB", "--utilization", "1",
                 "--kv-cache-dtype", "fp16", "--context", "1000000"]) == 0
    text = capsys.readouterr().out
    assert "not one sequence of 1,000,000 tokens fits with: fp16" in text and "n/a" in text


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g64", "int4_g32", "int8_static", "fp16"])
def test_matches_memory_report_of_a_real_cache(scheme):
    spec = ModelSpec("one-layer", num_layers=1, num_kv_heads=2, head_dim=64, params=1000)
    p = plan_capacity(spec, scheme, gpu_mem="3MiB", context=200, block_size=64, utilization=1.0)
    assert p.max_batch > 0
    cal = None
    if kj.parse(scheme).static:
        ones = jnp.ones((2, 64), jnp.float32)
        cal = kj.Calibration(-ones, ones, -ones, ones, tokens=1)
    blocks = p.tokens_that_fit // 64
    kw = dict(block_size=64, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16, calibration=cal)
    seqs = None if kj.parse(scheme).is_passthrough else p.max_batch
    rep = kj.memory_report(kj.PagedKVCache.create(scheme, num_blocks=blocks, max_seqs=seqs, **kw))
    assert rep["total_bytes"] <= p.kv_budget_bytes
    assert rep["static_bytes"] == p.static_bytes == static_bytes_per_layer(scheme, 2, 64)
    assert rep["sink_bytes"] + rep["tail_bytes"] == p.max_batch * p.hp_bytes_per_seq
    assert rep["page_bytes"] == blocks * 64 * p.page_bytes_per_token
    # one more block would not fit; and the batch's own pages fit in the pool
    assert rep["total_bytes"] + 64 * p.page_bytes_per_token > p.kv_budget_bytes
    assert p.max_batch * (p.context + p.padding_tokens_per_seq) <= p.tokens_that_fit


def test_parse_bytes():
    assert parse_bytes("141GiB") == 141 * GIB
    assert parse_bytes("80GB") == 80 * 10 ** 9
    assert parse_bytes("1.5 GiB") == 3 * GIB // 2
    assert parse_bytes("512mib") == 512 * 2 ** 20
    assert parse_bytes(12345) == 12345
    for bad in ("abc", "-1GiB", "0", "12XB", "", 0):
        with pytest.raises(ValueError, match="gpu_mem"):
            parse_bytes(bad)


def test_model_spec_from_folder_and_gguf(tmp_path):
    from test_eval_support import tiny_llama

    model = tiny_llama(num_layers=3)
    model.save_pretrained(tmp_path / "m")
    spec = model_spec(tmp_path / "m")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (3, 2, 32)
    assert spec.params == sum(p.numel() for p in model.parameters())  # tied embeddings counted once

    import gguf
    path = tmp_path / "toy.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(5)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_embedding_length(512)
    w.add_tensor("token_embd.weight", np.zeros((100, 512), np.float32))
    w.add_tensor("blk.0.attn_k.weight", np.zeros((128, 512), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = model_spec(path)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.params) == (5, 2, 64, 100 * 512 + 128 * 512)
    with pytest.raises(ValueError, match="not a preset .* does not exist"):
        model_spec(tmp_path / "missing")
    with pytest.raises(ValueError, match="a folder without config.json"):
        model_spec(tmp_path)


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="context"):
        plan_capacity(TOY, "int8", gpu_mem="1GiB", context=0)
    with pytest.raises(ValueError, match="utilization"):
        plan_capacity(TOY, "int8", gpu_mem="1GiB", context=10, utilization=1.5)
    with pytest.raises(ValueError, match="weight_dtype"):
        plan_capacity(TOY, "int8", gpu_mem="1GiB", context=10, weight_dtype="fp4")
    with pytest.raises(ValueError, match="block_size"):
        plan_capacity(TOY, "kvarn_k4v2_g128", gpu_mem="1GiB", context=10, block_size=64)
    with pytest.raises(ValueError, match="head_dim"):
        plan_capacity(ModelSpec("odd", 2, 2, 96, 10), "kvarn_k4v2_g32", gpu_mem="1GiB", context=10)


def test_cli(tmp_path, capsys):
    out = tmp_path / "cap.json"
    assert main(["capacity", "--preset", "llama3-8b,qwen3-32b", "--gpu-mem", "141GiB",
                 "--kv-cache-dtype", "fp16,kvarn_k4v2_g128", "--context", "32768", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kvarn_k4v2_g128" in text and "qwen3-32b" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    want = plan_capacity(MODEL_PRESETS["qwen3-32b"], "kvarn_k4v2_g128", gpu_mem="141GiB", context=32768)
    assert rows[3]["max_batch"] == want.max_batch and rows[3]["tokens_that_fit"] == want.tokens_that_fit
    assert main(["capacity", "--preset", "llama3-8b", "--model", "x", "--gpu-mem", "1GiB"]) == 2
    assert main(["capacity", "--preset", "llama3-8b", "--gpu-mem", "lots"]) == 2
    assert "--gpu-mem 'lots' is not a size" in capsys.readouterr().err
    assert main(["capacity", "--preset", "llama3-7b", "--gpu-mem", "1GiB"]) == 2
    assert "--preset: model 'llama3-7b' is not a preset" in capsys.readouterr().err
    assert main(["capacity", "--model", "/none/x.gguf", "--gpu-mem", "1GiB"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["capacity", "--preset", "llama3-8b", "--gpu-mem", "1GiB", "--utilization", "1.5"]) == 2
    assert "argument --utilization: must be a number in (0, 1]" in capsys.readouterr().err
    assert main(["capacity", "--preset", "llama3-8b", "--gpu-mem", "1GiB", "--kv-cache-dtype", "int3"]) == 2
    assert "--kv-cache-dtype 'int3': key bits 3 is not accepted" in capsys.readouterr().err
