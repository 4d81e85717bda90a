"""The vLLM bridge's layout and torch entry points, without vLLM: zero-copy binding of a flat uint8
buffer shaped as vLLM allocates it; steps planned as vLLM's metadata builder plans them (decode rows
first, chunked prefill rows after); in-place writes against `kvarn_jax.write`; attention against the
library's references (`paged_prefill_attention_reference` for prefill rows,
`paged_decode_attention_reference` for decode rows); outputs that do not depend on the chunking or
on the rest of the batch; nothing read back from the device on the GPU path."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvarn_jax as kj
from helpers import allocate_tables, random_kv
from kvarn_jax.attention.prefill import paged_prefill_attention_reference
from kvarn_vllm import torch_ops
from kvarn_vllm.layout import ALIGN, PageLayout, allocate_hp
from kvarn_vllm.plan import StepPlan

SCHEMES = ["kvarn_k4v2_g32", "kivi_k2v2_g32", "int4", "int8_g16", "fp8", "fp16", "int8_static"]


def _calibration(rng, heads, dim):
    lo = rng.standard_normal((heads, dim)).astype(np.float32) - 3
    return kj.Calibration(jnp.asarray(lo), jnp.asarray(lo + 6), jnp.asarray(lo), jnp.asarray(lo + 6), tokens=64)


def _vllm_tensor(layout, num_blocks, rng, hp_in_buffer=True):
    """A [num_blocks, 1, block_size, C] uint8 tensor as vLLM allocates it, filled with random bytes."""
    share = -(-layout.hp_bytes // num_blocks) if hp_in_buffer else 0
    page = layout.vllm_page_bytes(share)
    kv = torch.empty((num_blocks, 1, layout.block_size, page // layout.block_size), dtype=torch.uint8)
    kv.view(-1).copy_(torch.from_numpy(rng.integers(0, 256, num_blocks * page, dtype=np.uint8)))
    return kv


def _poison_float(t, rng):
    """Random finite values (never zeros) in a float view, so unwritten garbage cannot pass as data."""
    t.copy_(torch.from_numpy(rng.standard_normal(tuple(t.shape)).astype(np.float32) * 5 + 2).to(t.dtype))


def _bind(scheme, rng, num_blocks=12, block_size=32, heads=2, dim=32, max_seqs=4, dtype="float32",
          hp_in_buffer=True):
    lay = PageLayout(scheme, block_size=block_size, num_kv_heads=heads, head_dim=dim, dtype=dtype,
                     max_seqs=max_seqs)
    static = None
    if lay.cfg.static:
        cal = _calibration(rng, heads, dim)
        static = kj.PagedKVCache.create(scheme, num_blocks=1, block_size=block_size, num_kv_heads=heads,
                                        head_dim=dim, max_seqs=max_seqs, dtype=dtype, calibration=cal).static
    kv = _vllm_tensor(lay, num_blocks, rng, hp_in_buffer)
    hp = None if hp_in_buffer else allocate_hp(lay, "cpu")
    bound = torch_ops.bind(kv, lay, hp_buffers=hp, static=static)
    for view in bound.views.values():  # floats must be finite garbage, not NaN bit patterns
        if view.is_floating_point():
            _poison_float(view, rng)
    return bound, kv


def _snapshot(bound):
    """An independent JAX copy of the bound cache (the library's functional oracle starts from it)."""
    return jax.tree_util.tree_map(lambda a: jnp.array(np.asarray(a)), bound.cache)


def _leaves(cache):
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        out[".".join(str(getattr(p, "name", getattr(p, "key", p))) for p in path)] = np.asarray(leaf)
    return out


def _plan(bound, rows, tables, done):
    """The StepPlan vLLM's builder makes for rows [(seq, tokens)]: decode rows (one token after the
    first) first. Returns (plan, row order, positions per row)."""
    bs = bound.layout.block_size
    order = sorted(rows, key=lambda x: 0 if x[1] == 1 and done[x[0]] > 0 else 1)
    nd = sum(1 for i, n in order if n == 1 and done[i] > 0)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in order])])
    lens = np.array([done[i] + n for i, n in order])
    pos = np.concatenate([np.arange(done[i], done[i] + n) for i, n in order])
    seq = np.concatenate([[i] * n for i, n in order])
    slots = np.array([tables[i, p // bs] * bs + p % bs for i, p in zip(seq, pos)], np.int32)
    plan = StepPlan.build(block_size=bs, max_seqs=bound.layout.max_seqs, query_start_loc=qsl, seq_lens=lens,
                          seq_ids=np.array([i for i, _ in order]), block_table=torch.from_numpy(tables[[i for i, _ in order]]),
                          slot_mapping=torch.from_numpy(slots), num_decodes=nd)
    return plan, order, pos, seq


def _steps(rng, lens, max_chunk):
    """Per step, tokens per sequence: a chunked prefill of random chunks, then one token at a time,
    sequences starting and finishing at different steps."""
    done, out = [0] * len(lens), []
    while any(d < n for d, n in zip(done, lens)):
        step = []
        for i, n in enumerate(lens):
            if done[i] < n and rng.random() < 0.85:
                t = int(rng.integers(1, max_chunk + 1)) if done[i] < n // 2 else 1
                t = min(t, n - done[i])
                step.append((i, t))
                done[i] += t
        if step:
            out.append(step)
    return out


def _serve(bound, oracle, seqs, queries, tables, steps, impl="auto", gpu_like=False, attention=True, split=False):
    """Run `steps` through the bridge (write + attend, in place) and, unless oracle is None, the
    library (functional write, reference attention before it). Returns (bridge outputs, library
    outputs) per sequence ([tokens, Hq, D] each) and the oracle cache. gpu_like: as on a GPU - no
    host-side checks, and every call under `no_read_back`. attention=False: the library's writes only.
    split: `write` then `attend` (the GPU's order) instead of `forward`."""
    done = [0] * len(seqs)
    got = [[] for _ in seqs]
    want = [[] for _ in seqs]
    for step in steps:
        plan, order, pos, seq = _plan(bound, step, tables, done)
        k = np.concatenate([seqs[i][0][done[i]:done[i] + n] for i, n in order])
        v = np.concatenate([seqs[i][1][done[i]:done[i] + n] for i, n in order])
        q = np.concatenate([queries[i][done[i]:done[i] + n] for i, n in order])
        for i, n in order if oracle is not None and attention else ():  # the library's attention before the write, row by row
            c = max(4, 1 << (n - 1).bit_length())  # padded to few shapes: few compilations
            part = [np.zeros((c,) + x.shape[1:], np.float32) for x in (queries[i], seqs[i][0], seqs[i][1])]
            for x, src in zip(part, (queries[i], seqs[i][0], seqs[i][1])):
                x[:n] = src[done[i]:done[i] + n]
            o = paged_prefill_attention_reference(*(jnp.asarray(x)[None] for x in part), oracle,
                                                  jnp.asarray(tables[i:i + 1]), jnp.asarray([done[i]]), jnp.asarray([n]),
                                                  seq_ids=jnp.asarray([i]))
            want[i].append(np.asarray(o[0, :n]))
        if oracle is not None:
            oracle = kj.write(oracle, jnp.asarray(k), jnp.asarray(v), jnp.asarray(plan.slot_mapping.numpy()),
                              seq_ids=jnp.asarray(seq, jnp.int32), positions=jnp.asarray(pos, jnp.int32))
        if gpu_like:
            plan.cache["checked"] = True
        with no_read_back() if gpu_like else contextlib.nullcontext():
            if split:
                written = torch_ops.write(bound, torch.from_numpy(k), torch.from_numpy(v), plan)
                out = torch_ops.attend(bound, torch.from_numpy(q), plan, written=written, impl=impl)
            else:  # as vLLM's impl calls it (on the CPU a decode-only step runs write and attention as one)
                out = torch_ops.forward(bound, torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), plan,
                                        impl=impl)
        out = out.numpy()
        for r, (i, n) in enumerate(order):
            a = int(plan.q_start[r])
            got[i].append(out[a:a + n])
            done[i] += n
    cat = lambda parts: np.concatenate(parts) if parts else None  # noqa: E731
    return [cat(x) for x in got], [cat(x) for x in want], oracle


def _sequences(rng, lens, heads=2, q_heads=4, dim=32):
    seqs = [random_kv(rng, n, heads, dim, np.float32, outliers=2) for n in lens]
    queries = [rng.standard_normal((n, q_heads, dim)).astype(np.float32) for n in lens]
    return seqs, queries


@contextlib.contextmanager
def no_read_back():
    """Fail on anything that reads device data back to the host - torch or JAX values turned into
    Python or NumPy ones, nonzero, explicit synchronization - the calls that would make a GPU
    caller wait. On CPU they cost nothing, so this is how CI checks the bridge's GPU path keeps
    its dispatch asynchronous."""
    from jax._src.array import ArrayImpl

    def refuse(what):
        def f(*a, **k):
            raise AssertionError(f"read back from the device: {what}")
        return f

    saved = []
    for owner, names in ((torch.Tensor, ["item", "cpu", "numpy", "tolist", "nonzero", "__int__", "__bool__",
                                          "__float__", "__index__", "__array__"]),
                         (torch, ["nonzero"]), (torch.cuda, ["synchronize"]),
                         (ArrayImpl, ["__array__", "__bool__", "__int__", "__float__", "__index__", "item", "tolist",
                                      "block_until_ready"]),
                         (jax, ["block_until_ready", "device_get"])):
        for n in names:
            saved.append((owner, n, getattr(owner, n)))
            setattr(owner, n, refuse(f"{getattr(owner, '__name__', owner)}.{n}"))
    try:
        yield
    finally:
        for owner, n, f in saved:
            setattr(owner, n, f)


# ------------------------------------------------------------------------------------- layout
@pytest.mark.parametrize("scheme", SCHEMES + ["kvarn_k4v2_g128", "int2_g32"])
def test_layout_fields_match_the_cache_pytree(scheme, rng):
    bs = 128 if scheme.endswith("g128") else 32
    lay = PageLayout(scheme, block_size=bs, num_kv_heads=3, head_dim=64, dtype="bfloat16", max_seqs=5)
    cal = _calibration(rng, 3, 64) if lay.cfg.static else None
    cache = kj.PagedKVCache.create(scheme, num_blocks=7, block_size=bs, num_kv_heads=3, head_dim=64,
                                   max_seqs=5, dtype=jnp.bfloat16, calibration=cal)
    leaves = _leaves(cache)
    regions = lay.regions(7, hp_in_buffer=True)
    end = regions.pop("__end__")
    assert set(regions) == {k for k in leaves if k.startswith(("pages.", "sink.", "tail."))}
    spans = []
    for key, (off, shape, dtype) in regions.items():
        assert off % ALIGN == 0
        assert tuple(shape) == leaves[key].shape and np.dtype(dtype) == leaves[key].dtype
        spans.append((off, off + leaves[key].nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == end
    # the page is exactly the format's bytes: kvarn_jax's own accounting agrees
    assert lay.format_page_bytes == kj.bytes_per_token(scheme, 64) * bs * 3
    rep = kj.memory_report(cache)
    assert lay.hp_bytes == rep["sink_bytes"] + rep["tail_bytes"]
    assert lay.format_page_bytes * 7 == rep["page_bytes"]


# ------------------------------------------------------------------------------------- binding
def test_imports_share_the_tensors_memory_and_take_jax_dtypes(rng):
    """`torch_ops._to_jax` (every per-call import): the JAX array reads the tensor's memory (a later
    torch write shows through), a strided view comes in as its values, and a 64-bit tensor as JAX's
    32-bit type (x64 off), as `jax.dlpack.from_dlpack` gives them. (The tensor from torch's allocator:
    JAX copies memory that is not aligned to its liking, as from_dlpack does, e.g. a NumPy array's.)"""
    t = torch.empty((6, 5)).copy_(torch.from_numpy(rng.standard_normal((6, 5)).astype(np.float32)))
    x = torch_ops._to_jax(t)
    t[2, 3] = 7.0
    assert float(x[2, 3]) == 7.0
    np.testing.assert_array_equal(np.asarray(torch_ops._to_jax(t[:, 1:4])), t[:, 1:4].numpy())
    for dt in (torch.bfloat16, torch.int32, torch.int64):
        want = jax.dlpack.from_dlpack(t.to(dt).contiguous())
        got = torch_ops._to_jax(t.to(dt))
        assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want)), dt


def test_bind_is_zero_copy_and_rejects_bad_buffers(rng):
    bound, kv = _bind("kvarn_k4v2_g32", rng)
    ptrs = bound.pointers()
    assert len(ptrs) == 12 and all(t == j for t, j in ptrs.values())
    lo, hi = kv.data_ptr(), kv.data_ptr() + kv.numel()
    assert all(lo <= t < hi for t, _ in ptrs.values())
    lay = bound.layout
    flat = kv.reshape(-1)
    with pytest.raises(ValueError, match="aligned"):
        torch_ops.bind(flat[16:16 + 8 * lay.vllm_page_bytes()], lay, num_blocks=8)
    with pytest.raises(ValueError, match="needs"):
        torch_ops.bind(flat[: 3 * lay.vllm_page_bytes()], lay, num_blocks=3)
    with pytest.raises(ValueError, match="uint8"):
        torch_ops.bind(kv.view(torch.int16), lay)
    with pytest.raises(ValueError, match="contiguous"):
        torch_ops.bind(kv[::2], lay)
    with pytest.raises(ValueError, match="hp_buffers"):
        torch_ops.bind(kv, lay, hp_buffers={})


# ------------------------------------------------------------------------------------- write
@pytest.mark.parametrize("scheme, split", [(s, False) for s in SCHEMES] + [("kvarn_k4v2_g32", True), ("fp16", True)])
def test_writes_and_attention_match_the_library(scheme, split, rng):
    """Chunked prefills (chunks of up to 40 tokens, some starting inside a block) and decodes, several
    sequences per step. The cache: pages, sink and tail bit-identical to `kvarn_jax.write`'s for the
    schemes that store tokens as given; for rotated (KVarN) ones the stored rows come from torch's
    rotation, which may round the last fp32 bit differently from XLA's (so a code may flip at a
    near-tie). Every row's attention: against `paged_prefill_attention_reference` on the library's
    own cache (decode rows are one-token rows of it)."""
    bound, kv = _bind(scheme, rng, hp_in_buffer=scheme != "int4")
    oracle = _snapshot(bound)
    ptr = kv.data_ptr()
    lens = [70, 33, 5, 96]
    seqs, queries = _sequences(rng, lens)
    tables = allocate_tables(rng, lens, 32, 12)
    got, want, oracle = _serve(bound, oracle, seqs, queries, tables, _steps(rng, lens, 40), split=split)
    assert kv.data_ptr() == ptr and all(t == j for t, j in bound.pointers().values())
    leaves, lib = _leaves(bound.cache), _leaves(oracle)
    for key in bound.views:
        if not kj.parse(scheme).rotated:
            np.testing.assert_array_equal(leaves[key], lib[key], err_msg=f"{scheme}: {key}")
        elif leaves[key].dtype.kind == "f" and not key.startswith("pages"):
            np.testing.assert_allclose(leaves[key], lib[key], rtol=1e-6, atol=1e-5, err_msg=key)  # |k| up to ~30
        elif leaves[key].dtype.kind == "f":  # fp32 scales of an fp32 cache: from rows a last bit apart
            np.testing.assert_allclose(leaves[key], lib[key], rtol=1e-4, atol=1e-6, err_msg=key)
        else:
            assert np.mean(leaves[key] != lib[key]) < 1e-3, key
    for i in range(len(lens)):
        np.testing.assert_allclose(got[i], want[i], rtol=2e-4, atol=2e-4, err_msg=f"{scheme} sequence {i}")
    c = torch_ops.counters()
    assert c["write_tokens"] >= sum(lens) and c["write_calls"] > 0 and c["decode_rows"] > 0


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "int8_g16", "fp16"])
def test_prefill_rows_off_the_cpu_op_match_the_library(scheme, rng, monkeypatch):
    """Prefill rows as GPUs run them (`_prefill_rows`: SDPA calls, lower-right causal per own block;
    the CPU's quantized caches take vLLM's op instead, turned off here): chunks starting inside a
    block, spanning several, completing some, one token long; against the library's reference."""
    monkeypatch.setattr(torch_ops, "_prefill_by_rule_op", lambda bound: False)
    bound, _ = _bind(scheme, rng)
    lens = [100, 45, 70]
    seqs, queries = _sequences(rng, lens)
    tables = allocate_tables(rng, lens, 32, 12)
    steps = [[(0, 17), (1, 45)], [(0, 50), (2, 1)], [(0, 33), (2, 69)]]
    got, want, _ = _serve(bound, _snapshot(bound), seqs, queries, tables, steps, impl="reference")
    for i in range(len(lens)):
        np.testing.assert_allclose(got[i], want[i], rtol=2e-4, atol=2e-4, err_msg=f"{scheme} sequence {i}")


@pytest.mark.parametrize("scheme, dtype, model_dtype, impl", [("kvarn_k4v2_g32", "float16", np.float16, "auto"),
                                                             ("kvarn_k4v2_g32", "float16", np.float16, "reference"),
                                                             ("int4", "bfloat16", np.float32, "auto"),
                                                             ("fp16", "float32", np.float32, "auto")])
def test_bad_values_are_stored_by_the_librarys_rule_and_counted(scheme, dtype, model_dtype, impl, rng):
    """NaN/Inf tokens and values beyond the cache's range, in a prefill (blocks completed and
    quantized) and in decode steps (on the CPU: the fused write + attention; impl "reference": the
    GPUs' fused step on the library's decode, `_decode_step_library`): the cache holds what
    the library's write stores (`kvarn_jax.storage`: such a token as zeros, values saturated; a NaN
    never spreads to its tile), `altered_tokens` counts what the library counts, outputs stay finite."""
    bound, _ = _bind(scheme, rng, dtype=dtype)
    oracle = _snapshot(bound)
    k, v = (x.astype(model_dtype) for x in random_kv(rng, 70, 2, 32, np.float32))
    k[3, 1, 5], v[40, 0, 0], k[66, 0, 2] = np.nan, np.inf, -np.inf     # the sink, a quantized block, a decode
    big = 6e4 if model_dtype == np.float16 else 1e6  # fp16 input: its rotation exceeds fp16's range
    k[50, 0] = big                                                       # beyond an fp16 cache's range
    if model_dtype == np.float32 and scheme != "fp16":
        v[68, 1, 3] = 1e20                                               # beyond QUANT_MAX (2^50)
    queries = rng.standard_normal((70, 4, 32)).astype(model_dtype)
    tables = allocate_tables(rng, [70], 32, 12)
    torch_ops.reset_counters()
    done, outs = [0], []
    write = jax.jit(kj.cache.paged.write_reference)
    for n in (66, 1, 1, 1, 1):
        plan, _, pos, seq = _plan(bound, [(0, n)], tables, done)
        sl = slice(done[0], done[0] + n)
        oracle = write(oracle, jnp.asarray(k[sl]), jnp.asarray(v[sl]), jnp.asarray(plan.slot_mapping.numpy()),
                       jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32))
        with torch.inference_mode():  # as vLLM runs its model
            outs.append(torch_ops.forward(bound, torch.from_numpy(queries[sl]), torch.from_numpy(k[sl]),
                                          torch.from_numpy(v[sl]), plan, impl=impl).float().numpy())
        done[0] += n
    leaves, lib = _leaves(bound.cache), _leaves(oracle)
    for key in bound.views:
        if kj.parse(scheme).rotated and leaves[key].dtype.kind == "f":  # fp16: torch's rotation vs XLA's
            np.testing.assert_allclose(leaves[key].astype(np.float32), lib[key].astype(np.float32), rtol=2e-3,
                                       atol=2e-3, err_msg=key)
        elif kj.parse(scheme).rotated:
            assert np.mean(leaves[key] != lib[key]) < 1e-2, key
        else:
            np.testing.assert_array_equal(leaves[key], lib[key], err_msg=key)
        assert np.all(np.isfinite(leaves[key].astype(np.float32))), key
    got = torch_ops.altered_tokens()
    assert sum(got.values()) == int(oracle.dropped_tokens), got  # the library counts all three kinds
    assert got["nonfinite_tokens"] == 3 and got["saturated_tokens"] == 1, got  # 6e4 rotated, 1e6 in fp16, 1e20
    assert all(np.all(np.isfinite(o)) for o in outs)
    torch_ops.reset_counters()  # outside inference mode, as a caller between engine runs
    assert sum(torch_ops.altered_tokens().values()) == 0


def test_a_decode_step_without_completed_blocks_runs_no_jax(rng, monkeypatch):
    """Most decode steps complete no block: the write is torch alone (JAX - the storage rule, the
    quantizer - runs only for prefill rows and completed blocks)."""
    bound, _ = _bind("kvarn_k4v2_g32", rng)
    tables = allocate_tables(rng, [40, 20], 32, 12)
    seqs, queries = _sequences(rng, [40, 20])
    _serve(bound, _snapshot(bound), seqs, queries, tables, [[(0, 38), (1, 20)]])
    calls = []
    monkeypatch.setattr(torch_ops, "_write_step", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(
        AssertionError("quantized without a completed block")))
    plan, _, _, _ = _plan(bound, [(0, 1)], tables, [38, 20])  # position 38: block 1 not full
    k = torch.randn(1, 2, 32)
    torch_ops.write(bound, k, k, plan)
    assert not calls and plan.completing == 0
    plan, _, _, _ = _plan(bound, [(0, 26)], tables, [38, 20])  # positions 38..63: completes block 1
    with pytest.raises(AssertionError, match="quantized"):
        torch_ops.write(bound, torch.randn(26, 2, 32), torch.randn(26, 2, 32), plan)
    assert plan.completing == 1


# ------------------------------------------------------------------------------------- attention
def _fused_and_split(scheme, fused_impl, split_impl, decodes):
    """The same prefill and `decodes` one-token steps of three sequences (blocks complete at the
    fourth), through `forward` with fused_impl and through `write` then `attend` with split_impl:
    ([caches' leaves], [outputs per sequence]) for the two."""
    lens = [70, 33, 64]
    caches, outs = [], []
    for split, impl in ((False, fused_impl), (True, split_impl)):
        rng = np.random.default_rng(7)
        bound, _ = _bind(scheme, rng)
        seqs, queries = _sequences(rng, lens)
        tables = allocate_tables(rng, lens, 32, 12)
        steps = [[(0, 60), (1, 20), (2, 40)]] + [[(0, 1), (1, 1), (2, 1)]] * decodes  # 63 -> 64: blocks complete
        got, _, _ = _serve(bound, None, seqs, queries, tables, steps, impl=impl, split=split)
        caches.append(_leaves(bound.cache))
        outs.append(got)
    return caches, outs


def _assert_same_cache(scheme, caches):
    for key in caches[0]:
        if key.startswith(("pages", "sink", "tail")):
            if key.startswith("pages") or not kj.parse(scheme).rotated:
                np.testing.assert_array_equal(caches[0][key], caches[1][key], err_msg=key)
            else:  # XLA's rotation (fused) and torch's (split) may round the last fp32 bit differently
                np.testing.assert_allclose(caches[0][key], caches[1][key], rtol=1e-6, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "fp16"])
def test_the_fused_decode_step_equals_write_then_attend(scheme):
    """On the CPU a decode-only step runs write and attention in one XLA computation; the split path
    with the library's decode (impl="reference") leaves the same cache and gives the same rows -
    decode steps that complete blocks included."""
    caches, outs = _fused_and_split(scheme, "auto", "reference", 10)
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    _assert_same_cache(scheme, caches)


def test_kvarn_decode_rows_run_the_cpu_kernel_where_asked(monkeypatch):
    """On the CPU, impl "auto" and "native" attend KVarN decode rows with the C++ kernel (counted:
    `decode_native_calls`), inside the fused step and after a split write alike; "reference" runs
    the library's reference; "native" for a scheme the kernel does not take is an error naming it.
    (The outputs: `test_the_fused_decode_step_equals_write_then_attend` against the reference.)"""
    from kvarn_jax.attention import paged_decode_cpu

    if paged_decode_cpu.available() is not None:
        pytest.skip(f"the CPU kernel cannot be built here: {paged_decode_cpu.available()}")
    for impl, ran in (("auto", True), ("native", True), ("reference", False)):
        torch_ops.reset_counters()
        _fused_and_split("kvarn_k4v2_g32", impl, impl, 2)  # 2 decode steps fused, then 2 after split writes
        calls = torch_ops.counters()["decode_native_calls"]
        assert calls == (4 if ran else 0), (impl, calls)
    rng = np.random.default_rng(0)
    bound, _ = _bind("int8_g16", rng)
    lens = [40]
    seqs, queries = _sequences(rng, lens)
    tables = allocate_tables(rng, lens, 32, 12)
    with pytest.raises(ValueError, match="impl='native' cannot run layer scheme int8_g16"):
        _serve(bound, None, seqs, queries, tables, [[(0, 39)], [(0, 1)]], impl="native")


@pytest.mark.parametrize("scheme, impl", [("kvarn_k4v2_g32", "reference"), ("kvarn_k4v2_g32", "pallas"),
                                          ("fp16", "reference")])
def test_the_library_decode_step_equals_write_then_attend(scheme, impl, monkeypatch):
    """Where decode rows run the library's decode (GPUs; here impl "reference", or the GPU kernel
    interpreted), a decode-only step is one JAX call (`_decode_step_library`: the rows as stored,
    and attention over the cached tokens plus each row's new one): the same outputs and cache as
    `write` then `attend`, the step that completes blocks included (its blocks come back from the
    call and are quantized by the write's own executable: the same page bits)."""
    fused = []
    real = torch_ops._decode_step_library
    monkeypatch.setattr(torch_ops, "_decode_step_library", lambda *a, **k: fused.append(a[4].completing) or real(*a, **k))
    caches, outs = _fused_and_split(scheme, impl, impl, 6)
    assert len(fused) == 6 and fused[3] > 0  # every decode step fused; the fourth completes blocks
    # the kernel reads a cached token through fp16 products, the merged new one in fp32 (its tolerance
    # against the reference, test_paged_decode_kernel)
    tol = 4e-3 if impl == "pallas" else 1e-5
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())
    _assert_same_cache(scheme, caches)


def test_outputs_do_not_depend_on_the_chunking_or_the_batch(rng):
    """The same sequence prefilled in other chunks, next to other sequences or alone: its outputs
    agree to float rounding (a block read quantized instead of exact would move them by ~1e-2), and
    its decode rows are the same bits whatever else is in the batch."""
    lens = [100, 60, 90]
    seqs, queries = _sequences(rng, lens)
    tables = allocate_tables(rng, lens, 32, 12)
    outs = []
    for steps in ([[(0, 100)]],
                  [[(0, 17), (1, 30)], [(0, 50), (1, 30), (2, 40)], [(0, 33), (2, 50)]],
                  [[(0, 64), (2, 1)], [(0, 1), (2, 20)]] + [[(0, 1)]] * 35):
        bound, _ = _bind("kvarn_k4v2_g32", rng)
        got, _, _ = _serve(bound, None, seqs, queries, tables, steps)
        outs.append(got[0])
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-5, atol=1e-5)
    # decode rows: sequence 0's positions 64.. one at a time, alone or beside two other decodes
    dec = []
    for others in ([], [1, 2]):
        bound, _ = _bind("kvarn_k4v2_g32", rng)
        steps = [[(0, 64)] + [(j, lens[j] - 20) for j in others]] + [[(0, 1)] + [(j, 1) for j in others]] * 20
        got, _, _ = _serve(bound, None, seqs, queries, tables, steps)
        dec.append(got[0][64:])
    np.testing.assert_array_equal(dec[0], dec[1])


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "fp16"])
def test_gpu_path_reads_nothing_back(scheme, rng):
    """As on a GPU: no host-side index checks, and every read of device data back to the host refused
    (`no_read_back`) - writes and attention stay asynchronous; outputs as on the checked path."""
    lens = [70, 33, 5, 96]
    seqs, queries = _sequences(rng, lens)
    tables = allocate_tables(rng, lens, 32, 12)
    steps = _steps(rng, lens, 40)
    for split in (True, False):  # write + attend; forward (decode-only steps: `_decode_step_library`)
        bound, _ = _bind(scheme, np.random.default_rng(3), hp_in_buffer=scheme == "fp16")
        got, want, _ = _serve(bound, _snapshot(bound), seqs, queries, tables, steps, impl="reference", gpu_like=True,
                              split=split)
        for i in range(len(lens)):
            np.testing.assert_allclose(got[i], want[i], rtol=2e-4, atol=2e-4)
    with no_read_back(), pytest.raises(AssertionError, match="read back"):  # the guard can fail
        torch.tensor([1]).item()


def test_bad_input_is_refused_by_name(rng):
    bound, _ = _bind("int4", rng)
    tables = allocate_tables(rng, [40], 32, 12)
    plan, _, _, _ = _plan(bound, [(0, 4)], tables, [0])
    k = torch.randn(4, 2, 32)
    with pytest.raises(ValueError, match="key"):
        torch_ops.write(bound, torch.randn(4, 3, 32), k, plan)
    with pytest.raises(ValueError, match="value"):
        torch_ops.write(bound, k, k[:3], plan)
    with pytest.raises(ValueError, match="prefill rows need"):
        torch_ops.attend(bound, torch.randn(4, 4, 32), plan)
    written = torch_ops.write(bound, k, k, plan)
    with pytest.raises(ValueError, match="multiple"):
        torch_ops.attend(bound, torch.randn(4, 3, 32), plan, written=written)
    with pytest.raises(ValueError, match="impl"):
        torch_ops.attend(bound, torch.randn(4, 4, 32), plan, written=written, impl="triton")
    with pytest.raises(ValueError, match="out"):
        torch_ops.attend(bound, torch.randn(4, 4, 32), plan, written=written, out=torch.empty(3, 4, 32))
    other, _ = _bind("int4", rng, block_size=64)
    with pytest.raises(ValueError, match="block_size"):
        torch_ops.write(other, k, k, plan)
    bad = StepPlan.build(block_size=32, max_seqs=4, query_start_loc=[0, 4], seq_lens=[4], seq_ids=[0],
                         block_table=torch.tensor([[99]], dtype=torch.int32), slot_mapping=torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="block_table"):
        torch_ops.write(bound, k, k, bad)
    bad = StepPlan.build(block_size=32, max_seqs=4, query_start_loc=[0, 4], seq_lens=[4], seq_ids=[0],
                         block_table=torch.tensor([[3]], dtype=torch.int32), slot_mapping=torch.tensor([96, 97, 98, 100]))
    with pytest.raises(ValueError, match="positions and slot_mapping"):
        torch_ops.write(bound, k, k, bad)
    ok = dict(block_size=32, max_seqs=4, query_start_loc=[0, 4], seq_lens=[4], seq_ids=[0],
              block_table=torch.zeros(1, 2, dtype=torch.int32), slot_mapping=torch.arange(4))
    for change, match in ((dict(query_start_loc=[0, 5]), "query_start_loc"), (dict(seq_ids=[4]), "seq_ids"),
                          (dict(seq_ids=[0, 1]), "seq_ids"), (dict(block_table=torch.zeros(2)), "block_table"),
                          (dict(slot_mapping=torch.arange(3)), "slot_mapping"), (dict(seq_lens=[65]), "capacity"),
                          (dict(num_decodes=1), "num_decodes")):
        with pytest.raises(ValueError, match=match):
            StepPlan.build(**{**ok, **change})


@pytest.mark.parametrize("scheme, hp_in_buffer", [("kvarn_k4v2_g32", True), ("int4", False), ("fp16", True)])
def test_the_write_targets_are_one_row_view(scheme, hp_in_buffer, rng):
    """The regions a write stores rows into (sink and tail, or the passthrough pages) lie back to
    back, inside vLLM's buffer or in `allocate_hp`'s one allocation: one [rows, D] view covers them."""
    bound, kv = _bind(scheme, rng, hp_in_buffer=hp_in_buffer)
    keys = ["pages.k.values", "pages.v.values"] if kj.parse(scheme).is_passthrough else ["sink.k", "sink.v", "tail.k",
                                                                                          "tail.v"]
    first, last = bound.views[keys[0]], bound.views[keys[-1]]
    assert bound.rows.data_ptr() == first.data_ptr() and bound.rows.shape[1] == 32
    assert bound.rows.numel() * bound.rows.element_size() == (last.data_ptr() + last.numel() * last.element_size()
                                                               - first.data_ptr())


# ------------------------------------------------------------------------------------- failing requests
@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "fp16"])
def test_altered_tokens_are_counted_per_sequence_and_never_reach_the_neighbours(scheme, rng):
    """A NaN key in one sequence's prefill chunk and an Inf value in another's decode step: the
    per-slot counts name exactly those sequences (and are handed out once), and every other row's
    output is the same bits as in the same steps without them."""
    lens = [73, 49, 90]
    seqs, queries = _sequences(rng, lens)
    tables = allocate_tables(rng, lens, 32, 12)
    steps = [[(0, 40), (1, 45), (2, 64)], [(0, 30), (1, 1), (2, 26)]] + [[(0, 1), (1, 1)]] * 3
    poisoned = [(k.copy(), v.copy()) for k, v in seqs]
    poisoned[1][0][20, 1, 3] = np.nan          # sequence 1, its prefill
    poisoned[0][1][70, 0, 0] = np.inf          # sequence 0, its first decode step
    outs, slots = [], []
    for data in (seqs, poisoned):
        bound, _ = _bind(scheme, rng)
        torch_ops.reset_counters()
        got, _, _ = _serve(bound, None, data, queries, tables, steps)
        outs.append(got)
        slots.append(torch_ops.take_altered_slots("cpu", bound.layout.max_seqs))
        assert not torch_ops.take_altered_slots("cpu", bound.layout.max_seqs).any()  # handed out once
    assert not slots[0].any()
    assert slots[1][1, 0] == 1 and slots[1][0, 0] == 1 and slots[1][2:].sum() == 0, slots[1]
    assert torch_ops.altered_tokens()["nonfinite_tokens"] == 2  # the totals keep what was handed out
    np.testing.assert_array_equal(outs[1][2], outs[0][2])          # never touched either
    np.testing.assert_array_equal(outs[1][0][:70], outs[0][0][:70])  # sequence 0 before its Inf
    np.testing.assert_array_equal(outs[1][1][:20], outs[0][1][:20])  # sequence 1 before its NaN token
    assert all(np.all(np.isfinite(o)) for o in outs[1])


def test_failed_requests_lose_their_token_and_are_named_in_the_output():
    """The worker side of failing a request (`failures`): the slots' counts map to request ids, the
    step's output drops their sampled token and names them, and vLLM's shared outputs stay untouched."""
    pytest.importorskip("vllm")
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    from kvarn_vllm import failures
    from kvarn_vllm.metadata import _StepRows

    class Batch:  # the runner's batch: row r is high-precision slot r
        req_ids = ["a", None, "b", "c"]

    table = _StepRows(type("Runner", (), {"input_batch": Batch})())
    assert table.slot_of == {"a": 0, "b": 2, "c": 3}
    counts = np.zeros((4, 3), np.int64)
    counts[2] = (1, 0, 32)
    failed = failures.failed_requests(table.slot_of, counts)
    assert list(failed) == ["b"] and "1 token(s) with NaN/Inf" in failed["b"] and "32 token(s)" in failed["b"]
    out = ModelRunnerOutput(req_ids=["a", "b", "c"], req_id_to_index={"a": 0, "b": 1, "c": 2},
                            sampled_token_ids=[[5], [6], [7]])
    marked = failures.mark(out, failed)
    assert marked.sampled_token_ids == [[5], [], [7]] and getattr(marked, failures.FAILED) == failed
    assert out.sampled_token_ids == [[5], [6], [7]] and not hasattr(out, failures.FAILED)
    assert failures.mark(EMPTY_MODEL_RUNNER_OUTPUT, failed) is not EMPTY_MODEL_RUNNER_OUTPUT
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, failures.FAILED)

    class Runner:  # the model runner's output methods, wrapped by `watch`
        def sample_tokens(self, grammar):
            return out

        def execute_model(self, scheduler_output):
            return None

    runner = Runner()
    torch_ops.reset_counters()
    failures.watch(runner, table, "cpu", 4)
    failures.watch(runner, table, "cpu", 4)  # once
    assert runner.execute_model(None) is None
    assert runner.sample_tokens(None) is out  # nothing altered
    torch_ops._altered(torch.device("cpu"), 4)[3, 1] += 2
    got = runner.sample_tokens(None)
    assert got.sampled_token_ids == [[5], [6], []] and list(getattr(got, failures.FAILED)) == ["c"]
    assert runner.sample_tokens(None) is out  # reported once


def test_saturated_block_metadata_is_counted_for_its_sequence_on_every_write_path(rng, monkeypatch):
    """A completed block whose KVarN metadata saturated counts block_size tokens for its own sequence,
    whether a decode-only step completed it (the fused step's quantizer) or a prefill did (`write`):
    every block is made to look saturated, and the per-slot counts must name exactly the two
    sequences' page blocks (a sink block is no page and counts nothing)."""
    monkeypatch.setattr(torch_ops, "saturated_blocks",
                        lambda cache, fields: jnp.ones(next(iter(fields["k"].values())).shape[0], bool))
    torch_ops._completed_fields.clear_cache()  # traced again with the patched check (and after the test)
    fused = []
    step_served = torch_ops._decode_step_served
    monkeypatch.setattr(torch_ops, "_decode_step_served",
                        lambda bound, q, k, v, plan, *a, **kw: fused.append(plan.completing) or step_served(
                            bound, q, k, v, plan, *a, **kw))
    lens = [70, 70, 70]
    seqs, queries = _sequences(rng, lens)
    tables = allocate_tables(rng, lens, 32, 12)
    # seq 0 fills block 1 (positions 32..63) in a decode-only step, seq 1 in a prefill chunk; seq 2
    # only fills its sink block (block 0)
    steps = [[(0, 63), (1, 20), (2, 10)], [(0, 1), (1, 1), (2, 1)], [(1, 43), (2, 30)]]
    bound, _ = _bind("kvarn_k4v2_g32", rng)
    torch_ops.reset_counters()
    try:
        _serve(bound, None, seqs, queries, tables, steps)
        slots = torch_ops.take_altered_slots("cpu", bound.layout.max_seqs)
    finally:
        torch_ops._completed_fields.clear_cache()
    assert 1 in fused  # the decode-only step that completed seq 0's block 1 ran fused
    np.testing.assert_array_equal(slots[:, 2], [32, 32, 0, 0])
    assert not slots[:, :2].any()
