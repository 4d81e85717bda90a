"""KVarNCache (a transformers Cache backed by kvarn_jax): storage round trip, DLPack zero-copy, equality
with teacher-forced serving semantics, and generate (greedy, beam search, per-layer schemes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

import kvarn_jax as kj
from kvarn_jax.evaluation.agreement import greedy_continuation
from kvarn_jax.layer_config import write_layer_config
from kvarn_jax.evaluation.serving_attention import serving_semantics
from kvarn_jax.integrations.dlpack import dequantize_bhtd, quantize_bhtd, served_bhtd, to_jax
from kvarn_jax.integrations.transformers import KVarNCache, KVarNLayer, cache_kwargs
from test_eval_support import one_torch_thread, tiny_llama

BS = 32

_one_thread = pytest.fixture(autouse=True)(one_torch_thread)


def _expected(k_all, v_all, scheme, stored):
    """What the cache must return for its first `stored` tokens: sink and tail as the high-precision
    storage keeps them (`served_bhtd`), full blocks after the sink = kvarn_jax round trip of that
    block of those values (computed per sequence, directly)."""
    b, h, _, d = k_all.shape
    k_all, v_all = served_bhtd(k_all, v_all, scheme)
    k_exp, v_exp = k_all[:, :, :stored].clone(), v_all[:, :, :stored].clone()
    for blk in range(1, stored // BS):
        sl = slice(blk * BS, (blk + 1) * BS)
        for bi in range(b):
            kk = jnp.asarray(k_all[bi, :, sl].permute(1, 0, 2).numpy())
            vv = jnp.asarray(v_all[bi, :, sl].permute(1, 0, 2).numpy())
            kh, vh = kj.dequantize(kj.quantize((kk, vv), scheme))
            k_exp[bi, :, sl] = torch.from_numpy(np.array(kh)).permute(1, 0, 2)
            v_exp[bi, :, sl] = torch.from_numpy(np.array(vh)).permute(1, 0, 2)
    return k_exp, v_exp


def _feed(layer, k_all, v_all, chunks):
    """Feed chunks; check every returned K/V against the storage contract. Returns tokens stored."""
    pos = 0
    for n in chunks:
        k_new, v_new = k_all[:, :, pos:pos + n], v_all[:, :, pos:pos + n]
        keys, values = layer.update(k_new, v_new)
        k_exp, v_exp = _expected(k_all, v_all, layer.cfg.name, pos)
        assert keys.shape == (k_all.shape[0], k_all.shape[1], pos + n, k_all.shape[3])
        # float32 data keeps float32 scales: their sums run in a shape-dependent order, so the
        # round trip agrees to float32 rounding (a code that differed would be off by a quantization step)
        torch.testing.assert_close(keys[:, :, :pos], k_exp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[:, :, :pos], v_exp, atol=1e-5, rtol=1e-5)
        # this step's own tokens come back as the high-precision storage keeps them (float16 here)
        k_hp, v_hp = served_bhtd(k_new, v_new, layer.cfg)
        assert torch.equal(keys[:, :, pos:], k_hp) and torch.equal(values[:, :, pos:], v_hp)
        assert not torch.equal(k_hp, k_new)
        pos += n
        assert layer.get_seq_length() == pos
        hp = min(pos, BS) + (pos - BS) % BS if pos > BS else pos
        assert layer.high_precision_tokens == hp
        assert layer.num_quantized_blocks == max(pos // BS - 1, 0)
    return pos


@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8))
def test_layer_round_trip_int4(chunks):
    g = torch.Generator().manual_seed(sum(chunks) * 31 + len(chunks))
    total = sum(chunks)
    k_all = torch.randn(2, 2, total, 32, generator=g)
    v_all = torch.randn(2, 2, total, 32, generator=g)
    layer = KVarNLayer("int4", block_size=BS)
    _feed(layer, k_all, v_all, chunks)


def test_layer_round_trip_kvarn_and_bytes(rng):
    k_all = torch.from_numpy(rng.standard_normal((2, 2, 5 * BS + 9, 32)).astype(np.float32))
    k_all[..., 7] = k_all[..., 7] * 20 + 5
    v_all = torch.from_numpy(rng.standard_normal((2, 2, 5 * BS + 9, 32)).astype(np.float32))
    layer = KVarNLayer("kvarn_k4v2_g32", block_size=BS)
    stored = _feed(layer, k_all, v_all, [40, 1, 1, 30, 50, 47])
    nb = layer.nbytes()
    # 4 quantized blocks in a buffer of capacity 4; 32 sink + 9 tail tokens, held in the model's fp32
    # tensors (their values rounded to float16)
    assert layer.num_quantized_blocks == 4 and layer.capacity_blocks == 4
    assert nb["quantized_bytes"] == 4 * BS * 2 * 2 * kj.bytes_per_token("kvarn_k4v2_g32", 32, "float32")  # scales in float32
    assert nb["high_precision_bytes"] == (BS + stored - 5 * BS) * 2 * 2 * 32 * 2 * 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_dtypes_round_trip(rng, dtype):
    k = torch.from_numpy(rng.standard_normal((1, 2, 3 * BS, 32)).astype(np.float32)).to(dtype)
    v = torch.from_numpy(rng.standard_normal((1, 2, 3 * BS, 32)).astype(np.float32)).to(dtype)
    layer = KVarNLayer("int8", block_size=BS)
    layer.update(k, v)
    keys, values = layer.update(k[:, :, :1], v[:, :, :1])
    assert keys.dtype == dtype and values.dtype == dtype
    sl = slice(BS, 2 * BS)
    kh, vh = kj.dequantize(kj.quantize((to_jax(k[0, :, sl].permute(1, 0, 2).contiguous()),
                                        to_jax(v[0, :, sl].permute(1, 0, 2).contiguous())), "int8"))
    assert kh.dtype == jnp.dtype(str(dtype).split(".")[1])
    np.testing.assert_array_equal(keys[0, :, sl].permute(1, 0, 2).float().numpy(), np.asarray(kh, np.float32))
    np.testing.assert_array_equal(values[0, :, sl].permute(1, 0, 2).float().numpy(), np.asarray(vh, np.float32))
    assert (keys[0, :, sl] - k[0, :, sl]).abs().max() > 0  # really quantized


def test_dlpack_is_zero_copy():
    t = torch.randn(BS, 4, 32)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    k = torch.randn(1, 2, BS, 32)
    q = quantize_bhtd(k, k, "int8")
    k_hat, _ = dequantize_bhtd(q, 1)
    # the returned torch view aliases jax's dequantized buffer
    jk, _ = kj.dequantize(q)
    assert k_hat.shape == (1, 2, BS, 32)
    assert torch.from_dlpack(jk).data_ptr() == jk.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="contiguous"):
        to_jax(torch.randn(4, 8).t())


def test_decode_equals_teacher_forced_serving():
    """Token-by-token decoding through KVarNCache gives the logits of the teacher-forced serving path."""
    # A calm model (init 0.02): K/V computed by the prefill and by the full-window forward differ by
    # float rounding only. That rounding can still flip a rounding decision of the quantizer now and
    # then (int2, seed 3: one code, on an AMD EPYC with XLA's optimizations off; on an Intel AVX-512
    # machine none), which moves the logits by a quantization step: each scheme must match on at least
    # two of three prompts. A difference of semantics shows on every prompt.
    model = tiny_llama(num_layers=2, init=0.02)
    # float32 sink and tail: the default 16-bit ones turn the float rounding differences between the two
    # paths into differences of a float16 step (tested above, `_feed`, and in test_eval_serving.py)
    for scheme in ("kvarn_k4v2_g32_hpfp32", "int2_g32_hpfp32"):
        errors = []
        for seed in (3, 4, 5):
            x = torch.randint(0, 97, (2, 4 * BS + 11), generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                with serving_semantics(model, scheme, block_size=BS):
                    tf = model(x, use_cache=False).logits
                cache = KVarNCache(scheme, block_size=BS)
                steps = [model(x[:, :2 * BS], use_cache=True, **cache_kwargs(model, cache)).logits]   # exact prefill (sink + block 1)
                for t in range(2 * BS, x.shape[1]):
                    steps.append(model(x[:, t:t + 1], use_cache=True, **cache_kwargs(model, cache)).logits)
            dec = torch.cat(steps, dim=1)
            try:
                torch.testing.assert_close(dec, tf, atol=2e-5, rtol=1e-4)
            except AssertionError as e:
                errors.append(f"seed {seed}: {e}")
            exact = model(x, use_cache=False).logits.detach()
            assert (exact - tf).abs().max() > 1e-3   # the quantized blocks did change the logits
        assert len(errors) <= 1, f"{scheme}: " + "\n".join(errors)


def _gen_model():
    model = tiny_llama(num_layers=2, seed=1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_generate_greedy_and_beams():
    model = _gen_model()
    x = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=40, do_sample=False)
    with torch.no_grad():
        out = model.generate(x, past_key_values=KVarNCache("kvarn_k4v2_g32", block_size=BS), **kw)
        manual = greedy_continuation(model, x, "kvarn_k4v2_g32", 40, block_size=BS)
        assert torch.equal(out[:, 50:], manual)
        # fp32 storage is exact: identical to transformers' own cache, greedy and with beam search
        # (beam search reorders the cache every step: sink, quantized buffer and tail alike)
        ref = model.generate(x, past_key_values=DynamicCache(), **kw)
        assert torch.equal(model.generate(x, past_key_values=KVarNCache("fp32", block_size=BS), **kw), ref)
        beam_ref = model.generate(x, num_beams=3, past_key_values=DynamicCache(), **kw)
        beam = model.generate(x, num_beams=3, past_key_values=KVarNCache("fp32", block_size=BS), **kw)
        assert torch.equal(beam, beam_ref)
        # a quantized cache under beam search stays consistent with itself across batch layouts
        b1 = model.generate(x[:1], num_beams=3, past_key_values=KVarNCache("int8", block_size=BS), **kw)
        b2 = model.generate(x, num_beams=3, past_key_values=KVarNCache("int8", block_size=BS), **kw)
        assert torch.equal(b1[0], b2[0])


def test_per_layer_schemes_and_file(tmp_path):
    model = _gen_model()
    path = tmp_path / "layers.json"
    write_layer_config(path, ["int8", "int4"], block_size=BS, model={"num_layers": 2, "head_dim": 32})
    x = torch.randint(0, 97, (1, 70), generator=torch.Generator().manual_seed(7))
    for spec in (["int8", "int4"], str(path), path):
        cache = KVarNCache(spec, block_size=BS)
        with torch.no_grad():
            model(x, use_cache=True, **cache_kwargs(model, cache))
        assert [layer.cfg.name for layer in cache.layers] == ["int8", "int4"]
        assert cache.get_seq_length() == 70
    cache = KVarNCache(["int8"], block_size=BS)
    with pytest.raises(ValueError, match="per-layer schemes cover 1 layers"):
        with torch.no_grad():
            model(x, use_cache=True, **cache_kwargs(model, cache))


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="Calibration"):
        KVarNCache("int8_static")
    with pytest.raises(ValueError, match="block_size"):
        KVarNCache("kvarn_k4v2_g128", block_size=64)
    with pytest.raises(ValueError, match="int3"):
        KVarNCache("int3")
    with pytest.raises(ValueError, match="non-empty"):
        KVarNCache([])
    layer = KVarNLayer("int8", block_size=BS)
    layer.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32))
    with pytest.raises(ValueError, match="does not match"):
        layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
    with pytest.raises(ValueError, match="same shape"):
        layer.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 2, 32))
    with pytest.raises(ValueError, match="cropped"):
        layer.crop(-1)
    with pytest.raises(ValueError, match="head_dim"):
        KVarNLayer("kvarn_k4v2_g32", block_size=BS).update(torch.randn(1, 2, 3, 48), torch.randn(1, 2, 3, 48))
    assert jax.default_backend() == "cpu"
