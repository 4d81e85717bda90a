"""The C++ CPU decode kernel (`attention/paged_decode_cpu`, impl="native") against the reference.

Both compute in fp32 from the same stored fields; only the order of the sums differs. Required:
|native - reference| <= 2e-5 * max|reference| elementwise on fp32 outputs (measured ~1e-6), and for
16-bit outputs one ulp of that dtype on top. Every output element is compared, on fresh random
caches and queries each example, so an element the kernel failed to write (left as XLA's buffer held
it) does not pass; unread pages and rows are poisoned with NaN.
"""

import ctypes
import dataclasses
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvarn_jax as kj
from test_paged_decode_kernel import build  # a cache filled as a serving loop fills it
from kvarn_jax.attention import paged_decode_cpu, reference
from kvarn_jax.attention.paged_decode import decode_impl
from kvarn_jax.attention.paged_decode_cpu import build as native_build
from kvarn_jax.impl import resolve_impl

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is the CPU backend's")


def compare(q, cache, bt, sl, **kw):
    ref = kj.paged_decode_attention(q, cache, bt, sl, impl="reference", **kw)
    out = kj.paged_decode_attention(q, cache, bt, sl, impl="native", **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ref, out = np.asarray(ref, np.float32), np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    tol = 2e-5 + (float(jnp.finfo(q.dtype).eps) if q.dtype != jnp.float32 else 0.0)
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol * max(np.abs(ref).max(), 1e-6))
    return out


@settings(max_examples=15, deadline=None)
@given(bits=st.sampled_from([(4, 2), (4, 4), (2, 4), (2, 2), (8, 8), (8, 2)]), group=st.sampled_from([32, 64, 128]),
       suffix=st.sampled_from(["", "", "_hpint8", "_hpfp32", "_sink4", "_clip"]),
       dtype=st.sampled_from([jnp.float16, jnp.bfloat16, jnp.float32]), dim=st.sampled_from([64, 128, 32]),
       heads=st.sampled_from([1, 2]), ratio=st.sampled_from([1, 3, 4]), block_mult=st.sampled_from([1, 2]),
       lens=st.lists(st.integers(0, 400), min_size=1, max_size=3), window=st.sampled_from([None, None, 45]),
       seed=st.integers(0, 2 ** 16))
def test_native_matches_reference(bits, group, suffix, dtype, dim, heads, ratio, block_mult, lens, window, seed):
    """Every KVarN geometry the kernel takes (compile-time sizes, and the generic path: head_dim 32),
    every metadata dtype, int8 / fp32 / short sinks, windows, empty rows."""
    rng = np.random.default_rng(seed)
    cfg = f"kvarn_k{bits[0]}v{bits[1]}_g{group}{suffix}"
    cache, bt, sl = build(cfg, lens, heads, dim, group * block_mult, rng, dtype=dtype)[:3]
    q = jnp.asarray(rng.standard_normal((len(lens), heads * ratio, dim)), dtype)
    compare(q, cache, bt, sl, window=window)
    compare(q, cache, bt, sl, rotated_output=True)


@pytest.mark.parametrize("dim,ratio", [(256, 2), (64, 9), (128, 16)])
def test_wide_heads_and_large_groups(dim, ratio):
    """head_dim 256 (the widest compiled row), and GQA groups beyond the 8 query heads the staged
    products hold (plain dots there)."""
    rng = np.random.default_rng(dim + ratio)
    cache, bt, sl = build("kvarn_k4v2_g64", [70, 200], 1, dim, 64, rng)[:3]
    compare(jnp.asarray(rng.standard_normal((2, ratio, dim)), jnp.float32), cache, bt, sl)


def test_new_token_seq_ids_and_two_ring_blocks():
    """new_kv (a token not cached yet), sequence slots other than the row index, a two-block ring."""
    rng = np.random.default_rng(7)
    lens = [1, 127, 128, 300]
    cache, bt, sl = build("kvarn_k4v2_g64", lens, 2, 64, 64, rng, max_seqs=6, seq_ids=[5, 0, 3, 1],
                         tail_blocks=2)[:3]
    sid = jnp.asarray([5, 0, 3, 1], jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.float32)
    compare(q, cache, bt, sl, seq_ids=sid)
    kv = tuple(jnp.asarray(rng.standard_normal((4, 2, 64)), jnp.float32) for _ in range(2))
    compare(q, cache, bt, sl, seq_ids=sid, new_kv=kv)


def test_a_new_token_gives_the_bits_of_writing_it_first():
    """new_kv is attended as one more high-precision row, in the order a written token is: the output
    is bit-equal to writing the token (`kj.write`) and decoding with one more position - for a new
    token in the sink, in the ring, completing a block and opening one. The vLLM bridge relies on it:
    its fused decode step passes the token, a mixed step writes it first, and a request's tokens must
    not depend on which one ran."""
    rng = np.random.default_rng(11)
    lens = [1, 127, 128, 200, 300]
    cache, bt, sl, _ = build("kvarn_k4v2_g64", lens, 2, 64, 64, rng, dtype=jnp.bfloat16)
    bt = np.asarray(bt).copy()
    used = {int(bt[i, j]) for i, n in enumerate(lens) for j in range(-(-n // 64))}
    bt[2, 2] = min(set(range(cache.num_blocks)) - used)  # position 128 opens block 2: a free page for it
    k, v = (jnp.asarray(rng.standard_normal((len(lens), 2, 64)), jnp.float32) for _ in range(2))
    pos = np.asarray(lens)
    slots = jnp.asarray([int(bt[i, p // 64]) * 64 + p % 64 for i, p in enumerate(pos)], jnp.int32)
    written = kj.write(cache, k, v, slots, seq_ids=jnp.arange(len(lens), dtype=jnp.int32),
                       positions=jnp.asarray(pos, jnp.int32))
    # the rows as the cache stores them (rotated, rounded), read back from where the write put them
    rows = tuple(jnp.where((pos < 64)[:, None, None], written.sink[x][jnp.arange(len(lens)), :, pos % 64],
                           written.tail[x][jnp.arange(len(lens)), :, pos % written.tail_len]) for x in ("k", "v"))
    q = jnp.asarray(rng.standard_normal((len(lens), 8, 64)), jnp.float32)
    bt = jnp.asarray(bt)
    passed = kj.paged_decode_attention(q, cache, bt, sl, impl="native", new_kv=rows, rotated_output=True)
    after = kj.paged_decode_attention(q, written, bt, sl + 1, impl="native", rotated_output=True)
    np.testing.assert_array_equal(np.asarray(passed), np.asarray(after))


def test_the_bridges_row_inputs_read_the_same_rows():
    """hp_rows ([S, 4, Hk, bs, D]: each row's sink and one-block ring side by side) and hp_units (the
    same rows as scattered units of a buffer and their indices, as vLLM's blocks hold them) give the
    bits of the cache's own sink and tail, with and without a new token."""
    rng = np.random.default_rng(5)
    lens = [3, 64, 100, 250]
    bs, hk, d = 64, 2, 64
    cache, bt, sl, _ = build("kvarn_k4v2_g64", lens, hk, d, bs, rng, dtype=jnp.bfloat16, tail_blocks=2)
    b = len(lens)
    own = (np.asarray(sl) - 1) // bs
    ring = [cache.tail[x].reshape(b, hk, 2, bs, d)[np.arange(b), :, own % 2] for x in ("k", "v")]
    rows = jnp.stack([cache.sink["k"], cache.sink["v"], ring[0], ring[1]], 1)           # [B, 4, Hk, bs, D]
    ru = 4                                                                              # 4 units of 16 a row
    flat = np.asarray(rows.astype(jnp.float32)).reshape(-1, d // ru)
    perm = rng.permutation(flat.shape[0] + 7)                                           # buffer unit of each
    buf = np.asarray(rng.standard_normal((flat.shape[0] + 7, d // ru)), np.float32)
    buf[perm[:flat.shape[0]]] = flat
    units = (jnp.asarray(buf, jnp.bfloat16), jnp.asarray(perm[:flat.shape[0]].reshape(b, -1), jnp.int32))
    q = jnp.asarray(rng.standard_normal((b, hk * 3, d)), jnp.float32)
    new = tuple(jnp.asarray(rng.standard_normal((b, hk, d)), jnp.float32) for _ in range(2))
    for kv, lengths in ((None, sl), (new, sl - 1)):
        want = paged_decode_cpu.paged_decode_cpu(q, cache, bt, lengths, None, scale=0.125, window=None, new_kv=kv)
        for extra in ({"hp_rows": rows}, {"hp_units": units}):
            got = paged_decode_cpu.paged_decode_cpu(q, cache, bt, lengths, None, scale=0.125, window=None, new_kv=kv,
                                                    **extra)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(list(extra)))
    with pytest.raises(ValueError, match="hp_units"):
        paged_decode_cpu.paged_decode_cpu(q, cache, bt, sl, None, scale=0.125, window=None,
                                          hp_units=(units[0], units[1][:, :-1]))


def test_vmap_runs_one_call_per_element():
    rng = np.random.default_rng(13)
    cache, bt, sl = build("kvarn_k4v4_g64", [90, 200], 1, 64, 64, rng)[:3]
    qs = jnp.asarray(rng.standard_normal((3, 2, 4, 64)), jnp.float32)
    f = lambda q: kj.paged_decode_attention(q, cache, bt, sl, impl="native", check_values=False)  # noqa: E731
    got = np.asarray(jax.vmap(f)(qs))
    for i in range(3):
        np.testing.assert_array_equal(got[i], np.asarray(f(qs[i])))


def test_unread_pages_may_hold_anything():
    """Pages, sink rows and ring rows that no position reads are not read: NaN there changes nothing."""
    rng = np.random.default_rng(11)
    lens = [300, 90]
    cache, bt, sl = build("kvarn_k4v2_g128", lens, 2, 64, 128, rng)[:3]
    q = jnp.asarray(rng.standard_normal((2, 6, 64)), jnp.float32)
    want = compare(q, cache, bt, sl)
    used = {int(bt[0, 1])}   # row 0's only page (block 0 is its sink, block 2 its ring's); row 1 has none
    poison = {side: {n: (a.at[jnp.asarray(sorted(set(range(cache.num_blocks)) - used))].set(jnp.nan)
                         if a.dtype != jnp.uint8 else a) for n, a in f.items()} for side, f in cache.pages.items()}
    # row 0 reads ring rows 0-43 (positions 256-299); row 1 its sink's rows 0-89 and no ring row
    tail = {side: a.at[0, :, 300 - 256:].set(jnp.nan).at[1].set(jnp.nan) for side, a in cache.tail.items()}
    sink = {side: a.at[1, :, 90:].set(jnp.nan) for side, a in cache.sink.items()}
    bad = dataclasses.replace(cache, pages=poison, tail=tail, sink=sink)
    got = kj.paged_decode_attention(q, bad, bt, sl, impl="native")
    np.testing.assert_array_equal(np.asarray(got), want)


def test_unchecked_out_of_range_indices_are_clamped():
    """As every implementation: block ids and sequence slots clamped, lengths capped at the table."""
    rng = np.random.default_rng(5)
    cache, bt, sl = build("kvarn_k4v2_g64", [150, 70], 1, 64, 64, rng)[:3]
    q = jnp.asarray(rng.standard_normal((2, 2, 64)), jnp.float32)
    bt_bad = bt.at[0, 0].set(10 ** 6).at[1, 0].set(-7)
    sl_bad = jnp.asarray([10 ** 6, 70], jnp.int32)
    sid_bad = jnp.asarray([-3, 99], jnp.int32)
    args = dict(seq_ids=sid_bad, check_values=False)
    ref = kj.paged_decode_attention(q, cache, bt_bad, sl_bad, impl="reference", **args)
    out = kj.paged_decode_attention(q, cache, bt_bad, sl_bad, impl="native", **args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=2e-5 * float(jnp.abs(ref).max()))


def test_auto_runs_native_on_kvarn_caches_only():
    assert decode_impl(kj.parse("kvarn_k4v2_g128"), 128, 128, backend="cpu")[0] == "native"
    for scheme in ("int8", "kivi_k2v2_g32", "fp8", "fp16"):
        assert decode_impl(kj.parse(scheme), 128, 128, backend="cpu")[0] == "reference"
    assert decode_impl(kj.parse("kvarn_k4v2_g128"), 128, 128, backend="gpu")[0] == "pallas"


def test_refusals_name_the_reason():
    rng = np.random.default_rng(2)
    cache, bt, sl = build("int8", [40], 1, 64, 64, rng)[:3]
    with pytest.raises(ValueError, match="impl='native' cannot run this cache: the CPU kernel reads KVarN caches only"):
        kj.paged_decode_attention(jnp.zeros((1, 1, 64)), cache, bt, sl, impl="native")
    assert "reads KVarN caches only" in paged_decode_cpu.supports(kj.parse("kivi_k2v2_g32"), 64, 64)
    with pytest.raises(ValueError, match="impl must be one of \\['auto', 'pallas', 'reference'\\], got 'native'"):
        kj.write(cache, jnp.zeros((1, 1, 64)), jnp.zeros((1, 1, 64)), jnp.zeros((1,), jnp.int32), impl="native")
    with pytest.raises(ValueError, match="impl='native' is a decode attention kernel; the write path has none"):
        resolve_impl("native", "write", kj.parse("kvarn_k4v2_g128"), None)


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    """Without a C++ compiler the build says so and how to go on; "auto" then runs the reference
    and warns (never silently)."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native_build.compiler() is None
    with pytest.raises(native_build.NativeKernelUnavailable, match="needs a C\\+\\+17 compiler.*impl='reference'"):
        native_build.library()
    monkeypatch.setattr(paged_decode_cpu, "available", lambda: "no compiler here")
    with pytest.warns(RuntimeWarning, match="runs the jnp reference .* no compiler here"):
        assert decode_impl(kj.parse("kvarn_k4v4_g32"), 32, 64, backend="cpu")[0] == "reference"


def test_library_is_cached_by_source(tmp_path, monkeypatch):
    """A second build with the same source and compiler reuses the library file."""
    monkeypatch.setenv("KVARN_JAX_CACHE", str(tmp_path))
    assert native_build.library().parent == tmp_path / "cpu_kernel"
    built = list((tmp_path / "cpu_kernel").glob("*.so"))
    assert len(built) == 1
    mtime = os.path.getmtime(built[0])
    native_build.library()
    assert list((tmp_path / "cpu_kernel").glob("*.so")) == built and os.path.getmtime(built[0]) == mtime


_PORTABLE = {}  # arch flag -> the FFI target its library is registered under (once per process)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 instruction sets")
@pytest.mark.parametrize("arch", ["-march=x86-64-v3", "-march=x86-64"])
def test_other_instruction_sets_match_the_reference(arch, monkeypatch):
    """The AVX2 and plain C++ paths (what a machine without AVX-512 runs), built for those
    instruction sets here whatever this CPU has."""
    if arch not in _PORTABLE:
        lib = ctypes.cdll.LoadLibrary(str(native_build.library([arch])))
        _PORTABLE[arch] = "kvarn_decode_cpu_" + arch.split("=")[1].replace("-", "_")
        jax.ffi.register_ffi_target(_PORTABLE[arch], jax.ffi.pycapsule(lib.KvarnDecodeCpu), platform="cpu")
    monkeypatch.setattr(native_build, "load", lambda: _PORTABLE[arch])
    rng = np.random.default_rng(3)
    for cfg, dim, ratio, dtype in [("kvarn_k4v2_g128", 64, 3, jnp.float32), ("kvarn_k8v4_g32_hpint8", 128, 9, jnp.bfloat16),
                                   ("kvarn_k2v2_g64", 32, 2, jnp.float16)]:
        cache, bt, sl = build(cfg, [30, 260, 700], 2, dim, 128, rng, dtype=dtype)[:3]
        q = jnp.asarray(rng.standard_normal((3, 2 * ratio, dim)), jnp.float32)
        ref = np.asarray(reference.attend(q, cache, bt, sl, 0.3, None, None, True, False, None), np.float32)
        # a new jit per call: the target is read when the call is traced
        out = np.asarray(jax.jit(lambda q: paged_decode_cpu.paged_decode_cpu(q, cache, bt, sl, None, scale=0.3,
                                                                             window=None))(q))
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_the_kernel_source_ships_with_the_package():
    """Installed from a wheel, the kernel is built from the packaged source: pyproject's package data
    must name it."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvarn_jax"]
    shipped = [p for pattern in data for p in (root / "kvarn_jax").glob(pattern)]
    assert native_build.SOURCE.resolve() in [p.resolve() for p in shipped]
