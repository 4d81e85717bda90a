"""The store/commit executable's XLA options: level 1 on CPUs unless XLA_FLAGS sets a level, and an
engine whose stores compile with them gives the same greedy tokens."""

import jax
from flax import nnx

from kvarn_jax.models import Decoder, LlamaConfig
from kvarn_jax.serving import Engine, SamplingParams, runner

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, max_position_embeddings=256)


def test_store_options_yield_to_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert runner.store_options() is None
    monkeypatch.setenv("XLA_FLAGS", "")
    assert runner.store_options() == ({"xla_backend_optimization_level": 1} if jax.default_backend() == "cpu" else None)


def test_stores_compiled_with_the_options_give_the_same_tokens(monkeypatch, rng):
    model = Decoder(TINY, rngs=nnx.Rngs(3), init_std=0.2)
    prompts = [rng.integers(1, 128, n).tolist() for n in (45, 20)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)  # 45 + 40 tokens: blocks complete in decode
    kw = dict(kv_cache_dtype="kvarn_k4v2_g32", block_size=32, max_seqs=2, max_model_len=96, prefill_chunk=32)
    # store_options reads XLA_FLAGS: a level set there means no options of its own (the backend is
    # already up, so this changes only which options the engine passes, not the process's flags)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert runner.store_options() is None
    want = [r.output_ids for r in Engine(model, **kw).generate(prompts, params)]
    runner._COMPILED.clear()
    monkeypatch.setenv("XLA_FLAGS", "")  # the options are passed
    assert runner.store_options() is not None or jax.default_backend() != "cpu"
    got = [r.output_ids for r in Engine(model, **kw).generate(prompts, params)]
    assert got == want
