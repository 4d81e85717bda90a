"""Test helpers: simulate a serving loop writing sequences into a paged cache, and an independent
numpy (float64) oracle of what decode attention must return."""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvarn_jax as kj


def random_kv(rng, tokens, heads, dim, dtype=np.float16, outliers=0, outlier_scale=20.0):
    """Gaussian K/V; `outliers` channels of K get `outlier_scale` x the magnitude (as in real LLM keys)."""
    k = rng.standard_normal((tokens, heads, dim))
    v = rng.standard_normal((tokens, heads, dim))
    if outliers:
        ch = rng.choice(dim, outliers, replace=False)
        k[..., ch] *= outlier_scale
        k[..., ch] += outlier_scale / 2
    return k.astype(dtype), v.astype(dtype)


def allocate_tables(rng, lens, block_size, num_blocks, extra_cols=1):
    """Random distinct physical blocks for each sequence; unused entries hold random junk ids."""
    need = [-(-L // block_size) for L in lens]
    assert sum(need) <= num_blocks, (need, num_blocks)
    perm = rng.permutation(num_blocks)
    width = max(max(need), 1) + extra_cols
    tables = rng.integers(0, num_blocks, (len(lens), width))
    c = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[c:c + n]
        c += n
    return tables.astype(np.int32)


def serve_writes(cache, tables, seqs, rng, seq_ids=None, max_chunk=None, write=kj.write):
    """Write each sequence's tokens like a serving loop would: a chunked prefill of random length,
    then tokens in random-size steps, sequences interleaved in each call, padding rows mixed in."""
    n = len(seqs)
    seq_ids = list(range(n)) if seq_ids is None else list(seq_ids)
    done = [0] * n
    lens = [s[0].shape[0] for s in seqs]
    bs = cache.block_size
    while any(d < L for d, L in zip(done, lens)):
        rows = []
        for i in range(n):
            if done[i] >= lens[i]:
                continue
            step = int(rng.integers(1, (max_chunk or lens[i]) + 1)) if done[i] == 0 else int(rng.integers(1, 4))
            for p in range(done[i], min(lens[i], done[i] + step)):
                rows.append((i, p))
            done[i] = min(lens[i], done[i] + step)
        k = np.stack([seqs[i][0][p] for i, p in rows])
        v = np.stack([seqs[i][1][p] for i, p in rows])
        slots = [int(tables[i, p // bs]) * bs + p % bs for i, p in rows]
        ids = [seq_ids[i] for i, _ in rows]
        pos = [p for _, p in rows]
        # pad to a power of two with slot -1 rows, as a server pads batches (and so few shapes compile)
        pad = max(8, 1 << len(rows).bit_length()) - len(rows)
        k = np.concatenate([k, np.repeat(k[:1], pad, 0)])
        v = np.concatenate([v, np.repeat(v[:1], pad, 0)])
        slots += [-1] * pad
        ids += [0] * pad
        pos += [0] * pad
        cache = write(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots, jnp.int32),
                      seq_ids=jnp.asarray(ids, jnp.int32), positions=jnp.asarray(pos, jnp.int32))
    return cache


def hp_value_dtype(cfg, dtype):
    """The dtype a cache of model `dtype` keeps its sink and tail in (or, for int8, their scales):
    the hp format if it is a float, else the model dtype if 16-bit, else float16."""
    sixteen = jnp.dtype(dtype) if jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)) else jnp.float16
    return {"fp16": jnp.float16, "bf16": jnp.bfloat16, "fp32": jnp.float32}.get(cfg.hp, sixteen)


def expected_kv(cfg, seq_k, seq_v, block_size, dtype):
    """What attention must see for one sequence (float64, storage frame), computed independently of
    the cache: the sink and the last block (partial, or completed by the last token: a token never
    sees its own block quantized) = the written values as the high-precision storage keeps them
    (rounded to its dtype; int8: the int8 scheme's round trip of each token); the full blocks between
    = quantize/dequantize of those values. A sink of S tokens: block 0 is quantized too (once it is
    not the last block), with its first S tokens replaced by the mean of the others, and its first S
    positions read from the sink."""
    cfg = kj.parse(cfg)
    L, h, d = seq_k.shape
    out = []
    store = jnp.dtype(cfg.dtype) if cfg.is_passthrough else hp_value_dtype(cfg, dtype)
    for x in (seq_k, seq_v):
        x = jnp.asarray(x)
        # kj.rotate is checked on its own (bit-exact vs the reference's rotated tiles, orthonormality)
        x = kj.rotate(x, store) if cfg.rotated else x.astype(store)
        out.append(x)
    if cfg.hp == "int8":  # the int8 scheme's per-token rows, scales in the 16-bit dtype, read in fp32
        q = kj.quantize((out[0], out[1]), "int8")
        out = list(kj.dequantize(dataclasses.replace(q, dtype="float32")))
    # pages quantize the stored values in the cache's dtype
    paged = [np.asarray(x.astype(dtype).astype(jnp.float32)).astype(np.float64) for x in out]
    out = [np.asarray(x.astype(jnp.float32)).astype(np.float64) for x in out]
    if cfg.is_passthrough:
        return out
    s = cfg.sink_tokens
    start = 0 if s else block_size
    full = ((L - 1) // block_size) * block_size  # blocks before the one holding position L - 1
    if full > start:
        region = [x[start:full].copy() for x in paged]
        if s:
            for x in region:
                x[:s] = x[s:block_size].mean(axis=0)
        # in `dtype`, so that scales are stored in it as the cache stores them; dequantized to fp32,
        # not rounded back to `dtype`
        q = kj.quantize((jnp.asarray(region[0], dtype), jnp.asarray(region[1], dtype)), cfg, rotated=True)
        kq, vq = kj.dequantize(dataclasses.replace(q, dtype="float32"), rotated=True)
        keep = max(s, start) - start  # a short sink's positions stay as stored
        out[0][start + keep:full] = np.asarray(kq.astype(jnp.float32))[keep:]
        out[1][start + keep:full] = np.asarray(vq.astype(jnp.float32))[keep:]
    return out


def dense_attention(q, ks, vs, lens, scale, window=None):
    """float64 GQA attention of q [B, Hq, D] over per-sequence K/V lists ([L, Hk, D])."""
    b, hq, d = q.shape
    out = np.zeros((b, hq, d))
    for i in range(b):
        L = lens[i]
        lo = 0 if window is None else max(0, L - window)
        if L == 0:
            continue
        k, v = ks[i][lo:L], vs[i][lo:L]
        hk = k.shape[1]
        for h in range(hq):
            kh = h // (hq // hk)
            s = k[:, kh] @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[:, kh]
    return out


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO text of jit(fn) lowered for an abstract CUDA platform (Pallas kernels lowered to
    Triton). jax up to 0.10 emits the Triton module at lowering; later versions also compile it
    there, which needs a GPU: without one the test is skipped, not failed."""
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
        if "No supported GPU devices found" in str(e):
            pytest.skip("this jax compiles Triton kernels while lowering, which needs a GPU")
        raise
