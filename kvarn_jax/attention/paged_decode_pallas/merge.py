"""Merging the decode kernel's splits (flash-decoding): jnp reference and a Pallas kernel.

The GPU decode kernel (`kernel.py`) runs several programs per (sequence, kv head) along
the KV length. Each leaves an unnormalized partial output `acc` with its running max `m` (base-2
logits) and softmax sum `l` (with a single split the kernel normalizes its output itself and none of
this runs: merge="kernel"); the merge rescales them to a common max and normalizes:

    M = max_s m_s,   w_s = 2^(m_s - M),   o = Σ_s w_s · acc_s / Σ_s w_s · l_s

and puts the value planes back in channel order (channel vp·i + n is element i of plane n).

`merge_splits_reference` is that in jnp (a few XLA fusions). `merge_splits_pallas` is
one kernel: a program per (sequence, kv head, value plane, channel chunk) loads every split of its
chunk at once (the split axis padded to a power of two, as Triton needs; the padding is masked,
whatever it holds) and writes its channels in their final places, so small batches still spread
the merge over the whole chip and only the slice of a GQA group that is not a power of two
(the decode kernel stores the group's heads rounded up to one) is left to XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .launch_table import LaunchTable, launch_table


def padded_splits(splits: int) -> int:
    """Length of the split axis the Pallas merge reads: the next power of two."""
    return 1 << (max(1, splits) - 1).bit_length()


def unpadded_splits(splits: int) -> int:
    """The largest power of two <= splits: a default split count the Pallas merge reads unpadded."""
    return 1 << (max(1, splits).bit_length() - 1)


def merge_splits_reference(acc, m, l, splits: int, heads_axis: int):
    """acc [B, Hk, S, vp, X, Y], m and l [B, Hk, S, Gp] -> o [B, Hk, Gp, D/vp, vp] fp32, whose
    reshape to [B, Hk, Gp, D] has the channels in order.

    Only the first `splits` entries along S are read. heads_axis: which of acc's last two axes is
    the Gp one (-1: tokens-major [.., D/vp, Gp]; -2: heads-major [.., Gp, D/vp])."""
    acc, m, l = acc[:, :, :splits], m[:, :, :splits], l[:, :, :splits]
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_all)                                            # m is in base-2 units
    l_all = jnp.sum(w * l, axis=2)                                     # [B, Hk, Gp]
    per_head = (lambda v: v[..., None, :]) if heads_axis == -1 else (lambda v: v[..., :, None])
    o = jnp.sum(per_head(w)[:, :, :, None] * acc, axis=2)             # w: [B, Hk, S, 1, (Gp)]
    o = o / per_head(jnp.where(l_all > 0, l_all, 1.0))[:, :, None]     # [B, Hk, vp, X, Y]
    return o.transpose(0, 1, 4, 3, 2) if heads_axis == -1 else o.transpose(0, 1, 3, 4, 2)


def _merge_kernel(m_ref, l_ref, acc_ref, o_ref, *, splits: int, heads_axis: int):
    s_pad = m_ref.shape[0]
    valid = jnp.arange(s_pad, dtype=jnp.int32)[:, None] < splits       # [S, 1]
    # entries past `splits` were never written: masked before any arithmetic reads them
    m = jnp.where(valid, m_ref[...], -jnp.inf)                         # [S, Gp]
    m_all = jnp.max(m, axis=0)                                         # finite: split 0 always exists
    w = jnp.where(valid, jnp.exp2(m - m_all[None, :]), 0.0)
    l_all = jnp.sum(jnp.where(valid, w * l_ref[...], 0.0), axis=0)     # [Gp]
    wb = w[:, None, :] if heads_axis == -1 else w[:, :, None]
    o = jnp.sum(jnp.where(valid[:, :, None], wb * acc_ref[...], 0.0), axis=0)   # [c, Gp] or [Gp, c]
    den = jnp.where(l_all > 0, l_all, 1.0)
    if heads_axis == -1:
        o_ref[...] = (o / den[None, :]).T
    else:
        o_ref[...] = o / den[:, None]


def merge_launch(batch: int, num_kv_heads: int, vp: int, splits: int, gp: int, width: int, heads_axis: int,
                 table: LaunchTable | None = None):
    """(padded split axis, channels per program, warps) of `merge_splits_pallas`.

    Channels: of the `width` = D/vp of a value plane, as many as keep a program's partial outputs
    within a block of elements while the grid keeps enough programs (powers of two; the numbers
    are the launch table's). Tokens-major (heads_axis -1): one warp per block of elements (more only
    where one channel of all splits is larger). Heads-major, whose chunks are runs of that many
    contiguous floats: at least 4 channels, 4 warps, more for larger blocks (up to 16: ~64 elements
    per thread at 32 K), so few splits of a big GQA group still fit in registers."""
    table = table or launch_table()
    s_pad = padded_splits(splits)
    tokens = heads_axis == -1
    if tokens:
        block, programs = table.tokens_merge_block, table.tokens_merge_programs
    else:
        block, programs = table.merge_block, table.merge_programs_per_sm * table.num_sms
    floor = 1 if tokens else min(4, width)
    c = width
    while c > floor and (s_pad * gp * c > block or batch * num_kv_heads * vp * (width // c) < programs):
        c //= 2
    elems = s_pad * gp * c
    if tokens:
        return s_pad, c, int(min(16, max(1, elems // block)))
    return s_pad, c, 4 if elems <= block else 8 if elems <= 2 * block else 16


@functools.partial(jax.jit, static_argnames=("splits", "heads_axis", "interpret", "num_warps"))
def merge_splits_pallas(acc, m, l, *, splits: int, heads_axis: int, interpret: bool = False,
                        num_warps: int | None = None):
    """Same result as `merge_splits_reference`, in one Pallas kernel. The split axis of acc, m and l
    must be `padded_splits(splits)` long (entries from `splits` on are ignored)."""
    b, hk, s_pad, vp, x, y = acc.shape
    gp = m.shape[-1]
    if s_pad != padded_splits(splits) or m.shape != (b, hk, s_pad, gp) or l.shape != m.shape:
        raise ValueError(f"merge_splits_pallas: acc {acc.shape}, m {m.shape}, l {l.shape} do not hold "
                         f"{padded_splits(splits)} (padded) splits of {splits}")
    if heads_axis not in (-1, -2) or (y if heads_axis == -1 else x) != gp:
        raise ValueError(f"merge_splits_pallas: heads_axis={heads_axis} does not name acc's Gp={gp} axis ({acc.shape})")
    width = x if heads_axis == -1 else y
    if width & (width - 1) or gp & (gp - 1):
        raise ValueError(f"merge_splits_pallas: channels per value plane ({width}) and Gp ({gp}) must be powers of two")
    _, c, warps = merge_launch(b, hk, vp, splits, gp, width, heads_axis)
    blk, at = ((c, gp), lambda j: (j, 0)) if heads_axis == -1 else ((gp, c), lambda j: (0, j))
    in_specs = [pl.BlockSpec((None, None, s_pad, gp), lambda i, h, n, j: (i, h, 0, 0))] * 2 + [
        pl.BlockSpec((None, None, s_pad, None) + blk, lambda i, h, n, j: (i, h, 0, n) + at(j))]
    # output [B, Hk, Gp, D/vp, vp]: plane n's chunk j is channels (j*c + i)*vp + n
    out_spec = pl.BlockSpec((None, None, gp, c, None), lambda i, h, n, j: (i, h, 0, j, n))
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps or warps, num_stages=1)
    return pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits, heads_axis=heads_axis),
        grid=(b, hk, vp, width // c), in_specs=in_specs, out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((b, hk, gp, width, vp), jnp.float32), interpret=interpret,
        name="kvarn_decode_split_merge", **params)(m, l, acc)
