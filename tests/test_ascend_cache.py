"""kvarn_ascend's paged cache: write path and decode against kvarn_jax's cache and reference decode,
the NPU call path end to end through the recording fake of torch_npu, and the errors of the public
functions (the vllm-ascend route: test_ascend_vllm.py).

Tolerances: a decode on the NPU path rounds to the model dtype twice (the fused op's output, then the
merge of the quantized and high-precision parts, or the un-rotation for KVarN), so it is compared
with 2x the Ascend op-test tolerance (ops.TOLERANCE). For KVarN/KIVI the fused op must also take the
dequantized K/V and the rotated query in the model dtype; those roundings are applied to the oracle
(kvarn_jax.gather_dense's values, rounded) so that only the op's arithmetic is compared.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvarn_jax as kj
from kvarn_ascend import AscendPagedKVCache, ops, scheme_kind
from kvarn_ascend.cpu_semantics import unpack_int4
from kvarn_ascend.kvarn_torch import hadamard, load_tiled

import ascend_fake_npu
from helpers import allocate_tables, random_kv


@pytest.fixture
def fake_torch_npu(monkeypatch):
    return ascend_fake_npu.install(monkeypatch)

JDT = {torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16}
BS, HK, HQ, D, NB = 32, 2, 4, 64, 20
LENS = [5, 32, 33, 64, 90]
MAX_SEQS = len(LENS) + 2  # one cache shape for every test (kvarn_jax compiles per shape)


def _calibration(seqs, scheme):
    k = np.concatenate([s[0] for s in seqs])
    v = np.concatenate([s[1] for s in seqs])
    return kj.calibrate([(jnp.asarray(k), jnp.asarray(v))], scheme)


def _stream(rng, lens):
    """A serving loop's writes: (seq, first position, count) chunks - a prefill of random length per
    sequence in the first call, then 1-3 tokens per sequence per call."""
    done = [0] * len(lens)
    calls = []
    while any(d < n for d, n in zip(done, lens)):
        call = []
        for i, n in enumerate(lens):
            if done[i] < n:
                step = int(rng.integers(1, n + 1)) if done[i] == 0 else int(rng.integers(1, 4))
                step = min(step, n - done[i])
                call.append((i, done[i], step))
                done[i] += step
        calls.append(call)
    return calls


def _rows(call, seqs, tables, pad_to):
    ids, pos = [], []
    for i, p0, n in call:
        ids += [i] * n
        pos += list(range(p0, p0 + n))
    k = np.stack([seqs[i][0][p] for i, p in zip(ids, pos)])
    v = np.stack([seqs[i][1][p] for i, p in zip(ids, pos)])
    slots = [int(tables[i, p // BS]) * BS + p % BS for i, p in zip(ids, pos)]
    pad = pad_to - len(ids)  # padding rows (slot -1), as a server pads its batches
    k = np.concatenate([k, np.repeat(k[:1], pad, 0)])
    v = np.concatenate([v, np.repeat(v[:1], pad, 0)])
    return k, v, np.array(slots + [-1] * pad, np.int32), np.array(ids + [0] * pad, np.int32), \
        np.array(pos + [0] * pad, np.int32)


def write_both(jc, tc, seqs, tables, rng):
    """The same stream into a kvarn_jax cache (if given) and an Ascend cache (if given)."""
    for j, call in enumerate(_stream(rng, [s[0].shape[0] for s in seqs])):
        # two padded sizes only (prefill, then steps): each new shape costs kvarn_jax a compile
        k, v, slots, ids, pos = _rows(call, seqs, tables, 256 if j == 0 else 32)
        if jc is not None:
            jc = kj.write(jc, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), seq_ids=jnp.asarray(ids),
                          positions=jnp.asarray(pos))
        if tc is not None:
            tc.write(torch.from_numpy(k), torch.from_numpy(v), torch.from_numpy(slots), seq_ids=torch.from_numpy(ids),
                     positions=torch.from_numpy(pos))
    return jc


def make(scheme, dtype, cal=None, backend="cpu", **kw):
    args = dict(num_blocks=NB, block_size=BS, num_kv_heads=HK, head_dim=D, max_seqs=MAX_SEQS, calibration=cal)
    args.update(kw)
    jc = kj.PagedKVCache.create(scheme, dtype=JDT[dtype], **args)
    tc = AscendPagedKVCache.create(scheme, dtype=dtype, backend=backend, device="cpu", **args)
    return jc, tc


def setup(rng, scheme, dtype, lens=LENS):
    seqs = [random_kv(rng, n, HK, D, dtype=np.float32, outliers=2) for n in lens]
    cal = _calibration(seqs, scheme) if scheme.endswith("_static") else None
    tables = allocate_tables(rng, lens, BS, NB)
    return seqs, cal, tables


SCHEMES = [("int8", torch.float16), ("int8", torch.bfloat16), ("int4", torch.float16), ("int8_static", torch.bfloat16),
           ("int4_static", torch.float16), ("fp16", torch.float16), ("kvarn_k4v2_g32", torch.float16),
           ("kvarn_k4v4_g32", torch.bfloat16), ("kivi_k2v2_g32", torch.bfloat16)]


# ------------------------------------------------------------------------------------------ write path
def _pages_match(tc, same, full, scheme):
    """Our pages vs kvarn_jax's (`same`, converted) on the quantized blocks `full`."""
    kind = scheme_kind(kj.parse(scheme), D)
    for s in "kv":
        if kind == "passthrough":
            assert torch.equal(tc.pages[s]["values"], same.pages[s]["values"])
        elif kind == "tiled":
            cfg = kj.parse(scheme)
            bits = cfg.bits(s)
            a = load_tiled(tc.pages[s]["codes"][full], bits).reshape(len(full) * HK * (BS // cfg.group), -1)
            b = load_tiled(same.pages[s]["codes"][full], bits).reshape(a.shape)
            assert int((a != b).sum(1).max()) <= 16 * cfg.group // 128 + 1
            for name, x in tc.pages[s].items():
                if name != "codes":
                    y = same.pages[s][name][full].double()
                    rel = (x[full].double() - y).abs() / y.abs().clamp(min=1e-6)
                    assert float(rel.max()) <= 0.01, (s, name, float(rel.max()))
        else:
            a, b = tc.pages[s]["codes"][full], same.pages[s]["codes"][full]
            if kj.parse(scheme).k_bits == 4:
                a, b = unpack_int4(a), unpack_int4(b)
            # kvarn_jax picks codes against its scale/zero rounded to the model dtype, the op against float32
            # ones: fp16 roundings (2^-11) move an int8 code by up to ~0.1, bf16 ones (2^-8) by up to ~0.5, so
            # 10-25% of bf16's int8 codes land on the other side of a rounding boundary
            diff = (a.int() - b.int()).abs()
            flipped = 0.05 if tc.dtype == torch.float16 else 0.3
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= flipped


@pytest.mark.parametrize("scheme,dtype", SCHEMES, ids=[f"{s}-{str(d)[6:]}" for s, d in SCHEMES])
def test_write_path_matches_kvarn_jax(rng, scheme, dtype):
    seqs, cal, tables = setup(rng, scheme, dtype)
    jc, tc = make(scheme, dtype, cal)
    jc = write_both(jc, tc, seqs, tables, np.random.default_rng(7))
    same = AscendPagedKVCache.from_kvarn_jax(jc, backend="cpu")  # kvarn_jax's content in this layout
    if tc.hp is not None:  # the high-precision sink and ring blocks are exactly kvarn_jax's
        for s in "kv":
            assert torch.equal(tc.hp[s], same.hp[s])
    full = [int(tables[i, j]) for i, n in enumerate(LENS) for j in range(1, n // BS)]  # quantized pages
    assert full, "the stream must complete some non-sink blocks"
    _pages_match(tc, same, full, scheme)
    kind = scheme_kind(kj.parse(scheme), D)
    # what attention reads: within one quantization step of kvarn_jax's values
    bt, sl = torch.from_numpy(tables), torch.tensor(LENS)
    kd, vd = kj.gather_dense(jc, jnp.asarray(tables), jnp.asarray(LENS, jnp.int32))
    for ours, theirs in zip(tc.dense_kv(bt, sl), (kd, vd)):
        theirs = np.array(theirs)
        for i, n in enumerate(LENS):
            x, y = ours[i, :, :n].numpy(), theirs[i, :, :n]
            step = (y.max(-1, keepdims=True) - y.min(-1, keepdims=True)) / (2 ** kj.parse(scheme).k_bits - 1) \
                if kind == "int_dynamic" else np.abs(y).max() * (2 ** -7 if kind != "int_static" else 2 ** -3)
            assert np.all(np.abs(x - y) <= 1.01 * step + np.abs(y) * 2 ** -7 + 1e-4), (i, float(np.abs(x - y).max()))


# ------------------------------------------------------------------------------------------ decode
def _oracle(tc, jc, q, tables, lens):
    """kvarn_jax's reference decode, and (for KVarN/KIVI) a float64 oracle on gather_dense's values rounded
    to the model dtype with the rotated query rounded likewise (what the fused op is fed)."""
    qj = jnp.asarray(q.float().numpy()).astype(JDT[tc.dtype])
    ref = kj.paged_decode_attention_reference(qj, jc, jnp.asarray(tables), jnp.asarray(lens, jnp.int32))
    ref = torch.from_numpy(np.array(ref.astype(jnp.float32)))
    if tc.kind != "tiled":
        return ref, ref
    kd, vd = kj.gather_dense(jc, jnp.asarray(tables), jnp.asarray(lens, jnp.int32))
    rnd = lambda a: torch.from_numpy(np.array(a)).to(tc.dtype).double()  # noqa: E731
    k, v = rnd(kd), rnd(vd)
    h = hadamard(D, torch.float64)
    qq = (q.double() @ h).float().to(tc.dtype).double() if tc.cfg.rotated else q.double()
    b = q.shape[0]
    out = torch.zeros(b, HQ, D, dtype=torch.float64)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        kk, vv = k[i, :, :n].repeat_interleave(HQ // HK, 0), v[i, :, :n].repeat_interleave(HQ // HK, 0)
        p = torch.softmax(torch.einsum("hd,hsd->hs", qq[i], kk) / np.sqrt(D), -1)
        out[i] = torch.einsum("hs,hsd->hd", p, vv)
    if tc.cfg.rotated:
        out = out @ h
    return ref, out


@pytest.mark.parametrize("scheme,dtype", SCHEMES, ids=[f"{s}-{str(d)[6:]}" for s, d in SCHEMES])
def test_decode_matches_kvarn_jax_reference_on_the_same_content(rng, scheme, dtype):
    lens = LENS + [0, 3]
    seqs, cal, tables = setup(rng, scheme, dtype, lens)
    jc, _ = make(scheme, dtype, cal)
    jc = write_both(jc, None, seqs, tables, np.random.default_rng(3))
    tc = AscendPagedKVCache.from_kvarn_jax(jc, backend="cpu")
    # pages a decode must not read hold garbage: blocks no sequence uses and, when the sink and the
    # partial last block come from high precision, those blocks' pages too
    first = 0 if tc.kind == "passthrough" else 1
    read = {int(tables[i, j]) for i, n in enumerate(lens)
            for j in range(first, -(-n // BS) if tc.kind == "passthrough" else n // BS)}
    unused = torch.tensor(sorted(set(range(NB)) - read))
    for p in tc.pages.values():
        for a in p.values():
            a[unused] = torch.nan if a.is_floating_point() else torch.randint(-100, 100, a[unused].shape).to(a.dtype)
    bt, sl = torch.from_numpy(tables), torch.tensor(lens)
    # the dense K/V attention sees: kvarn_jax's gather_dense
    kd, vd = kj.gather_dense(jc, jnp.asarray(tables), jnp.asarray(lens, jnp.int32))
    for ours, theirs in zip(tc.dense_kv(bt, sl), (kd, vd)):
        theirs = torch.from_numpy(np.array(theirs))
        for i, n in enumerate(lens):  # static ones pass through npu_anti_quant's model-dtype output
            tol_dtype = dtype if tc.kind == "int_static" else torch.float32
            assert ops.max_violation(ours[i, :, :n], theirs[i, :, :n], tol_dtype) <= 1
    q = torch.from_numpy(rng.standard_normal((len(lens), HQ, D)).astype(np.float32)).to(dtype)
    out = tc.decode(q, bt, sl)
    assert out.dtype == dtype and out.shape == (len(lens), HQ, D)
    ref, oracle = _oracle(tc, jc, q, tables, lens)
    assert ops.max_violation(out, oracle.float(), dtype) <= 2
    if tc.kind == "tiled":  # vs the fp32 reference: the model-dtype inputs cost at most a few bf16 steps
        assert ops.max_violation(out, ref, torch.bfloat16) <= 4
    assert float(out[len(LENS)].abs().max()) == 0.0  # an empty sequence gives a zero row


@pytest.mark.parametrize("scheme", ["int8", "kvarn_k4v2_g32"])
def test_long_prefill_in_one_call_and_two_tail_blocks_match_kvarn_jax(rng, scheme):
    """Whole prompts longer than the ring in one write, then steps crossing block boundaries, with a
    two-block ring (the partial block can sit in either ring block)."""
    lens = [130, 75, 40]
    seqs, _, tables = setup(rng, scheme, torch.float16, lens)
    jc, tc = make(scheme, torch.float16, tail_blocks=2)
    pre = [120, 75, 33]  # 120 > sink + ring (96): the ring keeps the write's last 64 positions
    steps = [[(i, p + j, 1) for i, p in enumerate(pre) if p + j < lens[i]] for j in range(max(lens))]
    for j, call in enumerate([[(i, 0, p) for i, p in enumerate(pre)]] + [c for c in steps if c]):
        k, v, slots, ids, pos = _rows(call, seqs, tables, 256 if j == 0 else 32)
        jc = kj.write(jc, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), seq_ids=jnp.asarray(ids),
                      positions=jnp.asarray(pos))
        tc.write(torch.from_numpy(k), torch.from_numpy(v), torch.from_numpy(slots), seq_ids=torch.from_numpy(ids),
                 positions=torch.from_numpy(pos))
    for s in "kv":  # the rings hold exactly kvarn_jax's tokens
        assert torch.equal(tc.hp[s], AscendPagedKVCache.from_kvarn_jax(jc, backend="cpu").hp[s])
    bt, sl = torch.from_numpy(tables), torch.tensor(lens)
    q = torch.from_numpy(rng.standard_normal((3, HQ, D)).astype(np.float16))
    same = AscendPagedKVCache.from_kvarn_jax(jc, backend="cpu")
    ref, oracle = _oracle(same, jc, q, tables, lens)
    assert ops.max_violation(same.decode(q, bt, sl), oracle.float(), torch.float16) <= 2
    _pages_match(tc, same, [int(tables[i, j]) for i, n in enumerate(lens) for j in range(1, n // BS)], scheme)


def test_decode_with_seq_ids_and_gqa_rows_in_any_order(rng):
    seqs, _, tables = setup(rng, "int8", torch.float16)
    jc, _ = make("int8", torch.float16)
    jc = write_both(jc, None, seqs, tables, np.random.default_rng(5))
    tc = AscendPagedKVCache.from_kvarn_jax(jc, backend="cpu")
    perm = np.array([3, 0, 4, 2, 1])
    q = torch.from_numpy(rng.standard_normal((5, 8, D)).astype(np.float16))
    out = tc.decode(q, torch.from_numpy(tables[perm]), torch.tensor(LENS)[perm], seq_ids=torch.from_numpy(perm))
    ref = kj.paged_decode_attention_reference(jnp.asarray(q.numpy()), jc, jnp.asarray(tables[perm]),
                                              jnp.asarray(np.array(LENS)[perm]), seq_ids=jnp.asarray(perm))
    assert ops.max_violation(out, torch.from_numpy(np.array(ref.astype(jnp.float32))), torch.float16) <= 2


def test_rewrite_after_rollback_equals_fresh_write(rng):
    """Speculative decoding: drafts that crossed a block boundary are rejected and rewritten."""
    n, cut = 80, 60
    seq = random_kv(rng, n, HK, D, dtype=np.float32)
    other = random_kv(rng, n, HK, D, dtype=np.float32)
    tables = allocate_tables(rng, [n], BS, NB)
    a = AscendPagedKVCache.create("int8", num_blocks=NB, block_size=BS, num_kv_heads=HK, head_dim=D, max_seqs=1,
                                  dtype=torch.float16, tail_blocks=2, backend="cpu")
    b = dataclasses.replace(a, pages={s: {k: x.clone() for k, x in p.items()} for s, p in a.pages.items()},
                            hp={s: x.clone() for s, x in a.hp.items()})

    def put(cache, kv, lo, hi):
        pos = np.arange(lo, hi)
        slots = tables[0, pos // BS] * BS + pos % BS
        cache.write(torch.from_numpy(kv[0][lo:hi]), torch.from_numpy(kv[1][lo:hi]),
                    torch.from_numpy(slots.astype(np.int32)),
                    seq_ids=torch.zeros(hi - lo, dtype=torch.int32), positions=torch.from_numpy(pos.astype(np.int32)))
    put(a, seq, 0, cut)
    put(a, other, cut, cut + 10)   # drafts 60..69 fill block 1 (its last slot 63) with rejected tokens
    put(a, seq, cut, n)            # rollback: rewrite 60..79 with the accepted tokens
    put(b, seq, 0, n)
    for s in "kv":
        for name in a.pages[s]:
            assert torch.equal(a.pages[s][name], b.pages[s][name]), (s, name)
    q = torch.from_numpy(rng.standard_normal((1, HQ, D)).astype(np.float16))
    bt, sl = torch.from_numpy(tables), torch.tensor([n])
    assert torch.equal(a.decode(q, bt, sl), b.decode(q, bt, sl))


# ------------------------------------------------------------------------------------------ storage rule
def _one_sequence(tc, jc, k, v):
    """Write k, v [n, Hk, D] (float32) as one sequence on pages 0.. of both caches; (tables, lens)."""
    n = k.shape[0]
    pos = np.arange(n, dtype=np.int32)
    args = (pos, np.zeros(n, np.int32), pos)
    if jc is not None:
        jc = kj.write(jc, jnp.asarray(k, JDT[tc.dtype]), jnp.asarray(v, JDT[tc.dtype]), *map(jnp.asarray, args[:1]),
                      seq_ids=jnp.asarray(args[1]), positions=jnp.asarray(args[2]))
    tc.write(torch.from_numpy(k).to(tc.dtype), torch.from_numpy(v).to(tc.dtype), *map(torch.from_numpy, args[:1]),
             seq_ids=torch.from_numpy(args[1]), positions=torch.from_numpy(args[2]))
    return jc, np.arange(-(-n // BS) + 1, dtype=np.int32)[None], [n]


@pytest.mark.parametrize("scheme", ["int8", "int4", "kvarn_k4v2_g32", "kivi_k2v2_g32"])
def test_bfloat16_values_beyond_float16_are_kept(rng, scheme):
    """Scales and zero points in the model dtype: bf16 data beyond 65,504 (a 7e4 token, a constant 1e4
    tile) reads back as accurately as small data and decodes finite, as kvarn_jax's reference does;
    float16 metadata made it inf (KVarN/KIVI pages) or NaN."""
    n = 3 * BS
    k, v = (a * 3 for a in random_kv(rng, n, HK, D, dtype=np.float32))
    for x in (k, v):
        x[BS + 5] = 7e4        # one large token in a quantized block
        x[BS:2 * BS, 1] = 1e4  # a constant tile of head 1
    k, v = (torch.from_numpy(a).bfloat16().float().numpy() for a in (k, v))
    jc, tc = make(scheme, torch.bfloat16, max_seqs=1)
    jc, tables, lens = _one_sequence(tc, jc, k, v)
    for s in "kv":  # (the pages are not compared with kvarn_jax's: a constant row is stored differently)
        for name, x in tc.pages[s].items():
            assert bool(torch.isfinite(x.float()).all()), (s, name)
    bt, sl = torch.from_numpy(tables), torch.tensor(lens)
    bound = {"int8": 0.01}.get(scheme, 0.6)  # relative error of the large values
    for got, want in zip(tc.dense_kv(bt, sl), (k, v)):
        got = got[0, :, :n].permute(1, 0, 2).numpy()
        if tc.cfg.rotated:
            got = got @ hadamard(D).numpy()
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got[BS + 5], want[BS + 5], rtol=bound, atol=bound * 7e4)
        np.testing.assert_allclose(got[BS:2 * BS, 1], want[BS:2 * BS, 1], rtol=bound, atol=bound * 1e4)
    q = torch.from_numpy(rng.standard_normal((1, HQ, D)).astype(np.float32)).bfloat16()
    ref, oracle = _oracle(tc, jc, q, tables, lens)
    out = tc.decode(q, bt, sl)
    assert bool(torch.isfinite(out).all())
    assert ops.max_violation(out, oracle.float(), torch.bfloat16) <= 2


def test_float16_kvarn_token_beyond_the_rotated_range():
    """KVarN rotates in fp32 and rounds once to fp16: a token whose rotated values fit (all 64 channels
    8,100: rotated 64,800) is stored finite and as kvarn_jax stores it; one whose rotated values do not
    (8,300: 66,400; an L2 norm above 65,504) is refused before anything is written, as by an eager
    kvarn_jax.write."""
    rng = np.random.default_rng(0)
    n = 2 * BS
    k, v = random_kv(rng, n, HK, D, dtype=np.float32)
    k[BS + 3], v[BS + 3] = 8100.0, -8100.0
    jc, tc = make("kvarn_k4v2_g32", torch.float16, max_seqs=1)
    jc, tables, lens = _one_sequence(tc, jc, k, v)
    assert int(jc.dropped_tokens) == 0
    for s in "kv":
        for name, x in tc.pages[s].items():
            assert bool(torch.isfinite(x.float()).all()), (s, name)
    _pages_match(tc, AscendPagedKVCache.from_kvarn_jax(jc, backend="cpu"), [1], "kvarn_k4v2_g32")
    q = torch.from_numpy(rng.standard_normal((1, HQ, D)).astype(np.float16))
    assert bool(torch.isfinite(tc.decode(q, torch.from_numpy(tables), torch.tensor(lens))).all())
    _, fresh = make("kvarn_k4v2_g32", torch.float16, max_seqs=1)
    k[BS + 3] = 8300.0
    with pytest.raises(ValueError, match="k holds values beyond torch.float16's range after the Hadamard"):
        _one_sequence(fresh, None, k, v)
    assert not bool(fresh.hp["k"].any()) and not any(bool(x.any()) for x in fresh.pages["k"].values())


# ------------------------------------------------------------------------------------------ NPU call path
FAKE_CASES = {  # scheme: (expected fused-attention key dtype and antiquant modes of the quantized part)
    "int8": (torch.int8, 5, True), "int4": (torch.int32, 3, False), "int8_static": (torch.int8, 0, True),
    "int4_static": (torch.int32, 0, False), "fp16": (torch.float16, None, True),
    "kvarn_k4v2_g32": (torch.float16, None, False),
}


@pytest.mark.parametrize("scheme", sorted(FAKE_CASES))
def test_npu_path_runs_through_torch_npu_with_documented_arguments(fake_torch_npu, rng, scheme):
    dtype = torch.float16
    seqs, cal, tables = setup(rng, scheme, dtype)
    _, cpu = make(scheme, dtype, cal, backend="cpu")
    _, dev = make(scheme, dtype, cal, backend="npu")
    assert dev.backend == "npu" and cpu.backend == "cpu"
    write_both(None, cpu, seqs, tables, np.random.default_rng(11))
    n_cpu_calls = len(fake_torch_npu.calls)
    assert n_cpu_calls == 0  # the CPU backend never touches torch_npu
    write_both(None, dev, seqs, tables, np.random.default_rng(11))
    writes = list(fake_torch_npu.names())
    for s in "kv":  # same bits in every page and high-precision block
        for name in cpu.pages[s]:
            assert torch.equal(cpu.pages[s][name], dev.pages[s][name]), (s, name)
        if cpu.hp is not None:
            assert torch.equal(cpu.hp[s], dev.hp[s])
    kind = cpu.kind
    want_quant = {"int_dynamic": "npu_dynamic_quant_asymmetric", "int_static": "npu_quantize"}.get(kind)
    assert "npu_scatter_pa_kv_cache" in writes
    if want_quant:
        assert want_quant in writes
    else:
        assert set(writes) == {"npu_scatter_pa_kv_cache"}  # KVarN: torch ops, then the scatter of HP tokens
    for c in fake_torch_npu.calls:
        if c.name == "npu_scatter_pa_kv_cache":
            assert c.args["cache_mode"] == "Norm" and c.tensor("slot_mapping")[0] == torch.int32
            kdt, kshape = c.tensor("key")
            assert kdt in (torch.float16, torch.int8)  # int4 codes as their bytes: int8 [..., D/2]
            if kdt == torch.int8 and kj.parse(scheme).k_bits == 4:
                assert kshape[-1] == D // 2 and c.tensor("key_cache")[1][-1] == D // 2
        if c.name == "npu_quantize":  # float32 input with its float32 scales and zero points
            assert c.tensor("input")[0] == c.tensor("scales")[0] == c.tensor("zero_points")[0] == torch.float32
    fake_torch_npu.calls.clear()
    q = torch.from_numpy(rng.standard_normal((len(LENS), HQ, D)).astype(np.float16))
    bt, sl = torch.from_numpy(tables), torch.tensor(LENS)
    out_dev, out_cpu = dev.decode(q, bt, sl), cpu.decode(q, bt, sl)
    assert torch.equal(out_dev, out_cpu)
    fia = [c for c in fake_torch_npu.calls if c.name == "npu_fused_infer_attention_score"]
    kv_dtype, mode, paged = FAKE_CASES[scheme]
    assert all(c.args["input_layout"] == "BNSD" and c.args["num_heads"] == HQ and c.args["num_key_value_heads"] == HK
               for c in fia)
    last = fia[-1]
    assert last.tensor("key")[0] == kv_dtype
    assert (last.args["block_table"] is not None) == paged
    if mode is not None:
        assert last.args["key_antiquant_mode"] == last.args["value_antiquant_mode"] == mode
        assert len(fia) == 2 and fia[0].tensor("key")[0] == dtype  # high precision, then quantized pages
        assert fia[0].args["softmax_lse_flag"] and last.args["softmax_lse_flag"]
        if mode == 0:
            assert last.tensor("key_antiquant_scale") == (dtype, (1, HK, 1, D))
            assert last.args["key_antiquant_offset"] is None  # folded out exactly, see cache.py
        else:
            assert last.tensor("key_antiquant_offset")[0] == torch.float32
    else:
        assert len(fia) == 1
    if kind == "int_static":
        fake_torch_npu.calls.clear()
        dev.dense_kv(bt, sl)
        assert "npu_anti_quant" in fake_torch_npu.names()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_constant_tokens_are_stored_exactly(fake_torch_npu, rng, scheme):
    """A token-head whose values are all equal (a zero row, a constant row) has no range: the cache stores
    it as code 0, scale 1, offset = the value, so every antiquant gives it back exactly, whatever the op's
    undocumented scale floor does with it."""
    n = 70
    k, v = random_kv(rng, n, HK, D, dtype=np.float32)
    k[5, 0], k[40, 1], v[41, 0], v[33] = 0.0, 2.75, -0.0078125, 1.5
    tables = allocate_tables(rng, [n], BS, NB)
    for backend in ("cpu", "npu"):
        _, tc = make(scheme, torch.bfloat16, backend=backend)
        pos = np.arange(n)
        tc.write(torch.from_numpy(k), torch.from_numpy(v),
                 torch.from_numpy((tables[0, pos // BS] * BS + pos % BS).astype(np.int32)),
                 seq_ids=torch.zeros(n, dtype=torch.int32), positions=torch.from_numpy(pos))
        kd, vd = tc.dense_kv(torch.from_numpy(tables), torch.tensor([n]))
        for got, want, (p, h) in ((kd, k, (5, 0)), (kd, k, (40, 1)), (vd, v, (41, 0)), (vd, v, (33, 0)),
                                  (vd, v, (33, 1))):
            assert torch.equal(got[0, h, p], torch.from_numpy(want[p, h]).bfloat16().float()), (backend, p, h)
        q = torch.from_numpy(rng.standard_normal((1, HQ, D)).astype(np.float32)).bfloat16()
        assert bool(torch.isfinite(tc.decode(q, torch.from_numpy(tables), torch.tensor([n]))).all())


# ------------------------------------------------------------------------------------------ errors
CREATE_BAD = [
    (dict(scheme="int2"), "int8/int4 only"),
    (dict(scheme="fp8"), "no fp8 KV"),
    (dict(scheme="int_k8v4"), "K and V of one dtype"),
    (dict(scheme="int8_g32"), "no channel groups"),
    (dict(scheme="fp32"), "float16/bfloat16 KV only"),
    (dict(block_size=48), "multiple of 32"),
    (dict(block_size=1024), "up to 512"),
    (dict(scheme="int4", head_dim=32), "multiple of 64"),
    (dict(dtype=torch.float32), "torch.float16 or torch.bfloat16"),
    (dict(scheme="bf16"), "must match the passthrough"),
    (dict(max_seqs=None), "max_seqs must be a positive int"),
    (dict(scheme="int8_static"), "calibration is required"),
    (dict(tail_blocks=3), "tail_blocks"),
    (dict(num_blocks=0), "num_blocks must be a positive int"),
    (dict(backend="npu"), "no NPU is usable"),
    (dict(num_kv_heads=300), "256"),
]


@pytest.mark.parametrize("change,fragment", CREATE_BAD, ids=[c[1] for c in CREATE_BAD])
def test_create_rejects(change, fragment):
    args = dict(scheme="int8", num_blocks=4, block_size=32, num_kv_heads=2, head_dim=64, max_seqs=2,
                dtype=torch.float16, backend="cpu")
    args.update(change)
    with pytest.raises(ValueError) as e:
        AscendPagedKVCache.create(args.pop("scheme"), **args)
    assert fragment in str(e.value), str(e.value)


def _wargs(**change):
    k = torch.randn(3, 2, 64)
    args = dict(k=k, v=k.clone(), slot_mapping=torch.tensor([0, 1, 33]), seq_ids=torch.tensor([0, 0, 1]),
                positions=torch.tensor([0, 1, 33]))
    args.update(change)
    return args


WRITE_BAD = [
    (_wargs(slot_mapping=torch.tensor([0, 1, 128])), "out of range"),
    (_wargs(slot_mapping=torch.tensor([0, 0, 33]), positions=torch.tensor([0, 0, 33])), "repeats a slot"),
    (_wargs(positions=torch.tensor([0, 2, 33])), "disagree"),
    (_wargs(seq_ids=None), "seq_ids is required"),
    (_wargs(seq_ids=torch.tensor([0, 0, 2])), "max_seqs=2"),
    (_wargs(k=torch.full((3, 2, 64), float("nan"))), "non-finite"),
    (_wargs(k=torch.full((3, 2, 64), 1e5)), "beyond torch.float16's range"),  # float32 data, a float16 cache
    (_wargs(v=torch.full((3, 2, 64), -1e16)), "v holds values beyond ±1.13e+15"),
    (_wargs(k=torch.randn(3, 2, 32), v=torch.randn(3, 2, 32)), "must be [tokens, 2, 64]"),
    (_wargs(slot_mapping=torch.tensor([0.0, 1.0, 33.0])), "1-D integer tensor"),
    (_wargs(positions=torch.tensor([0, 1])), "positions has 2 entries"),
    (_wargs(k=np.zeros((3, 2, 64))), "must be a torch.Tensor"),
]


@pytest.mark.parametrize("args,fragment", WRITE_BAD, ids=[w[1] for w in WRITE_BAD])
def test_write_rejects_before_touching_the_cache(args, fragment):
    c = AscendPagedKVCache.create("int8", num_blocks=4, block_size=32, num_kv_heads=2, head_dim=64, max_seqs=2,
                                  dtype=torch.float16, backend="cpu")
    with pytest.raises((ValueError, TypeError)) as e:
        c.write(args.pop("k"), args.pop("v"), args.pop("slot_mapping"), **args)
    assert fragment in str(e.value), str(e.value)
    assert not bool(c.hp["k"].any()) and not bool(c.pages["k"]["codes"].any())


DECODE_BAD = [
    (dict(q=torch.randn(2, 4, 64)), "cache's dtype"),
    (dict(q=torch.randn(2, 3, 64).half()), "multiple of num_kv_heads"),
    (dict(block_tables=torch.tensor([[0, 9], [1, 2]])), "block ids in [0, num_blocks=4)"),
    (dict(seq_lens=torch.tensor([65, 3])), "seq_lens must be in"),
    (dict(seq_ids=torch.tensor([0, 5])), "seq_ids must be in"),
    (dict(block_tables=torch.tensor([[0, 1]])), "rows for a batch of 2"),
]


@pytest.mark.parametrize("change,fragment", DECODE_BAD, ids=[d[1] for d in DECODE_BAD])
def test_decode_rejects(change, fragment):
    c = AscendPagedKVCache.create("int8", num_blocks=4, block_size=32, num_kv_heads=2, head_dim=64, max_seqs=2,
                                  dtype=torch.float16, backend="cpu")
    args = dict(q=torch.randn(2, 4, 64).half(), block_tables=torch.tensor([[0, 1], [2, 3]]),
                seq_lens=torch.tensor([40, 3]))
    args.update(change)
    with pytest.raises(ValueError) as e:
        c.decode(args.pop("q"), args.pop("block_tables"), args.pop("seq_lens"), **args)
    assert fragment in str(e.value), str(e.value)


def test_memory_bytes_count_every_page_and_block():
    c = AscendPagedKVCache.create("int8", num_blocks=4, block_size=32, num_kv_heads=2, head_dim=64, max_seqs=2,
                                  dtype=torch.bfloat16, backend="cpu")
    m = c.memory_bytes()
    per_side_pages = 4 * 32 * 2 * 64 + 2 * (4 * 2 * 32 * 4)  # int8 codes + float32 scale and offset
    assert m == {"pages": 2 * per_side_pages, "high_precision": 2 * (2 * 2 * 32 * 2 * 64 * 2), "static": 0}
