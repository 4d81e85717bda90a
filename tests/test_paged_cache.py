import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvarn_jax as kj
from helpers import allocate_tables, dense_attention, expected_kv, random_kv, serve_writes
from kvarn_jax.hadamard import hadamard_matrix_np, rotate_rows


def make_cache(cfg, num_blocks=24, block_size=32, heads=2, dim=64, max_seqs=4, dtype=jnp.float16, **kw):
    return kj.PagedKVCache.create(cfg, num_blocks=num_blocks, block_size=block_size, num_kv_heads=heads,
                                  head_dim=dim, max_seqs=max_seqs, dtype=dtype, **kw)


def poison(cache, rng):
    """Fill every array of the cache with random garbage (never zeros)."""
    def junk(a):
        if a.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, a.shape, dtype=np.uint8))
        if a.dtype == jnp.int32:
            return a
        return jnp.asarray(rng.standard_normal(a.shape) * 7 + 3, a.dtype)
    return jax.tree_util.tree_map(junk, cache)


def check_against_oracle(cfg, cache, tables, seqs, rng, hq, window=None, calibration=None):
    lens = [s[0].shape[0] for s in seqs]
    bt, sl = jnp.asarray(tables), jnp.asarray(lens, jnp.int32)
    kd, vd = kj.gather_dense(cache, bt, sl)
    c = kj.parse(cfg)
    exp_k, exp_v = [], []
    for i, (k, v) in enumerate(seqs):
        ek, ev = expected_kv(c, k, v, cache.block_size, cache.dtype) if not c.static else _static_expected(c, k, v, cache, calibration)
        exp_k.append(ek)
        exp_v.append(ev)
        for got, exp in ((kd, ek), (vd, ev)):
            g = np.asarray(got[i, :, :lens[i]]).transpose(1, 0, 2)
            np.testing.assert_allclose(g, exp, rtol=2e-3, atol=2e-3 * (np.abs(exp).max() + 1e-6))
    d = cache.head_dim
    q = rng.standard_normal((len(seqs), hq, d)).astype(np.float32)
    out = np.asarray(kj.paged_decode_attention_reference(jnp.asarray(q), cache, bt, sl, window=window))
    qq = q @ hadamard_matrix_np(d) if c.rotated else q
    ref = dense_attention(qq.astype(np.float64), exp_k, exp_v, lens, 1 / np.sqrt(d), window)
    if c.rotated:
        ref = ref @ hadamard_matrix_np(d)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def _static_expected(c, k, v, cache, calibration):
    full = ((k.shape[0] - 1) // cache.block_size) * cache.block_size  # the last token's block stays exact
    out = []
    kc, vc = (jnp.asarray(x, cache.dtype) for x in (k, v))  # static parameters in the cache's dtype, as it has them
    kq, vq = kj.dequantize(dataclasses.replace(kj.quantize((kc, vc), c, calibration=calibration), dtype="float32"))
    for x, xq in ((k, kq), (v, vq)):
        e = np.asarray(jnp.asarray(x, cache.dtype).astype(jnp.float32)).astype(np.float64)
        e[cache.block_size:full] = np.asarray(xq.astype(jnp.float32))[cache.block_size:full]
        out.append(e)
    return out


SCHEMES = ["kvarn_k4v2_g32", "kvarn_k2v4_g32", "kivi_k2v2_g32", "int4", "int8_g16", "int_k8v2", "fp8", "fp16", "bf16"]


@settings(max_examples=6)  # each example compiles the write and attention anew (~14 s on 2 CI cores)
@given(cfg=st.sampled_from(SCHEMES), dim=st.sampled_from([64, 128]), heads=st.sampled_from([1, 2]),
       ratio=st.sampled_from([1, 4, 7, 8]), blocks_per_tile=st.sampled_from([1, 2]),
       lens=st.lists(st.integers(1, 150), min_size=1, max_size=3), dtype=st.sampled_from(["float16", "bfloat16"]),
       seed=st.integers(0, 2 ** 16))
def test_serving_writes_then_attention_match_dense_oracle(cfg, dim, heads, ratio, blocks_per_tile, lens, dtype, seed):
    rng = np.random.default_rng(seed)
    c = kj.parse(cfg)
    bs = max(c.tile_tokens, 16) * blocks_per_tile
    nb = sum(-(-L // bs) for L in lens) + 2
    cache = poison(make_cache(cfg, num_blocks=nb, block_size=bs, heads=heads, dim=dim, max_seqs=3,
                              dtype=jnp.dtype(dtype)), rng)
    cache = dataclasses.replace(cache, dropped_tokens=jnp.zeros((), jnp.int32))
    seqs = [random_kv(rng, L, heads, dim, dtype=np.float32, outliers=2) for L in lens]
    tables = allocate_tables(rng, lens, bs, nb)
    cache = serve_writes(cache, tables, seqs, rng)
    assert int(cache.dropped_tokens) == 0
    check_against_oracle(cfg, cache, tables, seqs, rng, hq=heads * ratio)


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g64", "int4_g32", "fp8"])
@pytest.mark.parametrize("block_size", [64, 256])  # 128-token blocks of 64-token tiles: test_block_ids_read_ahead
def test_block_sizes(cfg, block_size, rng):
    lens = [block_size * 2 + 5, block_size - 3, block_size * 2]  # mid-block, < 1 block, exactly full
    nb = 8
    cache = make_cache(cfg, num_blocks=nb, block_size=block_size, heads=1, dim=64, max_seqs=3)
    seqs = [random_kv(rng, L, 1, 64, dtype=np.float32) for L in lens]
    tables = allocate_tables(rng, lens, block_size, nb)
    cache = serve_writes(cache, tables, seqs, rng)
    check_against_oracle(cfg, cache, tables, seqs, rng, hq=4)


@pytest.mark.parametrize("cfg", ["int8_static", "fp8_static"])
def test_static_schemes_in_the_cache(cfg, rng):
    seqs = [random_kv(rng, L, 2, 64, dtype=np.float32) for L in (100, 40)]
    cal = kj.calibrate([(jnp.asarray(k), jnp.asarray(v)) for k, v in seqs], cfg)
    cache = make_cache(cfg, calibration=cal)
    tables = allocate_tables(rng, [100, 40], 32, 24)
    cache = serve_writes(cache, tables, seqs, rng)
    check_against_oracle(cfg, cache, tables, seqs, rng, hq=4, calibration=cal)


def test_sliding_window(rng):
    lens = [150, 37]
    cache = make_cache("kvarn_k4v4_g32")
    seqs = [random_kv(rng, L, 2, 64, dtype=np.float32) for L in lens]
    tables = allocate_tables(rng, lens, 32, 24)
    cache = serve_writes(cache, tables, seqs, rng)
    check_against_oracle("kvarn_k4v4_g32", cache, tables, seqs, rng, hq=8, window=50)


def test_zero_length_sequence_gives_zero_output(rng):
    cache = make_cache("int8")
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    out = kj.paged_decode_attention_reference(q, cache, jnp.zeros((2, 3), jnp.int32), jnp.array([0, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), 0)


@pytest.mark.parametrize("cfg", ["int8", "int4_g32", "int_k8v2", "fp8"])
def test_per_token_value_codes_are_stored_tokens_last(cfg, rng):
    """Per-token int and fp8 value codes live in the pages as [.., D*b/8, block_size] (the decode kernel reads
    them along tokens): a completed block's value page is the quantized tokens' codes transposed,
    its key page and scales are the codes per token, as `schemes.quantize_side` makes them."""
    from kvarn_jax import schemes
    c = kj.parse(cfg)
    bs, hk, d = 16, 2, 32
    cache = poison(make_cache(cfg, num_blocks=6, block_size=bs, heads=hk, dim=d), rng)
    k, v = (jnp.asarray(rng.standard_normal((3 * bs, hk, d)) * 2, jnp.float16) for _ in range(2))
    table = np.array([4, 1, 3])                                   # logical block j -> physical
    slots = jnp.asarray(table[np.arange(3 * bs) // bs] * bs + np.arange(3 * bs) % bs, jnp.int32)
    out = kj.write(cache, k, v, slots, seq_ids=jnp.zeros(3 * bs, jnp.int32), positions=jnp.arange(3 * bs))
    assert out.pages["v"]["codes"].shape == (6, hk, d * c.v_bits // 8, bs)
    assert out.pages["k"]["codes"].shape == (6, hk, bs, d * c.k_bits // 8)
    for j in (1, 2):                                              # block 0 is the sequence's sink
        for side, x in (("k", k), ("v", v)):
            want = schemes.quantize_side(x[j * bs:(j + 1) * bs].transpose(1, 0, 2), c, side)  # [Hk, bs, ...]
            for name, f in want.items():
                got = np.asarray(out.pages[side][name][table[j]])
                if side == "v" and name == "codes":
                    got = got.swapaxes(-1, -2)
                np.testing.assert_array_equal(got, np.asarray(f).astype(got.dtype), err_msg=f"{side}.{name} block {j}")


def test_rotated_io_convention(rng):
    lens = [90]
    cache = make_cache("kvarn_k4v2_g32")
    seqs = [random_kv(rng, 90, 2, 64, dtype=np.float32)]
    tables = allocate_tables(rng, lens, 32, 24)
    cache = serve_writes(cache, tables, seqs, rng)
    q = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.float32)
    bt, sl = jnp.asarray(tables), jnp.array(lens, jnp.int32)
    plain = kj.paged_decode_attention_reference(q, cache, bt, sl)
    rot = kj.paged_decode_attention_reference(kj.rotate(q), cache, bt, sl, rotated_io=True)
    np.testing.assert_allclose(np.asarray(kj.unrotate(rot)), np.asarray(plain), atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_rotated_output_is_the_output_in_the_stored_frame(rng, impl):
    """`rotated_output=True` leaves a KVarN cache's output rotated (q still in the model frame);
    followed by a matrix that holds the rotation (`rotate_rows`) it gives the plain output's product.
    Caches that are not rotated ignore it."""
    lens = [90, 41]
    tables = jnp.asarray(allocate_tables(rng, lens, 32, 24))
    sl = jnp.array(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4 * 64, 24)), jnp.float32)
    for scheme in ("kvarn_k4v2_g32", "int8"):
        cache = serve_writes(make_cache(scheme), np.asarray(tables),
                             [random_kv(rng, n, 2, 64, dtype=np.float32) for n in lens], rng)
        plain = kj.paged_decode_attention(q, cache, tables, sl, impl=impl)
        rot = kj.paged_decode_attention(q, cache, tables, sl, impl=impl, rotated_output=True)
        if scheme == "int8":
            np.testing.assert_array_equal(np.asarray(rot), np.asarray(plain))
            continue
        np.testing.assert_allclose(np.asarray(kj.rotate(plain)), np.asarray(rot), atol=1e-5)
        np.testing.assert_allclose(np.asarray(rot.reshape(2, -1) @ rotate_rows(w, 64)),
                                   np.asarray(plain.reshape(2, -1) @ w), atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(heads=st.integers(1, 4), log_d=st.integers(1, 7), n=st.integers(1, 9), scale=st.sampled_from([1e-6, 1.0, 1e6]))
def test_rotate_rows_carries_the_rotation_into_the_next_product(heads, log_d, n, scale):
    d = 1 << log_d
    r = np.random.default_rng(heads * 1000 + log_d * 10 + n)
    x = jnp.asarray(r.standard_normal((3, heads, d)) * scale, jnp.float32)
    w = jnp.asarray(r.standard_normal((heads * d, n)), jnp.float32)
    got = kj.rotate(x).reshape(3, -1) @ rotate_rows(w, d)
    want = x.reshape(3, -1) @ w
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * scale * np.sqrt(heads * d))
    with pytest.raises(ValueError, match="head_dim"):
        rotate_rows(w[1:], d)


@settings(max_examples=25, deadline=None)
@given(log_d=st.integers(1, 7), rows=st.integers(1, 40), scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e30]),
       bound=st.sampled_from([None, 2.0 ** 50]))
def test_a_bf16_rotation_is_the_fp32_rotation(log_d, rows, scale, bound):
    """bf16 rows rotate as one bf16 product of H's signs with fp32 sums (`hadamard.rotate`): the
    fp32 rotation of the same values up to the order of the sums, at any magnitude, clipped to the
    bound as before; rows beyond SAFE_ABS come out finite and equal to the fp32 path's too."""
    from kvarn_jax.hadamard import SAFE_ABS, _matmul, hadamard_matrix
    assert SAFE_ABS < 2.0 ** 120
    d = 1 << log_d
    r = np.random.default_rng(log_d * 100 + rows)
    x = jnp.asarray(r.standard_normal((rows, 2, d)) * scale * np.exp(r.standard_normal((rows, 2, d))), jnp.bfloat16)
    if bound is None:
        x = x.at[0, 0, 0].set(jnp.bfloat16(2.0 ** 120))   # a row beyond SAFE_ABS: scaled, not overflowed
    got = kj.rotate(x, jnp.float32, max_abs=bound)
    want = _matmul(x.astype(jnp.float32), hadamard_matrix(d), bound)
    assert got.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(got)))
    row_max = np.max(np.abs(np.asarray(want)), axis=-1, keepdims=True)
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(err <= 4e-7 * np.sqrt(d) * row_max), float(np.max(err / row_max))


# ------------------------------------------------------------------ isolation
@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g32", "int4", "fp16"])
def test_writes_touch_only_the_named_slots(cfg, rng):
    cache = poison(make_cache(cfg, num_blocks=10, max_seqs=3), rng)
    before = jax.tree_util.tree_map(np.asarray, cache)
    # sequence 1 gets blocks 3 and 7: a 32-token sink block and 20 tokens of its second block
    k, v = random_kv(rng, 52, 2, 64, dtype=np.float32)
    slots = np.concatenate([3 * 32 + np.arange(32), 7 * 32 + np.arange(20)])
    cache = kj.write(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots, jnp.int32),
                     seq_ids=jnp.full((52,), 1, jnp.int32), positions=jnp.arange(52, dtype=jnp.int32))
    after = jax.tree_util.tree_map(np.asarray, cache)
    c = kj.parse(cfg)
    for side in ("k", "v"):
        for name in before.pages[side]:
            b, a = before.pages[side][name], after.pages[side][name]
            touched = [3, 7] if c.is_passthrough else []  # quantized schemes: nothing is full yet
            for blk in range(10):
                if blk not in touched:
                    np.testing.assert_array_equal(a[blk], b[blk], err_msg=f"page {blk} changed")
            if c.is_passthrough:
                np.testing.assert_array_equal(a[7][:, 20:], b[7][:, 20:])  # unwritten slots of block 7
        if not c.is_passthrough:
            for s in (0, 2):
                np.testing.assert_array_equal(after.sink[side][s], before.sink[side][s])
                np.testing.assert_array_equal(after.tail[side][s], before.tail[side][s])
            np.testing.assert_array_equal(after.tail[side][1][:, 20:], before.tail[side][1][:, 20:])
    # complete block 7: now exactly page 7 changes among the pages
    k2, v2 = random_kv(rng, 12, 2, 64, dtype=np.float32)
    cache = kj.write(cache, jnp.asarray(k2), jnp.asarray(v2), jnp.asarray(7 * 32 + np.arange(20, 32), jnp.int32),
                     seq_ids=jnp.full((12,), 1, jnp.int32), positions=jnp.arange(52, 64, dtype=jnp.int32))
    final = jax.tree_util.tree_map(np.asarray, cache)
    for side in ("k", "v"):
        for name in before.pages[side]:
            for blk in range(10):
                if blk != 7 and not (c.is_passthrough and blk == 3):
                    np.testing.assert_array_equal(final.pages[side][name][blk], before.pages[side][name][blk])
            assert not np.array_equal(final.pages[side][name][7], before.pages[side][name][7])


def test_invalid_entries_under_jit_are_dropped_and_counted(rng):
    cache = poison(make_cache("kvarn_k4v2_g32", num_blocks=4, max_seqs=2), rng)
    cache = dataclasses.replace(cache, dropped_tokens=jnp.zeros((), jnp.int32))
    before = jax.tree_util.tree_map(np.asarray, cache)
    k, v = random_kv(rng, 4, 2, 64, dtype=np.float32)
    slots = jnp.array([4 * 32, 5, -1, 2], jnp.int32)          # out of range; ok; padding; bad seq id
    seq_ids = jnp.array([0, 1, 0, 9], jnp.int32)
    positions = jnp.array([0, 6, 0, 2], jnp.int32)             # slot 5 has offset 5 but position 6
    out = jax.jit(kj.write)(cache, jnp.asarray(k), jnp.asarray(v), slots, seq_ids=seq_ids, positions=positions)
    assert int(out.dropped_tokens) == 3  # padding is not counted
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(out)):
        if a.shape:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ speculative decoding
def test_rollback_across_a_block_boundary_with_two_tail_blocks(rng):
    bs = 32
    k, v = random_kv(rng, 100, 2, 64, dtype=np.float32)
    wk, wv = random_kv(rng, 100, 2, 64, dtype=np.float32)  # rejected drafts
    table = np.array([[5, 2, 9, 0]], np.int32)

    def put(cache, kk, vv, lo, hi, step=2):
        # in calls of `step` tokens, as speculative decoding writes them (one shape: one compile)
        for a in range(lo, hi, step):
            pos = np.arange(a, a + step)
            slots = table[0, pos // bs] * bs + pos % bs
            cache = kj.write(cache, jnp.asarray(kk[a:a + step]), jnp.asarray(vv[a:a + step]),
                             jnp.asarray(slots, jnp.int32), seq_ids=jnp.zeros(step, jnp.int32),
                             positions=jnp.asarray(pos, jnp.int32))
        return cache

    cache = put(make_cache("kvarn_k4v2_g32", tail_blocks=2), k, v, 0, 60)
    cache = put(cache, wk, wv, 60, 70)   # drafts complete block 1 (positions 32..63) and spill into block 2
    cache = put(cache, k, v, 60, 70)     # verification rejected them: the correct tokens are re-written
    cache = put(cache, k, v, 70, 76)
    fresh = put(make_cache("kvarn_k4v2_g32", tail_blocks=2), k, v, 0, 76, step=38)  # and in whole prefills
    for a, b in zip(kj.gather_dense(cache, jnp.asarray(table), jnp.array([76])),
                    kj.gather_dense(fresh, jnp.asarray(table), jnp.array([76]))):
        np.testing.assert_array_equal(np.asarray(a[:, :, :76]), np.asarray(b[:, :, :76]))
    # a rollback to inside block 1 (seq_len 62) reads block 1 from the ring, not from its page
    rb = put(put(make_cache("kvarn_k4v2_g32", tail_blocks=2), k, v, 0, 62), wk, wv, 62, 66)
    kd, _ = kj.gather_dense(rb, jnp.asarray(table), jnp.array([62]))
    exp = np.asarray(kj.rotate(jnp.asarray(k[32:62]), jnp.float16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(kd[0, :, 32:62]).transpose(1, 0, 2), exp)


# ------------------------------------------------------------------ jit / vmap
def test_jit_with_donation_matches_eager(rng):
    cache = make_cache("kvarn_k4v2_g32", max_seqs=2)
    k, v = random_kv(rng, 64, 2, 64, dtype=np.float32)
    args = (jnp.asarray(k), jnp.asarray(v), jnp.arange(64, dtype=jnp.int32) + 64)
    kw = dict(seq_ids=jnp.zeros(64, jnp.int32), positions=jnp.arange(64, dtype=jnp.int32))
    eager = kj.write(cache, *args, **kw)
    jitted = jax.jit(kj.write, donate_argnums=0)(make_cache("kvarn_k4v2_g32", max_seqs=2), *args, **kw)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_arrays_closed_over_by_a_jitted_caller_are_checked_and_written(rng):
    """Concrete arrays captured by a jitted function: the checks still run (no tracer errors) and the
    result equals the eager write."""
    k, v = (jnp.asarray(a) for a in random_kv(rng, 64, 2, 64, dtype=np.float32))
    slots = jnp.arange(64, dtype=jnp.int32) + 64
    sid, pos = jnp.zeros(64, jnp.int32), jnp.arange(64, dtype=jnp.int32)
    eager = kj.write(make_cache("kvarn_k4v2_g32", max_seqs=2), k, v, slots, seq_ids=sid, positions=pos)
    closed = jax.jit(lambda c: kj.write(c, k, v, slots, seq_ids=sid, positions=pos))(
        make_cache("kvarn_k4v2_g32", max_seqs=2))
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(closed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad_pos = pos.at[3].set(7)
    with pytest.raises(ValueError, match=r"positions\[3\] = 7 and slot_mapping\[3\] = 67 disagree"):
        jax.jit(lambda c: kj.write(c, k, v, slots, seq_ids=sid, positions=bad_pos))(make_cache("kvarn_k4v2_g32", max_seqs=2))
    bad_k = k.at[0, 0, 0].set(jnp.inf)
    with pytest.raises(ValueError, match="k contains 1 non-finite"):
        jax.jit(lambda c: kj.write(c, bad_k, v, slots, seq_ids=sid, positions=pos))(make_cache("kvarn_k4v2_g32", max_seqs=2))


def test_stack_layers_and_vmap(rng):
    layers = 3
    caches = kj.stack_layers([make_cache("int4", num_blocks=6, max_seqs=2) for _ in range(layers)])
    k, v = random_kv(rng, layers * 40, 2, 64, dtype=np.float32)
    k, v = jnp.asarray(k).reshape(layers, 40, 2, 64), jnp.asarray(v).reshape(layers, 40, 2, 64)
    slots = jnp.arange(40, dtype=jnp.int32) + 64
    kw = dict(seq_ids=jnp.zeros(40, jnp.int32), positions=jnp.arange(40, dtype=jnp.int32))
    out = jax.vmap(lambda c, k, v: kj.write(c, k, v, slots, **kw))(caches, k, v)
    q = jnp.asarray(rng.standard_normal((layers, 1, 4, 64)), jnp.float32)
    bt, sl = jnp.array([[2, 3, 0]], jnp.int32), jnp.array([40], jnp.int32)
    att = jax.vmap(lambda c, q: kj.paged_decode_attention_reference(q, c, bt, sl))(out, q)
    for layer in range(layers):
        single = kj.write(make_cache("int4", num_blocks=6, max_seqs=2), k[layer], v[layer], slots, **kw)
        np.testing.assert_array_equal(np.asarray(out.pages["k"]["codes"][layer]), np.asarray(single.pages["k"]["codes"]))
        ref = kj.paged_decode_attention_reference(q[layer], single, bt, sl)
        np.testing.assert_allclose(np.asarray(att[layer]), np.asarray(ref), rtol=1e-5, atol=1e-6)
    rep = kj.memory_report(out)
    assert rep["layers"] == 3 and rep["fp16_bytes"] == 3 * 6 * 32 * 2 * 64 * 4


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("cfg, dim, expected", [
    ("kvarn_k4v2_g128", 128, 108.0),   # 13,824 B per 128-token tile (docs/design.md §1.5)
    ("kvarn_k4v4_g128", 128, 140.0),   # (8192 + 768) + (8192 + 768) over 128 tokens
    ("int8", 128, 264.0),              # 128 codes + fp16 scale + zero, for K and V
    ("int4_g32", 128, 160.0),          # 64 codes + 4 groups x 4 B, x2
    ("fp8", 128, 260.0),               # 128 codes + fp16 scale, x2
    ("kivi_k2v2_g32", 128, 96.0),      # K: (1024 + 512)/32; V: (1024 + 256 + 256)/32
    ("fp16", 64, 256.0),
])
def test_bytes_per_token(cfg, dim, expected):
    assert kj.bytes_per_token(cfg, dim) == expected


def test_memory_report_exact():
    cache = make_cache("kvarn_k4v2_g128", num_blocks=10, block_size=128, heads=2, dim=128, max_seqs=3)
    rep = kj.memory_report(cache)
    assert rep["page_bytes"] == 10 * 2 * 13824
    assert rep["code_bytes"] == 10 * 2 * (8192 + 4096)
    assert rep["sink_bytes"] == 2 * 3 * 2 * 128 * 128 * 2
    assert rep["tail_bytes"] == rep["sink_bytes"]
    assert rep["total_bytes"] == rep["page_bytes"] + rep["sink_bytes"] + rep["tail_bytes"]
    assert rep["fp16_bytes"] == 10 * 128 * 2 * 128 * 4
    assert rep["bytes_per_token_per_head"] == 108.0
    assert rep["capacity_vs_fp16"] == pytest.approx(rep["fp16_bytes"] / rep["total_bytes"])
    assert "kvarn_k4v2_g128" in kj.format_memory_report(rep)
    assert sum(a.nbytes for a in jax.tree_util.tree_leaves(cache)) == rep["total_bytes"] + 4  # + dropped counter


# ------------------------------------------------------------------ errors
def test_create_errors():
    with pytest.raises(ValueError, match="max_seqs must be a positive int for kvarn_k4v2_g128"):
        kj.PagedKVCache.create("kvarn_k4v2_g128", num_blocks=4, block_size=128, num_kv_heads=1, head_dim=128)
    with pytest.raises(ValueError, match="block_size=64 cannot be used with kvarn_k4v2_g128"):
        make_cache("kvarn_k4v2_g128", block_size=64)
    with pytest.raises(ValueError, match="not a known scheme"):
        make_cache("kvarn_k4v2")
    with pytest.raises(ValueError, match="head_dim=80"):
        make_cache("kvarn_k4v2_g32", dim=80)
    with pytest.raises(ValueError, match="calibration is required by int8_static"):
        make_cache("int8_static")
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        make_cache("int8", num_blocks=0)


def test_write_errors(rng):
    cache = make_cache("kvarn_k4v2_g32", num_blocks=4, max_seqs=2)
    k, v = (jnp.asarray(a) for a in random_kv(rng, 3, 2, 64, dtype=np.float32))
    ok = dict(seq_ids=jnp.zeros(3, jnp.int32), positions=jnp.arange(3, dtype=jnp.int32))
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 128 is out of range"):
        kj.write(cache, k, v, jnp.array([0, 128, 2], jnp.int32), **ok)
    with pytest.raises(ValueError, match=r"seq_ids\[2\] = 2 is out of range.*max_seqs=2"):
        kj.write(cache, k, v, jnp.arange(3, dtype=jnp.int32), seq_ids=jnp.array([0, 0, 2], jnp.int32),
                 positions=ok["positions"])
    with pytest.raises(ValueError, match=r"positions\[0\] = 5 and slot_mapping\[0\] = 0 disagree"):
        kj.write(cache, k, v, jnp.arange(3, dtype=jnp.int32), seq_ids=ok["seq_ids"],
                 positions=jnp.array([5, 1, 2], jnp.int32))
    with pytest.raises(ValueError, match="seq_ids is required by kvarn_k4v2_g32"):
        kj.write(cache, k, v, jnp.arange(3, dtype=jnp.int32))
    with pytest.raises(ValueError, match=r"k must be \[tokens, 2, 64\]"):
        kj.write(cache, k[:, :1], v[:, :1], jnp.arange(3, dtype=jnp.int32), **ok)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 3 tokens"):
        kj.write(cache, k, v, jnp.arange(2, dtype=jnp.int32), **ok)
    with pytest.raises(ValueError, match="slot_mapping must be an integer array"):
        kj.write(cache, k, v, jnp.arange(3, dtype=jnp.float32), **ok)
    with pytest.raises(ValueError, match="k contains 1 non-finite"):
        kj.write(cache, k.at[1, 1, 1].set(jnp.nan), v, jnp.arange(3, dtype=jnp.int32), **ok)


def test_attention_errors(rng):
    cache = make_cache("int8", num_blocks=4, max_seqs=2)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    bt = jnp.array([[0, 1], [2, 3]], jnp.int32)
    sl = jnp.array([40, 10], jnp.int32)
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 4 is out of range"):
        kj.paged_decode_attention_reference(q, cache, bt.at[1, 1].set(4), jnp.array([40, 40], jnp.int32))
    # an unused entry may hold anything (vLLM pads tables)
    kj.paged_decode_attention_reference(q, cache, bt.at[1, 1].set(99), sl)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 65 is out of range"):
        kj.paged_decode_attention_reference(q, cache, bt, jnp.array([65, 1], jnp.int32))
    with pytest.raises(ValueError, match="q has 3 heads, which is not a multiple"):
        kj.paged_decode_attention_reference(q[:, :3], cache, bt, sl)
    with pytest.raises(ValueError, match="block_tables has 2 rows, seq_lens 1"):
        kj.paged_decode_attention_reference(q, cache, bt, sl[:1])
    with pytest.raises(ValueError, match=r"seq_ids\[0\] = 3 is out of range"):
        kj.paged_decode_attention_reference(q, cache, bt, sl, seq_ids=jnp.array([3, 0], jnp.int32))
    with pytest.raises(ValueError, match="q contains"):
        kj.paged_decode_attention_reference(q.at[0, 0, 0].set(jnp.nan), cache, bt, sl)
    with pytest.raises(ValueError, match="window must be a positive int"):
        kj.paged_decode_attention_reference(q, cache, bt, sl, window=0)


# ------------------------------------------------------------------ high-precision storage options
HP_SCHEMES = ["kvarn_k4v2_g32_hpint8", "kvarn_k4v2_g32_sink16", "kvarn_k4v2_g32_hpint8_sink8", "kivi_k2v2_g32_hpint8",
              "int4_sink4", "int8_g16_hpint8_sink16", "fp8_hpbf16", "kvarn_k4v4_g32_hpfp32"]


@settings(max_examples=8)
@given(cfg=st.sampled_from(HP_SCHEMES), dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       lens=st.lists(st.integers(1, 110), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_high_precision_formats_and_short_sinks_match_the_oracle(cfg, dtype, lens, seed):
    rng = np.random.default_rng(seed)
    bs = 32
    nb = sum(-(-L // bs) for L in lens) + 2
    cache = poison(make_cache(cfg, num_blocks=nb, block_size=bs, heads=2, dim=64, max_seqs=3,
                              dtype=jnp.dtype(dtype)), rng)
    cache = dataclasses.replace(cache, dropped_tokens=jnp.zeros((), jnp.int32))
    seqs = [random_kv(rng, L, 2, 64, dtype=np.float32, outliers=2) for L in lens]
    tables = allocate_tables(rng, lens, bs, nb)
    cache = serve_writes(cache, tables, seqs, rng)
    assert int(cache.dropped_tokens) == 0
    check_against_oracle(cfg, cache, tables, seqs, rng, hq=4)


@pytest.mark.parametrize("cfg, dtype, fmt", [
    ("kvarn_k4v2_g128", jnp.float32, "float16"),      # never wider than 16 bits unless asked
    ("kvarn_k4v2_g128_hpfp32", jnp.float32, "float32"),
    ("int4", jnp.bfloat16, "bfloat16"), ("int4", jnp.float16, "float16"),
    ("kvarn_k4v2_g128_hpint8", jnp.float32, "int8"), ("kvarn_k4v2_g128_hpfp16", jnp.bfloat16, "float16")])
def test_high_precision_storage_dtype(cfg, dtype, fmt):
    cache = make_cache(cfg, num_blocks=2, block_size=128, heads=1, dim=128, max_seqs=2, dtype=dtype)
    assert cache.hp_format == fmt
    if fmt == "int8":
        assert cache.sink["k"].dtype == jnp.uint8 and cache.sink_meta["k"]["scale"].dtype == jnp.float16
        assert cache.tail_meta["v"]["zero"].shape == (2, 1, 128)
    else:
        assert cache.sink["k"].dtype == jnp.dtype(fmt) and cache.sink_meta is None
    # the pages' scales stay in the model dtype
    assert all(a.dtype in (jnp.uint8, jnp.dtype(dtype)) for d in cache.pages.values() for a in d.values())


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g32", "kvarn_k4v2_g32_hpint8_sink16", "int4_hpint8"])
def test_blocks_without_a_page_are_served_the_same(cfg, rng):
    """A serving layer may give no page (NO_PAGE) to blocks read only from high precision: the whole-
    block sink and the sequence's last block. Reads equal those of a cache with every page."""
    from kvarn_jax.cache.paged import NO_PAGE
    bs, lens = 32, [100, 64, 20]
    nb = sum(-(-L // bs) for L in lens)
    seqs = [random_kv(rng, L, 2, 64, dtype=np.float32, outliers=2) for L in lens]
    tables = allocate_tables(rng, lens, bs, nb)
    full = serve_writes(make_cache(cfg, num_blocks=nb, block_size=bs, heads=2, dim=64, max_seqs=3), tables, seqs,
                        np.random.default_rng(1))
    held = tables.copy()
    c = kj.parse(cfg)
    for i, L in enumerate(lens):
        n = -(-L // bs)
        held[i, n - 1] = NO_PAGE                     # the last block: always read from the ring
        if not c.sink_tokens:
            held[i, 0] = NO_PAGE                     # a whole-block sink
        held[i, n:] = NO_PAGE
    # tokens of NO_PAGE blocks carry slot NO_PAGE; pages of the others are poisoned first
    lean = poison(make_cache(cfg, num_blocks=nb, block_size=bs, heads=2, dim=64, max_seqs=3), rng)
    lean = dataclasses.replace(lean, dropped_tokens=jnp.zeros((), jnp.int32))

    def write(cache, k, v, slots, seq_ids, positions):
        s, pos, sid = np.asarray(slots), np.asarray(positions), np.asarray(seq_ids)
        blk = held[sid, pos // bs]
        s = np.where((s >= 0) & (blk == NO_PAGE), NO_PAGE, s)
        return kj.write(cache, k, v, jnp.asarray(s, jnp.int32), seq_ids=seq_ids, positions=positions)
    lean = serve_writes(lean, tables, seqs, np.random.default_rng(1), write=write)
    assert int(lean.dropped_tokens) == 0
    sl = jnp.asarray(lens, jnp.int32)
    for a, b in zip(kj.gather_dense(full, jnp.asarray(tables), sl), kj.gather_dense(lean, jnp.asarray(held), sl)):
        for i, L in enumerate(lens):
            np.testing.assert_array_equal(np.asarray(a[i, :, :L]), np.asarray(b[i, :, :L]))
    q = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(kj.paged_decode_attention(q, lean, jnp.asarray(held), sl, impl="pallas")),
                               np.asarray(kj.paged_decode_attention(q, full, jnp.asarray(tables), sl)),
                               rtol=0, atol=5e-3)
    # a block read from its page cannot be NO_PAGE
    bad = held.copy()
    bad[0, 1] = NO_PAGE
    with pytest.raises(ValueError, match="block_tables"):
        kj.gather_dense(lean, jnp.asarray(bad), sl)


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g32", "int4_sink16", "kivi_k2v2_g32"])
def test_reads_touch_only_the_pages_they_serve(cfg, rng):
    """gather_dense dequantizes only the blocks it serves from pages: with NaN in the pages of every
    other block (a whole-block sink, each query's block, the blocks past it, unused table entries),
    the positions a sequence has are unchanged and every position, garbage included, is finite."""
    bs, lens = 32, [100, 64, 20, 1]
    nb = sum(-(-L // bs) for L in lens) + 1
    seqs = [random_kv(rng, L, 2, 64, dtype=np.float32) for L in lens]
    tables = allocate_tables(rng, lens, bs, nb - 1, extra_cols=2)
    cache = serve_writes(make_cache(cfg, num_blocks=nb, block_size=bs, heads=2, dim=64, max_seqs=4), tables, seqs,
                         np.random.default_rng(1))
    c = kj.parse(cfg)
    unread = {nb - 1}                              # a spare block for the unused entries
    poisoned = tables.copy()
    for i, L in enumerate(lens):
        n = -(-L // bs)
        poisoned[i, n:] = nb - 1
        unread |= {int(tables[i, n - 1])} | ({int(tables[i, 0])} if not c.sink_tokens else set())
    nan = dataclasses.replace(cache, pages={s: {name: a.at[jnp.asarray(sorted(unread))].set(
        255 if a.dtype == jnp.uint8 else jnp.nan) for name, a in f.items()} for s, f in cache.pages.items()})
    sl = jnp.asarray(lens, jnp.int32)
    for a, b in zip(kj.gather_dense(cache, jnp.asarray(tables), sl), kj.gather_dense(nan, jnp.asarray(poisoned), sl)):
        assert np.isfinite(np.asarray(b)).all()
        for i, L in enumerate(lens):
            np.testing.assert_array_equal(np.asarray(a[i, :, :L]), np.asarray(b[i, :, :L]))
    q = jnp.asarray(rng.standard_normal((4, 4, 64)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(kj.paged_decode_attention(q, nan, jnp.asarray(poisoned), sl)),
                                  np.asarray(kj.paged_decode_attention(q, cache, jnp.asarray(tables), sl)))


@pytest.mark.parametrize("cfg", ["kvarn_k4v2_g32", "kvarn_k4v2_g32_hpint8_sink4", "int8_sink4", "fp16"])
def test_dense_tiles_equal_the_dense_context(cfg, rng):
    """`paged.dense_tiles` (prefill's per-tile read) gives exactly `gather_dense`'s slice for every
    offset and tile size, whether the tile starts mid-block, spans the sink, pages and ring, or
    ends at the table's last block; pages that are not the sequences' hold poison."""
    from kvarn_jax.cache.paged import dense_tiles
    lens, bs = [150, 37, 96], 32
    nb = sum(-(-L // bs) for L in lens) + 3
    cache = poison(make_cache(cfg, num_blocks=nb, block_size=bs, heads=2, dim=32, max_seqs=3), rng)
    seqs = [random_kv(rng, L, 2, 32, dtype=np.float32, outliers=2) for L in lens]
    tables = allocate_tables(rng, lens, bs, nb)
    cache = serve_writes(cache, tables, seqs, rng)
    tbl, sl = jnp.asarray(tables), jnp.asarray([L - int(rng.integers(0, 3)) for L in lens], jnp.int32)
    sid = jnp.asarray([2, 0, 1], jnp.int32)
    want = [np.asarray(x) for x in kj.gather_dense(cache, tbl, sl, sid)]
    read, length = dense_tiles(cache, tbl, sl, sid)
    assert length == want[0].shape[2]
    for tile in (8, 40, 64, length):
        f = jax.jit(lambda off, tile=tile: read(off, tile))
        for off in sorted({0, 5, 31, 32, 33, length - tile, *rng.integers(0, length - tile + 1, 4).tolist()}):
            if not 0 <= off <= length - tile:
                continue
            got = f(jnp.int32(off))
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), w[:, :, off:off + tile], err_msg=f"{tile=} {off=}")
