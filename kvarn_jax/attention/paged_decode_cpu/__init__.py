"""The CPU decode kernel: KVarN paged caches attended by compiled C++ (`kernel.cc`, an XLA FFI
custom call built on first use by `build.py`), one call per layer instead of the reference's ~150
XLA operations. Same semantics as the reference (`attention/reference.py: attend`), fp32 throughout;
docs/kernels.md ("The CPU decode kernel")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...config import KVQuantConfig
from . import build
from .build import NativeKernelUnavailable, available  # noqa: F401

BITS = (2, 4, 8)


def supports(cfg: KVQuantConfig, block_size: int, head_dim: int) -> str | None:
    """None if the kernel takes caches of this scheme and geometry, else why not."""
    if cfg.method != "kvarn":
        return f"the CPU kernel reads KVarN caches only, not {cfg.name}"
    if cfg.k_bits not in BITS or cfg.v_bits not in BITS:
        return f"the CPU kernel reads {BITS}-bit codes, not k{cfg.k_bits}v{cfg.v_bits}"
    if block_size % cfg.tile_tokens:
        return f"block_size {block_size} is not a multiple of the {cfg.tile_tokens}-token tile"
    return None


def paged_decode_cpu(q, cache, block_tables, seq_lens, seq_ids, *, scale: float, window: int | None,
                     new_kv=None, max_threads: int = 0, hp_rows=None, hp_units=None):
    """q [B, Hq, D] in the cache's (rotated) frame -> fp32 [B, Hq, D] in the same frame: what
    `reference.attend(..., rotated_io=True)` computes before its saturation, for a KVarN cache.
    (sequence, kv head) pairs are spread over XLA's CPU threads when the call reads enough tokens
    (~1K per thread); max_threads > 0 caps them. Every pair is computed the same way whichever
    thread takes it: the result does not depend on the threads.

    hp_rows: [S, 4, Hk, bs, D] float, in place of the cache's sink and tail - per sequence slot its
    whole-block sink and the ring's one block (K, V, K, V) side by side, as the vLLM bridge copies
    them out of vLLM's blocks (read where they are: no slice is copied for the call). hp_units:
    (units [U, D / ru] float, index [S, 4 * Hk * bs * ru] int32), the same rows where they live:
    row i of part p (sink K, sink V, ring K, ring V) and kv head h of slot s is the ru units
    index[s, ((p * Hk + h) * bs + i) * ru + k], k < ru (indices clamped into the buffer)."""
    target = build.load()
    b, hq, d = q.shape
    pk, pv = cache.pages["k"], cache.pages["v"]
    hp_int8 = cache.hp_format == "int8"
    one = jnp.zeros((1,), jnp.float32)
    meta = [one] * 8
    if hp_int8:
        meta = [getattr(cache, part + "_meta")[side][n] for part in ("sink", "tail") for side in ("k", "v")
                for n in ("scale", "zero")]
    if seq_ids is None:
        seq_ids = jnp.arange(b, dtype=jnp.int32)
    if new_kv is None:
        nk = nv = jnp.zeros((1, 1, d), jnp.float32)
    else:
        nk, nv = (x.astype(jnp.float32) for x in new_kv)
    hp = (cache.sink["k"], cache.sink["v"], cache.tail["k"], cache.tail["v"])
    if hp_rows is not None:
        if hp_int8 or hp_rows.ndim != 5 or hp_rows.shape[1] != 4 or hp_rows.shape[3] != cache.block_size \
                or cache.paged_from != cache.block_size:
            raise ValueError("hp_rows must be float [S, 4, Hk, block_size, D] for a cache with a whole-block sink, "
                             f"got {hp_rows.shape} {hp_rows.dtype}")
        hp = (hp_rows,) * 4
    units = jnp.zeros((1, 1), jnp.int32)
    if hp_units is not None:
        buf, units = hp_units
        per = 4 * cache.num_kv_heads * cache.block_size
        if hp_int8 or hp_rows is not None or buf.ndim != 2 or units.ndim != 2 or units.shape[1] % per \
                or buf.shape[1] * (units.shape[1] // per) != d or cache.paged_from != cache.block_size:
            raise ValueError(f"hp_units must be float units [U, D / ru] and int32 indices [S, {per} * ru] for a cache "
                             f"with a whole-block sink, got {buf.shape} {buf.dtype} and {units.shape}")
        hp, units = (buf,) * 4, units.astype(jnp.int32)
    # under vmap: one call per batch element (vmap over layers of stacked caches, say)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((b, hq, d), jnp.float32), vmap_method="sequential")
    return call(q.astype(jnp.float32), block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
                seq_ids.astype(jnp.int32),
                pk["codes"], pk["scale_chan"], pk["zero_chan"], pk["scale_tok"],
                pv["codes"], pv["scale_chan"], pv["scale_tok"], pv["zero_tok"],
                *hp, units, *meta, nk, nv,
                scale=np.float32(scale), window=np.int64(window or 0), k_bits=np.int64(cache.cfg.k_bits),
                v_bits=np.int64(cache.cfg.v_bits), block_size=np.int64(cache.block_size),
                paged_from=np.int64(cache.paged_from), has_new=np.int64(new_kv is not None),
                hp_parts=np.int64(4 if hp_rows is not None else -4 if hp_units is not None else 1),
                max_threads=np.int64(max_threads))
