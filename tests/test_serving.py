"""The serving engine: batching, the page allocator, EOS, sampling and the run-time precision switch.

Small random models (2 layers) keep compiles cheap; their weights are drawn large enough (std 0.2)
that logits are well separated, so greedy tokens are a sharp test of equality.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import kvarn_jax as kj
from kvarn_jax.models import Decoder, LlamaConfig, load_model
from kvarn_jax.models import weights as weights_mod
from kvarn_jax.models.llama import DecodeBatch, PrefillBatch
from kvarn_jax.serving import BlockAllocator, Engine, OutOfBlocksError, SamplingParams, runner, sample

TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32, max_position_embeddings=512, eos_token_ids=(3,))


# One engine geometry for most tests: compiled functions are cached process-wide by model structure
# and shapes, so tests that share it share their compiles.
KW = dict(block_size=32, max_seqs=4, max_model_len=96, prefill_chunk=32)


@pytest.fixture(scope="module")
def tiny_model():
    return Decoder(TINY, rngs=nnx.Rngs(7), init_std=0.2)


def _prompts(rng, lengths):
    return [rng.integers(4, TINY.vocab_size, n).tolist() for n in lengths]


def greedy_direct(model, scheme, prompt, n, *, block_size=32, impl="reference", decode_loop="unroll", chunk=32):
    """Greedy tokens from the model's own prefill/decode (one sequence, the prompt in chunks of
    `chunk` tokens as the engine's prefill_chunk, blocks committed in the call): a reference path
    with no engine, scheduler or compiled steps. (A chunk reads earlier chunks as the cache keeps
    them - the sink and tail in 16 bits for a float32 model -, so the chunking must match.)"""
    nb = -(-(len(prompt) + n) // block_size)
    caches = model.new_caches(scheme, num_blocks=nb, block_size=block_size, max_seqs=1)
    table = jnp.arange(nb, dtype=jnp.int32)[None]
    for start in range(0, len(prompt), chunk):
        part = prompt[start:start + chunk]
        pos = jnp.arange(start, start + len(part), dtype=jnp.int32)[None]
        logits, caches = model.prefill(caches, PrefillBatch(jnp.asarray([part], jnp.int32), pos, pos,
                                                            jnp.zeros(1, jnp.int32), table,
                                                            jnp.array([start], jnp.int32),
                                                            jnp.array([len(part) - 1], jnp.int32)))
    out = [int(jnp.argmax(logits[0]))]
    for t in range(len(prompt), len(prompt) + n - 1):
        p = jnp.array([t], jnp.int32)
        logits, caches = model.decode(caches, DecodeBatch(jnp.array(out[-1:], jnp.int32), p, p, jnp.zeros(1, jnp.int32),
                                                          table), impl=impl, layer_loop=decode_loop)
        out.append(int(jnp.argmax(logits[0])))
    assert int(caches.dropped_tokens) == 0
    return tuple(out)


def _poison(engine, scheme, seed=0):
    """Fill a fresh pool's caches with large finite garbage: correct code never reads a slot it did not write."""
    pool = engine.pool(scheme)
    key = [jax.random.PRNGKey(seed)]

    def junk(a):
        key[0], sub = jax.random.split(key[0])
        if a.ndim == 0:  # dropped_tokens counter
            return a
        if jnp.issubdtype(a.dtype, jnp.floating):
            return (jax.random.normal(sub, a.shape, jnp.float32) * 300).astype(a.dtype)
        return jax.random.randint(sub, a.shape, 0, 120, jnp.int32).astype(a.dtype)

    pool.caches = jax.tree.map(junk, pool.caches)


# --------------------------------------------------------------------------------------- batching
@pytest.mark.parametrize("scheme", ["fp16", "kvarn_k4v2_g32"])
def test_mixed_length_batch_equals_one_by_one(tiny_model, rng, scheme):
    # lengths cross the sink block, page boundaries and prefill chunks (chunk 32, block 32); every
    # chunk holds more than 16 tokens, so all prefill calls share one padded length (fewer compiles)
    prompts = _prompts(rng, [20, 85, 50, 60])
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    kw = dict(kv_cache_dtype=scheme, **KW)
    batch_engine = Engine(tiny_model, **kw)
    _poison(batch_engine, scheme)
    batched = batch_engine.generate(prompts, params)
    single_engine = Engine(tiny_model, **kw)
    _poison(single_engine, scheme, seed=1)
    singles = [single_engine.generate([p], params)[0] for p in prompts]
    for b, s in zip(batched, singles):
        assert b.output_ids == s.output_ids and len(b.output_ids) == 10
        assert b.kv_cache_dtype == kj.parse(scheme).name and b.finish_reason == "length"
    # every page and slot is back; no write was dropped
    pool = batch_engine.pool(scheme)
    assert pool.blocks.num_free == batch_engine.num_blocks and pool.slots.num_free == 4
    assert int(pool.caches.dropped_tokens) == 0
    # the engine (chunked prefill, asynchronous steps, blocks committed apart) equals the model run directly
    assert batched[1].output_ids == greedy_direct(tiny_model, scheme, prompts[1], 10)
    # the quantized run differs from fp16 only through quantization: most tokens agree
    if scheme != "fp16":
        fp16 = Engine(tiny_model, **{**kw, "kv_cache_dtype": "fp16"}).generate(prompts, params)
        same = np.mean([a == b for r, f in zip(batched, fp16) for a, b in zip(r.output_ids, f.output_ids)])
        assert same > 0.5


def test_a_step_past_the_sinks_skips_only_their_writes_and_a_broken_promise_is_counted(tiny_model, rng):
    """`DecodeBatch.past_sink` (the engine's choice when every row is past its sink): the same logits
    and caches as the full write; a row inside its sink under that promise is dropped and counted in
    every layer, its sink left as it was. The engine takes the promise only when it holds; on CPUs
    its o_proj matrices also hold the rotation, and its tokens still equal the model's own decode."""
    scheme, bs = "kvarn_k4v2_g32", 32
    caches = tiny_model.new_caches(scheme, num_blocks=3, block_size=bs, max_seqs=2)
    table = jnp.arange(3, dtype=jnp.int32)[None].repeat(2, 0)
    decode = jax.jit(lambda c, b: tiny_model.decode(c, b, impl="reference"))
    for pos, inside in ((40, False), (7, True)):
        p = jnp.array([pos, -1], jnp.int32)
        slots = jnp.array([pos, -1], jnp.int32)
        batch = dict(tokens=jnp.asarray(rng.integers(4, TINY.vocab_size, 2), jnp.int32), positions=p,
                     slot_mapping=slots, seq_ids=jnp.arange(2, dtype=jnp.int32), block_tables=table)
        want, c_want = decode(caches, DecodeBatch(**batch))
        got, c_got = decode(caches, DecodeBatch(**batch, past_sink=True))
        if not inside:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(c_got), jax.tree.leaves(c_want)))
            continue
        assert int(c_want.dropped_tokens) == 0
        assert int(c_got.dropped_tokens) == TINY.num_layers
        for g, g0, gw in zip(c_got.groups, caches.groups, c_want.groups):
            for side in ("k", "v"):
                np.testing.assert_array_equal(np.asarray(g.sink[side]), np.asarray(g0.sink[side]))
                assert not np.array_equal(np.asarray(gw.sink[side]), np.asarray(g0.sink[side]))
    # the engine: a batch with a row inside its sink writes the sinks; once every row is past, it does not
    steps, rotated = [], []
    eng = Engine(tiny_model, kv_cache_dtype=scheme, **KW)
    decode_step = eng.runner._decode_fn

    def spy(*a, past_sink, rotated_o_proj, **kw):
        steps.append(past_sink)
        rotated.append(rotated_o_proj)
        return decode_step(*a, past_sink=past_sink, rotated_o_proj=rotated_o_proj, **kw)
    eng.runner._decode_fn = spy
    prompts = _prompts(rng, [20, 40])
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    runner._COMPILED.clear()  # traced afresh, so the spy sees each executable's flag
    out = eng.generate(prompts, params)
    assert sorted(set(steps)) == [False, True]
    # the switch and unrolled loops read o_proj matrices that hold the rotation (`ModelRunner.decode_kernels`)
    assert set(rotated) == {eng.runner.decode_loop != "scan"}
    assert [r.output_ids for r in out] == [greedy_direct(tiny_model, scheme, q, 16) for q in prompts]
    assert int(eng.pool().caches.dropped_tokens) == 0


def test_engine_matches_plain_model(tiny_model, rng):
    """The engine's chunked prefill + decode produce the argmax of the model's own full-prompt logits."""
    prompt = _prompts(rng, [50])[0]
    out = Engine(tiny_model, kv_cache_dtype="fp32", **KW).generate(
        [prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    seq = prompt + list(out.output_ids[:-1])
    n = len(seq)
    caches = tiny_model.new_caches("fp32", num_blocks=2, block_size=32, max_seqs=1)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    batch = PrefillBatch(jnp.asarray([seq], jnp.int32), pos, pos, jnp.zeros(1, jnp.int32),
                         jnp.arange(2, dtype=jnp.int32)[None], jnp.zeros(1, jnp.int32), jnp.array([n - 1], jnp.int32))
    logits = np.asarray(tiny_model.prefill(caches, batch, all_logits=True)[0])[0]
    assert list(logits[len(prompt) - 1:].argmax(-1)) == list(out.output_ids)


# --------------------------------------------------------------------------------------- allocator
@settings(max_examples=30)
@given(num=st.integers(1, 24), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10)), max_size=40))
def test_allocator_never_hands_out_a_page_twice(num, ops):
    alloc = BlockAllocator(num)
    held = []  # lists of ids owned by live "sequences"
    for is_alloc, n in ops:
        if is_alloc:
            free_before = alloc.num_free
            if n > free_before:
                with pytest.raises(OutOfBlocksError, match="out of KV-cache pages"):
                    alloc.allocate(n)
                assert alloc.num_free == free_before  # nothing taken on failure
                continue
            ids = alloc.allocate(n)
            owned = {i for h in held for i in h}
            assert len(set(ids)) == n and not owned & set(ids) and all(0 <= i < num for i in ids)
            held.append(ids)
        elif held:
            alloc.free(held.pop(n % len(held)))
        assert alloc.num_free + sum(map(len, held)) == num
    for h in held:
        alloc.free(h)
    assert alloc.num_free == num and alloc.allocate(num) and alloc.num_free == 0


def test_allocator_rejects_double_and_foreign_frees():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    alloc.free(ids[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(ids[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([ids[1], ids[1]])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([99])
    assert alloc.num_free == 3  # the failed frees changed nothing
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def test_pages_are_freed_and_waiting_requests_admitted(tiny_model, rng):
    prompts = _prompts(rng, [30, 40, 20])
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    # each request needs 2 pages of 32; with 4 pages only two run at once, the third waits
    eng = Engine(tiny_model, kv_cache_dtype="fp16", num_blocks=4, **KW)
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step()
    pool = eng.pool("fp16")
    assert len(pool.running) == 2 and len(eng.waiting) == 1 and pool.blocks.num_free == 0
    held = [set(s.blocks) for s in pool.running]
    assert not held[0] & held[1]
    results = eng.run()
    assert pool.blocks.num_free == 4 and pool.slots.num_free == 4 and not pool.running
    solo = Engine(tiny_model, kv_cache_dtype="fp16", **KW)
    for i, p in zip(ids, prompts):
        assert results[i].output_ids == solo.generate([p], params)[0].output_ids
    # a request that could never fit is refused up front (90 + 20 - 1 cached tokens, capped at 95 = 3 pages)
    assert eng.blocks_needed(90, 20) == 3 and eng.blocks_needed(64, 1) == 2 and eng.blocks_needed(63, 2) == 2
    assert eng.blocks_needed(64, 2) == 3
    small = Engine(tiny_model, kv_cache_dtype="fp16", **{**KW, "num_blocks": 2})
    with pytest.raises(ValueError, match="num_blocks=2"):
        small.add_request(list(range(4, 94)), params)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(list(range(4, 100)), params)


# --------------------------------------------------------------------------------------- EOS
def test_stops_on_eos_and_frees_pages(tiny_model, rng):
    prompt = _prompts(rng, [12])[0]
    eng = Engine(tiny_model, kv_cache_dtype="fp16", **KW)
    free = eng.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].output_ids
    stop = free[4]
    first = free.index(stop)
    r = eng.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))[0]
    assert r.finish_reason == "stop" and r.output_ids == free[:first + 1]
    assert eng.pool().blocks.num_free == eng.num_blocks and eng.pool().slots.num_free == 4
    # the model's own EOS ids are the default stop tokens
    eos_cfg = dataclasses.replace(TINY, eos_token_ids=(stop,))
    model = Decoder(eos_cfg, rngs=nnx.Rngs(7), init_std=0.2)
    r2 = Engine(model, kv_cache_dtype="fp16", **KW).generate(
        [prompt], SamplingParams(max_new_tokens=12))[0]
    assert r2.output_ids == r.output_ids and r2.finish_reason == "stop"


# --------------------------------------------------------------------------------------- sampling
def _probs(logits):
    e = np.exp(logits - logits.max())
    return e / e.sum()


def test_top_p_never_samples_outside_the_nucleus(rng):
    v, n = 32, 400
    logits = rng.normal(size=v).astype(np.float32) * 2
    p = _probs(logits)
    order = np.argsort(-p)
    top_p = 0.7
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)].tolist())
    toks = np.asarray(sample(jnp.tile(jnp.asarray(logits), (n, 1)), jnp.ones(n), jnp.full(n, top_p),
                             jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32)))
    assert set(toks.tolist()) <= nucleus and len(set(toks.tolist())) >= min(3, len(nucleus))
    # frequencies follow the renormalized nucleus probabilities (loose: 400 samples)
    q = {t: p[t] / sum(p[list(nucleus)]) for t in nucleus}
    for t in nucleus:
        assert abs(np.mean(toks == t) - q[t]) < 4 * np.sqrt(q[t] * (1 - q[t]) / n) + 0.01


def test_sampling_is_seeded_per_request_and_greedy_at_zero_temperature(rng):
    b, v = 6, 50
    logits = jnp.asarray(rng.normal(size=(b, v)).astype(np.float32))
    args = (jnp.full(b, 0.8), jnp.full(b, 0.95), jnp.arange(b, dtype=jnp.uint32) + 11, jnp.full(b, 3, jnp.int32))
    a, again = np.asarray(sample(logits, *args)), np.asarray(sample(logits, *args))
    assert (a == again).all()
    # a row's sample depends on its own seed and step only, not on the other rows
    solo = np.asarray(sample(logits[2:3], args[0][2:3], args[1][2:3], args[2][2:3], args[3][2:3]))
    assert solo[0] == a[2]
    draws = [np.asarray(sample(logits, args[0], args[1], args[2], jnp.full(b, s, jnp.int32))) for s in range(8)]
    assert len({tuple(d) for d in draws}) > 1  # other steps draw differently
    greedy = np.asarray(sample(logits, jnp.zeros(b), jnp.full(b, 0.5), args[2], args[3]))
    assert (greedy == np.asarray(logits).argmax(-1)).all()
    # top_p tiny -> always the most likely token even when sampling
    top1 = np.asarray(sample(logits, jnp.full(b, 5.0), jnp.full(b, 1e-6), args[2], args[3]))
    assert (top1 == np.asarray(logits).argmax(-1)).all()


def test_sampled_generation_is_reproducible_and_batch_independent(tiny_model, rng):
    prompts = _prompts(rng, [9, 30])
    kw = dict(kv_cache_dtype="fp16", **KW)
    ps = [SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=s) for s in (5, 6)]
    a = Engine(tiny_model, **kw).generate(prompts, ps)
    b = Engine(tiny_model, **kw).generate(prompts[1:], ps[1:])
    assert a[1].output_ids == b[0].output_ids
    c = Engine(tiny_model, **kw).generate(prompts, [dataclasses.replace(p, seed=p.seed + 100) for p in ps])
    assert [r.output_ids for r in c] != [r.output_ids for r in a]


def test_bad_arguments_are_clear_errors(tiny_model):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="not a known scheme"):
        Engine(tiny_model, kv_cache_dtype="nf4")
    with pytest.raises(ValueError, match="block_size"):
        Engine(tiny_model, kv_cache_dtype="kvarn_k4v2_g128", block_size=64)
    with pytest.raises(ValueError, match="calibration"):
        Engine(tiny_model, kv_cache_dtype="int8_static")
    eng = Engine(tiny_model, kv_cache_dtype="fp16", **KW)
    with pytest.raises(ValueError, match="not a known scheme"):
        eng.default_kv_cache_dtype = "q3"
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([TINY.vocab_size])
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([])
    with pytest.raises(ValueError, match="decode_loop"):
        Engine(tiny_model, decode_loop="while")
    with pytest.raises(ValueError, match="integer token ids"):
        eng.add_request([5.7, 9.2])
    with pytest.raises(ValueError, match="impl"):
        Engine(tiny_model, impl="cuda")


def test_decode_loop_does_not_change_results(tiny_model, rng):
    prompts = _prompts(rng, [20, 35])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    kw = dict(kv_cache_dtype="kvarn_k4v2_g32", **KW)
    scan = Engine(tiny_model, decode_loop="scan", **kw)
    engines = (scan, Engine(tiny_model, decode_loop="unroll", **kw), Engine(tiny_model, decode_loop="switch", **kw))
    outputs = [[r.output_ids for r in e.generate(prompts, params)] for e in engines]
    assert outputs[0] == outputs[1] == outputs[2]
    # the unrolled loop reads a rotated copy of every layer's o_proj (the scan unrotates instead)
    o_bytes = tiny_model.layers.attn.o_proj.kernel[...].nbytes
    assert (scan.runner.rotated_bytes(), engines[1].runner.rotated_bytes()) == (0, o_bytes)
    assert Engine(tiny_model, **kw).runner.decode_loop == ("switch" if jax.default_backend() == "cpu" else "unroll")
    # compiled once per shape: repeating the same batch compiles nothing new
    n = scan.runner.stats.compiles
    scan.generate(prompts, params)
    assert scan.runner.stats.compiles == n


def test_switch_layer_loop_gives_the_scans_bits():
    """layer_loop="switch" (each product picks its layer's own array) computes what the scan over
    stacked weights computes, bit for bit, in decode and prefill, over runs of mixed schemes (three
    cache groups: the switch index is the layer within its run) and distinct weights per layer."""
    cfg = dataclasses.replace(TINY, num_layers=5)
    model = Decoder(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))), init_std=0.2)
    schemes = ["kvarn_k4v2_g32", "kvarn_k4v2_g32", "int8", "int8", "fp16"]
    kernels = model.layer_kernels()
    assert all(len(v) == 5 and not any(np.array_equal(v[0], w) for w in v[1:]) for v in kernels.values())
    rng = np.random.default_rng()
    n, bs = 40, 32
    caches = model.new_caches(schemes, num_blocks=4, block_size=bs, max_seqs=1)
    assert [r[2] for r in caches.runs()] == [2, 2, 1]
    table = jnp.arange(4, dtype=jnp.int32)[None]
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    batch = PrefillBatch(jnp.asarray(rng.integers(4, cfg.vocab_size, (1, n)), jnp.int32), pos, pos,
                         jnp.zeros(1, jnp.int32), table, jnp.array([0], jnp.int32), jnp.array([n - 1], jnp.int32))
    prefill = jax.jit(lambda c, b, k, loop: model.prefill(c, b, layer_loop=loop, kernels=k), static_argnums=3)
    ref, caches = prefill(caches, batch, None, "scan")
    got, _ = prefill(caches, batch, kernels, "switch")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    p = jnp.array([n], jnp.int32)
    step = DecodeBatch(jnp.asarray(rng.integers(4, cfg.vocab_size, 1), jnp.int32), p, p, jnp.zeros(1, jnp.int32), table)
    decode = jax.jit(lambda c, b, k, loop: model.decode(c, b, impl="reference", layer_loop=loop, kernels=k),
                     static_argnums=3)
    (ref, c_ref), (got, c_got) = decode(caches, step, None, "scan"), decode(caches, step, kernels, "switch")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(jax.tree.leaves(c_got), jax.tree.leaves(c_ref)))
    with pytest.raises(ValueError, match="kernels"):
        model.decode(caches, step, layer_loop="switch")
    with pytest.raises(ValueError, match="kernels"):
        model.decode(caches, step, layer_loop="scan", kernels=kernels)


def test_pallas_decode_matches_reference_in_the_model(rng):
    """The model's decode through the Pallas kernel (interpreted on CPU) vs the reference, bf16 weights.

    70 tokens at block 32 in high-precision slot 1 of 2: the sink, one quantized page and a partial
    tail are all read, from the slot the batch names.
    """
    model = Decoder(TINY, dtype="bfloat16", rngs=nnx.Rngs(3), init_std=0.2)
    seq = np.asarray(_prompts(rng, [70])[0], np.int32)
    n = len(seq)
    table, slot = jnp.arange(3, dtype=jnp.int32)[None], jnp.ones(1, jnp.int32)
    pos = jnp.arange(n - 1, dtype=jnp.int32)[None]
    caches = model.new_caches("int8", num_blocks=3, block_size=32, max_seqs=2)
    _, caches = model.prefill(caches, PrefillBatch(jnp.asarray(seq[None, :-1]), pos, pos, slot, table,
                                                   jnp.zeros(1, jnp.int32), jnp.array([n - 2], jnp.int32)))
    last = jnp.array([n - 1], jnp.int32)
    batch = DecodeBatch(jnp.asarray(seq[-1:]), last, last, slot, table)
    logits = {impl: np.asarray(model.decode(caches, batch, impl=impl)[0]) for impl in ("reference", "pallas")}
    ref, ker = logits["reference"], logits["pallas"]
    assert np.abs(ker - ref).max() <= 2e-2 * np.abs(ref).max()
    assert ker.argmax() == ref.argmax()


# --------------------------------------------------------------------------------------- asynchronous steps
def test_a_late_found_stop_never_leaks_into_the_next_request(tiny_model, rng):
    """A sequence that stops on a stop token is found one step late (its extra step is discarded);
    the next request takes its freed slot and pages while that step is still queued on the device."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    kw = dict(kv_cache_dtype="kvarn_k4v2_g32", **{**KW, "max_seqs": 1, "num_blocks": 3})
    first, second = _prompts(rng, [40, 50])
    free = Engine(tiny_model, **kw).generate([first], params)[0].output_ids
    stop = free[3]
    eng = Engine(tiny_model, **kw)
    _poison(eng, "kvarn_k4v2_g32")
    a = eng.add_request(first, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))
    b = eng.add_request(second, params)   # waits for the only slot
    done = eng.run()
    assert done[a].output_ids == free[:free.index(stop) + 1] and done[a].finish_reason == "stop"
    assert done[b].output_ids == greedy_direct(tiny_model, "kvarn_k4v2_g32", second, 12)
    assert int(eng.pool().caches.dropped_tokens) == 0


def test_generate_is_all_or_nothing(tiny_model, rng):
    eng = Engine(tiny_model, kv_cache_dtype="fp16", **KW)
    ok = _prompts(rng, [10, 12])
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
        eng.generate([ok[0], list(range(4, 200)), ok[1]], SamplingParams(max_new_tokens=4))
    assert not eng.waiting and not eng.has_unfinished()
    # the engine still works, and returns only this call's results
    assert len(eng.generate(ok, SamplingParams(max_new_tokens=3))) == 2


def test_a_pool_larger_than_the_device_is_refused_at_start(tiny_model, monkeypatch):
    class Device:
        def memory_stats(self):
            return {"bytes_limit": 2 ** 20, "bytes_in_use": 0}
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    with pytest.raises(ValueError, match=r"fp16 KV cache pool needs .* GiB .* the device has 0\.00 GiB free"):
        Engine(tiny_model, kv_cache_dtype="fp16", **{**KW, "num_blocks": 4096})
    # a small one starts (with a prefill call's buffers that fit beside it)
    Engine(tiny_model, kv_cache_dtype="fp16", **{**KW, "num_blocks": 4, "prefill_batch": 1})


def test_a_refused_pool_leaves_no_rotated_o_proj_copy(tiny_model, monkeypatch):
    """The unrolled loop's rotated o_proj copy is made before a KVarN pool's memory check (it takes
    memory too); when the pool is refused, the copy goes with it, and the engine's other pools work on."""
    eng = Engine(tiny_model, kv_cache_dtype="fp16", decode_loop="unroll", **KW)

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 2 ** 10, "bytes_in_use": 0}
    with monkeypatch.context() as m:
        m.setattr(jax, "devices", lambda *a: [Device()])
        with pytest.raises(ValueError, match="kvarn_k4v2_g32 KV cache pool needs"):
            eng.pool("kvarn_k4v2_g32")
    assert eng.runner.rotated_bytes() == 0 and list(eng.pools) == [eng.pool().cfg]
    eng.pool("kvarn_k4v2_g32")
    assert eng.runner.rotated_bytes() == tiny_model.layers.attn.o_proj.kernel[...].nbytes


def test_a_prefill_that_cannot_fit_next_to_the_pool_is_refused_at_start(tiny_model, monkeypatch):
    """A pool that fits but leaves less than one prefill call's buffers is refused at start, naming
    prefill_batch and prefill_chunk, instead of running out of memory in the middle of a request;
    with a smaller prefill_batch the same pool starts."""
    from kvarn_jax.serving.engine import prefill_workspace
    kw = {**KW, "num_blocks": 16, "prefill_chunk": 64}
    pool = Engine(tiny_model, kv_cache_dtype="fp16", **kw).memory_report()["total_bytes"]
    big, small = (prefill_workspace(tiny_model.config, tiny_model.dtype, prefill_batch=b, prefill_chunk=64,
                                    context=-(-kw["max_model_len"] // kw["block_size"]) * kw["block_size"])
                  for b in (8, 1))
    assert big > 4 * small

    class Device:
        def memory_stats(self):
            return {"bytes_limit": pool + (big + small) // 2, "bytes_in_use": 0}
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    with pytest.raises(ValueError, match=r"prefill_batch=8 sequences x prefill_chunk=64 tokens .* working memory"):
        Engine(tiny_model, kv_cache_dtype="fp16", **{**kw, "prefill_batch": 8})
    Engine(tiny_model, kv_cache_dtype="fp16", **{**kw, "prefill_batch": 1})


# --------------------------------------------------------------------------------------- precision switch
def _write_tiny_checkpoint(folder, rng):
    """A Llama checkpoint folder in HF format (safetensors + config.json), written without torch."""
    from safetensors.numpy import save_file
    c = TINY

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    t = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size), "model.norm.weight": 1 + w(c.hidden_size),
         "lm_head.weight": w(c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        t[pre + "input_layernorm.weight"] = 1 + w(c.hidden_size)
        t[pre + "post_attention_layernorm.weight"] = 1 + w(c.hidden_size)
        for n, rows in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
            t[pre + f"self_attn.{n}_proj.weight"] = w(rows * c.head_dim, c.hidden_size)
        t[pre + "self_attn.o_proj.weight"] = w(c.hidden_size, c.num_heads * c.head_dim)
        t[pre + "mlp.gate_proj.weight"] = w(c.intermediate_size, c.hidden_size)
        t[pre + "mlp.up_proj.weight"] = w(c.intermediate_size, c.hidden_size)
        t[pre + "mlp.down_proj.weight"] = w(c.hidden_size, c.intermediate_size)
    folder.mkdir()
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "eos_token_id": 3}))
    return t


def test_precision_switch_reloads_nothing_and_equals_a_fresh_run(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("KVARN_JAX_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny-llama"
    tensors = _write_tiny_checkpoint(folder, rng)
    before = weights_mod.stats()
    model, _ = load_model(folder, progress=False)
    assert weights_mod.stats()["conversions"] == before["conversions"] + 1
    np.testing.assert_array_equal(np.asarray(model.layer(1).attn.q_proj.kernel[...]),
                                  tensors["model.layers.1.self_attn.q_proj.weight"].T)
    prompts = _prompts(rng, [30, 60, 20])
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    kw = KW
    eng = Engine(model, kv_cache_dtype="fp16", **kw)
    weights_before = jax.tree.leaves(eng.runner.weights)
    stats = weights_mod.stats()

    r_fp16 = eng.add_request(prompts[0], params)           # starts under fp16
    eng.step()
    eng.step()
    eng.default_kv_cache_dtype = "int8"                    # switch while it runs
    r_int8 = eng.add_request(prompts[1], params)
    r_int4 = eng.add_request(prompts[2], params, kv_cache_dtype="int4")  # explicit per request
    results = eng.run()

    assert weights_mod.stats() == stats                     # no conversion, no load
    assert all(a is b for a, b in zip(weights_before, jax.tree.leaves(eng.runner.weights)))  # the same buffers
    assert set(eng.pools) == {kj.parse(s) for s in ("fp16", "int8", "int4")}
    assert results[r_fp16].kv_cache_dtype == "fp16"         # kept the scheme it started with
    assert results[r_int8].kv_cache_dtype == "int8" and results[r_int4].kv_cache_dtype == "int4"

    fresh_model, _ = load_model(folder, progress=False)     # cached conversion: a load, not a conversion
    assert weights_mod.stats()["conversions"] == stats["conversions"]
    for rid, prompt, scheme in ((r_fp16, prompts[0], "fp16"), (r_int8, prompts[1], "int8"),
                                (r_int4, prompts[2], "int4")):
        fresh = Engine(fresh_model, kv_cache_dtype=scheme, **kw).generate([prompt], params)[0]
        assert fresh.output_ids == results[rid].output_ids, scheme
    eng.release_pool("int4")
    assert kj.parse("int4") not in eng.pools


# --------------------------------------------------------------------------------------- per-layer schemes
def _layer_file(path, layers):
    from kvarn_jax.layer_config import write_layer_config
    write_layer_config(path, layers, block_size=32, model={"num_layers": len(layers)})
    return path


def test_layer_config_gives_each_layer_its_scheme(tiny_model, rng, tmp_path):
    """A 2-scheme layer file (from `kvarn-jax tune`): each layer's cache has its scheme, and the tokens
    are those of an engine whose layer caches were set by hand; a file of one scheme is that scheme."""
    a, b = "kvarn_k2v2_g32", "fp16"
    path = _layer_file(tmp_path / "layers.json", [a, b])
    prompts = _prompts(rng, [85, 70])  # 2 full blocks each beyond the sink: quantized pages are read
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    eng = Engine(tiny_model, kv_cache_dtype=str(path), **KW)
    assert eng.default_kv_cache_dtype == (a, b)
    mixed = eng.generate(prompts, params)
    key = (kj.parse(a), kj.parse(b))
    assert set(eng.pools) == {key} and all(r.kv_cache_dtype == (a, b) for r in mixed)
    pool = eng.pool()
    layers = [pool.caches.layer(i) for i in range(2)]
    assert [c.cfg for c in layers] == list(key)
    assert pool.blocks.num_free == eng.num_blocks and int(pool.caches.dropped_tokens) == 0
    # the same tokens as the model run directly with those per-layer caches
    assert mixed[0].output_ids == greedy_direct(tiny_model, [a, b], prompts[0], 10)
    # ...and neither uniform scheme (the file is not ignored)
    for s in (a, b):
        assert [r.output_ids for r in mixed] != [r.output_ids for r in Engine(
            tiny_model, kv_cache_dtype=s, **KW).generate(prompts, params)], s

    # memory: every layer's own bytes, summed (page bytes differ per layer, the page count does not)
    report = eng.memory_report()
    own = [kj.memory_report(c) for c in layers]
    assert own[0]["page_bytes"] != own[1]["page_bytes"] and own[0]["tokens"] == own[1]["tokens"]
    for k in ("page_bytes", "sink_bytes", "tail_bytes", "total_bytes", "fp16_bytes"):
        assert report[k] == own[0][k] + own[1][k], k
    assert report["layers"] == 2 and report["layer_schemes"] == [a, b]
    assert report["scheme"] == f"per-layer: 1 x {a}, 1 x {b}"

    # per request, beside a plain scheme in the same engine; a per-layer list works like the file
    # (two prompts per pool: the batch shapes compiled above)
    rids = [eng.add_request(p, params, kv_cache_dtype=[a, b]) for p in prompts]
    rids_b = [eng.add_request(p, params, kv_cache_dtype=b) for p in prompts]
    done = eng.run()
    assert [done[i].output_ids for i in rids] == [r.output_ids for r in mixed]
    assert all(done[i].kv_cache_dtype == b for i in rids_b)
    assert set(eng.pools) == {key, kj.parse(b)}
    eng.release_pool(path)
    assert set(eng.pools) == {kj.parse(b)}

    # a file whose layers all have one scheme is exactly that scheme: same pool key, same tokens
    same = Engine(tiny_model, kv_cache_dtype=_layer_file(tmp_path / "same.json", ["int8", "int8"]), **KW)
    assert same.default_kv_cache_dtype == "int8" and set(same.pools) == {kj.parse("int8")}
    assert [r.output_ids for r in same.generate(prompts, params)] == [
        r.output_ids for r in Engine(tiny_model, kv_cache_dtype="int8", **KW).generate(prompts, params)]


def test_layer_config_errors_name_the_file_and_counts(tiny_model, tmp_path):
    three = _layer_file(tmp_path / "three.json", ["int8", "int4", "int8"])
    with pytest.raises(ValueError, match=r"three\.json.* has 3 layers but the model has num_layers=2"):
        Engine(tiny_model, kv_cache_dtype=str(three), **KW)
    with pytest.raises(ValueError, match="3 per-layer schemes but the model has num_layers=2"):
        Engine(tiny_model, kv_cache_dtype=["int8", "int4", "int8"], **KW)
    with pytest.raises(ValueError, match="layer 1: .*not a known scheme"):
        Engine(tiny_model, kv_cache_dtype=["int8", "nf4"], **KW)
    with pytest.raises(ValueError, match="layer 0: .*block_size"):  # a 128-token tile on 32-token pages
        Engine(tiny_model, kv_cache_dtype=["kvarn_k4v2_g128", "int8"], **KW)
    with pytest.raises(ValueError, match=r"missing\.json.*no such file"):
        Engine(tiny_model, kv_cache_dtype=str(tmp_path / "missing.json"), **KW)
    eng = Engine(tiny_model, kv_cache_dtype="fp16", **KW)
    with pytest.raises(ValueError, match="three.json"):
        eng.add_request([5, 6, 7], kv_cache_dtype=three)
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        eng.add_request([5, 6, 7], kv_cache_dtype=3)


def test_caches_split_into_groups_under_the_kernels_offset_limit(rng, monkeypatch):
    """A scheme's layers are split into groups whose buffers stay under 2^31 elements (the kernels
    address a buffer with 32-bit offsets); the split changes no token, in scans and unrolled loops."""
    from kvarn_jax.cache import layers as layers_mod
    model = Decoder(dataclasses.replace(TINY, num_layers=4), rngs=nnx.Rngs(5), init_std=0.2)
    prompts = _prompts(rng, [40, 70])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    kw = dict(kv_cache_dtype="kvarn_k4v2_g32", **KW)
    whole = Engine(model, **kw)
    assert len(whole.pool().caches.groups) == 1
    expected = [r.output_ids for r in whole.generate(prompts, params)]
    one = whole.pool().caches.groups[0]
    per_layer = max(a.size for a in jax.tree.leaves(one) if a.ndim) // 4
    monkeypatch.setattr(layers_mod, "MAX_BUFFER_ELEMENTS", 2 * per_layer)  # two layers a group
    for loop in ("scan", "unroll"):
        split = Engine(model, decode_loop=loop, **kw)
        caches = split.pool().caches
        assert len(caches.groups) == 2 and caches.runs() == [(0, 0, 2), (1, 2, 2)]
        assert all(a.size <= 2 * per_layer for c in caches.groups for a in jax.tree.leaves(c) if a.ndim)
        assert [r.output_ids for r in split.generate(prompts, params)] == expected, loop
    monkeypatch.setattr(layers_mod, "MAX_BUFFER_ELEMENTS", per_layer // 2)
    with pytest.raises(ValueError, match="at most"):
        Engine(model, **kw)
