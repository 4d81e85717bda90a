"""kvarn_ascend's op table: CPU semantics vs kvarn_jax (and the ops' documented CPU goldens), the
validators against every documented bad case, the documented signatures, and the NPU call path
through a recording fake of torch_npu.

Tolerances are the Ascend op tests' (ops.TOLERANCE): |got - ref| <= max(|ref|, 1) * tol, tol =
2^-10 (fp16), 2^-7 (bf16), 2^-13 (fp32); quantization codes may differ by 1 where float rounding
of a scale puts a value on the other side of a .5 (the op tests' atol=1 on codes).
"""

import dataclasses
import inspect
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import kvarn_jax as kj
from kvarn_jax.schemes import rtn as jrtn
from kvarn_ascend import cpu_semantics as cs, ops, validators
from kvarn_ascend.cache import merge_partials
from kvarn_ascend.kvarn_torch import hadamard

import ascend_fake_npu
from ascend_fake_npu import REAL_SCHEMAS, FakeTorchNpu, real_signature


@pytest.fixture
def fake_torch_npu(monkeypatch):
    return ascend_fake_npu.install(monkeypatch)

DTYPES = [torch.float16, torch.bfloat16]
JNP = {torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16}


def tt(a, dtype=None):
    x = torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=np.float32) if dtype is not None else a))
    return x.to(dtype) if dtype is not None else x


def to_np(x: torch.Tensor) -> np.ndarray:
    return x.float().numpy() if x.is_floating_point() else x.numpy()


def kv_like(rng, shape, outliers=True):
    """Gaussian values with a few large channels (as real keys have): never zeros."""
    x = rng.standard_normal(shape)
    if outliers:
        ch = rng.choice(shape[-1], 2, replace=False)
        x[..., ch] = x[..., ch] * 15 + 5
    return x


def jx(x: torch.Tensor):
    """torch -> jnp of the same dtype (bf16 via fp32, exact)."""
    if x.dtype == torch.bfloat16:
        return jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(x.numpy())


# ------------------------------------------------------------------------------------------ int4 packing
def test_int4_nibble_order_is_element_zero_low():
    vals = torch.tensor([[1, -1, 2, -8, 7, 0, 3, -2]], dtype=torch.int8)
    word = cs.pack_int4(vals)
    nibbles = [1, 0xF, 2, 0x8, 7, 0, 3, 0xE]
    expect = sum(n << (4 * j) for j, n in enumerate(nibbles))
    assert int(word[0, 0]) == expect - 2 ** 32  # two's complement int32
    # the op tests' unpacking: bytes of the little-endian int32, low nibble of each byte first
    b = word.view(torch.uint8).reshape(-1).to(torch.int16)
    low, high = ((b & 0xF) ^ 8) - 8, ((b >> 4) ^ 8) - 8
    assert torch.stack([low, high], 1).reshape(-1).tolist() == vals[0].tolist()


@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2 ** 31))
def test_int4_pack_roundtrip(rows, words, seed):
    v = torch.from_numpy(np.random.default_rng(seed).integers(-8, 8, (rows, words * 8)).astype(np.int8))
    packed = cs.pack_int4(v)
    assert packed.dtype == torch.int32 and packed.shape == (rows, words)
    assert torch.equal(cs.unpack_int4(packed), v)


# ------------------------------------------------------------------------------------------ dynamic quant
_RTN = jax.jit(jrtn.rtn_codes, static_argnums=3)


def _kvarn_rtn_codes(x, scale, bits):
    """kvarn_jax's RTN codes with min = -2^(bits-1) * scale, on rows padded to one shape (one compile)."""
    r, h, d = x.shape
    xp = np.zeros((24, 2, 64), np.float32)
    sp = np.ones((24, 2), np.float32)
    xp[:r, :h, :d], sp[:r, :h] = x, scale
    out = _RTN(jnp.asarray(xp), jnp.asarray(-(2 ** (bits - 1)) * sp), jnp.asarray(sp), bits)
    return np.asarray(out)[:r, :h, :d].astype(int)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dst", [torch.int8, torch.quint4x2])
@given(rows=st.integers(1, 24), d8=st.integers(1, 8), seed=st.integers(0, 2 ** 31))
def test_dynamic_quant_matches_golden_and_kvarn_rtn(dtype, dst, rows, d8, seed):
    rng = np.random.default_rng(seed)
    x = tt(kv_like(rng, (rows, 2, d8 * 8)), dtype)
    y, scale = cs.npu_dynamic_quant(x, dst_type=dst)
    dmax = 127 if dst is torch.int8 else 7
    codes = cs.unpack_int4(y) if dst is torch.quint4x2 else y
    # the op test's CPU golden: scale = amax / DTYPE_MAX, y = round(x / scale) (half to even)
    xf = to_np(x).astype(np.float32)
    g_scale = np.abs(xf).max(-1) / dmax
    np.testing.assert_allclose(to_np(scale), g_scale, rtol=1e-6)
    np.testing.assert_array_equal(to_np(codes), np.round(xf / g_scale[..., None]))
    # kvarn_jax's RTN with the same scale and min = -(DTYPE_MAX + 1) * scale gives the same codes + offset
    ref = _kvarn_rtn_codes(xf, to_np(scale), 8 if dmax == 127 else 4) - dmax - 1
    diff = np.abs(ref - to_np(codes).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() <= 0.01
    # dequantized within half a step (+ float slack) of x
    assert np.all(np.abs(to_np(codes) * to_np(scale)[..., None] - xf) <= 0.5001 * to_np(scale)[..., None] + 1e-6)


def test_dynamic_quant_smooth_scales_and_groups(rng):
    x = tt(kv_like(rng, (12, 16)), torch.float16)
    sm = tt(rng.uniform(0.5, 2.0, (3, 16)), torch.float16)
    gi = torch.tensor([4, 4, 12], dtype=torch.int32)
    y, scale = cs.npu_dynamic_quant(x, smooth_scales=sm, group_index=gi)
    xs = to_np(x).copy()
    xs[:4] *= to_np(sm[0])
    xs[4:] *= to_np(sm[2])  # group 1 is empty ([4, 4))
    s = np.abs(xs).max(-1) / 127
    np.testing.assert_allclose(to_np(scale), s, rtol=1e-6)
    np.testing.assert_array_equal(to_np(y), np.round(xs / s[:, None]))
    y1, s1 = cs.npu_dynamic_quant(x, smooth_scales=sm[1])
    np.testing.assert_allclose(to_np(s1), np.abs(to_np(x) * to_np(sm[1])).max(-1) / 127, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_dynamic_quant_asymmetric_matches_kvarn_jax_int(rng, dtype, scheme):
    bits = int(scheme[3:])
    x = tt(kv_like(rng, (40, 3, 64)), dtype)
    q = kj.quantize((jx(x), jx(x)), scheme)  # kvarn_jax: per token per head, fp16 scale + zero
    c = np.asarray(kj.packing.unpack(q.fields["k"]["codes"], bits)).astype(int)  # [40, 3, 64] in [0, 2^b)
    dst = torch.int8 if bits == 8 else torch.quint4x2
    y, scale, offset = cs.npu_dynamic_quant_asymmetric(x.reshape(-1, 64), dst_type=dst)
    yc = to_np(cs.unpack_int4(y) if bits == 4 else y).reshape(40, 3, 64).astype(int)
    half = 2 ** (bits - 1)
    diff = np.abs(yc + half - c)
    # kvarn_jax picks codes against scale/zero rounded to x's dtype, the op against float32 ones (bf16
    # roundings move an int8 code by up to ~0.5: 10-25% of them flip)
    flipped = 0.05 if dtype == torch.float16 else 0.3
    assert diff.max() <= 1 and (diff > 0).mean() <= flipped, (diff.max(), (diff > 0).mean())
    # the documented formula, evaluated independently
    xf = to_np(x).reshape(-1, 64).astype(np.float32)
    mx, mn = xf.max(-1), xf.min(-1)
    s = (mx - mn) / (2 ** bits - 1)
    o = (half - 1) - mx / s
    np.testing.assert_allclose(to_np(scale), s, rtol=1e-6)
    np.testing.assert_allclose(to_np(offset), o, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(yc.reshape(-1, 64), np.clip(np.round(xf / s[:, None] + o[:, None]), -half, half - 1))
    # both dequantizations approximate x within one step
    ours = (yc.reshape(-1, 64) - to_np(offset)[:, None]) * to_np(scale)[:, None]
    theirs = np.asarray(kj.dequantize(q)[0].astype(jnp.float32)).reshape(-1, 64)
    step = s[:, None]
    assert np.all(np.abs(ours - xf) <= 0.51 * step + 1e-6)
    # kvarn_jax rounds its scale/zero to fp16 and its output to x's dtype
    assert np.all(np.abs(ours - theirs) <= 1.01 * step + np.abs(xf) * 2 ** -8 + 1e-3)


# ------------------------------------------------------------------------------------------ static quant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", ["int8_static", "int4_static"])
def test_quantize_and_anti_quant_match_kvarn_jax_static(rng, dtype, scheme):
    bits = 8 if scheme.startswith("int8") else 4
    hk, d = 2, 64
    calib = tt(kv_like(rng, (256, hk, d)), dtype)
    x = tt(kv_like(rng, (48, hk, d)), dtype)
    cal = kj.calibrate([(jx(calib), jx(calib))], scheme)
    q = kj.quantize((jx(x), jx(x)), scheme, calibration=cal)
    c = np.asarray(kj.packing.unpack(q.fields["k"]["codes"], bits)).astype(int)
    p = cal.params(kj.parse(scheme), hk, d, jx(x).dtype)["k"]  # in x's dtype, as kvarn_jax quantizes with them
    s16 = torch.from_numpy(np.array(p["scale"], np.float32)).reshape(-1)
    z16 = torch.from_numpy(np.array(p["zero"], np.float32)).reshape(-1)
    half = 2 ** (bits - 1)
    y = cs.npu_quantize(x.reshape(48, hk * d), 1.0 / s16, -z16 / s16 - half,
                        torch.qint8 if bits == 8 else torch.quint4x2, axis=-1, div_mode=False)
    yc = to_np(cs.unpack_int4(y) if bits == 4 else y).astype(int).reshape(48, hk, d)
    diff = np.abs(yc + half - c)
    assert diff.max() <= 1 and (diff > 0).mean() <= 0.01
    # the documented formula round(x * scales + zero_points), clamped, evaluated independently
    ref = np.clip(np.round(to_np(x).reshape(48, -1) * to_np(1.0 / s16) + to_np(-z16 / s16 - half)), -half, half - 1)
    np.testing.assert_array_equal(yc.reshape(48, -1), ref)
    # anti-quant of kvarn_jax's own codes (c - 2^(b-1)) equals kvarn_jax's dequantization
    codes = torch.from_numpy(c.reshape(48, -1) - half)
    xq = cs.pack_int4(codes) if bits == 4 else codes.to(torch.int8)
    out = cs.npu_anti_quant(xq, s16, offset=half + z16 / s16, dst_dtype=dtype,
                            src_dtype=torch.quint4x2 if bits == 4 else torch.int8)
    assert out.dtype == dtype
    theirs = torch.from_numpy(np.array(kj.dequantize(q)[0].astype(jnp.float32))).reshape(48, -1)
    assert ops.max_violation(out, theirs, dtype) <= 1


def test_quantize_div_mode_matches_torch_quantize_per_channel(rng):
    """div_mode=True: the op tests' golden is torch.quantize_per_channel(...).int_repr()."""
    if not hasattr(torch, "quantize_per_channel"):
        pytest.skip("torch.quantize_per_channel (the op tests' golden) was removed from this torch")
    x = tt(rng.uniform(-1, 1, (5, 7)), torch.float32)
    s = tt(rng.uniform(0.01, 0.1, 7), torch.float32)
    z = torch.from_numpy(rng.integers(-5, 5, 7)).to(torch.int32)
    for axis, dtype in ((1, torch.qint8), (1, torch.quint8)):
        zz = z if dtype is torch.qint8 else z + 100
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = torch.quantize_per_channel(x, s, zz.long(), axis, dtype).int_repr()
        got = cs.npu_quantize(x, s, zz, dtype, axis=axis, div_mode=True)
        assert torch.equal(got, ref)


# ------------------------------------------------------------------------------------------ undocumented cases
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dst", [torch.int8, torch.quint4x2])
def test_constant_rows_dequantize_to_their_value(rng, dtype, dst):
    """Not in the docs: a constant row. Asymmetric: the kernel's 1e-12 scale floor, so (y - offset) * scale
    gives the value back; symmetric: an all-zero row gives scale 0 (dequantized 0, whatever the codes)."""
    int4 = dst is torch.quint4x2
    x = tt(kv_like(rng, (6, 32)), dtype)
    x[1] = 0.0
    x[2] = 3.5
    x[3] = -0.01171875
    y, scale, offset = cs.npu_dynamic_quant_asymmetric(x, dst_type=dst)
    codes = (cs.unpack_int4(y) if int4 else y).float()
    assert bool(torch.isfinite(scale).all() & torch.isfinite(offset).all())
    assert float(scale[1:4].max()) == pytest.approx(cs.ASYMMETRIC_MIN_SCALE, rel=1e-6)
    back = (codes - offset[:, None]) * scale[:, None]
    span = (15 if int4 else 255) * cs.ASYMMETRIC_MIN_SCALE  # codes anywhere in the range
    assert float((back[1:4] - x[1:4].float()).abs().max()) <= span + x[1:4].float().abs().max() * 2 ** -22
    ys, ss = cs.npu_dynamic_quant(x, dst_type=dst)
    assert float(ss[1]) == 0.0 and float(((cs.unpack_int4(ys) if int4 else ys)[1].float() * ss[1]).abs().max()) == 0


@pytest.mark.parametrize("dst,lo,hi", [(torch.qint8, -128, 127), (torch.quint4x2, -8, 7)])
def test_quantize_saturates_to_the_output_range(dst, lo, hi):
    """npu_quantize (div_mode=False) saturates: aclnnAscendQuantV3's golden clips after rounding (np.clip);
    the torch_npu doc does not say."""
    x = torch.tensor([[-1e6, -300.0, -8.6, -8.4, -0.5, 0.5, 1.5, 7.4, 7.6, 300.0, 1e6, 2.5, 3.5, 0.0, -2.5, 126.5]])
    y = cs.npu_quantize(x, torch.ones(16), None, dst, axis=-1, div_mode=False)
    got = (cs.unpack_int4(y) if dst is torch.quint4x2 else y).flatten().tolist()
    want = np.clip(np.round(x.numpy().astype(np.float32)), lo, hi).astype(int).flatten().tolist()  # np.round: half even
    assert got == want and min(got) == lo and max(got) == hi


def test_asymmetric_codes_use_the_whole_range_and_never_wrap(rng):
    x = tt(kv_like(rng, (64, 128)) * 1e3, torch.bfloat16)
    for dst, lo, hi in ((torch.int8, -128, 127), (torch.quint4x2, -8, 7)):
        y, _, _ = cs.npu_dynamic_quant_asymmetric(x, dst_type=dst)
        c = cs.unpack_int4(y) if dst is torch.quint4x2 else y
        assert int(c.min(1).values.max()) == lo and int(c.max(1).values.min()) == hi


def test_fia_lse_shapes_and_empty_rows():
    """softmax_lse is (0,) when not asked for (op-plugin allocates {0}; the doc says (1,)); a row with
    actual length 0 gives output 0 and lse -3.40e38 (the decode kernel's InitAllZeroOutput)."""
    q = torch.randn(3, 4, 1, 64).half()
    k = torch.randn(3, 2, 40, 64).half()
    common = dict(actual_seq_lengths_kv=[0, 40, 7], num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                  scale=0.125, backend="cpu")
    out, lse = ops.call("npu_fused_infer_attention_score", q, k, k.clone(), **common)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (0,)
    out, lse = ops.call("npu_fused_infer_attention_score", q, k, k.clone(), softmax_lse_flag=True, **common)
    assert tuple(lse.shape) == (3, 4, 1, 1)
    assert float(out[0].abs().max()) == 0.0
    assert lse[0].flatten().tolist() == [np.float32(-3.40e38)] * 4
    assert bool(torch.isfinite(lse).all()) and bool((lse[1:] > -1e30).all())


# ------------------------------------------------------------------------------------------ scatter
@pytest.mark.parametrize("cache_mode", ["Norm", "PA_NZ"])
@given(tokens=st.integers(1, 12), heads=st.integers(1, 3), d16=st.integers(1, 3), seed=st.integers(0, 2 ** 31))
def test_scatter_pa_kv_cache_matches_slot_loop(cache_mode, tokens, heads, d16, seed):
    rng = np.random.default_rng(seed)
    d, nb, bs, last = d16 * 16, 4, 8, 16
    key = tt(rng.standard_normal((tokens, heads, d)), torch.float16)
    val = tt(rng.standard_normal((tokens, heads, d)), torch.float16)
    shape = (nb, bs, heads, d) if cache_mode == "Norm" else (nb, heads * d // last, bs, last)
    kc = tt(rng.standard_normal(shape) * 7 + 3, torch.float16)  # poisoned
    vc = tt(rng.standard_normal(shape) * 7 + 3, torch.float16)
    slots = torch.from_numpy(rng.choice(nb * bs, tokens, replace=False).astype(np.int32))
    gk, gv = kc.clone(), vc.clone()
    for i, slot in enumerate(slots.tolist()):  # the op test's golden, written out
        b, o = divmod(slot, bs)
        if cache_mode == "Norm":
            gk[b, o], gv[b, o] = key[i], val[i]
        else:
            fk, fv = key[i].reshape(-1), val[i].reshape(-1)
            for r in range(heads * d // last):
                gk[b, r, o], gv[b, r, o] = fk[r * last:(r + 1) * last], fv[r * last:(r + 1) * last]
    assert ops.call("npu_scatter_pa_kv_cache", key, val, kc, vc, slots, cache_mode=cache_mode, backend="cpu") is None
    assert torch.equal(kc, gk) and torch.equal(vc, gv)


# ------------------------------------------------------------------------------------------ attention
def _oracle(q, k, v, lens, scale):
    """float64 GQA attention: q [B, Hq, D], k/v [B, Hk, S, D] numpy; returns (out, lse [B, Hq])."""
    b, hq, d = q.shape
    hk = k.shape[1]
    out = np.zeros((b, hq, d))
    lse = np.full((b, hq), cs.EMPTY_ROW_LSE)  # the decode kernel's lse of a row with no keys
    for i in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            s = k[i, kh, :lens[i]] @ q[i, h] * scale
            if lens[i] == 0:
                continue
            m = s.max()
            p = np.exp(s - m)
            out[i, h] = p @ v[i, kh, :lens[i]] / p.sum()
            lse[i, h] = np.log(p.sum()) + m
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,cache_layout", [("BNSD", "BnBsH"), ("BSH", "BnBsH"), ("BSND", "BnBsH"),
                                                 ("BNSD", "BnNBsD")])
def test_fia_paged_matches_kvarn_jax_reference(rng, dtype, layout, cache_layout):
    nb, bs, hk, hq, d = 12, 16, 2, 6, 32
    lens = [0, 1, 16, 17, 40, 61]
    tables = torch.from_numpy(np.stack([rng.permutation(nb)[:4] for _ in lens]).astype(np.int32))
    pages_k = tt(rng.standard_normal((nb, bs, hk, d)) * 2, dtype)
    pages_v = tt(rng.standard_normal((nb, bs, hk, d)), dtype)
    q = tt(rng.standard_normal((len(lens), hq, d)), dtype)
    scale = 1.0 / np.sqrt(d)
    # kvarn_jax holding exactly these pages (passthrough layout [blocks, Hk, bs, D])
    jc = kj.PagedKVCache.create("fp16" if dtype == torch.float16 else "bf16", num_blocks=nb, block_size=bs,
                                num_kv_heads=hk, head_dim=d)
    jc = dataclasses.replace(jc, pages={"k": {"values": jx(pages_k.permute(0, 2, 1, 3).contiguous())},
                                        "v": {"values": jx(pages_v.permute(0, 2, 1, 3).contiguous())}})
    ref = kj.paged_decode_attention_reference(jx(q), jc, jnp.asarray(tables.numpy()), jnp.asarray(lens, jnp.int32))
    ref = torch.from_numpy(np.array(ref.astype(jnp.float32)))
    if cache_layout == "BnBsH":
        kc, vc = pages_k.reshape(nb, bs, hk * d), pages_v.reshape(nb, bs, hk * d)
    else:
        kc, vc = pages_k.permute(0, 2, 1, 3).contiguous(), pages_v.permute(0, 2, 1, 3).contiguous()
    qin = {"BNSD": q[:, :, None], "BSND": q[:, None], "BSH": q.reshape(len(lens), 1, hq * d)}[layout].contiguous()
    out, lse = ops.call("npu_fused_infer_attention_score", qin, kc, vc, block_table=tables,
                        actual_seq_lengths_kv=lens, block_size=bs, num_heads=hq, num_key_value_heads=hk,
                        input_layout=layout, scale=scale, softmax_lse_flag=True, backend="cpu")
    assert out.dtype == dtype and out.shape == qin.shape
    assert ops.max_violation(out.reshape(len(lens), hq, d), ref, dtype) <= 1
    # lse = log sum exp(scale * q k^T), the quantity the documented ring-attention merge needs
    dense_k = to_np(pages_k)[tables.long().numpy()].transpose(0, 3, 1, 2, 4).reshape(len(lens), hk, -1, d)
    dense_v = to_np(pages_v)[tables.long().numpy()].transpose(0, 3, 1, 2, 4).reshape(len(lens), hk, -1, d)
    _, g_lse = _oracle(to_np(q).astype(np.float64), dense_k.astype(np.float64), dense_v.astype(np.float64), lens, scale)
    np.testing.assert_allclose(to_np(lse).reshape(len(lens), hq), g_lse, rtol=1e-5, atol=1e-5)


def _antiquant_case(rng, mode, bits, nb, bs, hk, b, s):
    """Random scale/offset for one side in the documented shape of `mode` (dtype fp16 query)."""
    if mode == 0:
        shape = (1, hk, 1, 64)
    elif mode == 1:
        shape = (1, b, s)
    elif mode == 2:
        shape = (hk,)
    elif mode == 3:
        shape = (b, hk, s)
    elif mode == 4:
        shape = (nb, bs)
    else:
        shape = (nb, hk, bs)
    dt = torch.float16 if mode in (0, 2) else torch.float32
    return tt(rng.uniform(0.01, 0.05, shape), dt), tt(rng.uniform(-3, 3, shape), dt)


def _expand(p, mode, b, hk, s, tables, bs):
    """A mode's parameter as [B, Hk, S, D or 1] float64 (positions s of row i map to physical slots)."""
    a = to_np(p).astype(np.float64)
    if mode == 0:
        return np.broadcast_to(a.reshape(1, hk, 1, -1), (b, hk, s, a.shape[-1]))
    if mode == 1:
        return np.broadcast_to(a[0, :, None, :s, None], (b, hk, s, 1))
    if mode == 2:
        return np.broadcast_to(a.reshape(1, hk, 1, 1), (b, hk, s, 1))
    if mode == 3:
        return a[:, :, :s, None]
    pos = np.arange(s)
    blk, off = tables[:, pos // bs], pos % bs
    if mode == 4:
        return np.broadcast_to(a[blk, off][:, None, :, None], (b, hk, s, 1))
    return a[blk, :, off].transpose(0, 2, 1)[..., None]


@pytest.mark.parametrize("kmode,vmode,paged,bits", [(0, 0, True, 8), (0, 1, True, 8), (1, 1, True, 8),
                                                    (2, 2, True, 8), (3, 3, True, 8), (4, 4, True, 8),
                                                    (5, 5, True, 8), (0, 0, False, 4), (3, 3, False, 4),
                                                    (0, 1, False, 4)])
def test_fia_antiquant_modes_match_float64_oracle(rng, kmode, vmode, paged, bits):
    nb, bs, hk, hq, d = 8, 32, 2, 4, 64
    lens = [0, 5, 32, 70]
    b = len(lens)
    tables = np.stack([rng.permutation(nb)[:3] for _ in lens]).astype(np.int32)
    s = 3 * bs
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    if paged:
        codes_k = torch.from_numpy(rng.integers(lo, hi, (nb, bs, hk, d)).astype(np.int8))
        codes_v = torch.from_numpy(rng.integers(lo, hi, (nb, bs, hk, d)).astype(np.int8))
        dense_k = to_np(codes_k)[tables].transpose(0, 3, 1, 2, 4).reshape(b, hk, s, d)
        dense_v = to_np(codes_v)[tables].transpose(0, 3, 1, 2, 4).reshape(b, hk, s, d)
        kin, vin = codes_k.reshape(nb, bs, hk * d), codes_v.reshape(nb, bs, hk * d)
        kw = dict(block_table=torch.from_numpy(tables), block_size=bs)
    else:
        dense_k = rng.integers(lo, hi, (b, hk, s, d))
        dense_v = rng.integers(lo, hi, (b, hk, s, d))
        kin, vin = cs.pack_int4(torch.from_numpy(dense_k)), cs.pack_int4(torch.from_numpy(dense_v))
        kw = {}
    ks, ko = _antiquant_case(rng, kmode, bits, nb, bs, hk, b, s)
    vs, vo = _antiquant_case(rng, vmode, bits, nb, bs, hk, b, s)
    q = tt(rng.standard_normal((b, hq, d)), torch.float16)
    out, lse = ops.call("npu_fused_infer_attention_score", q[:, :, None].contiguous(), kin, vin,
                        actual_seq_lengths_kv=lens, num_heads=hq, num_key_value_heads=hk, input_layout="BNSD",
                        scale=0.125, softmax_lse_flag=True, key_antiquant_scale=ks, key_antiquant_offset=ko,
                        value_antiquant_scale=vs, value_antiquant_offset=vo, key_antiquant_mode=kmode,
                        value_antiquant_mode=vmode, backend="cpu", **kw)
    kf = (dense_k + _expand(ko, kmode, b, hk, s, tables, bs)) * _expand(ks, kmode, b, hk, s, tables, bs)
    vf = (dense_v + _expand(vo, vmode, b, hk, s, tables, bs)) * _expand(vs, vmode, b, hk, s, tables, bs)
    ref, ref_lse = _oracle(to_np(q).astype(np.float64), kf, vf, lens, 0.125)
    assert ops.max_violation(out.reshape(b, hq, d), torch.from_numpy(ref), torch.float16) <= 1
    np.testing.assert_allclose(to_np(lse).reshape(b, hq), ref_lse, rtol=1e-5, atol=1e-5)


def test_fia_combined_antiquant_equals_separate(rng):
    nb, bs, hk, d = 4, 32, 2, 64
    k = torch.from_numpy(rng.integers(-128, 128, (nb, bs, hk * d)).astype(np.int8))
    v = torch.from_numpy(rng.integers(-128, 128, (nb, bs, hk * d)).astype(np.int8))
    sc = tt(rng.uniform(0.01, 0.05, (2, hk, 1, d)), torch.float16)
    off = tt(rng.uniform(-2, 2, (2, hk, 1, d)), torch.float16)
    q = tt(rng.standard_normal((2, 4, 1, d)), torch.float16)
    common = dict(block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), block_size=bs,
                  actual_seq_lengths_kv=[40, 64], num_heads=4, num_key_value_heads=hk, input_layout="BNSD",
                  scale=0.125, backend="cpu")
    a, _ = ops.call("npu_fused_infer_attention_score", q, k, v, antiquant_scale=sc, antiquant_offset=off, **common)
    b, _ = ops.call("npu_fused_infer_attention_score", q, k, v, key_antiquant_scale=sc[:1],
                    value_antiquant_scale=sc[1:],
                    key_antiquant_offset=off[:1], value_antiquant_offset=off[1:], **common)
    assert torch.equal(a, b)


def test_fia_lse_merge_of_two_key_sets_equals_one_call(rng):
    """Two fused calls over disjoint blocks merged by their lse = one call over all blocks (the cache's
    native decode relies on this)."""
    nb, bs, hk, hq, d = 10, 16, 2, 4, 32
    k = tt(rng.standard_normal((nb, bs, hk * d)) * 3, torch.bfloat16)
    v = tt(rng.standard_normal((nb, bs, hk * d)), torch.bfloat16)
    q = tt(rng.standard_normal((3, hq, 1, d)), torch.bfloat16)
    tab = torch.from_numpy(np.stack([rng.permutation(nb)[:4] for _ in range(3)]).astype(np.int32))
    common = dict(num_heads=hq, num_key_value_heads=hk, input_layout="BNSD", scale=0.2, block_size=bs,
                  softmax_lse_flag=True, backend="cpu")
    full, _ = ops.call("npu_fused_infer_attention_score", q, k, v, block_table=tab, actual_seq_lengths_kv=[64, 50, 20],
                       **common)
    o1, l1 = ops.call("npu_fused_infer_attention_score", q, k, v, block_table=tab[:, :2].contiguous(),
                      actual_seq_lengths_kv=[32, 32, 20], **common)
    o2, l2 = ops.call("npu_fused_infer_attention_score", q, k, v, block_table=tab[:, 2:].contiguous(),
                      actual_seq_lengths_kv=[32, 18, 0], **common)
    merged = merge_partials(o1.reshape(3, hq, d).float(), l1.reshape(3, hq), torch.tensor([True, True, True]),
                    o2.reshape(3, hq, d).float(), l2.reshape(3, hq), torch.tensor([True, True, False]))
    # two roundings to bf16 (the partial outputs, then the merged one)
    assert ops.max_violation(merged.to(torch.bfloat16), full.reshape(3, hq, d).float(), torch.bfloat16) <= 2


# ------------------------------------------------------------------------------------------ rotate quant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dst", [torch.int8, torch.quint4x2])
def test_rotate_quant_is_kvarn_rotation_then_dynamic_quant(rng, dtype, dst):
    x = tt(kv_like(rng, (16, 256)), dtype)
    rot = hadamard(128, dtype)
    y, scale = ops.call("npu_rotate_quant", x, rot, dst_dtype=dst, backend="cpu")
    # block rotation by the normalized Hadamard matrix = kvarn_jax's rotation of each 128-channel block
    xr = torch.from_numpy(np.array(kj.rotate(jx(x).reshape(16, 2, 128), out_dtype=jnp.float32))).reshape(16, 256)
    yr, sr = cs.npu_dynamic_quant(xr.to(dtype), dst_type=dst)
    np.testing.assert_allclose(to_np(scale), to_np(sr), rtol=2 ** -7)
    a = to_np(cs.unpack_int4(y) if dst is torch.quint4x2 else y).astype(int)
    b = to_np(cs.unpack_int4(yr) if dst is torch.quint4x2 else yr).astype(int)
    assert np.abs(a - b).max() <= 1 and (a != b).mean() <= 0.02


def test_rotate_quant_round_modes_on_exact_ties():
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([127.0, 2.5, -2.5, 3.5])  # scale = 127 / 127 = 1
    eye = torch.eye(128, dtype=torch.bfloat16)
    expect = {"rint": [127, 2, -2, 4], "round": [127, 3, -3, 4], "floor": [127, 2, -3, 3]}
    for mode, want in expect.items():
        y, s = ops.call("npu_rotate_quant", x, eye, round_mode=mode, backend="cpu")
        assert y[0, :4].tolist() == want and float(s[0]) == 1.0


# ------------------------------------------------------------------------------------------ validators
def _f16(*shape):
    return torch.randn(*shape).to(torch.float16)


def _i8(*shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8)


def _fia_base():
    return dict(query=_f16(2, 4, 1, 64), key=_i8(6, 32, 128), value=_i8(6, 32, 128),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), block_size=32,
                actual_seq_lengths_kv=[40, 64], num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                scale=0.125, key_antiquant_scale=_f16(1, 2, 1, 64), value_antiquant_scale=_f16(1, 2, 1, 64))


BASE = {
    "npu_dynamic_quant": lambda: dict(input=_f16(4, 16)),
    "npu_dynamic_quant_asymmetric": lambda: dict(input=_f16(4, 16), dst_type=torch.quint4x2),
    # the cache's form: float32 input with float32 scales and zero points
    "npu_quantize": lambda: dict(input=torch.randn(4, 16), scales=torch.rand(16), zero_points=torch.rand(16),
                                 dtype=torch.qint8, axis=-1, div_mode=False),
    "npu_anti_quant": lambda: dict(x=_i8(4, 16), scale=torch.rand(16), offset=torch.rand(16),
                                   dst_dtype=torch.bfloat16),
    "npu_scatter_pa_kv_cache": lambda: dict(key=_f16(3, 2, 16), value=_f16(3, 2, 16), key_cache=_f16(4, 8, 2, 16),
                                            value_cache=_f16(4, 8, 2, 16),
                                            slot_mapping=torch.tensor([0, 9, 31], dtype=torch.int32),
                                            cache_mode="Norm"),
    "npu_fused_infer_attention_score": _fia_base,
    "npu_rotate_quant": lambda: dict(x=_f16(4, 256), rotation=_f16(128, 128)),
}
VALID_VARIANTS = [  # further calls the contracts accept
    ("npu_quantize", dict(input=_f16(4, 16), scales=_f16(16), zero_points=_f16(16))),
    ("npu_quantize", dict(input=_f16(2, 4, 16).bfloat16(), scales=torch.rand(1, 4, 1).bfloat16(),
                          zero_points=torch.rand(1, 4, 1).bfloat16(), axis=-2)),
    ("npu_quantize", dict(dtype=torch.quint4x2, zero_points=None)),
    ("npu_scatter_pa_kv_cache", dict(key=_i8(3, 2, 16), value=_i8(3, 2, 16), key_cache=_i8(4, 8, 2, 16),
                                     value_cache=_i8(4, 8, 2, 16))),
    ("npu_scatter_pa_kv_cache", dict(cache_mode="PA_NZ", key_cache=_f16(4, 2, 8, 16), value_cache=_f16(4, 2, 8, 16))),
    ("npu_anti_quant", dict(x=torch.zeros(4, 2, dtype=torch.int32))),  # int32 x with src_dtype None: no check
    ("npu_fused_infer_attention_score", dict(actual_seq_lengths_kv=[64])),  # one length for every row
    ("npu_fused_infer_attention_score", dict(key=_i8(6, 2, 32, 64), value=_i8(6, 2, 32, 64))),  # BnNBsD
]

BAD = [  # (op, mutation of the valid base arguments, message fragment)
    ("npu_dynamic_quant", dict(input=_i8(4, 16)), "input must have dtype"),
    ("npu_dynamic_quant", dict(input=_f16(16)), "more than 1 dimension"),
    ("npu_dynamic_quant", dict(input=_f16(4, 12), dst_type=torch.quint4x2), "multiple of 8"),
    ("npu_dynamic_quant", dict(dst_type=torch.float16), "dst_type"),
    ("npu_dynamic_quant", dict(smooth_scales=_f16(12)), "smooth_scales must be 1-D"),
    ("npu_dynamic_quant", dict(smooth_scales=torch.rand(16).bfloat16()), "must equal input's"),
    ("npu_dynamic_quant", dict(group_index=torch.tensor([4], dtype=torch.int32)), "needs smooth_scales"),
    ("npu_dynamic_quant", dict(smooth_scales=_f16(2, 16), group_index=torch.tensor([1, 3], dtype=torch.int32)),
     "end at input's row count"),
    ("npu_dynamic_quant", dict(quant_mode="pertensor"), "quant_mode"),
    ("npu_dynamic_quant_asymmetric", dict(input=_f16(4, 20)), "multiple of 8"),
    ("npu_dynamic_quant_asymmetric", dict(smooth_scales=_f16(1025, 16),
                                          group_index=torch.arange(1025, dtype=torch.int32)), "E must be in"),
    ("npu_dynamic_quant_asymmetric", dict(dst_type_max=448.0), "dst_type_max"),
    # the call the cache used to make: bfloat16/float16 input with float32 scales (aclnn error 161002)
    ("npu_quantize", dict(input=_f16(4, 16).bfloat16()), "scales dtype torch.float32 must equal input's"),
    ("npu_quantize", dict(input=_f16(4, 16)), "scales dtype torch.float32 must equal input's"),
    ("npu_quantize", dict(dtype=torch.quint8), "qint8 or torch.quint4x2"),
    ("npu_quantize", dict(input=torch.randn(4, 12), dtype=torch.quint4x2, scales=torch.rand(12),
                          zero_points=torch.rand(12)), "multiple of 8"),
    ("npu_quantize", dict(scales=torch.rand(8), zero_points=torch.rand(8)), "must have 1 or input.shape"),
    ("npu_quantize", dict(scales=torch.rand(1, 16, 1), zero_points=torch.rand(1, 16, 1)), "must be 1-D"),
    ("npu_quantize", dict(zero_points=torch.rand(16).half()), "scales' shape and"),
    ("npu_quantize", dict(axis=-3), "axis must be in"),
    ("npu_quantize", dict(input=torch.randn(*[1] * 9 + [16])), "1 to 8 dimensions"),
    ("npu_quantize", dict(scales=torch.tensor(0.5), zero_points=None), "scalars are not supported"),
    ("npu_quantize", dict(div_mode=True, dtype=torch.quint4x2), "div_mode=True dtype"),
    ("npu_quantize", dict(input=_i8(4, 16)), "input must have dtype"),
    ("npu_quantize", dict(axis=1.0), "axis must be an int"),
    ("npu_anti_quant", dict(x=_f16(4, 16)), "x must have dtype"),
    ("npu_anti_quant", dict(scale=torch.rand(1, 16), offset=None), "scale must have 1 dimensions"),
    ("npu_anti_quant", dict(scale=torch.rand(8), offset=torch.rand(8)), "must have 1 or 16"),
    ("npu_anti_quant", dict(x=torch.zeros(4, 2, dtype=torch.int32), src_dtype=torch.int8), "does not match"),
    ("npu_anti_quant", dict(x=torch.zeros(2, 4, dtype=torch.int32).t()), "must be contiguous"),
    ("npu_anti_quant", dict(dst_dtype=torch.float32), "dst_dtype"),
    ("npu_anti_quant", dict(offset=torch.rand(16).bfloat16()), "offset must have scale's"),
    # the call the cache used to make: int4 codes as int32 (A2/A3 scatter: float16, bfloat16, int8 only)
    ("npu_scatter_pa_kv_cache", dict(key=torch.zeros(3, 2, 2, dtype=torch.int32),
                                     value=torch.zeros(3, 2, 2, dtype=torch.int32),
                                     key_cache=torch.zeros(4, 8, 2, 2, dtype=torch.int32),
                                     value_cache=torch.zeros(4, 8, 2, 2, dtype=torch.int32)), "key must have dtype"),
    ("npu_scatter_pa_kv_cache", dict(key=torch.randn(3, 2, 16), value=torch.randn(3, 2, 16),
                                     key_cache=torch.randn(4, 8, 2, 16), value_cache=torch.randn(4, 8, 2, 16)),
     "key must have dtype"),
    ("npu_scatter_pa_kv_cache", dict(slot_mapping=torch.tensor([0, 9, 32], dtype=torch.int32)), "is outside"),
    ("npu_scatter_pa_kv_cache", dict(slot_mapping=torch.tensor([0, -1, 3], dtype=torch.int32)), "padding slots"),
    ("npu_scatter_pa_kv_cache", dict(slot_mapping=torch.tensor([0, 9, 9], dtype=torch.int32)), "repeated slots"),
    ("npu_scatter_pa_kv_cache", dict(slot_mapping=torch.tensor([0, 9, 9], dtype=torch.float32)),
     "slot_mapping must have dtype"),
    ("npu_scatter_pa_kv_cache", dict(key_cache=_i8(4, 8, 2, 16)), "share one dtype"),
    ("npu_scatter_pa_kv_cache", dict(key_cache=_f16(4, 8, 4, 8)), "must be [num_blocks, block_size, 2, 16]"),
    ("npu_scatter_pa_kv_cache", dict(cache_mode="PA_NZ"), "PA_NZ"),
    ("npu_scatter_pa_kv_cache", dict(seq_lens=torch.tensor([3], dtype=torch.int32)), "compression"),
    ("npu_scatter_pa_kv_cache", dict(key=_f16(3, 16, 2).transpose(1, 2)), "contiguous"),
    ("npu_scatter_pa_kv_cache", dict(key=_f16(0, 2, 16), value=_f16(0, 2, 16),
                                     slot_mapping=torch.zeros(0, dtype=torch.int32)), "empty"),
    ("npu_scatter_pa_kv_cache", dict(key=_f16(1, 3, 2, 16)), "key must have 3 dimensions"),
    ("npu_scatter_pa_kv_cache", dict(cache_mode="NZ"), "cache_mode must be"),
    ("npu_fused_infer_attention_score", dict(query=torch.randn(2, 4, 1, 64)), "query must have dtype"),
    ("npu_fused_infer_attention_score", dict(query=_f16(2, 4, 2, 64)), "decode branch"),
    ("npu_fused_infer_attention_score", dict(query=_f16(2, 4, 1, 128)[..., ::2]), "must be contiguous"),
    ("npu_fused_infer_attention_score", dict(num_key_value_heads=3), "multiple of it"),
    ("npu_fused_infer_attention_score", dict(query=_f16(2, 130, 1, 64), num_heads=130, num_key_value_heads=2,
                                             key_antiquant_scale=_f16(1, 2, 1, 64)), "ratio"),
    ("npu_fused_infer_attention_score", dict(query=_f16(2, 4, 1, 48), key=_i8(6, 32, 96), value=_i8(6, 32, 96)),
     "32-byte"),
    ("npu_fused_infer_attention_score", dict(key=torch.zeros(6, 32, 16, dtype=torch.int32),
                                             value=torch.zeros(6, 32, 16, dtype=torch.int32)), "page attention"),
    ("npu_fused_infer_attention_score", dict(block_size=48, key=_i8(6, 48, 128), value=_i8(6, 48, 128)),
     "multiple of 32"),
    ("npu_fused_infer_attention_score", dict(block_size=1024, key=_i8(6, 1024, 128), value=_i8(6, 1024, 128)),
     "[1, 512]"),
    ("npu_fused_infer_attention_score", dict(actual_seq_lengths_kv=None), "required with page attention"),
    ("npu_fused_infer_attention_score", dict(actual_seq_lengths_kv=torch.tensor([40, 64])), "list of ints"),
    ("npu_fused_infer_attention_score", dict(actual_seq_lengths_kv=[40, 65]), "exceeds block_table"),
    ("npu_fused_infer_attention_score", dict(key=_i8(3, 32, 128), value=_i8(3, 32, 128)), "fewer than"),
    ("npu_fused_infer_attention_score", dict(block_table=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)),
     "outside [0, 6)"),
    ("npu_fused_infer_attention_score", dict(block_table=torch.tensor([[0, 1], [2, 3]])),
     "block_table must have dtype"),
    ("npu_fused_infer_attention_score", dict(value=_i8(6, 32, 64)), "same shape and dtype"),
    ("npu_fused_infer_attention_score", dict(key_antiquant_scale=None, value_antiquant_scale=None),
     "need key_antiquant"),
    ("npu_fused_infer_attention_score", dict(value_antiquant_scale=None), "both be given"),
    ("npu_fused_infer_attention_score", dict(value_antiquant_scale=_f16(1, 2, 64)), "must have the same shape"),
    ("npu_fused_infer_attention_score", dict(key_antiquant_mode=1), "must be equal"),
    ("npu_fused_infer_attention_score", dict(key_antiquant_mode=5, value_antiquant_mode=5, block_table=None,
                                             key=_i8(2, 64, 128), value=_i8(2, 64, 128), input_layout="BSH",
                                             query=_f16(2, 1, 256)), "needs int8 key/value and block_table"),
    ("npu_fused_infer_attention_score", dict(key_antiquant_scale=torch.rand(1, 2, 1, 64),
                                             value_antiquant_scale=torch.rand(1, 2, 1, 64)), "must be torch.float16"),
    ("npu_fused_infer_attention_score", dict(key_antiquant_mode=3, value_antiquant_mode=3,
                                             key_antiquant_scale=torch.rand(2, 2, 32),
                                             value_antiquant_scale=torch.rand(2, 2, 32)), "must have shape"),
    ("npu_fused_infer_attention_score", dict(query=_f16(2, 4, 1, 64).bfloat16(), value_antiquant_mode=1,
                                             key_antiquant_scale=torch.rand(1, 2, 1, 64).bfloat16(),
                                             value_antiquant_scale=torch.rand(1, 2, 64)), "float16 query"),
    ("npu_fused_infer_attention_score", dict(key_antiquant_offset=_f16(1, 2, 1, 64)), "both be given or both"),
    ("npu_fused_infer_attention_score", dict(atten_mask=torch.ones(2, 64, dtype=torch.bool)), "outside what"),
    ("npu_fused_infer_attention_score", dict(input_layout="TND"), "input_layout"),
    ("npu_fused_infer_attention_score", dict(input_layout="BSND", query=_f16(2, 1, 4, 64), key=_i8(6, 2, 32, 64),
                                             value=_i8(6, 2, 32, 64)), "needs input_layout BNSD"),
    ("npu_fused_infer_attention_score", dict(query=_f16(2, 300, 1, 64), num_heads=300), "num_heads must be in"),
    ("npu_fused_infer_attention_score", dict(key=_f16(6, 32, 128), value=_f16(6, 32, 128)), "need int8 or int4"),
    ("npu_fused_infer_attention_score", dict(scale=float("nan")), "finite"),
    ("npu_fused_infer_attention_score", dict(inner_precise=2), "inner_precise must be 0 or 1"),
    ("npu_rotate_quant", dict(rotation=_f16(8, 8)), "K in [16, 1024]"),
    ("npu_rotate_quant", dict(x=_f16(4, 100), rotation=_f16(20, 20)), "multiple of 8"),
    ("npu_rotate_quant", dict(dst_dtype=torch.float8_e4m3fn), "dst_dtype"),
    ("npu_rotate_quant", dict(rotation=torch.rand(128, 128).bfloat16()), "must equal x's"),
    ("npu_rotate_quant", dict(scale_alg=1), "scale_alg must be 0"),
    ("npu_rotate_quant", dict(round_mode="nearest"), "round_mode"),
]


@pytest.mark.parametrize("op", sorted(BASE))
def test_validators_accept_the_valid_base(op):
    getattr(validators, op)(**BASE[op]())
    for variant_op, change in VALID_VARIANTS:
        if variant_op == op:
            getattr(validators, op)(**{**BASE[op](), **change})


def _source_tag(message: str) -> str:
    tag = message.rsplit("[", 1)[-1].rstrip("]")
    assert tag in validators.SOURCES, f"no source cited: {message}"
    return tag


@pytest.mark.parametrize("op,mutation,fragment", BAD, ids=[f"{b[0][4:]}: {b[2]}" for b in BAD])
def test_validators_reject_each_documented_bad_case(op, mutation, fragment):
    args = {**BASE[op](), **mutation}
    sentinel = []
    with pytest.raises((ValueError, TypeError)) as e:
        getattr(validators, op)(**args)
    assert fragment in str(e.value) and op in str(e.value), str(e.value)
    _source_tag(str(e.value))  # every rule names the document or file it comes from
    # ops.call validates before running anything: the CPU function never sees the bad input
    orig = ops.OPS[op]
    ops.OPS[op] = dataclasses.replace(orig, cpu=lambda *a, **k: sentinel.append(1))
    try:
        with pytest.raises((ValueError, TypeError)):
            ops.call(op, backend="cpu", **args)
    finally:
        ops.OPS[op] = orig
    assert not sentinel
    # and the fake torch_npu rejects it when it is called directly (it runs the validators on every call)
    with pytest.raises((ValueError, TypeError, AssertionError)):
        getattr(FakeTorchNpu(), op)(**args)


def test_every_source_is_cited_by_a_rule_and_every_op_names_its_sources():
    rules = inspect.getsource(validators).split("\n}\n", 1)[1]  # the code after the SOURCES table
    semantics = inspect.getsource(cs)
    for tag in validators.SOURCES:
        cited = f'"{tag}"' in rules or f"[{tag}]" in rules or tag in semantics or tag.startswith("torch_npu-")
        assert cited, f"{tag} is cited by no rule and no CPU semantics"
    for spec in ops.OPS.values():
        assert all(t in validators.SOURCES for t in spec.sources), spec.name


# ------------------------------------------------------------------------------------------ signatures, backends
@pytest.mark.parametrize("op", sorted(REAL_SCHEMAS))
def test_signatures_match_op_plugin_functions_yaml(op):
    """Names (`Tensor self` binds as `input`), positional/keyword split and defaults of the real binding."""
    want = real_signature(op)
    for f in (getattr(cs, op), getattr(validators, op), getattr(FakeTorchNpu(), op)):
        assert inspect.signature(f) == want, (f.__module__, inspect.signature(f), want)
    assert set(ops.OPS) == set(REAL_SCHEMAS)


def test_backend_npu_without_npu_raises_with_reason():
    with pytest.raises(ValueError, match="no NPU is usable: torch_npu cannot be imported"):
        ops.call("npu_dynamic_quant", _f16(2, 8), backend="npu")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.call("npu_dynamic_quant", _f16(2, 8), backend="gpu")
    with pytest.raises(ValueError, match="unknown op"):
        ops.call("npu_flash_attention", _f16(2, 8))


def test_npu_path_calls_torch_npu_with_the_documented_arguments(fake_torch_npu, rng):
    x = tt(kv_like(rng, (6, 32)), torch.bfloat16)
    y, s, o = ops.call("npu_dynamic_quant_asymmetric", x, dst_type=torch.quint4x2, backend="npu")
    (call,) = fake_torch_npu.calls
    assert call.name == "npu_dynamic_quant_asymmetric"
    assert call.tensor("input") == (torch.bfloat16, (6, 32)) and call.args["dst_type"] is torch.quint4x2
    yc, sc, oc = cs.npu_dynamic_quant_asymmetric(x, dst_type=torch.quint4x2)
    assert torch.equal(y, yc) and torch.equal(s, sc) and torch.equal(o, oc)
    # auto picks the NPU when torch_npu is importable and reports a device
    ops.call("npu_dynamic_quant", x, backend="auto")
    assert fake_torch_npu.names()[-1] == "npu_dynamic_quant"
    # a wrong keyword is rejected by the signature itself: the binding's first argument is `input`
    # (the torch_npu doc calls it x)
    with pytest.raises(TypeError):
        fake_torch_npu.npu_dynamic_quant(x=x)
    with pytest.raises(TypeError):
        fake_torch_npu.npu_dynamic_quant(x, smooth=None)
    fake_torch_npu.npu_dynamic_quant(input=x)


def test_package_imports_without_torch_npu():
    code = ("import sys, kvarn_ascend as ka; assert 'torch_npu' not in sys.modules; "
            "assert not ka.npu_available(); print(ka.unavailable_reason()); "
            "import torch; y, s = ka.ops.call('npu_dynamic_quant', torch.ones(2, 8, dtype=torch.float16)); "
            "assert y.dtype == torch.int8 and abs(float(s[0]) - 1 / 127) < 1e-7; assert 'torch_npu' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch_npu cannot be imported" in r.stdout
