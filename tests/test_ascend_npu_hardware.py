"""On an Ascend NPU: each torch_npu op against kvarn_ascend's CPU semantics on the same inputs, and the
cache on the NPU against the cache on the CPU semantics. Skipped where no NPU is usable (CI).

Tolerances are the Ascend op tests': outputs |npu - cpu| <= max(|cpu|, 1) * tol(dtype) (ops.TOLERANCE),
twice that for the cache's decode (two roundings, see test_ascend_cache.py); codes within 1 of the
CPU semantics on at most 2% (5% for kvarn_jax-style fp16 metadata) of the elements.
"""

import os

import numpy as np
import pytest
import torch

from kvarn_ascend import AscendPagedKVCache, cpu_semantics as cs, npu_available, ops, unavailable_reason

pytestmark = pytest.mark.skipif(not npu_available(), reason=f"no NPU: {unavailable_reason()}")

DEV = os.environ.get("KVARN_ASCEND_TEST_DEVICE", "npu")  # "cpu" dry-runs this file on a fake torch_npu


def both(name, *args, **kwargs):
    """(NPU result on the host, CPU-semantics result) of one op on the same inputs."""
    move = lambda a: a.to(DEV) if isinstance(a, torch.Tensor) else a  # noqa: E731
    out_npu = ops.call(name, *[move(a) for a in args], backend="npu", **{k: move(v) for k, v in kwargs.items()})
    out_cpu = ops.call(name, *args, backend="cpu", **kwargs)
    host = lambda o: tuple(x.cpu() for x in o) if isinstance(o, tuple) else o.cpu()  # noqa: E731
    return host(out_npu), out_cpu


def codes_close(a, b, int4=False, frac=0.02):
    if int4:
        a, b = cs.unpack_int4(a), cs.unpack_int4(b)
    d = (a.int() - b.int()).abs()
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= frac


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dst", [torch.int8, torch.quint4x2])
def test_dynamic_quant_ops(rng, dtype, dst):
    x = torch.from_numpy(rng.standard_normal((64, 128)).astype(np.float32)).to(dtype)
    (y, s), (yc, sc) = both("npu_dynamic_quant", x, dst_type=dst)
    codes_close(y, yc, dst is torch.quint4x2)
    assert ops.max_violation(s, sc, torch.float32) <= 1
    (y, s, o), (yc, sc, oc) = both("npu_dynamic_quant_asymmetric", x, dst_type=dst)
    codes_close(y, yc, dst is torch.quint4x2)
    assert ops.max_violation(s, sc, torch.float32) <= 1 and ops.max_violation(o, oc, torch.float32) <= 8


@pytest.mark.parametrize("dst", [torch.qint8, torch.quint4x2])
def test_quantize_and_anti_quant_ops(rng, dst):
    x = torch.from_numpy(rng.standard_normal((64, 128)).astype(np.float32)).to(torch.bfloat16)
    s = torch.from_numpy(rng.uniform(5, 20, 128).astype(np.float32))
    z = torch.from_numpy(rng.uniform(-3, 3, 128).astype(np.float32))
    y, yc = both("npu_quantize", x, s, z, dst, axis=-1, div_mode=False)
    codes_close(y, yc, dst is torch.quint4x2)
    out, outc = both("npu_anti_quant", yc, 1.0 / s, offset=-z, dst_dtype=torch.bfloat16,
                     src_dtype=torch.int8 if dst is torch.qint8 else torch.quint4x2)
    assert ops.max_violation(out, outc, torch.bfloat16) <= 1


def test_scatter_pa_kv_cache_op(rng):
    key = torch.from_numpy(rng.standard_normal((20, 2, 128)).astype(np.float16))
    kc = torch.from_numpy(rng.standard_normal((8, 32, 2, 128)).astype(np.float16))
    slots = torch.from_numpy(rng.choice(8 * 32, 20, replace=False).astype(np.int32))
    kn, vn = kc.to(DEV), kc.clone().to(DEV)
    ops.call("npu_scatter_pa_kv_cache", key.to(DEV), key.to(DEV), kn, vn, slots.to(DEV), cache_mode="Norm",
             backend="npu")
    kcpu, vcpu = kc.clone(), kc.clone()
    ops.call("npu_scatter_pa_kv_cache", key, key, kcpu, vcpu, slots, cache_mode="Norm", backend="cpu")
    assert torch.equal(kn.cpu(), kcpu) and torch.equal(vn.cpu(), vcpu)


@pytest.mark.parametrize("case", ["fp16_paged", "int8_mode5", "int8_mode0", "int4_mode3"])
def test_fused_attention_op(rng, case):
    nb, bs, hk, hq, d = 16, 128, 2, 8, 128
    lens = [1, 127, 300, 511]
    b = len(lens)
    tables = torch.from_numpy(np.stack([rng.permutation(nb)[:4] for _ in lens]).astype(np.int32))
    q = torch.from_numpy(rng.standard_normal((b, hq, 1, d)).astype(np.float16))
    kw = dict(actual_seq_lengths_kv=lens, num_heads=hq, num_key_value_heads=hk, input_layout="BNSD", scale=d ** -0.5,
              softmax_lse_flag=True)
    if case == "fp16_paged":
        k = torch.from_numpy(rng.standard_normal((nb, bs, hk * d)).astype(np.float16))
        args, kw = (q, k, k.clone()), dict(kw, block_table=tables, block_size=bs)
    elif case == "int4_mode3":
        k = cs.pack_int4(torch.from_numpy(rng.integers(-8, 8, (b, hk, 512, d))))
        sc = torch.from_numpy(rng.uniform(0.05, 0.2, (b, hk, 512)).astype(np.float32))
        args = (q, k, k.clone())
        kw = dict(kw, key_antiquant_scale=sc, value_antiquant_scale=sc.clone(), key_antiquant_offset=-sc,
                  value_antiquant_offset=sc.clone(), key_antiquant_mode=3, value_antiquant_mode=3)
    else:
        k = torch.from_numpy(rng.integers(-128, 128, (nb, bs, hk * d)).astype(np.int8))
        if case == "int8_mode5":
            sc = torch.from_numpy(rng.uniform(0.005, 0.02, (nb, hk, bs)).astype(np.float32))
            extra = dict(key_antiquant_offset=sc * 10, value_antiquant_offset=-sc * 10, key_antiquant_mode=5,
                         value_antiquant_mode=5)
        else:
            sc = torch.from_numpy(rng.uniform(0.005, 0.02, (1, hk, 1, d)).astype(np.float16))
            extra = dict(key_antiquant_mode=0, value_antiquant_mode=0)
        args = (q, k, k.clone())
        kw = dict(kw, block_table=tables, block_size=bs, key_antiquant_scale=sc, value_antiquant_scale=sc.clone(),
                  **extra)
    (o, lse), (oc, lsec) = both("npu_fused_infer_attention_score", *args, **kw)
    assert ops.max_violation(o, oc.float(), torch.float16) <= 1
    assert ops.max_violation(lse[lsec.isfinite()], lsec[lsec.isfinite()], torch.float16) <= 1


def test_rotate_quant_op(rng):
    from kvarn_ascend.kvarn_torch import hadamard
    x = torch.from_numpy(rng.standard_normal((32, 512)).astype(np.float32)).to(torch.bfloat16)
    (y, s), (yc, sc) = both("npu_rotate_quant", x, hadamard(128, torch.bfloat16))
    codes_close(y, yc)
    assert ops.max_violation(s, sc, torch.bfloat16) <= 1


@pytest.mark.parametrize("scheme", ["int8", "int4", "int8_static", "bf16", "kvarn_k4v2_g128"])
def test_cache_on_npu_matches_cpu_semantics(rng, scheme):
    import jax.numpy as jnp
    import kvarn_jax as kj
    nb, bs, hk, hq, d = 24, 128, 2, 8, 128
    lens = [100, 300, 520]
    seqs = [rng.standard_normal((n, hk, d)).astype(np.float32) for n in lens]
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
            dev.write(*[a.to(DEV) for a in args], **{k: v.to(DEV) for k, v in meta.items()})
    q = torch.from_numpy(rng.standard_normal((len(lens), hq, d)).astype(np.float32)).to(torch.bfloat16)
    bt, sl = torch.from_numpy(tables), torch.tensor(lens)
    out = dev.decode(q.to(DEV), bt.to(DEV), sl).cpu()
    ref = cpu.decode(q, bt, sl)
    assert ops.max_violation(out, ref.float(), torch.bfloat16) <= 2
