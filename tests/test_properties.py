"""Properties of the paged cache over random shapes, schemes, dtypes and magnitudes (hypothesis), from
the public API, complementing test_reliability.py (one sequence, fixed shape) and test_paged_cache.py
(ordinary magnitudes):

1. Write -> read is as accurate at every magnitude as at 1: the values attention reads are within
   the scheme's stated relative L2 error of the input, or the write counted the tokens it could not
   store as given; attention over them is finite and equals float64 attention over the values read.
2. One sequence's bad tokens (NaN, Inf, values beyond the storage range) never reach another
   sequence: under jit every other sequence's pages, high-precision blocks, read-back values and
   attention output are bit-identical to a run where the bad sequence's input was clean, the bad
   tokens are counted, and all that attention reads stays finite; eagerly the same write raises.
3. A hand-built KVQuantConfig is valid exactly when the string grammar has its fields.

Tolerances (relative L2 of the read-back values against the input, over Gaussian data): the largest
seen over the schemes, dtypes, head sizes and magnitudes below, with ~1.3-2x headroom - 8-bit codes
0.6% -> 1.2%; 4-bit 10% -> 15%; 2-bit 50% -> 65%; fp8 (e4m3) 2.7% -> 4%; plus the storage dtype's
rounding (bf16 2^-8) for every scheme.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import kvarn_jax as kj
from helpers import allocate_tables, dense_attention
from kvarn_jax.hadamard import hadamard_matrix_np
from kvarn_jax.storage import QUANT_MAX

DTYPES = ["float16", "bfloat16", "float32"]
EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -23}
CODE_ERROR = {8: 0.012, 4: 0.15, 2: 0.65}
FP8_ERROR = 0.04


def rel_l2_bound(cfg, side: str, dtype: str) -> float:
    if cfg.is_passthrough:
        return 2 * EPS[cfg.dtype]
    base = FP8_ERROR if cfg.method == "fp8" else CODE_ERROR[cfg.bits(side)]
    return base + 2 * EPS[dtype]


def _cache(cfg, dtype, bs, heads, dim, num_blocks, max_seqs, calibration=None):
    return kj.PagedKVCache.create(cfg, num_blocks=num_blocks, block_size=bs, num_kv_heads=heads, head_dim=dim,
                                  max_seqs=max_seqs, dtype=dtype, calibration=calibration)


def _block_size(cfg, per_tile: int) -> int:
    return max(cfg.tile_tokens, 16) * per_tile


def _calibration(cfg, seqs):
    if not cfg.static:
        return None
    k = np.concatenate([s[0] for s in seqs])
    v = np.concatenate([s[1] for s in seqs])
    return kj.calibrate([(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))], cfg)


def _in_dtype(x, dtype):
    """float64 copy of x as the cache's dtype holds it (finite: clipped to its range)."""
    big = float(jnp.finfo(jnp.dtype(dtype)).max)
    return np.asarray(jnp.asarray(np.clip(x, -big, big), dtype).astype(jnp.float32)).astype(np.float64)


_jit_write = jax.jit(lambda c, k, v, s, seq_ids, positions: kj.write(c, k, v, s, seq_ids=seq_ids, positions=positions))


def _one_call(cache, tables, seqs, dtype):
    """Every token of every sequence in one jitted write (sequence i in high-precision row i)."""
    bs = cache.block_size
    rows = [(i, p) for i, s in enumerate(seqs) for p in range(s[0].shape[0])]
    k = np.stack([seqs[i][0][p] for i, p in rows])
    v = np.stack([seqs[i][1][p] for i, p in rows])
    slots = np.array([tables[i, p // bs] * bs + p % bs for i, p in rows], np.int32)
    ids = np.array([i for i, _ in rows], np.int32)
    pos = np.array([p for _, p in rows], np.int32)
    args = (jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(slots))
    return args, jnp.asarray(ids), jnp.asarray(pos)


# ----------------------------------------------------------------------------- 1. every magnitude
ACCURACY_SCHEMES = ["kvarn_k4v2_g32", "kvarn_k8v4_g32", "kvarn_k2v2_g64", "kivi_k2v4_g32", "kivi_k4v2_g32", "int8",
                    "int4_g16", "int2_g32", "int_k8v4", "int8_static", "fp8", "fp8_static", "fp16", "bf16", "fp32"]


# magnitudes (powers of two) from small to the dtype's largest: fp16's end (2^13-2^15: KVarN's rotation
# can leave its range), bf16's and fp32's beyond fp16 (2^17, 2^20: fp16 scales overflowed there), up
# to 2^50 (the clip) and beyond it; each is capped at the dtype's largest exponent
EXPONENTS = [-8, -3, 0, 5, 10, 13, 15, 17, 20, 40, 60, 100, 127]


@settings(max_examples=10)  # each example compiles a write and the reads: ~6 s of CPU
@given(scheme=st.sampled_from(ACCURACY_SCHEMES), dtype=st.sampled_from(DTYPES),
       dim=st.sampled_from([16, 32, 64, 128]), heads=st.integers(1, 3), per_tile=st.sampled_from([1, 2]),
       n_seqs=st.integers(1, 3), exponent=st.sampled_from(EXPONENTS), seed=st.integers(0, 2 ** 16))
@example(scheme="int8", dtype="bfloat16", dim=64, heads=2, per_tile=1, n_seqs=2, exponent=20, seed=1)
@example(scheme="kvarn_k4v2_g32", dtype="float16", dim=128, heads=1, per_tile=1, n_seqs=1, exponent=13, seed=2)
@example(scheme="kivi_k2v4_g32", dtype="bfloat16", dim=32, heads=1, per_tile=2, n_seqs=2, exponent=100, seed=3)
def test_write_read_is_as_accurate_at_every_magnitude(scheme, dtype, dim, heads, per_tile, n_seqs, exponent, seed):
    cfg = kj.parse(scheme)
    try:
        cfg.check_head_dim(dim)
    except ValueError:
        dim = 64  # e.g. a 128-channel int group under a 16-channel head
    if cfg.is_passthrough:
        dtype = cfg.dtype
    rng = np.random.default_rng(seed)
    exponent = min(exponent, int(np.log2(float(jnp.finfo(jnp.dtype(dtype)).max))))
    mag = 2.0 ** exponent
    bs = _block_size(cfg, per_tile)
    lens = [int(rng.integers(2 * bs + 1, 4 * bs + 1)) if i == 0 else int(rng.integers(1, 4 * bs + 1))
            for i in range(n_seqs)]
    seqs = [tuple(_in_dtype(rng.standard_normal((n, heads, dim)) * mag, dtype) for _ in "kv") for n in lens]
    nb = sum(-(-n // bs) for n in lens) + 1
    cache = _cache(cfg, dtype, bs, heads, dim, nb, n_seqs, _calibration(cfg, seqs))
    tables = allocate_tables(rng, lens, bs, nb)
    args, ids, pos = _one_call(cache, tables, seqs, dtype)
    cache = _jit_write(cache, *args, ids, pos)
    bt, sl = jnp.asarray(tables), jnp.asarray(lens, jnp.int32)
    kd, vd = (np.asarray(a).astype(np.float64) for a in kj.gather_dense(cache, bt, sl))
    assert np.isfinite(kd).all() and np.isfinite(vd).all()

    h = hadamard_matrix_np(dim) if cfg.rotated else np.eye(dim)
    if int(cache.dropped_tokens) == 0:  # stored as given: within the scheme's error
        for side, dense in (("k", kd), ("v", vd)):
            got = np.concatenate([dense[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(lens)])
            want = np.concatenate([s[side == "v"] for s in seqs]) @ h
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err <= rel_l2_bound(cfg, side, dtype), (side, err, mag)
    else:  # only at the top of the range: fp16's (KVarN's rotation can take a token beyond it), or 2^50
        assert exponent >= 10, (int(cache.dropped_tokens), mag)

    # attention, with the query scaled so that the scores stay O(1) at every magnitude: finite, and
    # equal to float64 attention over the values read
    hq = heads * int(rng.integers(1, 4))
    q = rng.standard_normal((n_seqs, hq, dim)) / mag
    out = np.asarray(kj.paged_decode_attention(jnp.asarray(q, jnp.float32), cache, bt, sl, impl="reference"))
    assert np.isfinite(out).all()
    ks = [kd[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(lens)]
    vs = [vd[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(lens)]
    want = dense_attention(np.asarray(jnp.asarray(q, jnp.float32), np.float64) @ h, ks, vs, lens, 1 / np.sqrt(dim)) @ h
    scale = max(np.abs(v).max() for v in vs)
    np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3 * scale)


# ----------------------------------------------------------------------------- 2. isolation
def _stream(cache, tables, seqs, rng, rows_per_call=512):
    """Jitted writes as a server issues them: one prefill call with a random prefix of every sequence,
    then calls of 1-3 tokens per sequence; each padded (slot -1 rows) to one size, so one compile."""
    bs, lens = cache.block_size, [s[0].shape[0] for s in seqs]
    done = [int(rng.integers(0, n + 1)) for n in lens]
    calls = [[(i, p) for i in range(len(seqs)) for p in range(done[i])]]
    while any(d < n for d, n in zip(done, lens)):
        step = [int(rng.integers(1, 4)) for _ in lens]
        calls.append([(i, p) for i in range(len(seqs)) for p in range(done[i], min(lens[i], done[i] + step[i]))])
        done = [min(n, d + s) for n, d, s in zip(lens, done, step)]
    for rows in calls:
        pad = [(0, 0)] * (rows_per_call - len(rows))
        k = np.stack([seqs[i][0][p] for i, p in rows + pad])
        v = np.stack([seqs[i][1][p] for i, p in rows + pad])
        slots = [int(tables[i, p // bs]) * bs + p % bs for i, p in rows] + [-1] * len(pad)
        cache = _jit_write(cache, jnp.asarray(k, cache.dtype), jnp.asarray(v, cache.dtype),
                           jnp.asarray(slots, jnp.int32), jnp.asarray([i for i, _ in rows + pad], jnp.int32),
                           jnp.asarray([p for _, p in rows + pad], jnp.int32))
    return cache


ISOLATION_SCHEMES = ["kvarn_k4v2_g32", "kvarn_k2v4_g32", "kivi_k2v2_g32", "int4_g16", "int8", "int_k8v2", "fp8",
                     "int8_static", "fp16", "bf16", "fp32"]
BAD_KINDS = ["nan", "inf", "-inf", "dtype_max", "beyond"]


def _poison(x, kind, dtype, rng):
    """Make token x [Hk, D] (float64, in place) bad: NaN/Inf at one value, or every value at the dtype's
    largest finite one (finite: beyond fp16's range after KVarN's rotation, beyond 2^50 in bf16/fp32),
    or (fp32/bf16) some values beyond 2^50."""
    h, d = int(rng.integers(x.shape[0])), int(rng.integers(x.shape[1]))
    big = float(jnp.finfo(jnp.dtype(dtype)).max)
    if kind in ("nan", "inf", "-inf"):
        x[h, d] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
    elif kind == "dtype_max":
        x[...] = big * rng.choice([-1.0, 1.0])
    else:
        x[h, d] = min(big, QUANT_MAX * 4) * rng.choice([-1.0, 1.0])


@settings(max_examples=8)  # each example compiles a write, the reads and an eager write: ~12 s of CPU
@given(scheme=st.sampled_from(ISOLATION_SCHEMES), dtype=st.sampled_from(DTYPES), dim=st.sampled_from([32, 64]),
       heads=st.integers(1, 2), lens=st.lists(st.integers(1, 100), min_size=2, max_size=3),
       victim=st.integers(0, 2), bad=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 1), st.sampled_from(BAD_KINDS)),
                                               min_size=1, max_size=3),
       seed=st.integers(0, 2 ** 16))
def test_one_sequences_bad_tokens_never_reach_another(scheme, dtype, dim, heads, lens, victim, bad, seed):
    cfg = kj.parse(scheme)
    if cfg.is_passthrough:
        dtype = cfg.dtype
    victim %= len(lens)
    rng = np.random.default_rng(seed)
    bs = _block_size(cfg, 1)
    lens = [n + (bs if i == victim else 0) for i, n in enumerate(lens)]
    clean = [tuple(_in_dtype(rng.standard_normal((n, heads, dim)), dtype) for _ in "kv") for n in lens]
    dirty = [(k.copy(), v.copy()) for k, v in clean]
    bad_positions = set()
    for where, side, kind in bad:
        p = min(int(where * lens[victim]), lens[victim] - 1)
        bad_positions.add(p)
        _poison(dirty[victim][side][p], kind, dtype, rng)
    nonfinite = {p for p in bad_positions if not all(np.isfinite(s[p]).all() for s in dirty[victim])}
    nb = sum(-(-n // bs) for n in lens) + 2
    cache = _cache(cfg, dtype, bs, heads, dim, nb, len(lens), _calibration(cfg, clean))
    tables = allocate_tables(rng, lens, bs, nb)

    # the same serving stream (a prefill, then steps, sequences interleaved) with either input
    got, want = (_stream(cache, tables, seqs, np.random.default_rng(seed)) for seqs in (dirty, clean))
    extra = int(got.dropped_tokens) - int(want.dropped_tokens)
    assert int(want.dropped_tokens) == 0
    assert extra >= len(nonfinite), (extra, nonfinite)
    if extra == 0:  # nothing counted: every bad token was finite and stored as given
        assert not nonfinite

    mine = {int(b) for b in tables[victim, :-(-lens[victim] // bs)]}
    for side in "kv":
        for name, a in got.pages[side].items():
            b = want.pages[side][name]
            for blk in range(nb):
                if blk not in mine:
                    np.testing.assert_array_equal(np.asarray(a[blk]), np.asarray(b[blk]), err_msg=f"{side} {name}")
        for hp in ("sink", "tail"):
            if getattr(got, hp) is not None:
                for i in range(len(lens)):
                    if i != victim:
                        np.testing.assert_array_equal(np.asarray(getattr(got, hp)[side][i]),
                                                      np.asarray(getattr(want, hp)[side][i]))
    bt, sl = jnp.asarray(tables), jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), 2 * heads, dim)), jnp.float32)
    reads = [kj.gather_dense(c, bt, sl) + (kj.paged_decode_attention(q, c, bt, sl, impl="reference"),)
             for c in (got, want)]
    for a, b in zip(*reads):  # dense K, dense V [B, Hk, L, D] (positions past a length are junk), output
        a, b = np.asarray(a), np.asarray(b)
        for i, n in enumerate(lens):
            a_i, b_i = (x[i, :, :n] if x.ndim == 4 else x[i] for x in (a, b))
            assert np.isfinite(a_i).all()
            if i != victim:
                np.testing.assert_array_equal(a_i, b_i)

    # eagerly, the same tokens in one call raise and name why, or (nothing counted) are stored as given
    args, ids, pos = _one_call(cache, tables, dirty, dtype)
    if extra:
        with pytest.raises(ValueError, match="nothing was written|non-finite"):
            kj.write(cache, *args, seq_ids=ids, positions=pos)
    else:
        eager = kj.write(cache, *args, seq_ids=ids, positions=pos)
        assert int(eager.dropped_tokens) == 0


def test_the_bad_tokens_count_matches_the_reasons():
    """One fp16 KVarN sequence: a NaN token, an Inf token and a token at fp16's max (beyond the range
    once rotated) in one jitted write are counted once each (3); the eager call refuses each, saying why."""
    d, bs = 32, 32
    x = np.random.default_rng(1).standard_normal((2, 70, 1, d))
    x[0, 40, 0, 3], x[1, 50, 0, 0], x[:, 60] = np.nan, np.inf, 65504.0
    cache = _cache("kvarn_k4v2_g32", "float16", bs, 1, d, 3, 1)
    pos = jnp.arange(70, dtype=jnp.int32)
    k, v = (jnp.asarray(a, jnp.float16) for a in x)
    out = _jit_write(cache, k, v, pos, jnp.zeros(70, jnp.int32), pos)
    assert int(out.dropped_tokens) == 3
    with pytest.raises(ValueError) as e:
        kj.write(cache, k, v, pos, seq_ids=jnp.zeros(70, jnp.int32), positions=pos)
    assert "non-finite" in str(e.value)
    x[0, 40], x[1, 50] = 0.0, 0.0
    why = r"write: 1 token\(s\) with values the cache cannot hold.*L2 norm exceeds 65,504"
    with pytest.raises(ValueError, match=why):
        kj.write(cache, *(jnp.asarray(a, jnp.float16) for a in x), pos, seq_ids=jnp.zeros(70, jnp.int32), positions=pos)
    kd, vd = kj.gather_dense(out, jnp.arange(3, dtype=jnp.int32)[None], jnp.array([70], jnp.int32))
    assert np.isfinite(np.asarray(kd)).all() and np.isfinite(np.asarray(vd)).all()


# ----------------------------------------------------------------------------- 3. configs
def _spelled(method, k_bits, v_bits, group, static, dtype) -> str:
    """How the string grammar would write these fields (the grammar decides whether it accepts it)."""
    if method == "passthrough":
        return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, f"passthrough{k_bits}")
    if method == "fp8":
        return "fp8_static" if static else "fp8"
    if method in ("kvarn", "kivi"):
        return f"{method}_k{k_bits}v{v_bits}_g{group}" + ("_static" if static else "")
    base = f"{method}{k_bits}" if k_bits == v_bits else f"{method}_k{k_bits}v{v_bits}"
    return base + (f"_g{group}" if group else "") + ("_static" if static else "")


def test_a_hand_built_config_is_valid_exactly_when_the_grammar_has_it():
    """KVQuantConfig(...) checks what parse checks: over every combination of these field values
    (exhaustively: no jax, microseconds each) it is accepted iff the string spelling those fields
    parses to the same fields, and then its name is that string."""
    accepted = 0
    for f in itertools.product(["kvarn", "kivi", "int", "fp8", "passthrough", "nf"], [1, 2, 3, 4, 8, 16, 32],
                               [2, 3, 4, 8, 16, 32], [0, 8, 16, 32, 48, 64, 128, 256, 512], [False, True],
                               ["", "float16", "bfloat16", "float32"]):
        try:
            parsed = kj.parse(_spelled(*f))
        except ValueError:
            parsed = None
        if parsed is not None and (parsed.method, parsed.k_bits, parsed.v_bits, parsed.group, parsed.static,
                                   parsed.dtype) != f:
            parsed = None  # the string names other fields (fp8 is always 8/8, group 0)
        try:
            cfg = kj.KVQuantConfig(f[0], f[1], f[2], group=f[3], static=f[4], dtype=f[5])
        except ValueError:
            assert parsed is None, f
        else:
            assert cfg == parsed and cfg.name == _spelled(*f), f
            accepted += 1
    # the grammar within this domain: kvarn 3x3 bits x 3 groups, kivi 2x2 x 3, int 3x3 x (7 groups + static),
    # fp8 and fp8_static, 3 passthrough
    assert accepted == 27 + 12 + 72 + 2 + 3
