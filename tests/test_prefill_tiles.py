"""Prefill attention streams the cached context in key tiles (`llama._stream_cached`).

- Same outputs as the attention it replaced (`_untiled`, kept below: one softmax over the whole
  context's scores and the chunk's own), on fresh random caches of fp16, int8 and kvarn_k4v2_g128,
  float32 and bfloat16 inputs, three rows with different starts (one with nothing cached), contexts
  that are no multiple of the tile (the last tile overlapping its predecessor), and a chunk whose
  last rows are padding. Also through the whole model (`Decoder.prefill_kv`).
- The compiled prefill's workspace does not grow with the context's P x Hq x C x L scores: going
  from a 2K to a 16K-token block table adds at most a few copies of the dense K and V that
  `gather_dense` returns, while the untiled attention, compiled the same way, breaks that bound.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvarn_jax.cache.layers import LayerCaches
from kvarn_jax.hadamard import SAFE_ABS, rotate, unrotate
from kvarn_jax.models.llama import PREFILL_KEY_TILE, Attention, Decoder, LlamaConfig, PrefillBatch, _product
from kvarn_jax.storage import QUANT_MAX

BS, HK, HQ, D = 128, 2, 8, 32     # kvarn_k4v2_g128 needs blocks of 128 tokens
W = 3                       # blocks per row: a context of L = 384 positions
C = 24                      # chunk length
SCHEMES = ("fp16", "int8", "kvarn_k4v2_g128")
# max |tiled - untiled| over max |untiled|: float32 rounding of the online rescaling (observed
# up to 1.5e-6); bfloat16 inputs are computed in float32 on CPUs, so the same bound holds there
TOL = {"float32": 1e-5, "bfloat16": 1e-5}


def _untiled(caches, q, k, v, batch, j, *, group, dtype):
    """The untiled prefill attention: fp32 scores [P, Hk, G, C, L + C] in one softmax."""
    layer = (group, j)
    cache, _, _ = caches.layer_cache(layer)
    p, c, hq, d = q.shape
    hk = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    qf = q.astype(jnp.float32).reshape(p, c, hk, hq // hk, d)
    kc, vc = caches.gather_dense(layer, batch.block_tables, batch.start, batch.seq_ids)
    qc = rotate(qf, max_abs=QUANT_MAX) if cache.cfg.rotated else qf
    s_cache = _product("pchgd,phld->phgcl", qc, kc, dtype) * scale
    cached = jnp.arange(kc.shape[2])[None, :] < batch.start[:, None]
    s_cache = jnp.where(cached[:, None, None, None, :], s_cache, -jnp.inf)
    s_self = _product("pchgd,pthd->phgct", qf, k, dtype) * scale
    s_self = jnp.where(jnp.arange(c)[None, :] <= jnp.arange(c)[:, None], s_self, -jnp.inf)
    prob = jax.nn.softmax(jnp.concatenate([s_cache, s_self], axis=-1), axis=-1)
    p_cache, p_self = prob[..., :kc.shape[2]], prob[..., kc.shape[2]:]
    o_cache = _product("phgcl,phld->pchgd", p_cache, vc, dtype)
    if cache.cfg.rotated:
        o_cache = unrotate(o_cache, max_abs=SAFE_ABS)
    return (o_cache + _product("phgct,pthd->pchgd", p_self, v, dtype)).reshape(p, c, hq, d)


def _filled(scheme, starts, rng, dtype):
    """One layer's caches holding random tokens 0 .. starts[i] - 1 of row i (blocks they complete
    quantized), and block tables [P, W] of distinct random blocks."""
    p = len(starts)
    caches = LayerCaches.create(scheme, 1, num_blocks=p * W, block_size=BS, num_kv_heads=HK, head_dim=D,
                                max_seqs=p, dtype=dtype)
    tables = rng.permutation(p * W).reshape(p, W).astype(np.int32)
    pos = np.concatenate([np.arange(s) for s in starts])
    rows = np.concatenate([np.full(s, i) for i, s in enumerate(starts)])
    slots = tables[rows, pos // BS] * BS + pos % BS
    kv = [jnp.asarray(rng.standard_normal((1, len(pos), HK, D)) * 2, dtype) for _ in range(2)]
    caches = caches.write_all(*kv, jnp.asarray(slots, jnp.int32), jnp.asarray(rows, jnp.int32),
                              jnp.asarray(pos, jnp.int32), max_completed=p * W)
    assert int(caches.dropped_tokens) == 0
    return caches, jnp.asarray(tables)


def _batch(tables, starts, q_lens):
    p = len(starts)
    start = jnp.asarray(starts, jnp.int32)
    real = np.arange(C)[None, :] < np.asarray(q_lens)[:, None]
    return PrefillBatch(tokens=jnp.zeros((p, C), jnp.int32), positions=start[:, None] + jnp.arange(C)[None],
                        slot_mapping=jnp.asarray(np.where(real, 0, -1), jnp.int32),  # unread here
                        seq_ids=jnp.arange(p, dtype=jnp.int32), block_tables=tables, start=start,
                        last=jnp.asarray(np.asarray(q_lens) - 1, jnp.int32))


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(x))
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiled_prefill_matches_untiled(scheme, dtype):
    rng = np.random.default_rng()
    L = W * BS
    # one row with nothing cached, one short, one reaching into the overlapping last tile
    starts = [0, int(rng.integers(1, 100)), int(rng.integers(L - C - 30, L - C + 1))]
    q_lens = [C, int(rng.integers(5, C)), C]              # row 1's chunk ends in padding rows
    caches, tables = _filled(scheme, starts, rng, jnp.dtype(dtype))
    batch = _batch(tables, starts, q_lens)
    q = jnp.asarray(rng.standard_normal((3, C, HQ, D)) * 2, dtype)
    k = jnp.asarray(rng.standard_normal((3, C, HK, D)) * 2, dtype)
    v = jnp.asarray(rng.standard_normal((3, C, HK, D)), dtype)
    g, j = caches.locate(0)
    args = (caches, q, k, v, batch, j)
    ref = jax.jit(functools.partial(_untiled, group=g, dtype=dtype))(*args)
    # the cached context matters: without it the rows that have one come out elsewhere
    alone = jax.jit(functools.partial(_untiled, group=g, dtype=dtype))(
        caches, q, k, v, _batch(tables, [0, 0, 0], q_lens), j)
    assert _rel_err(alone[1:], ref[1:]) > 0.05
    # 1024: one tile of 384 (no padding); 90: 5 tiles of 80, the last at 304; 200: 2 of 192;
    # 37: 11 tiles of 40 (the third row reads 9 or all 10 that hold positions)
    for key_tile in (PREFILL_KEY_TILE, 90, 200, 37):
        out = jax.jit(functools.partial(Attention._prefill_heads, group=g, dtype=dtype, key_tile=key_tile))(*args)
        assert out.shape == ref.shape and out.dtype == jnp.float32
        err = _rel_err(out, ref)
        assert err <= TOL[dtype], f"{scheme} {dtype} key_tile={key_tile}: relative error {err:.2e}"


def _tiny(num_layers=2, heads=8, kv_heads=1, head_dim=32):
    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=num_layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=1 << 15)


def _prefill_kv(model, key_tile=None):
    """A jitted (weights, caches, batch) -> (logits, (k, v)) of the model's prefill, with the
    untiled attention (key_tile None) or the tiled one over tiles of key_tile keys."""
    heads = _untiled if key_tile is None else functools.partial(Attention._prefill_heads, key_tile=key_tile)
    graphdef, state = nnx.split(model)

    def fn(state, caches, batch):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Attention, "_prefill_heads", staticmethod(heads))
            return nnx.merge(graphdef, state).prefill_kv(caches, batch, layer_loop="scan")
    return jax.jit(fn), state


@pytest.mark.parametrize("scheme", ["fp16", "kvarn_k4v2_g128"])
def test_model_prefill_tiled_matches_untiled(scheme):
    """Second chunks through `Decoder.prefill_kv` (two layers, scanned): logits and the chunk's
    k, v agree with the untiled attention's."""
    rng = np.random.default_rng()
    cfg = _tiny(head_dim=32)
    model = Decoder(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))), init_std=0.2)
    p, w = 2, 3
    caches = model.new_caches(scheme, num_blocks=p * w, block_size=BS, max_seqs=p)
    tables = jnp.asarray(rng.permutation(p * w).reshape(p, w), jnp.int32)
    first = [45, 77]                                     # the first chunks' lengths (no block multiple)
    c = 48
    for chunk, starts in ((0, [0, 0]), (1, first)):
        q_lens = first if chunk == 0 else [c, 30]
        start = jnp.asarray(starts, jnp.int32)
        pos = start[:, None] + jnp.arange(c)[None]
        real = jnp.arange(c)[None, :] < jnp.asarray(q_lens)[:, None]
        slots = jnp.where(real, tables[jnp.arange(p)[:, None], pos // BS] * BS + pos % BS, -1)
        batch = PrefillBatch(tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (p, c)), jnp.int32),
                             positions=pos, slot_mapping=slots, seq_ids=jnp.arange(p, dtype=jnp.int32),
                             block_tables=tables, start=start, last=jnp.asarray(q_lens, jnp.int32) - 1)
        if chunk == 0:
            _, caches = model.prefill(caches, batch)
    ref_fn, state = _prefill_kv(model)
    out_fn, _ = _prefill_kv(model, key_tile=90)          # 5 tiles of 80 over L = 384
    ref, out = ref_fn(state, caches, batch), out_fn(state, caches, batch)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert _rel_err(a, b) <= 1e-5


def _temp_bytes(model, scheme, p, c, max_blocks, untiled=False):
    caches = model.new_caches(scheme, num_blocks=8, block_size=128, max_seqs=p)
    z = jnp.zeros((p, c), jnp.int32)
    batch = PrefillBatch(tokens=z, positions=z, slot_mapping=z, seq_ids=jnp.arange(p, dtype=jnp.int32),
                         block_tables=jnp.zeros((p, max_blocks), jnp.int32), start=jnp.zeros((p,), jnp.int32),
                         last=jnp.zeros((p,), jnp.int32))
    fn, state = _prefill_kv(model, None if untiled else PREFILL_KEY_TILE)
    return fn.lower(state, caches, batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("scheme", ["fp16", "kvarn_k4v2_g128"])
def test_prefill_workspace_does_not_grow_with_scores(scheme):
    """Compiled (not run) on the CPU: P=2 rows, a 256-token chunk, 8 query heads over 1 KV head of
    128 channels, block tables of 2K and 16K tokens. Going 2K -> 16K, the tiled prefill's temp
    bytes may grow by at most 2 copies of the dense K and V (2 x P x Hk x dL x D float32; observed:
    1 copy), a quarter of one copy of the scores' growth (P x Hq x C x dL float32); the untiled
    attention's grow by more than that bound (observed: 3 copies of the scores)."""
    model = Decoder(_tiny(num_layers=2, heads=8, kv_heads=1, head_dim=128), rngs=nnx.Rngs(0))
    p, c, hq, hk, d = 2, 256, 8, 1, 128
    dl = 16384 - 2048
    kv_growth = 2 * p * hk * dl * d * 4
    bound = 2 * kv_growth
    assert bound <= p * hq * c * dl * 4 // 4
    grow = _temp_bytes(model, scheme, p, c, 128) - _temp_bytes(model, scheme, p, c, 16)
    assert grow <= bound, f"{scheme}: prefill temp bytes grew by {grow} from 2K to 16K context, bound {bound}"
    grow_untiled = (_temp_bytes(model, scheme, p, c, 128, untiled=True)
                    - _temp_bytes(model, scheme, p, c, 16, untiled=True))
    assert grow_untiled > bound, f"the bound {bound} does not tell the untiled attention (+{grow_untiled}) apart"
