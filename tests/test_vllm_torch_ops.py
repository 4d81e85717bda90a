"""The vLLM bridge's layout and torch entry points, without vLLM: zero-copy binding of a flat uint8
buffer shaped as vLLM allocates it, in-place writes bit-identical to `kvarn_jax.write`, decode and
(chunked) prefill attention against a float64 oracle."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvarn_jax as kj
from helpers import allocate_tables, random_kv
from kvarn_vllm import torch_ops
from kvarn_vllm.layout import ALIGN, PageLayout, allocate_hp

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


def _serve(bound, oracle, seqs, tables, rng, max_chunk, host_counts=False):
    """Write sequences chunk by chunk through the bridge (in place) and the library (functional).
    host_counts: pass what vLLM's metadata gives the bridge on a GPU - the blocks each write
    completes, counted here - and no host-side index checks; every call then runs under
    `no_read_back` (nothing may wait for the device)."""
    bs = bound.layout.block_size
    done = [0] * len(seqs)
    lens = [s[0].shape[0] for s in seqs]
    while any(d < n for d, n in zip(done, lens)):
        rows = []
        for i in range(len(seqs)):
            if done[i] < lens[i]:
                step = int(rng.integers(1, max_chunk + 1)) if done[i] == 0 else int(rng.integers(1, 5))
                rows += [(i, p) for p in range(done[i], min(lens[i], done[i] + step))]
                done[i] = min(lens[i], done[i] + step)
        pad = max(16, 1 << (len(rows) - 1).bit_length()) - len(rows)  # few shapes: few compiles
        k = np.stack([seqs[i][0][p] for i, p in rows] + [seqs[0][0][0]] * pad)
        v = np.stack([seqs[i][1][p] for i, p in rows] + [seqs[0][1][0]] * pad)
        slots = np.array([tables[i, p // bs] * bs + p % bs for i, p in rows] + [-1] * pad, np.int32)
        ids = np.array([i for i, _ in rows] + [0] * pad, np.int32)
        pos = np.array([p for _, p in rows] + [0] * pad, np.int32)
        args = (bound, torch.from_numpy(k), torch.from_numpy(v), torch.from_numpy(slots), torch.from_numpy(ids),
                torch.from_numpy(pos))
        if host_counts:
            live = (slots != -1) & (pos >= bs) & (pos % bs == bs - 1)
            with no_read_back():
                torch_ops.write(*args, check_values=False, completing=int(live.sum()))
        else:
            torch_ops.write(*args)
        oracle = kj.write(oracle, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), seq_ids=jnp.asarray(ids),
                          positions=jnp.asarray(pos))
    return oracle


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


def _attention64(q, k, v, lens, q_lens, scale):
    """float64 causal GQA attention: q [R, Tq, Hq, D] (the last q_lens[r] positions of each row) over
    dense k/v [R, Hk, L, D]."""
    r, _, hq, _ = q.shape
    hk = k.shape[1]
    out = np.zeros_like(q)
    for i in range(r):
        for j in range(q_lens[i]):
            p = lens[i] - q_lens[i] + j
            for h in range(hq):
                kh = h // (hq // hk)
                s = k[i, kh, :p + 1] @ q[i, j, h] * scale
                w = np.exp(s - s.max())
                out[i, j, h] = (w / w.sum()) @ v[i, kh, :p + 1]
    return out


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


@given(layers=st.integers(1, 40), gib=st.floats(0.05, 4.0), max_seqs=st.integers(1, 64),
       scheme=st.sampled_from(["kvarn_k4v2_g128", "int8", "int4", "fp8"]))
@settings(max_examples=20)
def test_budget_sizing_fits_the_sink_and_tail(layers, gib, max_seqs, scheme):
    lay = PageLayout(scheme, block_size=128, num_kv_heads=3, head_dim=64, dtype="float32", max_seqs=max_seqs)
    budget = int(gib * 2 ** 30)
    try:
        page = lay.vllm_page_bytes_for_budget(budget, layers)
    except ValueError as e:
        assert "max_num_seqs" in str(e)
        assert layers * (lay.hp_bytes + lay.format_page_bytes) > budget
        return
    n = budget // (layers * page)  # what vLLM computes
    assert n >= 1 and page % ALIGN == 0 and page % 128 == 0
    assert lay.regions(n, hp_in_buffer=True)["__end__"] <= n * page
    assert layers * n * page <= budget
    # as many blocks as fit when each block may carry up to 128 bytes of rounding (the page is
    # block_size * C bytes) besides its share of the sink/tail
    assert (n + 1) * (lay.format_page_bytes + 128) + lay.hp_bytes > budget // layers


# ------------------------------------------------------------------------------------- binding
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
@pytest.mark.parametrize("scheme", SCHEMES)
def test_write_in_place_is_bit_identical_to_the_library(scheme, rng):
    bound, kv = _bind(scheme, rng, hp_in_buffer=scheme != "int4")
    oracle = _snapshot(bound)
    ptr = kv.data_ptr()
    lens = [70, 33, 5, 96]
    seqs = [random_kv(rng, n, 2, 32, np.float32, outliers=2) for n in lens]
    tables = allocate_tables(rng, lens, 32, 12)
    oracle = _serve(bound, oracle, seqs, tables, rng, max_chunk=40)
    assert kv.data_ptr() == ptr and all(t == j for t, j in bound.pointers().values())
    got, want = _leaves(bound.cache), _leaves(oracle)
    for key in bound.views:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{scheme}: {key}")
    c = torch_ops.counters()
    assert c["write_tokens"] >= sum(lens) and c["write_calls"] > 0


@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "int8_g16", "fp16"])
def test_gpu_path_reads_nothing_back_and_matches_the_library(scheme, rng):
    """What vLLM's impl does on a GPU: block counts and the longest row from the host metadata, no
    host-side index checks. Writes stay bit-identical to the library's and decode equals the checked
    call, with every host read-back refused (`no_read_back`)."""
    bound, _ = _bind(scheme, rng, hp_in_buffer=scheme != "int8_g16")
    lens = [70, 33, 5, 96]
    seqs = [random_kv(rng, n, 2, 32, np.float32, outliers=2) for n in lens]
    tables = allocate_tables(rng, lens, 32, 12)
    oracle = _serve(bound, _snapshot(bound), seqs, tables, rng, max_chunk=40, host_counts=True)
    got, want = _leaves(bound.cache), _leaves(oracle)
    for key in bound.views:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{scheme}: {key}")
    q = torch.from_numpy(rng.standard_normal((4, 4, 32)).astype(np.float32))
    bt, sl, sid = torch.from_numpy(tables), torch.tensor(lens), torch.arange(4)
    checked = torch_ops.decode(bound, q, bt, sl, sid).clone()
    with no_read_back():
        fast = torch_ops.decode(bound, q, bt, sl, sid, max_seq_len=max(lens), check_values=False)
    np.testing.assert_array_equal(fast.numpy(), checked.numpy())
    # the default paths do read back (so the guard can fail): the decode's longest row, the write's count
    with no_read_back(), pytest.raises(AssertionError, match="read back"):
        torch_ops.decode(bound, q, bt, sl, sid, check_values=False)
    if not kj.parse(scheme).is_passthrough:
        k1 = torch.randn(1, 2, 32)
        with no_read_back(), pytest.raises(AssertionError, match="read back"):
            torch_ops.write(bound, k1, k1, torch.tensor([5]), torch.tensor([0]), torch.tensor([5]), check_values=False)
    # a host count below the true one is refused where it can be checked
    k2 = torch.randn(1, 2, 32)  # position 95 completes sequence 3's third block
    with pytest.raises(ValueError, match="completing"):
        torch_ops.write(bound, k2, k2, torch.tensor([int(tables[3, 2]) * 32 + 31]), torch.tensor([3]),
                        torch.tensor([95]), completing=0)


def test_write_rejects_bad_input(rng):
    bound, _ = _bind("int4", rng)
    k = torch.randn(4, 2, 32)
    ok = dict(slot_mapping=torch.tensor([0, 1, 2, -1]), seq_ids=torch.tensor([0, 0, 0, 0]),
              positions=torch.tensor([0, 1, 2, 0]))
    bad = [(dict(slot_mapping=torch.tensor([0, 1, 2, 12 * 32])), "slot_mapping"),
           (dict(seq_ids=torch.tensor([0, 0, 4, 0])), "seq_ids"),
           (dict(positions=torch.tensor([0, 1, 3, 0])), "positions"),
           (dict(positions=torch.tensor([0.0, 1, 2, 0])), "positions")]
    for change, name in bad:
        with pytest.raises(ValueError, match=name):
            torch_ops.write(bound, k, k, **{**ok, **change})
    with pytest.raises(ValueError, match="key"):
        torch_ops.write(bound, torch.randn(4, 3, 32), k, **ok)
    with pytest.raises(ValueError, match="value"):
        torch_ops.write(bound, k, k.to(torch.int32), **ok)


# ------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("scheme", ["kvarn_k4v2_g32", "int4", "fp16", "int8_static"])
def test_decode_and_prefill_match_a_float64_oracle(scheme, rng):
    bound, _ = _bind(scheme, rng)
    lens = [70, 33, 5, 96]
    seqs = [random_kv(rng, n, 2, 32, np.float32, outliers=2) for n in lens]
    tables = allocate_tables(rng, lens, 32, 12)
    _serve(bound, _snapshot(bound), seqs, tables, rng, max_chunk=40)
    bt, sl = torch.from_numpy(tables), torch.tensor(lens)
    sid = torch.arange(4)
    kd, vd = (np.asarray(x, np.float64) for x in kj.gather_dense(bound.cache, jnp.asarray(tables),
                                                                  jnp.asarray(lens, jnp.int32)))
    if kj.parse(scheme).rotated:  # the oracle works in the model frame
        h = kj.hadamard_matrix(32, jnp.float32)
        kd, vd = (np.asarray(jnp.asarray(x, jnp.float32) @ h, np.float64) for x in (kd, vd))
    scale = 0.3
    # decode: one query per sequence (6 query heads over 2 kv heads)
    q = rng.standard_normal((4, 6, 32)).astype(np.float32)
    out = torch_ops.decode(bound, torch.from_numpy(q), bt, sl, sid, scale=scale)
    want = _attention64(q[:, None].astype(np.float64), kd, vd, lens, [1] * 4, scale)[:, 0]
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-4, atol=2e-4)
    # prefill: the last q_lens[r] positions of each row, back to back
    q_lens = [9, 33, 1, 40]
    qp = rng.standard_normal((4, max(q_lens), 6, 32)).astype(np.float32)
    flat = np.concatenate([qp[i, :n] for i, n in enumerate(q_lens)])
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]))
    got = torch_ops.prefill(bound, torch.from_numpy(flat), qsl, sl, bt, sid, scale=scale).numpy()
    want = _attention64(qp.astype(np.float64), kd, vd, lens, q_lens, scale)
    want = np.concatenate([want[i, :n] for i, n in enumerate(q_lens)])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # a one-token prefill row equals the decode of the same query
    one = torch_ops.prefill(bound, torch.from_numpy(q[2:3]), torch.tensor([0, 1]), sl[2:3], bt[2:3], sid[2:3],
                            scale=scale)
    np.testing.assert_allclose(one.numpy(), out.numpy()[2:3], rtol=1e-5, atol=1e-6)


def test_attention_rejects_bad_input(rng):
    bound, _ = _bind("int8_g16", rng)
    q = torch.randn(2, 4, 32)
    bt, sl, sid = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 4]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="multiple"):
        torch_ops.decode(bound, torch.randn(2, 3, 32), bt, sl, sid)
    with pytest.raises(ValueError, match="block_tables"):
        torch_ops.decode(bound, q, bt[:1], sl, sid)
    with pytest.raises(ValueError, match="query_start_loc"):
        torch_ops.prefill(bound, q, torch.tensor([0, 1, 3]), sl, bt, sid)
