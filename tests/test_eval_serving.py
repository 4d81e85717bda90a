"""Serving-semantics attention for teacher forcing: masks, an independent float64 oracle, and equality
with kvarn_jax's own paged cache + reference decode attention."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvarn_jax as kj
from kvarn_jax.cache import hp
from kvarn_jax.hadamard import hadamard_matrix_np, rotate, unrotate
from kvarn_jax.evaluation.serving_attention import cache_reads, serving_attention, serving_masks, serving_semantics
from kvarn_jax.integrations.dlpack import served_bhtd
from test_eval_support import one_torch_thread, tiny_llama

BS = 32

_one_thread = pytest.fixture(autouse=True)(one_torch_thread)


@given(t=st.integers(1, 200), bs=st.sampled_from([1, 4, 16, 32]), own=st.booleans())
def test_masks_partition_the_causal_past(t, bs, own):
    exact, quant = serving_masks(t, bs, own)
    n_quant = quant.shape[1]
    assert n_quant == max(t // bs - 1, 0) * bs
    # Place the quantized columns at their token positions: every query sees each key j <= i once.
    seen = exact.int().clone()
    seen[:, bs:bs + n_quant] += quant.int()
    causal = torch.ones(t, t, dtype=torch.int32).tril()
    assert torch.equal(seen, causal)
    i = torch.arange(t)[:, None]
    jq = torch.arange(n_quant)[None, :] + bs
    # Quantized keys are never in the sink, always in full blocks, and never in the query's own
    # block unless own=True and the query is that block's last slot.
    assert not (quant & (jq // bs == 0)).any()
    own_block = jq // bs == i // bs
    if own:
        assert torch.equal(quant & own_block, own_block & ((i + 1) % bs == 0) & (i // bs >= 1) & (jq <= i))
    else:
        assert not (quant & own_block).any()
        # every earlier full block except the sink is read quantized
        assert torch.equal(quant, (jq // bs >= 1) & (jq // bs < i // bs))


def _held(x, cfg):
    """[B, Hk, T, D] float32 values as a float32 model's cache holds them in its sink and ring, float32
    in the storage frame: rotated for KVarN by the cache's own float32 rotation, rounded to float16
    (float32 with _hpfp32), and for _hpint8 the int8 scheme's row of each token (float16 scales).

    The cache's bits, not a float64 rotation: a rounding to float16 (and an int8 row's zero point,
    which is its smallest value) is a discrete choice, and a rotation off by one float32 ulp crosses a
    float16 midpoint now and then (numpy's matmul differs from XLA's in most last bits); under
    _hpint8 that moves a row's zero point by a float16 ulp, a tenth of an int8 step, and with it about
    a tenth of the row's codes."""
    y = np.asarray(rotate(jnp.asarray(x, jnp.float32), jnp.float32)) if cfg.rotated else np.asarray(x, np.float32)
    y = np.asarray(jnp.asarray(y).astype(jnp.float32 if cfg.hp == "fp32" else jnp.float16).astype(jnp.float32))
    if cfg.hp == "int8":
        t = jnp.asarray(y.reshape(-1, 1, y.shape[-1])).astype(jnp.float16)
        q = dataclasses.replace(kj.quantize((t, t), "int8"), dtype="float32")
        y = np.asarray(kj.dequantize(q)[0]).reshape(y.shape)
    return y


def _model_frame(y, cfg):
    y = np.asarray(y, np.float64)
    return y @ hadamard_matrix_np(y.shape[-1]) if cfg.rotated else y


def _pages(ks, vs, cfg, bs, first):
    """Dequantized pages (storage frame) of the full blocks from block `first` on, from the held values
    ks, vs [B, Hk, T, D]; a shorter sink's positions of block 0 replaced by the mean of the block's
    other tokens. Quantized in one call, heads-major like the evaluation: KVarN's 2-bit codes meet
    exact rounding ties (int8-held rows and a sink's mean rows make them ~10x more frequent), where
    float32 results that differ in a last bit (another batch layout, another summation order of the
    mean) pick the other code, as good but a whole step away."""
    b, hk, t, d = ks.shape
    sink, nq = cfg.sink_tokens, (t // bs - first) * bs
    regs = []
    for x in (ks, vs):
        r = x[:, :, first * bs:first * bs + nq].copy()
        if sink:
            # the cache's bits for the mean (`hp.exclude_sink`), checked here against its meaning
            r[:, :, :bs] = np.asarray(hp.exclude_sink(cfg, jnp.asarray(r[:, :, :bs]), jnp.zeros(b, jnp.int32)))
            mean = x[:, :, sink:bs].astype(np.float64).mean(2, keepdims=True)
            np.testing.assert_allclose(r[:, :, :sink], np.broadcast_to(mean, r[:, :, :sink].shape), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(r[:, :, sink:], x[:, :, sink:nq + first * bs])
        regs.append(jnp.asarray(r.transpose(2, 0, 1, 3).reshape(nq, b * hk, d)))
    kh, vh = kj.dequantize(kj.quantize(tuple(regs), cfg, rotated=True), rotated=True)
    return tuple(np.asarray(h).reshape(nq, b, hk, d).transpose(1, 2, 0, 3) for h in (kh, vh))


def _oracle(q, k, v, scheme, bs, own_quantized_at_last_slot):
    """float64 attention of every query over the cache as stored when it is decoded."""
    cfg = kj.parse(scheme)
    b, hq, t, d = q.shape
    hk = k.shape[1]
    ks, vs = _held(k, cfg), _held(v, cfg)
    sink = cfg.sink_tokens
    first = 0 if sink else 1        # the first block stored in a page
    kq, vq = ks.copy(), vs.copy()
    if t // bs > first:
        kq[:, :, first * bs:(t // bs) * bs], vq[:, :, first * bs:(t // bs) * bs] = _pages(ks, vs, cfg, bs, first)
    k, v, kq, vq = (_model_frame(x, cfg) for x in (ks, vs, kq, vq))
    out = np.zeros((b, hq, t, d))
    for i in range(t):
        ob = i // bs
        last = own_quantized_at_last_slot and (i + 1) % bs == 0 and ob >= first
        use_q = np.array([(j // bs >= first) and j >= sink and (j // bs < ob or (last and j // bs == ob))
                          for j in range(i + 1)])
        keys = np.where(use_q[None, None, :, None], kq[:, :, :i + 1], k[:, :, :i + 1])
        vals = np.where(use_q[None, None, :, None], vq[:, :, :i + 1], v[:, :, :i + 1])
        keys = np.repeat(keys, hq // hk, axis=1)
        vals = np.repeat(vals, hq // hk, axis=1)
        s = np.einsum("bhd,bhjd->bhj", q[:, :, i].astype(np.float64), keys) / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, i] = np.einsum("bhj,bhjd->bhd", p, vals)
    return out


def _qkv(rng, b=2, hq=4, hk=2, t=4 * BS + 7, d=32):
    q = rng.standard_normal((b, hq, t, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, t, d)).astype(np.float32)
    k[:, :, :, 3] = k[:, :, :, 3] * 12 + 6   # an outlier key channel, as in real models
    v = rng.standard_normal((b, hk, t, d)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("scheme", [
    "kvarn_k4v2_g32", "int2_g32", "int2_g32_sink4", "kvarn_k4v2_g32_hpint8_sink8", "kvarn_k4v2_g32_hpint8"])
def test_serving_attention_matches_float64_oracle(rng, scheme):
    q, k, v = _qkv(rng)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    for own in (False, True):
        got = serving_attention(tq, tk, tv, scheme, block_size=BS, quantize_own_full_block=own).numpy()
        want = _oracle(q, k, v, scheme, BS, own)
        # float32 against float64 (measured: at most 7e-6 over 50 fresh cases of _hpint8_sink8); a token
        # read from the wrong place or format, or a page from values the cache does not hold, moves
        # outputs by 1e-3 and more
        tol = 2e-5
        np.testing.assert_allclose(got, want, atol=tol, rtol=1e-4)
    # The two timings differ exactly at the last slot of blocks >= 1 (a token never sees its own block
    # quantized in the default mode), by far more than the tolerance: the oracle can tell them apart.
    default = serving_attention(tq, tk, tv, scheme, block_size=BS).numpy()
    own_q = serving_attention(tq, tk, tv, scheme, block_size=BS, quantize_own_full_block=True).numpy()
    diff = np.abs(default - own_q).max(axis=(0, 1, 3))
    first = 0 if kj.parse(scheme).sink_tokens else BS   # the first position stored in a page
    last_slots = [i for i in range(q.shape[2]) if (i + 1) % BS == 0 and i >= first]
    others = [i for i in range(q.shape[2]) if i not in last_slots]
    assert diff[others].max() == 0.0
    assert diff[last_slots].min() > 1e-3
    # Queries before the second paged block see no quantized key at all: the exact attention over
    # the values the sink and ring keep.
    sk, sv = served_bhtd(tk, tv, kj.parse(scheme))
    exact = serving_attention(tq, sk, sv, None, block_size=BS).numpy()
    np.testing.assert_allclose(default[:, :, :first + BS], exact[:, :, :first + BS], atol=1e-6, rtol=1e-6)
    assert np.abs(default[:, :, first + BS:] - exact[:, :, first + BS:]).max() > 1e-3


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "int4", "kvarn_k4v2_g32_hpint8_sink8"])
def test_equals_paged_cache_decode(rng, scheme):
    """Row p of the teacher-forced output == paged_decode_attention_reference at seq_len p + 1 on a
    PagedKVCache filled by kvarn_jax.write: a token never sees its own block quantized, even the token
    that completes it (the ablation quantize_own_full_block=True differs exactly at those tokens)."""
    q, k, v = _qkv(rng, b=1, t=4 * BS)
    t = q.shape[2]
    nb = t // BS
    cache = kj.PagedKVCache.create(scheme, num_blocks=nb + 2, block_size=BS, num_kv_heads=2, head_dim=32,
                                   max_seqs=1, dtype=jnp.float32)
    table = rng.permutation(nb + 2)[:nb].astype(np.int32)
    paged = np.full((1, 4, t, 32), np.nan, np.float32)  # poisoned: every row must be written below
    for m in range(nb):
        pos = np.arange(m * BS, (m + 1) * BS)
        slots = table[pos // BS] * BS + pos % BS
        k_new, v_new = (jnp.asarray(x[0][:, pos].transpose(1, 0, 2)) for x in (k, v))
        cache = kj.write(cache, k_new, v_new, jnp.asarray(slots, jnp.int32), seq_ids=jnp.zeros(BS, jnp.int32),
                         positions=jnp.asarray(pos, jnp.int32))
        # Every position of block m, decoded against the cache as it stands after block m is written.
        out = kj.paged_decode_attention_reference(
            jnp.asarray(q[0][:, pos].transpose(1, 0, 2)), cache, jnp.asarray(np.tile(table, (BS, 1))),
            jnp.asarray(pos + 1, jnp.int32), seq_ids=jnp.zeros(BS, jnp.int32))
        paged[0][:, pos] = np.asarray(out).transpose(1, 0, 2)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    default = serving_attention(tq, tk, tv, scheme, block_size=BS).numpy()
    np.testing.assert_allclose(default, paged, atol=3e-5, rtol=1e-4)
    ablation = serving_attention(tq, tk, tv, scheme, block_size=BS, quantize_own_full_block=True).numpy()
    first = 0 if kj.parse(scheme).sink_tokens else BS
    last = [i for i in range(first, t) if (i + 1) % BS == 0]  # a block's last token, past the sink
    not_last = [i for i in range(t) if i not in last]
    np.testing.assert_allclose(ablation[:, :, not_last], paged[:, :, not_last], atol=3e-5, rtol=1e-4)
    assert np.abs(ablation[:, :, last] - paged[:, :, last]).max() > 1e-3


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32_hpint8_sink8", "kvarn_k4v2_g32"])
def test_pages_and_served_values_equal_the_paged_cache(rng, scheme):
    """The evaluation's served values and pages (`cache_reads`) against a PagedKVCache that prefilled
    16 sequences with kvarn_jax.write (its pages read back by gather_dense): equal up to float32
    rounding (1e-5 measured; 1e-4 allowed), never a code apart (a step is 0.05 to 0.3 here).

    Pages quantized from served values rotated back to the model's frame and again (float32 noise on
    every input) differ from the cache's by a whole code where the quantizer meets a near or exact
    tie: for _hpint8_sink8 a few token rows of these 64 blocks move by ~0.2."""
    cfg = kj.parse(scheme)
    b, hk, d, nb = 16, 2, 32, 4
    t = nb * BS
    k = rng.standard_normal((b, hk, t + 1, d)).astype(np.float32)
    k[..., 3] = k[..., 3] * 12 + 6
    v = rng.standard_normal((b, hk, t + 1, d)).astype(np.float32)
    cache = kj.PagedKVCache.create(scheme, num_blocks=b * (nb + 1), block_size=BS, num_kv_heads=hk, head_dim=d,
                                   max_seqs=b, dtype=jnp.float32)
    table = rng.permutation(b * (nb + 1)).astype(np.int32).reshape(b, nb + 1)
    pos = np.tile(np.arange(t + 1), b)
    seq = np.repeat(np.arange(b), t + 1)
    slots = table[seq, pos // BS] * BS + pos % BS
    cache = kj.write(cache, *(jnp.asarray(x.transpose(0, 2, 1, 3).reshape(-1, hk, d)) for x in (k, v)),
                     jnp.asarray(slots, jnp.int32), seq_ids=jnp.asarray(seq, jnp.int32),
                     positions=jnp.asarray(pos, jnp.int32))
    # seq_len t + 1: every block of the first t positions past the sink is read from its page
    dense = kj.cache.paged.gather_dense(cache, jnp.asarray(table), jnp.full(b, t + 1, jnp.int32))
    want = [np.asarray(unrotate(x[:, :, :t], jnp.float32) if cfg.rotated else x[:, :, :t]) for x in dense]
    start = 0 if cfg.sink_tokens else BS
    got = cache_reads(torch.from_numpy(k[:, :, :t].copy()), torch.from_numpy(v[:, :, :t].copy()), cfg, BS, start,
                      t - start)
    for served, page, w in zip(got[:2], got[2:], want):
        served, page = served.numpy(), page.numpy()
        paged = np.arange(start, t) >= cfg.sink_tokens       # positions the cache reads from pages
        np.testing.assert_allclose(page[:, :, paged], w[:, :, start:][:, :, paged], atol=1e-4, rtol=0)
        sink_len = cfg.sink_tokens or BS
        np.testing.assert_allclose(served[:, :, :sink_len], w[:, :, :sink_len], atol=1e-4, rtol=0)


def test_model_context_exact_path_and_restore():
    model = tiny_llama(num_layers=2)
    x = torch.randint(0, 97, (2, 3 * BS + 5))
    before = model.config._attn_implementation
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        with serving_semantics(model, None, block_size=BS):
            got = model(x, use_cache=False).logits
        with serving_semantics(model, "int2_g32", block_size=BS):
            quant = model(x, use_cache=False).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert (quant - ref).abs().max() > 1e-3
    assert model.config._attn_implementation == before
    assert not any(hasattr(m, "kvarn_serving") for m in model.modules())
    with pytest.raises(RuntimeError), serving_semantics(model, "int8", block_size=BS):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before


def test_bad_input_is_rejected():
    model = tiny_llama(num_layers=2)
    q = torch.randn(1, 4, 64, 32)
    k = torch.randn(1, 2, 64, 32)
    with pytest.raises(ValueError, match="query"):
        serving_attention(q[0], k, k, "int8")
    with pytest.raises(ValueError, match="key/value"):
        serving_attention(q, k[:, :, :32], k[:, :, :32], "int8")
    with pytest.raises(ValueError, match="block_size"):
        serving_attention(q, k, k, "kvarn_k4v2_g32", block_size=48)
    with pytest.raises(ValueError, match="attention_mask"):
        serving_attention(q, k, k, "int8", block_size=BS, attention_mask=torch.ones(1, 1, 64, 64))
    with pytest.raises(ValueError, match="int3"):
        serving_attention(q, k, k, "int3")
    with pytest.raises(ValueError, match="3 entries but the model has 2 layers"):
        with serving_semantics(model, ["int8"] * 3, block_size=BS):
            pass
    with pytest.raises(ValueError, match="calibration"):
        with serving_semantics(model, "int8_static", block_size=BS):
            pass
    with pytest.raises(ValueError, match="block_size"):
        with serving_semantics(model, "kvarn_k4v2_g32", block_size=48):
            pass
