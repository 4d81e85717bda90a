"""Reference paged decode attention: pure jnp, runs anywhere, the oracle for the Pallas kernels.

It dequantizes every block a sequence uses (`gather_dense`), then does dense fp32 attention with
GQA. For rotated schemes the query is rotated once and the output un-rotated once, since the
cache holds rotated K/V and H is orthonormal: (qH)(KH)^T = qK^T and (P·VH)H = P·V.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ..cache.paged import PagedKVCache, check_read_args, gather_dense
from ..hadamard import SAFE_ABS, rotate, unrotate
from ..storage import QUANT_MAX
from ..schemes.arith import saturate
from ..validation import check_array, check_finite


def check_decode_args(q, cache, block_tables, seq_lens, seq_ids, window, values: bool = True):
    """The decode entries' argument checks (ValueError naming the argument); values=False checks
    shapes and dtypes only, reading nothing back from the device."""
    check_array(q, "q", ndim=3, floating=True)
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    nbt, hq, d = q.shape
    if d != cache.head_dim:
        raise ValueError(f"q head_dim {d} does not match the cache's head_dim {cache.head_dim}")
    if hq % cache.num_kv_heads:
        raise ValueError(f"q has {hq} heads, which is not a multiple of the cache's num_kv_heads="
                         f"{cache.num_kv_heads} (GQA needs num_q_heads % num_kv_heads == 0)")
    check_read_args(cache, block_tables, seq_lens, seq_ids, batch=nbt, values=values)
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be a positive int (attend to the last `window` tokens) or None, got {window!r}")
    if values:
        check_finite(q, "q")


def paged_decode_attention_reference(q: jnp.ndarray, cache: PagedKVCache, block_tables: jnp.ndarray,
                                     seq_lens: jnp.ndarray, scale: float | None = None, *,
                                     seq_ids: jnp.ndarray | None = None, window: int | None = None,
                                     rotated_io: bool = False) -> jnp.ndarray:
    """One query token per sequence against its cached tokens.

    q: [B, Hq, D] (Hq a multiple of the cache's Hk; query head h uses kv head h // (Hq // Hk)).
    block_tables: [B, max_blocks] physical block ids; seq_lens: [B] tokens per sequence (0 gives a
    zero output); seq_ids: [B] high-precision slots (default: the row index); scale: softmax scale
    (default 1/sqrt(D)); window: attend only to the last `window` tokens.
    rotated_io: q is already rotated and the output is returned rotated (kernels' convention).
    Returns [B, Hq, D] in q.dtype.
    """
    check_decode_args(q, cache, block_tables, seq_lens, seq_ids, window)
    return attend(q, cache, block_tables, seq_lens, scale, seq_ids, window, rotated_io)


@functools.partial(jax.jit, static_argnames=("scale", "window", "rotated_io"))
def attend(q, cache, block_tables, seq_lens, scale, seq_ids, window, rotated_io):
    """`paged_decode_attention_reference` without the argument checks (callers check first)."""
    nbt, hq, d = q.shape
    hk = cache.num_kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.astype(jnp.float32)
    if cache.cfg.rotated and not rotated_io:
        qf = rotate(qf, max_abs=QUANT_MAX)  # the kernels' bounds (`paged_decode._pallas`)
    k, v = gather_dense(cache, block_tables, seq_lens, seq_ids)  # [B, Hk, L, D]
    length = k.shape[2]
    qg = qf.reshape(nbt, hk, hq // hk, d)
    s = jnp.einsum("bhgd,bhld->bhgl", qg, k, precision="highest") * scale
    pos = jnp.arange(length)[None, :]
    lens = seq_lens.astype(jnp.int32)[:, None]
    mask = pos < lens
    if window is not None:
        mask &= pos >= lens - window
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgl,bhld->bhgd", p, v, precision="highest") / jnp.where(denom > 0, denom, 1.0)
    o = o.reshape(nbt, hq, d)
    if cache.cfg.rotated and not rotated_io:
        o = unrotate(o, max_abs=SAFE_ABS)
    return saturate(o, q.dtype)

