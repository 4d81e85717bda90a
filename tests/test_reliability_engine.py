"""The serving engine when a request's model output goes bad: a NaN/Inf key or value finishes that
request with finish_reason="error" and leaves its neighbours in the batch bit-identical; `debug`
raises when the caches drop a write for any other reason."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kvarn_jax.models import Decoder, LlamaConfig
from kvarn_jax.serving import Engine, SamplingParams

TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, max_position_embeddings=512, eos_token_ids=(3,))
KW = dict(block_size=32, max_seqs=4, max_model_len=96, prefill_chunk=32)
NEW = 12


@pytest.fixture(scope="module")
def models():
    """(clean, poisoned): the poisoned model's embedding of token BAD is NaN, so any request that feeds
    it (in its prompt, or as a generated token) computes NaN keys and values in every layer. The LM
    head is separate (untied), so every other request's logits are the clean model's."""
    clean = Decoder(TINY, rngs=nnx.Rngs(7), init_std=0.2)
    graphdef, state = nnx.split(clean)
    poisoned = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    return clean, poisoned


def _poison(model, token):
    table = model.embed.embedding[...]
    model.embed.embedding[...] = table.at[token].set(jnp.nan)


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "fp16"])
def test_a_nan_request_errors_and_its_neighbours_are_untouched(models, rng, scheme):
    clean, poisoned = models
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    prompts = [rng.integers(4, 256, n).tolist() for n in (40, 23, 70)]
    want = [r.output_ids for r in Engine(clean, kv_cache_dtype=scheme, **KW).generate(prompts, params)]
    # BAD: a token that the neighbour (row 0) neither reads nor generates, that row 2 generates at
    # step j (its next decode step then stores NaN) and that row 1 gets in its prompt
    seen0 = set(prompts[0]) | set(want[0])
    j, bad = next((i, t) for i, t in enumerate(want[2]) if t not in seen0 and t not in prompts[2])
    prompts[1] = prompts[1][:10] + [bad] + prompts[1][11:]
    _poison(poisoned, bad)
    eng = Engine(poisoned, kv_cache_dtype=scheme, debug=True, **KW)
    got = eng.generate(prompts, params)
    assert got[0].finish_reason == "length" and got[0].output_ids == want[0] and got[0].error is None
    assert got[1].finish_reason == "error" and got[1].output_ids == () and "prompt" in got[1].error
    assert "NaN or Inf" in got[1].error
    assert j + 1 < NEW  # generated BAD is returned; the decode step that reads it errors
    assert got[2].finish_reason == "error" and got[2].output_ids == want[2][:j + 1]
    assert f"output token {j + 1}" in got[2].error
    # the pool is whole again: its pages and slots were freed, and it serves the clean prompt alike
    again = eng.generate([prompts[0]], params)[0]
    assert again.output_ids == want[0]
    pool = eng.pool(scheme)
    assert pool.blocks.num_free == eng.num_blocks and not pool.running
    # the NaN tokens were counted (every layer's) and explained: debug did not raise
    assert int(pool.caches.dropped_tokens) == int(jnp.sum(pool.caches.nonfinite)) > 0


def test_debug_raises_when_the_cache_drops_a_write(models, rng, monkeypatch):
    clean, _ = models
    eng = Engine(clean, kv_cache_dtype="int8", debug=True, **KW)
    prompt = rng.integers(4, 256, 20).tolist()
    eng.generate([prompt], SamplingParams(max_new_tokens=3))  # nothing dropped: no error
    real = eng._slots

    def off_by_a_pool(seq, positions):  # an engine bug: a slot past the pool's pages
        out = real(seq, positions)
        return out + eng.num_blocks * eng.block_size
    monkeypatch.setattr(eng, "_slots", off_by_a_pool)
    with pytest.raises(RuntimeError, match="did not store .* as given"):
        eng.generate([prompt], SamplingParams(max_new_tokens=3))


def test_debug_must_be_a_bool(models):
    with pytest.raises(ValueError, match="debug must be a bool"):
        Engine(models[0], kv_cache_dtype="int8", debug=1, **KW)
