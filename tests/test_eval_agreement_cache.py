"""The greedy agreement's cache (`ServingCache`) reads what kvarn_jax's paged cache serves, for every
high-precision option: the sink and ring in the scheme's `_hp` format (float16 for a float32 model
by default, int8 rows with `_hpint8`), a sink of S tokens (`_sink{S}`) with the rest of block 0 in
its page, and pages quantized from the values the ring holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvarn_jax as kj
from kvarn_jax.cache.paged import gather_dense
from kvarn_jax.evaluation.agreement import ServingCache
from kvarn_jax.hadamard import unrotate
from test_eval_support import one_torch_thread

BS = 32
_one_thread = pytest.fixture(autouse=True)(one_torch_thread)

SCHEMES = ["kvarn_k4v2_g32", "kvarn_k4v2_g32_hpint8", "kvarn_k4v2_g32_sink8", "int4_g32_hpint8_sink8"]


def test_serving_cache_reads_what_the_paged_cache_serves(rng):
    """Random float32 K/V (one channel large, as keys' outlier channels are), a prompt prefilled,
    then tokens one per step. 40 + 26: block 0 is full at once (with _sink8 its other positions are
    read from its page from the first step on), block 1 is filled from a ring that held prompt
    tokens and read from its page at the last step; 64 + 2: the prompt's last block is read from
    its page from the first step on (one test: the two share most compilations).

    At every step the K/V a ServingCache row hands the model equals a PagedKVCache's reads
    (kvarn_jax.write of the same tokens, gather_dense at the step's length, rotated back) up to the
    float32 rounding of that rotation: 1.2e-5 measured, 2e-5 (absolute and relative) allowed, where
    float16 rounding moves values by up to 2e-3, int8 rows by ~0.05 and a code step is 0.05 to 1.
    (Pages were bit-equal: both quantize them from the values the ring holds.)"""
    for prompt, steps in ((40, 26), (64, 2)):
        _check_against_paged_cache(rng, prompt, steps)


_gather_dense = jax.jit(gather_dense)


def _check_against_paged_cache(rng, prompt, steps):
    b, hk, d = 2, 2, 32
    n = prompt + steps
    k = rng.standard_normal((b, hk, n, d)).astype(np.float32)
    k[..., 3] = k[..., 3] * 12 + 6
    v = rng.standard_normal((b, hk, n, d)).astype(np.float32)
    g = len(SCHEMES)
    serving = ServingCache(1, block_size=BS, capacity=n)
    layer = serving.layers[0]
    layer.update(torch.from_numpy(k[:, :, :prompt].copy()), torch.from_numpy(v[:, :, :prompt].copy()))
    serving.split(SCHEMES)

    nb = -(-n // BS)
    table = np.arange(b * nb, dtype=np.int32).reshape(b, nb)
    caches = [kj.PagedKVCache.create(s, num_blocks=b * nb, block_size=BS, num_kv_heads=hk, head_dim=d, max_seqs=b,
                                     dtype=jnp.float32) for s in SCHEMES]

    def write(cache, a, z):   # tokens [a, z) of every sequence
        pos = np.tile(np.arange(a, z), b)
        seq = np.repeat(np.arange(b), z - a)
        return kj.write(cache, *(jnp.asarray(x[:, :, a:z].transpose(0, 2, 1, 3).reshape(-1, hk, d)) for x in (k, v)),
                        jnp.asarray(table[seq, pos // BS] * BS + pos % BS, jnp.int32),
                        seq_ids=jnp.asarray(seq, jnp.int32), positions=jnp.asarray(pos, jnp.int32))

    caches = [write(c, 0, prompt) for c in caches]
    for t in range(prompt, n):
        caches = [write(c, t, t + 1) for c in caches]
        tok = [torch.from_numpy(x[:, :, t:t + 1].copy()).repeat(g, 1, 1, 1) for x in (k, v)]
        got_k, got_v = (x.numpy() for x in layer.update(*tok))
        for i, (scheme, cache) in enumerate(zip(SCHEMES, caches)):
            dense = _gather_dense(cache, jnp.asarray(table), jnp.full(b, t + 1, jnp.int32))
            for got, want in zip((got_k, got_v), dense):
                want = np.asarray(unrotate(want, jnp.float32) if cache.cfg.rotated else want)[:, :, :t + 1]
                np.testing.assert_allclose(got[i * b:(i + 1) * b], want, atol=2e-5, rtol=2e-5,
                                           err_msg=f"{scheme}, step at position {t}")


def test_serving_cache_checks_its_use():
    for scheme, d, why in (("int4_static", 32, "calibration"), ("kvarn_k4v2_g32_hpint8", 48, "head_dim")):
        cache = ServingCache(1, block_size=BS, capacity=8)
        x = torch.zeros(1, 2, 4, d)
        cache.layers[0].update(x, x)
        with pytest.raises(ValueError, match=why):
            cache.split([scheme])
    x = torch.zeros(1, 2, 4, 32)
    cache = ServingCache(1, block_size=BS, capacity=12)
    cache.layers[0].update(x, x)
    with pytest.raises(ValueError, match="one call"):
        cache.layers[0].update(x, x)
    cache.split(["kvarn_k4v2_g32"])
    with pytest.raises(ValueError, match="split"):
        cache.split(["kvarn_k4v2_g32"])
    with pytest.raises(ValueError, match="one token per step"):
        cache.layers[0].update(x[:, :, :2], x[:, :, :2])


def test_greedy_agreement_generates_the_engines_tokens(tmp_path, monkeypatch):
    """`greedy_continuations` on a transformers model against kvarn_jax's serving engine on the same
    float32 weights (prompt prefilled in one chunk, as the evaluation does): the same 60 greedy
    tokens for the default high precision (float16 here), _hpint8 and _sink8. A cache that reads the
    sink and ring as computed (float32), block 0 always exactly and pages quantized from the
    computed values gave other tokens for all three (first divergences 41, 3 and 1)."""
    from kvarn_jax.evaluation.agreement import greedy_continuations
    from kvarn_jax.models import load_model
    from kvarn_jax.serving import Engine, SamplingParams
    from test_eval_support import tiny_llama

    monkeypatch.setenv("KVARN_JAX_CACHE", str(tmp_path / "cache"))
    hf = tiny_llama(num_layers=2, seed=1, init=0.5)
    hf.save_pretrained(tmp_path / "tiny")
    model, _ = load_model(tmp_path / "tiny", progress=False)
    prompts = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    schemes = ["int2_g32", "kvarn_k4v2_g32_hpint8", "kvarn_k4v2_g32_sink8"]
    got = greedy_continuations(hf, prompts, schemes, 60, block_size=BS)
    for scheme, tokens in zip(schemes, got):
        engine = Engine(model, kv_cache_dtype=scheme, block_size=BS, max_seqs=2, max_model_len=100, prefill_chunk=64)
        out = engine.generate(prompts.tolist(), SamplingParams(max_new_tokens=60, ignore_eos=True))
        assert [list(r.output_ids) for r in out] == tokens.tolist(), scheme
