"""Parity suite for a machine with an Atlas A2/A3 NPU (torch_npu + CANN): each torch_npu op kvarn_ascend
calls against its CPU semantics on the same inputs, the undocumented cases the CPU semantics pin down,
calls the published contracts exclude (the real op must reject them too), and the cache on the NPU
against the cache on the CPU semantics. Skipped where no NPU is usable.

    python -m pytest tests/test_ascend_npu_hardware.py -v              # on the NPU machine
    KVARN_ASCEND_FAKE_NPU=1 python -m pytest tests/test_ascend_npu_hardware.py   # dry run, any CPU

The dry run answers every call with the recording fake of torch_npu (tests/ascend_fake_npu.py): it
proves the suite runs and that its calls pass the contracts, not that the NPU agrees.

Tolerances are the op tests' (op-plugin test/test_custom_ops): codes within 1 (atol=1.0) on at most 2%
of the elements (5% where a scale's last bit decides), scales rtol 1e-4, float outputs
|npu - cpu| <= max(|cpu|, 1) * tol(dtype) (ops.TOLERANCE; 2x for the cache's decode, which rounds twice).
A failure here is a difference between the NPU and this package's reading of the documents: report
it with the test id and CANN / torch_npu versions.
"""

import os
import sys

import numpy as np
import pytest
import torch

if os.environ.get("KVARN_ASCEND_FAKE_NPU") == "1":  # before kvarn_ascend looks for torch_npu
    import ascend_fake_npu
    sys.modules.setdefault("torch_npu", ascend_fake_npu.FakeTorchNpu())

from kvarn_ascend import AscendPagedKVCache, KVarNAscendAttention, cpu_semantics as cs, npu, ops, validators  # noqa: E402
from kvarn_ascend.kvarn_torch import hadamard  # noqa: E402

pytestmark = pytest.mark.skipif(not npu.npu_available(), reason=f"no NPU: {npu.unavailable_reason()}")

DEV = "cpu" if os.environ.get("KVARN_ASCEND_FAKE_NPU") == "1" else "npu"
F16 = [torch.float16, torch.bfloat16]


def to_dev(a):
    return a.to(DEV) if isinstance(a, torch.Tensor) else a


def host(o):
    return tuple(x.cpu() for x in o) if isinstance(o, tuple) else o.cpu()


def both(name, *args, **kwargs):
    """(NPU result on the host, CPU-semantics result) of one op on the same inputs (validated first)."""
    out_npu = ops.call(name, *[to_dev(a) for a in args], backend="npu", **{k: to_dev(v) for k, v in kwargs.items()})
    return host(out_npu), ops.call(name, *args, backend="cpu", **kwargs)


def codes_close(a, b, int4=False, frac=0.02):
    if int4:
        a, b = cs.unpack_int4(a), cs.unpack_int4(b)
    d = (a.int() - b.int()).abs()
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= frac, (int(d.max()), float((d > 0).float().mean()))


def rand(rng, shape, dtype=torch.float32, scale=1.0):
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).to(dtype)


# ------------------------------------------------------------------------------------------ quantize ops
@pytest.mark.parametrize("dtype", F16)
@pytest.mark.parametrize("dst", [torch.int8, torch.quint4x2])
@pytest.mark.parametrize("shape", [(64, 128), (3, 17, 64), (1, 256)])
def test_dynamic_quant(rng, dtype, dst, shape):
    x = rand(rng, shape, dtype, 3.0)
    (y, s), (yc, sc) = both("npu_dynamic_quant", x, dst_type=dst)
    codes_close(y, yc, dst is torch.quint4x2)
    torch.testing.assert_close(s, sc, atol=0.0, rtol=1e-4)
    (y, s, o), (yc, sc, oc) = both("npu_dynamic_quant_asymmetric", x, dst_type=dst)
    codes_close(y, yc, dst is torch.quint4x2)
    torch.testing.assert_close(s, sc, atol=0.0, rtol=1e-4)
    torch.testing.assert_close(o, oc, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", F16)
def test_dynamic_quant_smooth_scales(rng, dtype):
    x = rand(rng, (32, 128), dtype)
    sm = torch.from_numpy(rng.uniform(0.5, 2.0, 128).astype(np.float32)).to(dtype)
    (y, s), (yc, sc) = both("npu_dynamic_quant", x, smooth_scales=sm)
    codes_close(y, yc)
    torch.testing.assert_close(s, sc, atol=0.0, rtol=1e-4)


@pytest.mark.parametrize("dst", [torch.int8, torch.quint4x2])
def test_constant_rows_dequantize_to_their_value(dst):
    """Not documented: asymmetric quantization of a constant row (the kernel floors the scale at 1e-12)
    and symmetric quantization of a zero row (scale 0). Compared by what dequantization gives back."""
    x = torch.randn(6, 64).to(torch.bfloat16)
    x[1], x[2], x[3] = 0.0, 2.5, -0.01171875
    y, s, o = host(ops.call("npu_dynamic_quant_asymmetric", to_dev(x), dst_type=dst, backend="npu"))
    c = (cs.unpack_int4(y) if dst is torch.quint4x2 else y).float()
    assert bool(torch.isfinite(s).all() & torch.isfinite(o).all())
    back = (c - o[:, None]) * s[:, None]
    assert float((back[1:4] - x[1:4].float()).abs().max()) <= 1e-6
    ys, ss = host(ops.call("npu_dynamic_quant", to_dev(x), dst_type=dst, backend="npu"))
    assert float(ss[1]) == 0.0 and bool(torch.isfinite(ss).all())


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dst", [torch.qint8, torch.quint4x2])
@pytest.mark.parametrize("axis", [-1, -2])
def test_quantize(rng, in_dtype, dst, axis):
    x = rand(rng, (4, 16, 64), in_dtype)
    n = x.shape[axis]
    shape = (n,) if axis == -1 else (1, n, 1)
    s = torch.from_numpy(rng.uniform(2, 20, shape).astype(np.float32)).to(in_dtype)
    z = torch.from_numpy(rng.uniform(-3, 3, shape).astype(np.float32)).to(in_dtype)
    y, yc = both("npu_quantize", x, s, z, dst, axis=axis, div_mode=False)
    codes_close(y, yc, dst is torch.quint4x2, frac=0.01)


def test_quantize_as_the_cache_calls_it(rng):
    """float32 input from bfloat16 values, float32 scales and zero points near the int8 edges: exact."""
    x = rand(rng, (256, 128), torch.bfloat16).float()
    s = torch.from_numpy(rng.uniform(20, 60, 128).astype(np.float32))
    z = torch.from_numpy(rng.uniform(-128, 127, 128).astype(np.float32))
    for dst in (torch.qint8, torch.quint4x2):
        y, yc = both("npu_quantize", x, 1.0 / s, z / 16 if dst is torch.quint4x2 else z, dst, axis=-1, div_mode=False)
        codes_close(y, yc, dst is torch.quint4x2, frac=0.001)


@pytest.mark.parametrize("dst,lo,hi", [(torch.qint8, -128, 127), (torch.quint4x2, -8, 7)])
def test_quantize_saturates(dst, lo, hi):
    """Not in the torch_npu doc: out-of-range values saturate (aclnnAscendQuantV3's golden clips)."""
    x = torch.tensor([[-1e6, -300.0, -8.6, -8.4, -0.5, 0.5, 1.5, 7.4, 7.6, 300.0, 1e6, 2.5, 3.5, 0.0, -2.5, 126.5]])
    y, yc = both("npu_quantize", x, torch.ones(16), None, dst, axis=-1, div_mode=False)
    got = (cs.unpack_int4(y) if dst is torch.quint4x2 else y).flatten()
    assert int(got.min()) == lo and int(got.max()) == hi
    codes_close(y, yc, dst is torch.quint4x2, frac=0.2)  # the exact ties (x.5) may round either way


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dst_dtype", F16)
def test_anti_quant(rng, bits, scale_dtype, dst_dtype):
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    codes = torch.from_numpy(rng.integers(lo, hi, (32, 128)).astype(np.int8))
    x = codes if bits == 8 else cs.pack_int4(codes)
    s = torch.from_numpy(rng.uniform(0.01, 0.1, 128).astype(np.float32)).to(scale_dtype)
    o = torch.from_numpy(rng.uniform(-4, 4, 128).astype(np.float32)).to(scale_dtype)
    out, outc = both("npu_anti_quant", x, s, offset=o, dst_dtype=dst_dtype,
                     src_dtype=torch.int8 if bits == 8 else torch.quint4x2)
    assert ops.max_violation(out, outc.float(), dst_dtype) <= 1


# ------------------------------------------------------------------------------------------ scatter
@pytest.mark.parametrize("kind", ["float16", "bfloat16", "int8", "int4_as_int8"])
def test_scatter_pa_kv_cache(rng, kind):
    t, nb, bs, hk, d = 40, 8, 128, 2, 128
    if kind.startswith("int"):
        dd = d // 2 if kind == "int4_as_int8" else d
        key = torch.from_numpy(rng.integers(-128, 128, (t, hk, dd)).astype(np.int8))
        cache = torch.from_numpy(rng.integers(-128, 128, (nb, bs, hk, dd)).astype(np.int8))
    else:
        key, cache = rand(rng, (t, hk, d), getattr(torch, kind)), rand(rng, (nb, bs, hk, d), getattr(torch, kind))
    slots = torch.from_numpy(rng.choice(nb * bs, t, replace=False).astype(np.int32))
    kn, vn = to_dev(cache), to_dev(cache.clone())
    ops.call("npu_scatter_pa_kv_cache", to_dev(key), to_dev(key), kn, vn, to_dev(slots), cache_mode="Norm",
             backend="npu")
    kc, vc = cache.clone(), cache.clone()
    ops.call("npu_scatter_pa_kv_cache", key, key, kc, vc, slots, cache_mode="Norm", backend="cpu")
    assert torch.equal(kn.cpu(), kc) and torch.equal(vn.cpu(), vc)
    if kind == "int4_as_int8":  # the bytes are int4 codes: read back as int32 they unpack to what was written
        assert torch.equal(cs.unpack_int4(kn.cpu().view(torch.int32)), cs.unpack_int4(kc.view(torch.int32)))


# ------------------------------------------------------------------------------------------ fused attention
FIA_CASES = [  # (kv, query dtype, head_dim, block_size, q heads, kv heads)
    ("fp_paged", torch.float16, 128, 128, 8, 2), ("fp_paged", torch.bfloat16, 64, 16, 4, 4),
    ("fp_paged", torch.bfloat16, 128, 512, 32, 4),
    ("int8_mode5", torch.bfloat16, 128, 128, 8, 2), ("int8_mode5", torch.float16, 64, 32, 16, 1),
    ("int8_mode0", torch.bfloat16, 128, 128, 8, 2), ("int8_mode0", torch.float16, 128, 64, 4, 4),
    ("int8_mode01", torch.float16, 128, 128, 8, 2),
    ("int4_mode3", torch.bfloat16, 128, 0, 8, 2), ("int4_mode3", torch.float16, 64, 0, 4, 1),
    ("int4_mode0", torch.bfloat16, 128, 0, 8, 2),
]


def _fia_args(rng, kv, qdt, d, bs, hq, hk):
    lens = [0, 1, 127, 300, 511]
    b = len(lens)
    q = rand(rng, (b, hq, 1, d), qdt)
    kw = dict(actual_seq_lengths_kv=lens, num_heads=hq, num_key_value_heads=hk, input_layout="BNSD", scale=d ** -0.5,
              softmax_lse_flag=True)
    if bs:
        mb = -(-512 // bs)
        nb = b * mb
        kw.update(block_table=torch.from_numpy(rng.permutation(nb).reshape(b, mb).astype(np.int32)), block_size=bs)
    if kv == "fp_paged":
        k, v = rand(rng, (nb, bs, hk * d), qdt), rand(rng, (nb, bs, hk * d), qdt)
    elif kv.startswith("int8"):
        k = torch.from_numpy(rng.integers(-128, 128, (nb, bs, hk * d)).astype(np.int8))
        v = torch.from_numpy(rng.integers(-128, 128, (nb, bs, hk * d)).astype(np.int8))
        if kv == "int8_mode5":
            sc = lambda: torch.from_numpy(rng.uniform(0.005, 0.02, (nb, hk, bs)).astype(np.float32))  # noqa: E731
            kw.update(key_antiquant_scale=sc(), value_antiquant_scale=sc(), key_antiquant_offset=sc() * 100,
                      value_antiquant_offset=-sc() * 100, key_antiquant_mode=5, value_antiquant_mode=5)
        elif kv == "int8_mode0":
            sc = lambda: torch.from_numpy(rng.uniform(0.005, 0.02, (1, hk, 1, d)).astype(np.float32)).to(qdt)  # noqa
            kw.update(key_antiquant_scale=sc(), value_antiquant_scale=sc(), key_antiquant_mode=0,
                      value_antiquant_mode=0)
        else:  # key per channel, value per token
            s_kv = kw["block_table"].shape[1] * bs
            kw.update(key_antiquant_scale=torch.from_numpy(rng.uniform(0.005, 0.02, (1, hk, 1, d)).astype(np.float32))
                      .to(qdt),
                      value_antiquant_scale=torch.from_numpy(rng.uniform(0.005, 0.02, (1, b, s_kv)).astype(np.float32)),
                      key_antiquant_mode=0, value_antiquant_mode=1)
    else:  # int4: contiguous BNSD [B, Hk, S, D/8]
        k = cs.pack_int4(torch.from_numpy(rng.integers(-8, 8, (b, hk, 512, d))))
        v = cs.pack_int4(torch.from_numpy(rng.integers(-8, 8, (b, hk, 512, d))))
        if kv == "int4_mode3":
            sc = lambda: torch.from_numpy(rng.uniform(0.05, 0.2, (b, hk, 512)).astype(np.float32))  # noqa: E731
            kw.update(key_antiquant_scale=sc(), value_antiquant_scale=sc(), key_antiquant_offset=-sc(),
                      value_antiquant_offset=sc(), key_antiquant_mode=3, value_antiquant_mode=3)
        else:
            sc = lambda: torch.from_numpy(rng.uniform(0.05, 0.2, (1, hk, 1, d)).astype(np.float32)).to(qdt)  # noqa
            kw.update(key_antiquant_scale=sc(), value_antiquant_scale=sc(), key_antiquant_mode=0,
                      value_antiquant_mode=0)
    return (q, k, v), kw


@pytest.mark.parametrize("case", FIA_CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-d{c[2]}-bs{c[3]}-g{c[4]}x{c[5]}"
                                                 for c in FIA_CASES])
def test_fused_infer_attention_score(rng, case):
    kv, qdt, d, bs, hq, hk = case
    args, kw = _fia_args(rng, kv, qdt, d, bs, hq, hk)
    (o, lse), (oc, lsec) = both("npu_fused_infer_attention_score", *args, **kw)
    assert ops.max_violation(o, oc.float(), qdt) <= 1
    assert ops.max_violation(lse, lsec, torch.float16) <= 1  # rows with keys, and -3.40e38 for the empty row
    assert float(o[0].abs().max()) == 0.0 and bool((lse[0] == np.float32(cs.EMPTY_ROW_LSE)).all())
    (o2, lse_off), _ = both("npu_fused_infer_attention_score", *args, **{**kw, "softmax_lse_flag": False})
    assert tuple(lse_off.shape) == (0,) and torch.equal(o2, o)


def test_rotate_quant(rng):
    x = rand(rng, (32, 512), torch.bfloat16)
    (y, s), (yc, sc) = both("npu_rotate_quant", x, hadamard(128, torch.bfloat16))
    codes_close(y, yc)
    assert ops.max_violation(s, sc, torch.bfloat16) <= 1


# ------------------------------------------------------------------------------------------ rejections
def _reject_cases():
    f16 = lambda *s: torch.randn(*s).half()  # noqa: E731
    i8 = lambda *s: torch.randint(-128, 128, s, dtype=torch.int8)  # noqa: E731
    i32 = lambda *s: torch.zeros(s, dtype=torch.int32)  # noqa: E731
    fia = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.125, actual_seq_lengths_kv=[40, 64])
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return {  # name: (op, args, kwargs) - each excluded by the source its validator message cites
        "quantize_bf16_input_fp32_scales": ("npu_quantize", (f16(4, 16).bfloat16(), torch.rand(16), torch.rand(16),
                                                             torch.qint8), dict(axis=-1, div_mode=False)),
        "quantize_fp16_input_fp32_scales": ("npu_quantize", (f16(4, 16), torch.rand(16), None, torch.qint8),
                                            dict(axis=-1, div_mode=False)),
        "scatter_int32_cache": ("npu_scatter_pa_kv_cache", (i32(3, 2, 2), i32(3, 2, 2), i32(4, 32, 2, 2),
                                                            i32(4, 32, 2, 2),
                                                            torch.tensor([0, 9, 31], dtype=torch.int32)),
                                dict(cache_mode="Norm")),
        "scatter_float32_cache": ("npu_scatter_pa_kv_cache", (torch.randn(3, 2, 16), torch.randn(3, 2, 16),
                                                              torch.randn(4, 32, 2, 16), torch.randn(4, 32, 2, 16),
                                                              torch.tensor([0, 9, 31], dtype=torch.int32)),
                                  dict(cache_mode="Norm")),
        "dynamic_quant_1d": ("npu_dynamic_quant", (f16(16),), {}),
        "dynamic_quant_int4_odd_width": ("npu_dynamic_quant", (f16(4, 12),), dict(dst_type=torch.quint4x2)),
        "anti_quant_int32_with_int8_src": ("npu_anti_quant", (i32(4, 2), torch.rand(16)),
                                           dict(src_dtype=torch.int8)),
        "fia_int4_paged": ("npu_fused_infer_attention_score", (f16(2, 4, 1, 128), i32(4, 32, 32), i32(4, 32, 32)),
                           dict(fia, block_table=bt, block_size=32, key_antiquant_scale=f16(1, 2, 1, 128),
                                value_antiquant_scale=f16(1, 2, 1, 128))),
        "fia_block_size_1024": ("npu_fused_infer_attention_score", (f16(2, 4, 1, 64), f16(4, 1024, 128),
                                                                     f16(4, 1024, 128)),
                                dict(fia, block_table=bt, block_size=1024)),
        "fia_mismatched_antiquant_modes": ("npu_fused_infer_attention_score", (f16(2, 4, 1, 64), i8(4, 32, 128),
                                                                                i8(4, 32, 128)),
                                           dict(fia, block_table=bt, block_size=32, actual_seq_lengths_kv=[40, 64],
                                                key_antiquant_scale=torch.rand(1, 2, 40),
                                                value_antiquant_scale=f16(1, 2, 1, 64),
                                                key_antiquant_mode=1, value_antiquant_mode=0)),
    }


REJECT = _reject_cases()


@pytest.mark.parametrize("name", sorted(REJECT))
def test_the_op_rejects_what_its_contract_excludes(name):
    """Called on torch_npu directly (no validator in between): the real op must raise, as the validator
    does. If the NPU accepts one of these, the validator is stricter than the op: report it."""
    op, args, kwargs = REJECT[name]
    with pytest.raises((ValueError, TypeError)):
        getattr(validators, op)(*args, **kwargs)
    mod = npu.torch_npu_module()
    with pytest.raises(Exception):  # noqa: B017 - RuntimeError from aclnn on the NPU, ValueError from the fake
        getattr(mod, op)(*[to_dev(a) for a in args], **{k: to_dev(v) for k, v in kwargs.items()})
        if DEV == "npu":
            torch.npu.synchronize()


# ------------------------------------------------------------------------------------------ the cache
CACHE_SCHEMES = ["int8", "int4", "int8_static", "int4_static", "bf16", "kvarn_k4v2_g128", "kivi_k2v2_g128"]


@pytest.mark.parametrize("scheme", CACHE_SCHEMES)
def test_cache_on_npu_matches_cpu_semantics(rng, scheme):
    import jax.numpy as jnp
    import kvarn_jax as kj
    nb, bs, hk, hq, d = 24, 128, 2, 8, 128
    lens = [100, 300, 520]
    seqs = [rand(rng, (n, hk, d)).numpy() for n in lens]
    seqs[1][150, 0] = 0.0  # a constant token-head, stored exactly
    cal = None
    if scheme.endswith("_static"):
        allk = jnp.asarray(np.concatenate(seqs))
        cal = kj.calibrate([(allk, allk)], scheme)
    kw = dict(num_blocks=nb, block_size=bs, num_kv_heads=hk, head_dim=d, max_seqs=4, dtype=torch.bfloat16,
              calibration=cal)
    dev = AscendPagedKVCache.create(scheme, backend="npu", device=DEV, **kw)
    cpu = AscendPagedKVCache.create(scheme, backend="cpu", **kw)
    tables = np.stack([np.arange(i * 6, i * 6 + 6) for i in range(len(lens))]).astype(np.int32)
    for i, x in enumerate(seqs):  # a prefill, then one token per call
        n = lens[i]
        for lo, hi in [(0, n - 3), (n - 3, n - 2), (n - 2, n - 1), (n - 1, n)]:
            pos = np.arange(lo, hi)
            args = [torch.from_numpy(x[lo:hi]), torch.from_numpy(x[lo:hi] * 0.5),
                    torch.from_numpy((tables[i, pos // bs] * bs + pos % bs).astype(np.int32))]
            meta = dict(seq_ids=torch.full((hi - lo,), i, dtype=torch.int32), positions=torch.from_numpy(pos))
            cpu.write(*args, **meta)
            dev.write(*[to_dev(a) for a in args], **{k: to_dev(v) for k, v in meta.items()})
    q = rand(rng, (len(lens), hq, d), torch.bfloat16)
    bt, sl = torch.from_numpy(tables), torch.tensor(lens)
    out = dev.decode(to_dev(q), to_dev(bt), sl).cpu()
    assert ops.max_violation(out, cpu.decode(q, bt, sl).float(), torch.bfloat16) <= 2
    for got, want in zip(dev.dense_kv(to_dev(bt), sl), cpu.dense_kv(bt, sl)):
        for i, n in enumerate(lens):
            assert ops.max_violation(got[i, :, :n].cpu(), want[i, :, :n], torch.bfloat16) <= 1


@pytest.mark.parametrize("scheme", ["int8", "kvarn_k4v2_g128"])
def test_serving_step_in_engine_buffers_matches_cpu(rng, scheme):
    """What the vllm-ascend route runs per step (pages in the engine's KV tensors, decodes and a prefill
    chunk), on the NPU against the CPU semantics."""
    nb, bs, hk, hq, d = 16, 128, 2, 8, 128
    store = torch.int8 if scheme.startswith("kvarn") else torch.bfloat16
    lens0, add = [200, 0], [1, 150]
    lens = [a + b for a, b in zip(lens0, add)]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    kv = [(rand(rng, (n, hk, d), torch.bfloat16), rand(rng, (n, hk, d), torch.bfloat16)) for n in lens]
    q = rand(rng, (sum(add), hq, d), torch.bfloat16)
    outs = []
    for where, backend in ((DEV, "npu"), ("cpu", "cpu")):
        bufs = {s: torch.zeros(nb, bs, hk, d, dtype=store, device=where) for s in "kv"}
        hp = {s: torch.zeros(4, bs, hk, d, dtype=torch.bfloat16, device=where) for s in "kv"}
        attn = KVarNAscendAttention.over_buffers(scheme, bufs, hp=hp, num_heads=hq, num_kv_heads=hk, head_size=d,
                                                 block_size=bs, max_seqs=2, dtype=torch.bfloat16, backend=backend)
        p0 = torch.arange(lens0[0])
        attn.cache.write(kv[0][0][:lens0[0]].to(where), kv[0][1][:lens0[0]].to(where),
                         (tables[0, p0 // bs] * bs + p0 % bs).int().to(where),
                         seq_ids=torch.zeros(lens0[0], dtype=torch.int32, device=where), positions=p0.to(where))
        rows = [torch.arange(lens0[i], lens[i]) for i in range(2)]
        k = torch.cat([kv[i][0][r] for i, r in enumerate(rows)]).to(where)
        v = torch.cat([kv[i][1][r] for i, r in enumerate(rows)]).to(where)
        slots = torch.cat([tables[i, r // bs] * bs + r % bs for i, r in enumerate(rows)]).int().to(where)
        outs.append(attn.forward(q.to(where), k, v, slot_mapping=slots, query_start_loc=torch.tensor([0, 1, 151]),
                                 seq_lens=torch.tensor(lens), block_tables=tables.to(where),
                                 seq_ids=torch.tensor([0, 1])).cpu())
    assert ops.max_violation(outs[0], outs[1].float(), torch.bfloat16) <= 2
