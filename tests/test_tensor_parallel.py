"""Tensor parallelism on simulated CPU devices: the cache split over KV heads and the engine over a mesh.

Writes, commits and reads of a cache split over 2 or 4 devices equal a single-device cache's bit for
bit (each device runs the single-device code on its own heads). An engine over a mesh gives the
same tokens as one device; its caches differ only by float rounding from the second layer on (the
projections back from heads and MLP units sum partial products across devices in another order).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import kvarn_jax as kj
from kvarn_jax.cache import LayerCaches
from kvarn_jax.cache import sharding as cache_sharding
from kvarn_jax.cache.sharding import HeadParallel
from kvarn_jax.models import LlamaConfig
from kvarn_jax.models.llama import Decoder, DecodeBatch
from kvarn_jax.serving import Engine, SamplingParams

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py asks XLA for 4 CPUs)")

CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                  head_dim=32, max_position_embeddings=512, eos_token_ids=(3,))
KW = dict(block_size=32, max_seqs=4, max_model_len=112, prefill_chunk=32)


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, rngs=nnx.Rngs(1), init_std=0.2)


def _run(model, scheme, prompts, tp, **kw):
    eng = Engine(model, kv_cache_dtype=scheme, tensor_parallel=tp, **{**KW, **kw})
    out = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    return eng, out


def _calibration(rng):
    k, v = (rng.normal(size=(CFG.num_layers, 64, CFG.num_kv_heads, CFG.head_dim)).astype(np.float32) for _ in range(2))
    return kj.calibrate((k, v), "int8_static")


SCHEMES = ["kvarn_k4v2_g32", "kivi_k2v2_g32", "int4", "int8_static", "fp8", "fp16"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_cache_split_over_heads_is_bit_identical(rng, scheme):
    """Prefill-style writes, decode-step staging, commits and decode attention of a LayerCaches split
    over 2 and 4 devices against one device, on the same random K/V."""
    layers, hk, d, bs, ns, nb = 2, 4, 32, 32, 3, 12
    cal = _calibration(rng) if scheme.endswith("_static") else None
    one = LayerCaches.create(scheme, layers, num_blocks=nb, block_size=bs, num_kv_heads=hk, head_dim=d,
                                      max_seqs=ns, dtype=jnp.float32, calibration=cal)
    n = 70  # tokens 0..69 of sequence 1: the sink, a full page, a partial block
    k, v = (jnp.asarray(rng.normal(size=(layers, n, hk, d)), jnp.float32) for _ in range(2))
    pos = jnp.arange(n, dtype=jnp.int32)
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], jnp.int32)
    slots = table[1, pos // bs] * bs + pos % bs
    sid = jnp.ones(n, jnp.int32)
    q = jnp.asarray(rng.normal(size=(3, 8, d)), jnp.float32)
    kt, vt = (jnp.asarray(rng.normal(size=(3, hk, d)), jnp.float32) for _ in range(2))
    # one token each: sequence 0 in its sink, sequence 1 at position 95 (completing its block 2),
    # row 2 padding
    tpos = jnp.array([5, 95, 0], jnp.int32)
    tslot = jnp.array([5, int(table[1, 2]) * bs + 95 % bs, -1], jnp.int32)
    lens = jnp.array([6, 96, 0], jnp.int32)

    def work(caches, k, v, q, kt, vt):
        caches = caches.write_all(k, v, slots, sid, pos, max_completed=3)
        caches = caches.stage(1, kt, vt, tslot, jnp.arange(3, dtype=jnp.int32), tpos)
        caches = caches.commit(jnp.array([-1, table[1, 2], -1], jnp.int32), jnp.arange(3, dtype=jnp.int32),
                               jnp.array([0, 64, 0], jnp.int32))
        cache, tables, seq = caches.read_view(1, table, jnp.arange(3, dtype=jnp.int32))
        return kj.paged_decode_attention(q, cache, tables, lens, seq_ids=seq, impl="reference", check_values=False), caches

    ref_o, ref = jax.jit(work)(one, k, v, q, kt, vt)
    for size in (2, 4):
        tp = HeadParallel(Mesh(np.array(jax.devices()[:size]), ("tp",)))
        split = jax.device_put(one, cache_sharding.shardings(one, tp.mesh, "tp"))
        o, got = jax.jit(lambda c, k, v, q, kt, vt: cache_sharding.on_heads(
            tp, work, (c, k, v, q, kt, vt), ("caches", 2, 2, 1, 1, 1), (1, "caches")))(split, k, v, q, kt, vt)
        for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
            if x.ndim >= 2:
                assert y.sharding.spec[1] == "tp" and y.addressable_shards[0].data.shape[1] == x.shape[1] // size
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(ref_o), np.asarray(o))
    assert int(ref.dropped_tokens) == 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sharded_engine_gives_the_tokens_of_one_device(model, rng, scheme):
    # lengths cross the sink, quantized pages (prefill-written and decode-committed) and chunks
    prompts = [rng.integers(4, CFG.vocab_size, n).tolist() for n in (40, 75, 20)]
    kw = dict(calibration=_calibration(rng)) if scheme.endswith("_static") else {}
    one, tokens = _run(model, scheme, prompts, 1, **kw)
    for tp in (2, 4) if scheme in ("kvarn_k4v2_g32", "int4") else (2,):
        eng, got = _run(model, scheme, prompts, tp, **kw)
        assert got == tokens, tp
        caches = eng.pool().caches
        assert all(y.sharding.spec[1] == "tp" for y in jax.tree.leaves(caches) if y.ndim >= 2)
        assert int(caches.dropped_tokens) == 0
        rep = eng.memory_report()
        assert rep["devices"] == tp and rep["per_device_bytes"] * tp == rep["total_bytes"] == one.memory_report()["total_bytes"]


def test_sharded_unrolled_decode_reads_a_split_rotated_o_proj(model, rng):
    """The unrolled decode loop (GPUs, with or without a mesh) multiplies KVarN layers' rotated attention
    output by a rotated copy of o_proj (`ModelRunner.decode_kernels`); over a mesh the copy is split
    over the devices as o_proj is, and the tokens are those of one device. Releasing the pool frees it."""
    prompts = [rng.integers(4, CFG.vocab_size, n).tolist() for n in (40, 75, 20)]
    one, tokens = _run(model, "kvarn_k4v2_g32", prompts, 1, decode_loop="unroll")
    eng, got = _run(model, "kvarn_k4v2_g32", prompts, 2, decode_loop="unroll")
    assert got == tokens
    (copy,) = eng.runner._rotated_kernels.values()
    assert all(a.sharding.spec[0] == "tp" for a in copy["attn.o_proj"])
    o_bytes = model.layers.attn.o_proj.kernel[...].nbytes
    assert eng.runner.rotated_bytes() == one.runner.rotated_bytes() == o_bytes
    eng.release_pool("kvarn_k4v2_g32")
    assert eng.runner.rotated_bytes() == 0


def test_sharded_decode_logits_match_one_device(model, rng):
    """One decode step through the model with and without a mesh: logits within float32 rounding
    (the sharded projections sum partial products across devices in another order)."""
    # float32 sink and tail: 16-bit ones (the default) turn the float rounding differences of the
    # sharded projections into differences of a float16 step in the stored keys and values
    prompts = [rng.integers(4, CFG.vocab_size, 50).tolist() for _ in range(2)]
    one, _ = _run(model, "kvarn_k4v2_g32_hpfp32", prompts, 1)
    eng, _ = _run(model, "kvarn_k4v2_g32_hpfp32", prompts, 4)
    tp = eng.runner.tp
    pos = jnp.array([61, 61], jnp.int32)
    batch = DecodeBatch(jnp.array([5, 9], jnp.int32), pos, pos, jnp.array([0, 1], jnp.int32),
                        jnp.arange(2 * 4, dtype=jnp.int32).reshape(2, 4))
    ref, _ = jax.jit(lambda c: model.decode(c, batch, impl="reference"))(one.pool().caches)
    weights = eng.runner.weights
    got, caches = jax.jit(lambda w, c: nnx.merge(nnx.graphdef(model), w).decode(c, batch, impl="reference", tp=tp))(
        weights, eng.pool().caches)
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() <= 1e-5 * np.abs(np.asarray(ref)).max()
    assert all(y.sharding.spec[1] == "tp" for y in jax.tree.leaves(caches) if y.ndim >= 2)


def test_mesh_sizes_that_do_not_divide_the_heads_are_refused_at_start(model):
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide the model's num_kv_heads=4"):
        Engine(model, tensor_parallel=3, kv_cache_dtype="fp16", **KW)
    with pytest.raises(ValueError, match="decode_loop='switch' runs on one device"):
        Engine(model, tensor_parallel=2, decode_loop="switch", kv_cache_dtype="fp16", **KW)
    with pytest.raises(ValueError, match="needs that many devices"):
        Engine(model, tensor_parallel=len(jax.devices()) * 2, kv_cache_dtype="fp16", **KW)
    with pytest.raises(ValueError, match="axis named 'tp'"):
        Engine(model, mesh=Mesh(np.array(jax.devices()[:2]), ("x",)), kv_cache_dtype="fp16", **KW)
    gqa = Decoder(dataclasses.replace(CFG, num_heads=8, num_kv_heads=2), rngs=nnx.Rngs(0))  # GQA 4: 2 devices only
    Engine(gqa, tensor_parallel=2, kv_cache_dtype="fp16", **KW)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        Engine(gqa, tensor_parallel=4, kv_cache_dtype="fp16", **KW)
    with pytest.raises(ValueError, match="does not divide num_kv_heads=4"):
        cache_sharding.check_divides(4, 3)
    assert HeadParallel(Mesh(np.array(jax.devices()[:2]), ("tp",))).size == 2
