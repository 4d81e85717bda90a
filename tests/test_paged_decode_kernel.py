"""The Pallas decode kernels against the reference (interpret mode on CPU; natively on a GPU).

Tolerance: the GPU kernel feeds fp16 operands to the matrix unit (pre-scaled queries, probabilities,
high-precision K/V) with fp32 accumulation, so outputs agree with the fp32 reference to about 1e-3
of the output scale; we require |kernel - reference| <= 4e-3 * max|reference| elementwise. The TPU
kernel multiplies in fp32 at HIGHEST precision (its 0/1 plane-selection products must be exact):
<= 1e-4 * max|reference|. Every output element is compared, so an element a kernel failed to write
cannot pass.
"""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvarn_jax as kj
from helpers import allocate_tables, lower_for_cuda, random_kv, serve_writes

INTERPRET = jax.default_backend() == "cpu"


def build(cfg, lens, heads, dim, block_size, rng, calibration=None, max_seqs=None, seq_ids=None, tail_blocks=1,
          dtype=jnp.float16):
    nb = sum(-(-L // block_size) for L in lens) + 2
    cache = kj.PagedKVCache.create(cfg, num_blocks=nb, block_size=block_size, num_kv_heads=heads, head_dim=dim,
                                   max_seqs=max_seqs or len(lens), calibration=calibration, tail_blocks=tail_blocks,
                                   dtype=dtype)
    seqs = [random_kv(rng, L, heads, dim, dtype=np.float32, outliers=2) for L in lens]
    tables = allocate_tables(rng, lens, block_size, nb)
    cache = serve_writes(cache, tables, seqs, rng, seq_ids=seq_ids)
    return cache, jnp.asarray(tables), jnp.asarray(lens, jnp.int32), seqs


def compare(q, cache, bt, sl, kernel="gpu", **kw):
    ref = kj.paged_decode_attention(q, cache, bt, sl, impl="reference", **kw)
    interpret = jax.default_backend() != {"gpu": "gpu", "tpu": "tpu"}[kernel]
    out = kj.paged_decode_attention(q, cache, bt, sl, impl="pallas", interpret=interpret, kernel=kernel, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ref, out = np.asarray(ref, np.float32), np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    tol = 4e-3 if kernel == "gpu" else 1e-4
    # a kernel output in fp16/bf16 carries that rounding on top
    tol = max(tol, float(jnp.finfo(q.dtype).eps))
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol * max(np.abs(ref).max(), 1e-6))
    return out, ref


SCHEMES = ["kvarn_k4v2_g32", "kvarn_k2v4_g64", "kvarn_k8v8_g32", "kivi_k2v2_g32", "kivi_k4v4_g32", "int4",
           "int8_g16", "int_k8v2", "int2_g32", "fp8", "fp16", "bf16"]


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@settings(max_examples=6)  # each example compiles anew (~10 s on 2 CI cores)
@given(cfg=st.sampled_from(SCHEMES + ["kivi_k2v2_g128", "int4_g32"]), dim=st.sampled_from([64, 128]),
       heads=st.sampled_from([1, 2]), ratio=st.sampled_from([1, 4, 7, 8]), block_mult=st.sampled_from([1, 2]),
       lens=st.lists(st.integers(1, 140), min_size=1, max_size=3),
       window=st.sampled_from([None, None, 37]), seed=st.integers(0, 2 ** 16))
def test_kernel_matches_reference(kernel, cfg, dim, heads, ratio, block_mult, lens, window, seed):
    rng = np.random.default_rng(seed)
    bs = max(kj.parse(cfg).tile_tokens, 16) * block_mult
    cache, bt, sl, _ = build(cfg, lens, heads, dim, bs, rng)
    q = jnp.asarray(rng.standard_normal((len(lens), heads * ratio, dim)), jnp.float32)
    compare(q, cache, bt, sl, kernel=kernel, window=window)


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g128", "kvarn_k4v4_g64", "int8", "fp8"])
def test_head_dim_256_and_gqa_7(cfg, rng):
    c = kj.parse(cfg)
    bs = max(c.tile_tokens, 32)
    cache, bt, sl, _ = build(cfg, [3 * bs + 9, bs - 3, 2 * bs], 1, 256, bs, rng)
    q = jnp.asarray(rng.standard_normal((3, 7, 256)), jnp.float16)
    compare(q, cache, bt, sl)


def test_eight_bit_keys_with_outlier_channels():
    """Near-lossless keys leave the kernel's own rounding visible: with the key zero-point term
    summed as a ones-matrix product over fp16 roundings of q*z, this case was 1.4x outside the
    tolerance (the term is now an fp32 sum). Fixed data: the case that showed it."""
    rng = np.random.default_rng(3)
    cache, bt, sl, _ = build("kvarn_k8v8_g32", [5 * 32 + 7, 29, 64], 2, 64, 32, rng)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    compare(q, cache, bt, sl)


@pytest.mark.parametrize("cfg,orient", [("int8", "heads"), ("int8", "tokens"), ("int4", "heads")])
def test_per_token_zero_points_use_the_products_query(cfg, orient):
    """Per-token int keys: the zero-point term z[t]·Σ_d q must sum the fp16 query the code products
    see. Codes sit near their token's zero point when outlier channels set the range, so the
    unrounded query's sum was amplified to 4e-3 of the output's maximum on this data (the tests'
    general fp16 budget, which it once crossed on the H200); consistent, the error is ~4e-4. Fixed
    data: the case that showed it."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    rng = np.random.default_rng(zlib.crc32(b"tests/test_paged_decode_kernel.py::test_per_token_tokens_major[int8]"))
    bs = 128
    cache, bt, sl, _ = build(cfg, [3 * bs + 17, 40, 2 * bs], 2, 64, bs, rng)
    q = jnp.asarray(rng.standard_normal((3, 14, 64)), jnp.float32)
    ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference"))
    o = np.asarray(pdp.paged_decode_pallas(q, cache, bt, sl, jnp.arange(3, dtype=jnp.int32), scale=0.125,
                                           window=None, interpret=INTERPRET,
                                           launch=pdp.Launch(num_splits=2, orient=orient)))
    np.testing.assert_allclose(o, ref, rtol=0, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("cfg", ["int8_static", "int_k8v4_static", "fp8_static"])
def test_static_schemes(cfg, rng):
    k, v = random_kv(rng, 256, 2, 64, dtype=np.float32)
    cal = kj.calibrate((jnp.asarray(k), jnp.asarray(v)), cfg)
    cache, bt, sl, _ = build(cfg, [100, 33], 2, 64, 32, rng, calibration=cal)
    q = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32)
    compare(q, cache, bt, sl)


def test_seq_ids_zero_length_and_many_splits(rng):
    # sequences live in high-precision slots 3 and 1 of 4; a zero-length row; more splits than tiles
    cache, bt, sl, _ = build("kvarn_k4v2_g32", [150, 70], 2, 64, 32, rng, max_seqs=4, seq_ids=[3, 1])
    bt = jnp.concatenate([bt, bt[:1]])
    sl = jnp.concatenate([sl, jnp.zeros(1, jnp.int32)])
    sid = jnp.array([3, 1, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    out, _ = compare(q, cache, bt, sl, seq_ids=sid)
    assert (out[2] == 0).all()
    for splits in (7,):  # more splits than the rows have tiles (one split: test_block_ids_read_ahead)
        o = kj.paged_decode_attention(q, cache, bt, sl, seq_ids=sid, impl="pallas", interpret=INTERPRET,
                                      num_splits=splits)
        # other splits round the fp16 probabilities against other running maxima: same tolerance
        np.testing.assert_allclose(np.asarray(o), out, atol=4e-3 * np.abs(out).max())


def test_default_seq_ids_are_the_row_index(rng):
    """Without seq_ids the GPU kernel takes no sequence-id operand and reads sequence b's sink and
    tail from row b (the public entry passes None: no iota kernel before every call). Slots written
    swapped, so a kernel reading any other row than b fails; the same call with the ids given
    reads the other rows."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    cache, bt, sl, _ = build("kvarn_k4v2_g32", [150, 70, 33], 2, 64, 32, rng, max_seqs=3, seq_ids=[2, 0, 1])
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    compare(q, cache, bt, sl)  # reference: row b of the slots
    none = pdp.paged_decode_pallas(q, cache, bt, sl, None, scale=0.125, window=None, interpret=INTERPRET)
    rows = pdp.paged_decode_pallas(q, cache, bt, sl, jnp.arange(3, dtype=jnp.int32), scale=0.125, window=None,
                                   interpret=INTERPRET)
    slots = pdp.paged_decode_pallas(q, cache, bt, sl, jnp.array([2, 0, 1], jnp.int32), scale=0.125, window=None,
                                    interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(none), np.asarray(rows))
    assert np.abs(np.asarray(none) - np.asarray(slots)).max() > 1e-2 * np.abs(np.asarray(slots)).max()


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g32", "int4", "fp16"])
def test_unchecked_out_of_range_indices_are_clamped(kernel, cfg, rng):
    """check_values=False (no host read-back): bad indices are not reported but made harmless.
    Block ids and slots are clamped into range, by the kernels as by the reference, so a bad row
    reads pages of the cache and the other rows are untouched; a length past the table's capacity
    gives that row a finite, wrong output. With the checks on, each bad index is an error naming it.
    Interpreted, Pallas clamps indices past the end by itself, so on CPU this checks the semantics
    (the same clamped reading as the reference's); that no memory outside the table or cache is
    read is exercised only compiled (KVARN_TEST_PLATFORM=cuda; best under compute-sanitizer)."""
    cache, bt, sl, _ = build(cfg, [100, 100, 100, 33], 2, 64, 32, rng, max_seqs=4)
    q = jnp.asarray(rng.standard_normal((4, 4, 64)), jnp.float32)
    good = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference"))
    bad_bt = np.asarray(bt).copy()
    bad_bt[1, 1] = cache.num_blocks + 5                  # used block ids (read from the pages, not the
    bad_bt[2, 2] = -3                                    # sink or tail) past the pool and negative
    bad_sl = np.asarray(sl).copy()
    bad_sl[3] = bt.shape[1] * 32 + 50                    # longer than the table can hold
    bad_sid = jnp.array([0, 1, 9, 3], jnp.int32)         # past max_seqs
    for name, one in (("block_tables", (jnp.asarray(bad_bt), sl, None)), ("seq_lens", (bt, jnp.asarray(bad_sl), None)),
                      ("seq_ids", (bt, sl, bad_sid))):
        if name == "seq_ids" and not cache.has_hp:  # passthrough caches have no slots to index
            continue
        with pytest.raises(ValueError, match=name):
            kj.paged_decode_attention(q, cache, one[0], one[1], seq_ids=one[2], impl="reference")
    args = (q, cache, jnp.asarray(bad_bt), jnp.asarray(bad_sl))
    ref = np.asarray(kj.paged_decode_attention(*args, seq_ids=bad_sid, impl="reference", check_values=False))
    out = np.full(ref.shape, np.nan, np.float32)         # poisoned: every element must be written
    interpret = jax.default_backend() != {"gpu": "gpu", "tpu": "tpu"}[kernel]
    out[...] = np.asarray(kj.paged_decode_attention(*args, seq_ids=bad_sid, impl="pallas", interpret=interpret,
                                                    kernel=kernel, check_values=False), np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(ref[0], good[0])      # the good row as if the others were good
    tol = (4e-3 if kernel == "gpu" else 1e-4) * np.abs(good).max()
    np.testing.assert_allclose(out[:3], ref[:3], atol=tol)  # rows 1, 2: clamped ids, as the reference reads them
    # the reference's clamped reading, spelled out: ids into range, the length to the table's capacity
    fixed = kj.paged_decode_attention(q, cache, jnp.asarray(np.clip(bad_bt, 0, cache.num_blocks - 1)),
                                      jnp.minimum(jnp.asarray(bad_sl), bt.shape[1] * 32),
                                      seq_ids=jnp.array([0, 1, 3, 3], jnp.int32), impl="reference")
    np.testing.assert_allclose(ref, np.asarray(fixed), atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("cfg", ["kivi_k2v2_g32", "kvarn_k2v4_g32"])
def test_short_key_planes(kernel, cfg, rng):
    # 2-bit keys in 32-token tiles: 8-row bit planes, which the GPU kernel reassembles into token order
    # before its product; several full blocks, a window cutting into a quantized tile
    cache, bt, sl, _ = build(cfg, [7 * 32 + 5, 3 * 32, 40], 2, 64, 32, rng)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    compare(q, cache, bt, sl, kernel=kernel)
    compare(q, cache, bt, sl, kernel=kernel, window=70)


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g64", "kivi_k2v4_g64"])
def test_gpu_kernel_layouts(cfg, rng):
    """Every product layout of the GPU kernel against the reference: heads-major (M = 16 head rows),
    tokens-major (N = 8 heads; the default for tiled schemes) with and without the plane-bias fold,
    with the bias/zero-point sums as reductions or as products with a ones matrix, and tiles walked
    in parts and in several loop iterations (steps), the register-capped two-warp launch (whose
    sink/tail steps are 32 tokens, not 64: the sink and the short sequence end mid-step), and three
    pipeline stages with parts (block ids read ahead, KVarN's token scales not through the loop
    carry; whole tiles with three stages: `test_block_ids_read_ahead`), and the query read the way
    the scheme does not by default (`q_in_kernel`: masked rows of q_rot in the kernel, or a copy
    padded to Gp rows; two kv heads, so the second group's rows start mid-array). The defaults are
    measured choices; the others must stay correct."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    from kvarn_jax.hadamard import rotate, unrotate
    c = kj.parse(cfg)
    bs = c.tile_tokens * 2
    cache, bt, sl, _ = build(cfg, [5 * bs + 7, bs - 3, 2 * bs], 2, 64, bs, rng)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    sid = jnp.arange(3, dtype=jnp.int32)
    refs = {w: np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference", window=w))
            for w in (None, bs + 5)}
    variants = (dict(orient="heads"), dict(orient="tokens", fold=False), dict(orient="tokens", fold="all"),
                dict(orient="tokens", steps=2), dict(orient="tokens", sums="reduce", q_in_kernel=not pdp.default_q_in_kernel(c)),
                dict(orient="tokens", sums="reduce", fold=False, parts=2),
                dict(orient="tokens", num_warps=2, maxnreg=128), dict(orient="tokens", parts=2, num_stages=3))
    for i, kw in enumerate(variants):
        # every variant once per scheme, with a window for one of the two schemes (the suite's time)
        window = None if (i + (cfg[:4] == "kivi")) % 2 == 0 else bs + 5
        o = pdp.paged_decode_pallas(rotate(q) if c.rotated else q, cache, bt, sl, sid, scale=0.125,
                                    window=window, interpret=INTERPRET, launch=pdp.Launch(num_splits=2, **kw))
        o = np.asarray(unrotate(o) if c.rotated else o)
        ref = refs[window]
        np.testing.assert_allclose(o, ref, rtol=0, atol=4e-3 * np.abs(ref).max(), err_msg=f"{kw} window={window}")


def truncating_matmul(a, b):
    """[M, K] @ [K, N] of fp16 operands as NVIDIA's matrix units add products (a model, after Fasi et
    al., "Numerical behavior of NVIDIA tensor cores", 2021): per step of 16 products, the exact
    products and the fp32 accumulator are aligned to the largest of them and truncated to its 24
    bits, summed, and the sum truncated to fp32 (no extra guard bits: the harshest variant)."""
    a, b = a.astype(jnp.float16).astype(jnp.float32), b.astype(jnp.float16).astype(jnp.float32)
    acc = jnp.zeros((a.shape[0], b.shape[1]), jnp.float32)
    for s in range(0, a.shape[1], 16):
        terms = jnp.concatenate([acc[:, None, :], a[:, s:s + 16, None] * b[None, s:s + 16, :]], axis=1)
        mx = jnp.max(jnp.abs(terms), axis=1)
        unit = jnp.ldexp(jnp.ones_like(mx), jnp.frexp(jnp.where(mx > 0, mx, 1.0))[1] - 24)
        tot = jnp.sum(jnp.trunc(terms / unit[:, None, :]).astype(jnp.int32), axis=1)
        shift = jnp.maximum(32 - jax.lax.clz(jnp.abs(tot)) - 24, 0)
        acc = (jnp.sign(tot) * ((jnp.abs(tot) >> shift) << shift)).astype(jnp.float32) * unit
    return acc


def test_value_products_exact_under_a_truncating_matrix_unit(monkeypatch):
    """The drift the H200 showed (kvarn_k4v2_g128 0.9% off the reference at 4K tokens, 5.0% at 128K)
    comes from feeding the value products biased codes (2^10 + code): a matrix unit that truncates
    what it aligns loses the codes' low bits with one sign in every tile. With the products run
    through a model of that unit, the default launch (biased keys only) stays at its fp16 operand
    rounding (1.0e-3) while fold="all" (the old default) is 50x further off (5.9e-2 at 4K tokens)."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    from kvarn_jax.attention.paged_decode_pallas import layout
    from kvarn_jax.hadamard import rotate, unrotate

    def wrap(orig, lhs_t, rhs_t):
        def f(a, b, min_n=16, wide=False):
            small = min(a.shape) < 16 or (b.shape[0] if rhs_t else b.shape[1]) < min_n
            return orig(a, b, min_n) if small else truncating_matmul(a.T if lhs_t else a, b.T if rhs_t else b)
        return f

    for name, lt, rt in (("dot", False, False), ("dot_t", False, True), ("dot_tn", True, False)):
        monkeypatch.setattr(layout, name, wrap(getattr(layout, name), lt, rt))
    jax.clear_caches()  # no kernel traced before the patch may be reused, nor one traced with it after
    try:
        rng = np.random.default_rng(3)
        n = 32 * 128
        cache = kj.PagedKVCache.create("kvarn_k4v2_g128", num_blocks=n // 128, block_size=128, num_kv_heads=1,
                                       head_dim=128, max_seqs=1)
        k, v = (jnp.asarray(rng.standard_normal((n, 1, 128)), jnp.float16) for _ in range(2))
        pos = jnp.arange(n, dtype=jnp.int32)
        cache = kj.write(cache, k, v, pos, seq_ids=jnp.zeros(n, jnp.int32), positions=pos, impl="reference")
        bt, sl = jnp.arange(n // 128, dtype=jnp.int32)[None], jnp.array([n], jnp.int32)
        q = jnp.asarray(rng.standard_normal((1, 4, 128)), jnp.float32)
        ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference"))
        err = {}
        for fold in ("keys", "all"):
            o = pdp.paged_decode_pallas(rotate(q), cache, bt, sl, None, scale=128 ** -0.5, window=None,
                                        interpret=INTERPRET, launch=pdp.Launch(fold=fold))
            err[fold] = np.linalg.norm(np.asarray(unrotate(o)) - ref) / np.linalg.norm(ref)
        assert err["keys"] < 2e-3 and err["all"] > 2e-2, err
    finally:
        jax.clear_caches()


READ_AHEAD_RUNS = ((1, None, False), (3, None, True), (2, 137, False))  # (splits, window, bad rows)


@pytest.mark.parametrize("cfg, kw, runs", [("kvarn_k4v2_g64", {}, READ_AHEAD_RUNS),
                                           ("kvarn_k4v2_g64", dict(steps=2), READ_AHEAD_RUNS[1:2]),
                                           ("int4", {}, READ_AHEAD_RUNS[2:]),
                                           ("fp8", dict(orient="heads"), READ_AHEAD_RUNS[1:2])])
def test_block_ids_read_ahead(cfg, kw, runs, rng):
    """num_stages >= 3: a program reads its tiles' block ids before its tile loop, in groups of at
    most `ids_group` entries (the launch table's), and takes each tile's from registers (so that Triton double-buffers
    the tiles' copies). Groups of 2 blocks here, so that programs cross group boundaries; random
    block tables, two blocks per tile for KVarN (tiles of 64 tokens in blocks of 128), several
    splits, a window, and bad rows (unchecked): block ids past the pool and negative, which are
    clamped as the reference clamps them, and a length past the table's capacity, whose row's
    output is finite and wrong while the other rows are untouched."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    from kvarn_jax.hadamard import rotate, unrotate
    two_ids = dataclasses.replace(pdp.HOPPER, ids_group=2)  # the launch table, block ids read 2 at a time
    c = kj.parse(cfg)
    bs = 128 if c.tile_tokens > 1 else 32
    cache, bt, sl, _ = build(cfg, [9 * bs + 7, bs - 3, 4 * bs, 6 * bs + 1], 2, 64, bs, rng)
    bad_sl = sl.at[3].set(bt.shape[1] * bs + 40)
    bad_bt = bt.at[0, 3].set(cache.num_blocks + 5).at[2, 2].set(-3)   # blocks read from the pages
    q = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.float32)
    sid = jnp.arange(4, dtype=jnp.int32)
    for splits, window, bad in runs:  # each a compile: the other layouts take one run each
        lens, table = (bad_sl, bad_bt) if bad else (sl, bt)
        ref = np.asarray(kj.paged_decode_attention(q, cache, table, lens, impl="reference", window=window,
                                                   check_values=False))
        o = pdp.paged_decode_pallas(rotate(q) if c.rotated else q, cache, table, lens, sid, scale=0.125,
                                    window=window, interpret=INTERPRET, table=two_ids,
                                    launch=pdp.Launch(num_splits=splits, num_stages=3, **kw))
        o = np.asarray(unrotate(o) if c.rotated else o)
        rows = 3 if bad else 4  # the over-long row: finite, wrong (as without read-ahead)
        assert np.isfinite(o).all()
        np.testing.assert_allclose(o[:rows], ref[:rows], rtol=0, atol=4e-3 * np.abs(ref).max(),
                                   err_msg=f"splits={splits} window={window}")


@pytest.mark.parametrize("orient", ["tokens", "heads"])
def test_bf16_sink_and_tail_enter_the_products_unrounded(orient, rng):
    """A bf16 cache's sink and tail rows are multiplied as they are, against the query and the
    probabilities in two bf16 halves (`layout.Halves`): sequences held entirely in the sink and
    tail come out within 1e-4 of the fp32 reference, where rounding the query to fp16 (as products
    with codes do) is off by ~1e-3, and dropping the low halves by ~8e-3."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    from kvarn_jax.hadamard import rotate, unrotate
    cache, bt, sl, _ = build("kvarn_k4v2_g32", [20, 32, 45, 64], 2, 64, 32, rng, dtype=jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((4, 8, 64)) * 3, jnp.float32)
    ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference"))
    o = pdp.paged_decode_pallas(rotate(q), cache, bt, sl, None, scale=0.125, window=None, interpret=INTERPRET,
                                launch=pdp.Launch(num_splits=2, orient=orient))
    np.testing.assert_allclose(np.asarray(unrotate(o)), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_sink_and_tail_chunks_spread_over_the_splits(rng):
    """The sink's and the tail's 64-token chunks go to different splits (sink chunk c to split
    S-1-(c mod S), tail chunk c to split c mod S): with 128-token blocks the sink is two chunks and a
    tail up to two, and every position must be counted once whatever S is - fewer splits than chunks,
    as many, more - and when a window starts inside the sink or the tail (the first chunks skipped)."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    from kvarn_jax.hadamard import rotate, unrotate
    bs = 128
    lens = [130, 250, 3 * bs + 70, 60]  # tails of 2, 122 (two chunks) and 70 tokens; a sink-only row
    cache, bt, sl, _ = build("kvarn_k4v2_g32", lens, 2, 64, bs, rng, dtype=jnp.bfloat16)
    # a large query: the softmax leans on few positions, so a chunk counted twice or not at all shows
    q = jnp.asarray(rng.standard_normal((4, 8, 64)) * 3, jnp.float32)
    sid = jnp.arange(4, dtype=jnp.int32)
    # window 150: row 1's starts in the sink's second chunk; window 5: rows 1 and 2 start in their
    # tail's second chunk
    for splits, window in ((2, None), (3, 150), (4, 5), (5, None)):
        ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference", window=window))
        o = pdp.paged_decode_pallas(rotate(q), cache, bt, sl, sid, scale=0.125, window=window, interpret=INTERPRET,
                                    launch=pdp.Launch(num_splits=splits))
        np.testing.assert_allclose(np.asarray(unrotate(o)), ref, rtol=0, atol=4e-3 * np.abs(ref).max(),
                                   err_msg=f"splits={splits} window={window}")


@pytest.mark.parametrize("cfg", ["int8", "int4", "int_k8v2", "fp8"])
def test_per_token_tokens_major(cfg, rng):
    """Per-token schemes with one scale per token, tokens-major (scores [T, Gp] = codes @ q^T, the
    per-token scale and zero factored out of both products) against the reference: biased planes
    (fold) or not, zero-point sums as ones-matrix products or reductions, a window, GQA 7 padded to
    8 heads, chunks ending mid-block and a sequence shorter than a chunk."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    bs = 128
    cache, bt, sl, _ = build(cfg, [3 * bs + 17, 40, 2 * bs], 2, 64, bs, rng)
    q = jnp.asarray(rng.standard_normal((3, 14, 64)), jnp.float32)
    sid = jnp.arange(3, dtype=jnp.int32)
    # one variant per scheme (the suite's time): the defaults (biased planes, ones-matrix sums) with
    # two key planes, unbiased 8-bit planes, biased planes with reduced sums and four value planes
    kw, window = {"int8": (dict(fold=False), None), "int4": (dict(), bs + 9),
                  "int_k8v2": (dict(fold=True, sums="reduce"), None), "fp8": (dict(sums="reduce"), bs + 9)}[cfg]
    ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference", window=window))
    o = np.asarray(pdp.paged_decode_pallas(q, cache, bt, sl, sid, scale=0.125, window=window, interpret=INTERPRET,
                                           launch=pdp.Launch(num_splits=2, orient="tokens", **kw)))
    np.testing.assert_allclose(o, ref, rtol=0, atol=4e-3 * np.abs(ref).max(), err_msg=f"{kw} window={window}")


@pytest.mark.parametrize("cfg,kw", [("int4", {}), ("fp8", {}), ("int8", dict(chunk=32, fold=False)),
                                    ("int2", dict(chunk=256, num_warps=4))])
def test_per_token_steps(cfg, kw, rng):
    """Per-token schemes step through a block `chunk` tokens at a time (default 128 for int codes
    tokens-major and fp8 heads-major): steps smaller than, equal to and as large as a 256-token
    block, against the reference, with sequences ending mid-step and one shorter than a step."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    bs = 256
    cache, bt, sl, _ = build(cfg, [bs + 131, 70, bs], 2, 64, bs, rng)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    sid = jnp.arange(3, dtype=jnp.int32)
    ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference"))
    o = np.asarray(pdp.paged_decode_pallas(q, cache, bt, sl, sid, scale=0.125, window=None, interpret=INTERPRET,
                                           launch=pdp.Launch(num_splits=2, **kw)))
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, ref, rtol=0, atol=4e-3 * np.abs(ref).max(), err_msg=str(kw))
    assert pdp.default_chunk(kj.parse(cfg), 64) == 128


def test_per_token_step_errors(rng):
    from kvarn_jax.attention import paged_decode_pallas as pdp
    for cfg, chunk in (("kvarn_k4v2_g32", 32), ("int8", 48), ("int8", 8)):
        cache, bt, sl, _ = build(cfg, [40], 1, 64, 64, rng)
        q = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.float32)
        with pytest.raises(ValueError, match="chunk"):
            pdp.paged_decode_pallas(q, cache, bt, sl, jnp.zeros(1, jnp.int32), scale=0.125, window=None,
                                    interpret=True, launch=pdp.Launch(chunk=chunk))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="PTX: compiled on an NVIDIA GPU only")
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("biased", [False, True])
def test_asm_planes_equal_jnp_planes(bits, biased):
    """The PTX unpack (`unpack.planes_ptx`, the compiled default) gives the jnp planes bit for bit, for every
    byte value (8-bit codes: one `prmt` that inserts the magic byte, no `lop3`)."""
    from jax.experimental import pallas as pl
    from kvarn_jax.attention.paged_decode_pallas.unpack import planes, planes_ptx
    byte = jnp.arange(256 * 4, dtype=jnp.int32).astype(jnp.uint8).reshape(32, 32)
    n = 8 // bits

    def kernel(c_ref, o_ref):
        for j, plane in enumerate(planes_ptx(c_ref[...], bits, biased=biased)):
            o_ref[j] = plane

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n, 32, 32), jnp.float16))(byte)
    for j, want in enumerate(planes(byte, bits, biased=biased)):
        np.testing.assert_array_equal(np.asarray(got[j]).view(np.uint16), np.asarray(want).view(np.uint16))


def test_gpu_kernel_layout_errors(rng):
    from kvarn_jax.attention import paged_decode_pallas as pdp
    q, sid = jnp.ones((1, 4, 64), jnp.float32), jnp.zeros((1,), jnp.int32)
    bt, sl = jnp.zeros((1, 2), jnp.int32), jnp.array([40], jnp.int32)
    call = lambda cache, **kw: pdp.paged_decode_pallas(q, cache, bt, sl, sid, scale=0.125, window=None,  # noqa: E731
                                                       interpret=True, launch=pdp.Launch(**kw))
    grouped = kj.PagedKVCache.create("int8_g16", num_blocks=4, block_size=32, num_kv_heads=1, head_dim=64, max_seqs=1)
    with pytest.raises(ValueError, match="orient must be 'heads' or 'tokens', got 'tokens' for int8_g16 "
                                         "\\(tokens-major products need KVarN/KIVI, or one dynamic scale per token"):
        call(grouped, orient="tokens")
    with pytest.raises(ValueError, match="orient must be 'heads' or 'tokens', got 'rows'"):
        call(grouped, orient="rows")
    per_token = kj.PagedKVCache.create("fp8", num_blocks=4, block_size=32, num_kv_heads=1, head_dim=64, max_seqs=1)
    with pytest.raises(ValueError, match="parts and steps apply to the tiled schemes' tokens-major products only"):
        call(per_token, orient="tokens", parts=2)
    with pytest.raises(ValueError, match="fold to integer codes"):
        call(per_token, orient="tokens", fold=True)
    tiled = kj.PagedKVCache.create("kvarn_k4v2_g32", num_blocks=4, block_size=32, num_kv_heads=1, head_dim=64,
                                   max_seqs=1)
    with pytest.raises(ValueError, match="fold, parts, steps and sums apply to orient='tokens' only"):
        call(tiled, orient="heads", fold=True)
    with pytest.raises(ValueError, match="fold, parts, steps and sums apply to orient='tokens' only"):
        call(tiled, orient="heads", sums="mma")
    with pytest.raises(ValueError, match="sums must be 'reduce' or 'mma'"):
        call(tiled, sums="dot")
    with pytest.raises(ValueError, match="parts=3 x steps=1 must divide the 32-token tile"):
        call(tiled, parts=3)
    with pytest.raises(ValueError, match="maxnreg must be an int in \\[24, 255\\]"):
        call(tiled, maxnreg=300)
    with pytest.raises(ValueError, match="num_stages must be an int >= 1, got 0"):
        call(tiled, num_stages=0)


def test_register_cap_reaches_the_triton_module(monkeypatch):
    """maxnreg is set on the Triton module the kernel lowers to (as `ttg.maxnreg`, the attribute
    Triton turns into the kernel's register limit), and only on that kernel's module."""
    from jax._src.pallas.triton import lowering
    from kvarn_jax import triton_options
    from kvarn_jax.attention import paged_decode_pallas as pdp
    triton_options.install()
    hooked, modules, merges = lowering.lower_jaxpr_to_triton_module, [], []

    def capture(*a, **k):  # what the register-cap hook hands on to jax (decode modules; the split
        r = hooked(*a, **k)   # merge's, asked for below with merge="pallas", must carry no cap)
        asm = r.module.operation.get_asm(enable_debug_info=False)
        (merges if "module @kvarn_decode_split_merge" in asm else modules).append(asm)
        return r

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    cache = kj.PagedKVCache.create("kvarn_k4v2_g64", num_blocks=8, block_size=64, num_kv_heads=2, head_dim=64,
                                   max_seqs=2)
    args = (jnp.zeros((2, 8, 64), jnp.float32), cache, jnp.zeros((2, 2), jnp.int32),
            jnp.full((2,), 100, jnp.int32), jnp.arange(2, dtype=jnp.int32))
    # explicit warps, no cap; explicit cap; the default launch (4 (sequence, head) pairs: 2 warps
    # capped at 128 registers, `default_launch`; two tiles a row, one split, so no merge kernel); the
    # default launch with its splits merged by the Pallas kernel
    for kw in (dict(num_warps=1), dict(maxnreg=184), {}, dict(merge="pallas", num_splits=2)):
        fn = lambda q, c, t, l, s, kw=kw: pdp.paged_decode_pallas(q, c, t, l, s, scale=0.1, window=None,  # noqa: E731
                                                                  launch=pdp.Launch(**kw))
        lower_for_cuda(fn, *args)
    assert len(modules) == 4 and len(merges) == 1
    assert triton_options.register_cap(merges[0]) is None and triton_options.register_cap(modules[3]) == 128
    assert triton_options.register_cap(modules[0]) is None and "module @kvarn_paged_decode_kvarn_k4v2_g64 " in modules[0]
    assert triton_options.register_cap(modules[1]) == 184
    assert "module @kvarn_paged_decode_kvarn_k4v2_g64_maxnreg184 " in modules[1]
    assert triton_options.register_cap(modules[2]) == 128
    assert pdp.programs_per_sm(1, 168) == 11 and pdp.programs_per_sm(1, 184) == 8 and pdp.programs_per_sm(1) == 8
    assert pdp.programs_per_sm(2, 128) == 8
    # a jax whose lowering the cap cannot attach to: the default launch runs uncapped (one warp),
    # an explicit cap raises (another batch size, so that the kernel is traced again)
    monkeypatch.setattr(triton_options, "available", lambda: False)
    args3 = (jnp.zeros((3, 8, 64), jnp.float32), cache, jnp.zeros((3, 4), jnp.int32),
             jnp.full((3,), 200, jnp.int32), jnp.arange(3, dtype=jnp.int32))
    lower_for_cuda(lambda q, c, t, l, s: pdp.paged_decode_pallas(q, c, t, l, s, scale=0.1, window=None), *args3)
    assert len(modules) == 5 and triton_options.register_cap(modules[4]) is None
    with pytest.raises(RuntimeError, match="do not pass maxnreg"):
        lower_for_cuda(lambda q, c, t, l, s: pdp.paged_decode_pallas(q, c, t, l, s, scale=0.1, window=None,
                                                                       launch=pdp.Launch(maxnreg=128)), *args3)


@pytest.mark.parametrize("cfg,batch,kw,want", [
    ("kvarn_k4v2_g128", 32, {}, (1, None)), ("kvarn_k4v2_g128", 16, {}, (2, 128)),   # 128 pairs < 132
    ("kvarn_k4v2_g128", 17, {}, (1, None)), ("kivi_k2v2_g128", 1, {}, (2, 128)),
    ("kvarn_k4v4_g128", 32, {}, (2, 128)), ("kvarn_k2v8_g64", 1, {}, (1, None)), ("kvarn_k8v8_g32", 32, {}, (1, None)),
    ("kvarn_k4v2_g128", 1, dict(orient="heads"), (1, None)), ("kvarn_k4v2_g128", 1, dict(parts=2), (1, None)),
    ("kvarn_k4v2_g128", 1, dict(steps=2), (1, None)), ("int8", 1, {}, (2, None)), ("int8", 32, {}, (2, None)),
    ("int8", 128, dict(orient="heads"), (4, None)), ("int8", 32, dict(chunk=64), (4, None)), ("int8_g16", 32, {}, (2, None)),
    ("int8_static", 1, {}, (2, None)), ("int4_g32", 32, {}, (4, None)), ("int4", 32, {}, (2, None)), ("int_k8v2", 32, {}, (2, None)),
    ("fp8", 32, {}, (2, None)), ("fp8", 32, dict(orient="tokens"), (4, None)), ("fp8_static", 1, {}, (2, None))])
def test_default_launch(cfg, batch, kw, want):
    """The launch the H200 sweeps chose (2026-12-01_decode_zero_term_h200.md; per-token schemes
    2026-12-02_decode_value_layout_h200.md), 8 kv heads: two warps capped at 128 registers for whole
    tokens-major tiles of 4-bit values or of <= 2-bit values at small batch, otherwise what was
    measured uncapped: 2 warps for per-token schemes stepping 128 tokens at a time (int codes
    tokens-major, fp8 heads-major: 2026-12-02_decode_per_token_chunk_h200.md), else 4, but 2 for
    heads-major 8-bit int codes with grouped or static scales."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    assert pdp.default_launch(kj.parse(cfg), batch, 8, **kw) == want


@pytest.mark.parametrize("cfg,batch,head_dim,kw,want", [
    ("kvarn_k4v2_g128", 32, 128, {}, 3), ("kvarn_k4v2_g128", 16, 128, {}, 2),      # 128 pairs: capped two warps
    ("kvarn_k4v2_g64", 32, 128, {}, 3), ("kvarn_k4v2_g128", 32, 256, {}, 2),       # tiles past 128 x 128: 2
    ("kvarn_k4v4_g128", 32, 128, {}, 2), ("kivi_k2v2_g128", 32, 128, {}, 2),
    ("kvarn_k4v2_g128", 32, 128, dict(parts=2), 2), ("kvarn_k4v2_g128", 32, 128, dict(orient="heads"), 2),
    ("int4", 32, 128, {}, 2), ("fp8", 256, 128, {}, 2)])
def test_default_stages(cfg, batch, head_dim, kw, want):
    """Three pipeline stages (block ids read ahead, double-buffered tile copies) only where the H200
    measured them faster: KVarN's one-warp launch of whole tiles of <= 128 x 128
    (2026-12-03_decode_double_buffer_h200.md); 8 kv heads."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    assert pdp.default_stages(kj.parse(cfg), batch, 8, head_dim, **kw) == want


@pytest.mark.parametrize("cfg,want", [("kvarn_k4v2_g128", True), ("kvarn_k4v2_g64", True), ("kvarn_k4v4_g128", False),
                                      ("kivi_k2v2_g128", False), ("int8", False), ("fp8", False)])
def test_default_q_in_kernel(cfg, want):
    from kvarn_jax.attention import paged_decode_pallas as pdp
    assert pdp.default_q_in_kernel(kj.parse(cfg)) is want


@pytest.mark.parametrize("cfg,head_dim,want", [
    ("kvarn_k4v2_g128", 128, "tokens"), ("kivi_k2v2_g32", None, "tokens"), ("int8", 128, "tokens"),
    ("int4", None, "tokens"), ("int_k8v2", 64, "tokens"), ("int8_g128", 128, "tokens"), ("int8_g128", 256, "heads"),
    ("int8_g128", None, "heads"), ("int8_g16", 128, "heads"), ("int8_static", 128, "heads"), ("fp8", 128, "heads"),
    ("fp16", 128, "heads")])
def test_default_orient(cfg, head_dim, want):
    """Tokens-major products for the tiled schemes and for int schemes with one dynamic scale per
    token (the layouts the H200 sweeps chose, 2026-12-02_decode_value_layout_h200.md); a channel
    group counts as one scale per token only where it spans the head."""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    assert pdp.default_orient(kj.parse(cfg), head_dim) == want


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bit_planes_are_the_codes(bits):
    """The kernel's unpack (magic-number planes) against plain shifts, for every byte value."""
    from kvarn_jax.attention.paged_decode_pallas.unpack import planes
    byte = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    for j, plane in enumerate(planes(byte, bits)):
        assert plane.dtype == jnp.float16
        want = (np.arange(256).reshape(16, 16) >> (j * bits)) & ((1 << bits) - 1)
        np.testing.assert_array_equal(np.asarray(plane, np.float32), want)
    # biased planes (the tokens-major fold): 2^(10 - j*bits) + code, exactly
    for j, plane in enumerate(planes(byte, bits, biased=True)):
        want = ((np.arange(256).reshape(16, 16) >> (j * bits)) & ((1 << bits) - 1)) + 2.0 ** (10 - j * bits)
        np.testing.assert_array_equal(np.asarray(plane, np.float32), want)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("cfg, bs, lens, window, dtype", [
    ("kvarn_k4v2_g32_hpint8", 32, [100, 20, 64], None, jnp.float16),
    ("kvarn_k4v2_g32_hpint8", 32, [70, 33], None, jnp.bfloat16),
    ("kvarn_k4v2_g32_sink16", 64, [130, 10, 64, 65], None, jnp.float32),
    ("int8_hpint8_sink8", 32, [70, 3, 33], 37, jnp.float16),
    ("int4_sink16_hpint8", 32, [50, 16, 17], None, jnp.float16),
    ("kivi_k2v2_g32_hpbf16_sink16", 32, [90, 17], 20, jnp.float16),
    ("fp8_hpint8", 16, [40], 9, jnp.float16)])
def test_high_precision_formats_and_short_sinks(kernel, cfg, bs, lens, window, dtype, rng):
    """int8 sinks and rings (codes x per-token scale + zero) and sinks shorter than a block (the rest
    of block 0 read from its page, or from the ring while it is the query's; the sink positions from
    the sink only): lengths inside the sink, inside block 0, at block ends, windows into the sink."""
    cache, bt, sl, _ = build(cfg, lens, 2, 64, bs, rng, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), 8, 64)), jnp.float32)
    compare(q, cache, bt, sl, kernel=kernel, window=window)


def test_two_tail_blocks(rng):
    cache, bt, sl, _ = build("int4", [100, 64], 2, 64, 32, rng, tail_blocks=2)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    compare(q, cache, bt, sl)


def test_auto_on_cpu_is_the_reference(rng):
    if jax.default_backend() != "cpu":
        pytest.skip("auto picks the kernel off CPU")
    cache, bt, sl, _ = build("int8", [40], 2, 64, 32, rng)
    q = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.float32)
    a = kj.paged_decode_attention(q, cache, bt, sl)
    r = kj.paged_decode_attention_reference(q, cache, bt, sl)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def test_pallas_refuses_what_it_cannot_run(rng):
    cache = kj.PagedKVCache.create("int8", num_blocks=4, block_size=48, num_kv_heads=1, head_dim=64, max_seqs=1)
    q = jnp.zeros((1, 2, 64), jnp.float32) + 1
    with pytest.raises(ValueError, match=r"impl='pallas' cannot run this cache on the gpu kernel: block_size=48"):
        kj.paged_decode_attention(q, cache, jnp.zeros((1, 2), jnp.int32), jnp.array([10], jnp.int32), impl="pallas")
    with pytest.raises(ValueError, match="impl must be one of"):
        kj.paged_decode_attention(q, cache, jnp.zeros((1, 2), jnp.int32), jnp.array([10], jnp.int32), impl="triton")
    if jax.default_backend() != "gpu":  # compiled (not interpreted) only where Triton lowers
        ok = kj.PagedKVCache.create("int8", num_blocks=4, block_size=32, num_kv_heads=1, head_dim=64, max_seqs=1)
        with pytest.raises(ValueError, match="compiles for NVIDIA GPUs only"):
            kj.paged_decode_attention(q, ok, jnp.zeros((1, 2), jnp.int32), jnp.array([10], jnp.int32),
                                      impl="pallas", interpret=False)


# ----------------------------------------------------------------------------- the TPU kernel
@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g128", "int8"])
def test_tpu_head_dim_256_gqa_7_block_ends(cfg, rng):
    # lengths: mid-block, shorter than a block, exactly full (the query's own full block is read from
    # the high-precision ring), one past a block boundary
    c = kj.parse(cfg)
    bs = max(c.tile_tokens, 32)
    cache, bt, sl, _ = build(cfg, [2 * bs + 9, bs - 3, 2 * bs, bs + 1], 1, 256, bs, rng)
    q = jnp.asarray(rng.standard_normal((4, 7, 256)), jnp.float32)
    compare(q, cache, bt, sl, kernel="tpu")


@pytest.mark.parametrize("cfg", ["int8_static", "int_k8v4_static", "fp8_static"])
def test_tpu_static_schemes(cfg, rng):
    k, v = random_kv(rng, 256, 2, 64, dtype=np.float32)
    cal = kj.calibrate((jnp.asarray(k), jnp.asarray(v)), cfg)
    cache, bt, sl, _ = build(cfg, [100, 33], 2, 64, 32, rng, calibration=cal)
    q = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32)
    compare(q, cache, bt, sl, kernel="tpu")


def test_tpu_seq_ids_zero_length_two_tail_blocks_and_bad_table_entries(rng):
    # slots 3 and 1 of 4; a zero-length row; a ring of two blocks; table entries past each sequence
    # hold ids far outside the pool (vLLM leaves them unspecified): the kernel must not read them
    cache, bt, sl, _ = build("kvarn_k4v2_g32", [150, 64], 2, 64, 32, rng, max_seqs=4, seq_ids=[3, 1],
                             tail_blocks=2)
    bt = np.asarray(bt).copy()
    bt[1, 2:] = 10 ** 6
    bt = jnp.asarray(np.concatenate([bt, np.full((1, bt.shape[1]), -7, np.int32)]))
    sl = jnp.concatenate([sl, jnp.zeros(1, jnp.int32)])
    sid = jnp.array([3, 1, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    out, _ = compare(q, cache, bt, sl, kernel="tpu", seq_ids=sid)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g128", "kivi_k2v2_g32", "int4_g32", "int8_static", "fp8", "bf16",
                                 "kvarn_k4v2_g128_hpint8_sink16"])
def test_tpu_kernel_lowers_for_tpu(cfg):
    """The kernel lowers to a Mosaic custom call for an abstract TPU (jax lowers without the device).
    This checks Pallas -> Mosaic emission (shapes, scalar prefetch, every op has a TPU rule); Mosaic's
    own compilation needs a TPU and is not run here."""
    from kvarn_jax.attention.paged_decode_tpu import paged_decode_tpu
    c = kj.parse(cfg)
    cal = None
    if c.static:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 8, 128)), jnp.float32)
        cal = kj.calibrate((x, x), cfg)
    cache = kj.PagedKVCache.create(cfg, num_blocks=64, block_size=128, num_kv_heads=8, head_dim=128, max_seqs=4,
                                   dtype=jnp.bfloat16, calibration=cal)
    args = (jnp.zeros((4, 32, 128), jnp.bfloat16), cache, jnp.zeros((4, 16), jnp.int32),
            jnp.full((4,), 1000, jnp.int32), jnp.arange(4, dtype=jnp.int32))
    fn = lambda *a: paged_decode_tpu(*a, scale=0.1, window=None, interpret=False)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and f"kvarn_paged_decode_tpu_{c.name}" in text


def test_tpu_kernel_argument_errors(rng):
    cache, bt, sl, _ = build("int8", [40], 1, 64, 32, rng)
    q = jnp.asarray(rng.standard_normal((1, 2, 64)), jnp.float32)
    with pytest.raises(ValueError, match="kernel must be one of"):
        kj.paged_decode_attention(q, cache, bt, sl, impl="pallas", kernel="cuda")
    with pytest.raises(ValueError, match="num_splits applies to the GPU kernel only"):
        kj.paged_decode_attention(q, cache, bt, sl, impl="pallas", kernel="tpu", interpret=True, num_splits=2)
    odd = kj.PagedKVCache.create("int8", num_blocks=4, block_size=12, num_kv_heads=1, head_dim=64, max_seqs=1)
    with pytest.raises(ValueError, match="on the tpu kernel: block_size=12"):
        kj.paged_decode_attention(q, odd, jnp.zeros((1, 4), jnp.int32), jnp.array([10], jnp.int32), impl="pallas",
                                  kernel="tpu", interpret=True)
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match="compiles for TPUs only"):
            kj.paged_decode_attention(q, cache, bt, sl, impl="pallas", kernel="tpu", interpret=False)


def test_narrowed_operands_equal_per_product_scaling(rng):
    """A bf16/fp32 cache's operand narrowed once (`layout.narrow_operand`) gives every product exactly what
    scaling it inside each product gives, values beyond fp16's range included; small products
    (broadcast multiply and sum) see the unrounded operand."""
    from kvarn_jax.attention.paged_decode_pallas import layout
    a = jnp.asarray(rng.standard_normal((16, 64)) * np.where(rng.random((16, 64)) < 0.05, 3e5, 1.0), jnp.float32)
    codes = jnp.asarray(rng.integers(0, 16, (32, 64)), jnp.float16)
    n = layout.narrow_operand(a)
    assert float(jnp.max(jnp.abs(n.x16.astype(jnp.float32)))) <= 65504.0
    want = layout.dot_t(a, codes, wide=True)
    np.testing.assert_array_equal(np.asarray(layout.dot_t(n, codes, wide=True)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(layout.dot_t(codes, n, wide=True)), np.asarray(layout.dot_t(codes, a, wide=True)))
    assert np.isfinite(np.asarray(want)).all()
    exact = np.asarray(a, np.float64) @ np.asarray(codes, np.float64).T
    np.testing.assert_allclose(np.asarray(want), exact, rtol=0, atol=2e-3 * np.abs(exact).max())
    small = jnp.asarray(rng.integers(0, 4, (8, 64)), jnp.float16)  # N = 8 < 16: the broadcast path
    np.testing.assert_array_equal(np.asarray(layout.dot_t(n, small, wide=True)),
                                  np.asarray(layout.dot_t(a, small, wide=True)))
    assert layout.narrow_operand(codes).scale is None


@pytest.mark.parametrize("k_mag, v_mag", [(1e-12, 1e-20), (3e5, 1e9), (1e4, 1e-6)])
def test_bf16_kvarn_cache_of_any_magnitude_decodes_like_the_reference(k_mag, v_mag, rng):
    """A bf16 KVarN cache's tiles are balanced at write (`kvarn.balance`), so the kernel's fp16
    products see bounded factors whatever the data's magnitude: keys and values far below or above
    fp16's range (the query scaled inversely to the keys) decode as close to the reference as the
    same data at magnitude 1 does, finite. (Values of 1e-20 were zeros while their token scales
    entered the products as stored: fp16 underflows below 6e-8.)"""
    from kvarn_jax.attention import paged_decode_pallas as pdp
    from kvarn_jax.hadamard import rotate, unrotate
    lens, bs = [70, 129], 64
    nb = sum(-(-L // bs) for L in lens) + 2
    seqs = [random_kv(rng, L, 2, 64, dtype=np.float32, outliers=2) for L in lens]
    tables = allocate_tables(rng, lens, bs, nb)
    bt, sl = jnp.asarray(tables), jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 8, 64)) * 2, jnp.float32)
    seed = int(rng.integers(1 << 30))

    def error(km, vm):
        cache = kj.PagedKVCache.create("kvarn_k4v2_g32", num_blocks=nb, block_size=bs, num_kv_heads=2, head_dim=64,
                                       max_seqs=2, dtype=jnp.bfloat16)
        cache = serve_writes(cache, tables, [(k * km, v * vm) for k, v in seqs], np.random.default_rng(seed))
        o = pdp.paged_decode_pallas(rotate(q / km), cache, bt, sl, jnp.arange(2, dtype=jnp.int32), scale=0.125,
                                    window=None, interpret=INTERPRET, launch=pdp.Launch(num_splits=2))
        out = np.asarray(unrotate(o), np.float64)
        ref = np.asarray(kj.paged_decode_attention(q / km, cache, bt, sl, impl="reference", scale=0.125), np.float64)
        assert np.isfinite(out).all() and np.abs(ref).max() > 0
        return np.abs(out - ref).max() / np.abs(ref).max()

    assert error(k_mag, v_mag) <= 2 * error(1.0, 1.0) + 1e-3


@pytest.mark.parametrize("cfg, kw", [("kvarn_k4v2_g32", {}), ("kvarn_k4v2_g32", {"orient": "heads"}),
                                     ("kivi_k2v2_g32", {"sums": "reduce"})])
def test_narrow_bound_gives_the_same_bits_as_max(cfg, kw, rng):
    """narrow="bound" (KVarN: the query brought into range once per program, its tiles balanced at
    write; KIVI: the power of two from the query's maximum and the tile's scale vector) against
    "max" (from the scaled operand's own maximum) on a bf16 cache whose values exceed fp16's range:
    a power of two changes no fp16 rounding of a normal number, so the outputs are the same bits,
    finite, and within the kernel's tolerance of the reference."""
    from helpers import allocate_tables, random_kv, serve_writes
    from kvarn_jax.attention import paged_decode_pallas as pdp
    from kvarn_jax.hadamard import rotate, unrotate
    lens, bs = [70, 129], 64
    nb = sum(-(-L // bs) for L in lens) + 2
    cache = kj.PagedKVCache.create(cfg, num_blocks=nb, block_size=bs, num_kv_heads=2, head_dim=64, max_seqs=2,
                                   dtype=jnp.bfloat16)
    seqs = []
    for L in lens:
        k, v = random_kv(rng, L, 2, 64, dtype=np.float32, outliers=2)
        seqs.append((k * np.where(rng.random((L, 1, 1)) < 0.1, 3e5, 1.0), v * 3e5))
    tables = allocate_tables(rng, lens, bs, nb)
    cache = serve_writes(cache, tables, seqs, rng)
    bt, sl, sid = jnp.asarray(tables), jnp.asarray(lens, jnp.int32), jnp.arange(2, dtype=jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 8, 64)) * 2, jnp.float32)
    c = kj.parse(cfg)
    outs = {}
    for narrow in ("max", "bound"):
        o = pdp.paged_decode_pallas(rotate(q) if c.rotated else q, cache, bt, sl, sid, scale=0.125, window=None,
                                    interpret=INTERPRET, launch=pdp.Launch(num_splits=2, narrow=narrow, **kw))
        outs[narrow] = np.asarray(unrotate(o) if c.rotated else o, np.float32)
    np.testing.assert_array_equal(outs["bound"], outs["max"])
    assert np.isfinite(outs["bound"]).all()
    ref = np.asarray(kj.paged_decode_attention(q, cache, bt, sl, impl="reference", scale=0.125), np.float32)
    np.testing.assert_allclose(outs["bound"], ref, rtol=0, atol=4e-3 * np.abs(ref).max())
    with pytest.raises(ValueError, match="narrow must be"):
        pdp.resolve_launch(c, pdp.CallShape(batch=2, q_heads=8, kv_heads=2, head_dim=64, block_size=bs, max_blocks=3,
                                            interpret=True), pdp.Launch(narrow="exact"))
