"""The kernel entry: operands and block specs of one `pallas_call`, then the merge of the splits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ... import triton_options
from ...config import KVQuantConfig
from ...validation import is_power_of_two
from . import merge as split_merge
from .kernel import LOG2E, NEG, decode_kernel
from .launch import CallShape, Launch, resolve_launch
from .launch_table import LaunchTable, launch_table
from .layout import LayoutPlan, group_rows


def supports(cfg: KVQuantConfig, block_size: int, head_dim: int) -> str | None:
    """None if the kernel handles this cache, else the reason (the reference must be used)."""
    if not is_power_of_two(block_size) or block_size < 16:
        return f"block_size={block_size} (the kernel needs a power of two >= 16)"
    if not is_power_of_two(head_dim) or head_dim < 16:
        return f"head_dim={head_dim} (the kernel needs a power of two >= 16)"
    if cfg.method == "int" and not is_power_of_two(cfg.channel_group("k", head_dim)):
        return f"channel group {cfg.channel_group('k', head_dim)} (must be a power of two)"
    return None


@functools.partial(jax.jit, static_argnames=("scale", "window", "interpret", "launch", "table"))
def paged_decode_pallas(q_rot, cache, block_tables, seq_lens, seq_ids, *, scale: float, window: int | None,
                        interpret: bool = False, launch: Launch = Launch(), table: LaunchTable | None = None,
                        new_kv=None):
    """q_rot [B, Hq, D] in the stored frame -> output [B, Hq, D] fp32 in the stored frame.

    seq_ids: [B] rows of the high-precision sink and tail buffers, or None for row b of sequence b
    (no sequence-id operand then; the caller checks the range: `paged.check_read_args`).
    launch: layout and launch options; what it leaves open the rules decide (`resolve_launch`) from
    `table` (default: this device's `launch_table()`). Every launch gives the same results up to fp32
    rounding; the defaults are the fastest measured (docs/kernels.md).
    new_kv: (k, v) [B, Hk, D] in the stored frame, one more token per row after its seq_lens cached
    ones (`paged_decode_attention`): merged with the kernel's splits as one more split
    (`_with_new_token`), so a launch that would finish its output in the kernel (merge="kernel")
    leaves partials to XLA's merge instead.
    """
    table = table or launch_table()
    cfg = cache.cfg
    nbt, hq, d = q_rot.shape
    hk = cache.num_kv_heads
    shape = CallShape(batch=nbt, q_heads=hq, kv_heads=hk, head_dim=d, block_size=cache.block_size,
                      max_blocks=block_tables.shape[1], interpret=interpret, wide=cache.dtype != "float16")
    run = resolve_launch(cfg, shape, launch, table)
    if new_kv is not None and run.merge == "kernel":
        run = resolve_launch(cfg, shape, dataclasses.replace(launch, merge="xla"), table)
    tokens_major = run.orient == "tokens"
    t_tok, splits = run.chunk or cfg.tile_tokens, run.num_splits  # tokens per step: a chunk or a tile
    grp = hq // hk
    gp, written = group_rows(grp, tokens_major)
    tiles_per_block = cache.block_size // t_tok
    plan = LayoutPlan(cfg, d, t_tok, run.unpack, fold=run.fold, sums=run.sums, wide=cache.dtype != "float16",
                      narrow=run.narrow)
    # Under a register cap, or with read-ahead stages, the sink/tail is walked in half the steps
    # (docs/kernels.md: faster there; with 3+ stages its buffers then no longer set the shared memory).
    hp_chunk = table.hp_chunk // 2 if (run.maxnreg is not None or run.num_stages >= 3) else table.hp_chunk
    normalize = run.merge == "kernel"
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))  # noqa: E731
    head_spec = lambda a: pl.BlockSpec((a.shape[0], None) + a.shape[2:],  # noqa: E731
                                       lambda b, h, s, nd=a.ndim - 2: (0, h) + (0,) * nd)
    q_rows = grp if run.q_in_kernel else None
    if q_rows is not None:  # the kernel reads its group's rows from q_rot (masked loads)
        operands = [q_rot]
        specs = [pl.BlockSpec((None, hq, d), lambda b, h, s: (b, 0, 0))]
    else:
        qg = jnp.pad(q_rot.astype(jnp.float32).reshape(nbt, hk, grp, d), ((0, 0), (0, 0), (0, gp - grp), (0, 0)))
        operands = [qg]
        specs = [pl.BlockSpec((None, None, gp, d), lambda b, h, s: (b, h, 0, 0))]
    if plan.pk > 1:  # query split into the key channel planes: channels n, n + pk, ...
        qp = qg.reshape(nbt, hk, gp, d // plan.pk, plan.pk).transpose(0, 1, 4, 2, 3)
        operands.append(qp)
        specs.append(pl.BlockSpec((None, None, plan.pk, gp, d // plan.pk), lambda b, h, s: (b, h, 0, 0, 0)))
    operands += [block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32)]
    specs += [full(block_tables.shape), full(seq_lens.shape)]
    # sequence ids only index the sink and tail buffers: none passed, none read (building the
    # identity here would put one more kernel and its launch gap before every call)
    has_sid = cache.has_hp and seq_ids is not None
    if has_sid:
        operands.append(seq_ids.astype(jnp.int32))
        specs.append(full(seq_ids.shape))
    names = {}
    for side in ("k", "v"):
        names[side] = sorted(cache.pages[side])
        for n in names[side]:
            a = plan.page_view(side, n, cache.pages[side][n])
            operands.append(a)
            specs.append(head_spec(a))
    static_names = {}
    for side in ("k", "v"):
        static_names[side] = sorted(cache.static[side]) if cache.static else []
        for n in static_names[side]:
            a = plan.static_view(side, cache.static[side][n])
            operands.append(a)
            specs.append(pl.BlockSpec((None,) + a.shape[1:], lambda b, h, s, nd=a.ndim - 1: (h,) + (0,) * nd))
    hp_int8 = cache.hp_format == "int8"
    if cache.has_hp:
        for side, a in (("k", cache.sink["k"]), ("v", cache.sink["v"]), ("k", cache.tail["k"]), ("v", cache.tail["v"])):
            if side == "v":  # [.., D] -> [.., D/vp, vp]: value planes
                a = a.reshape(a.shape[:3] + (d // plan.vp, plan.vp))
            operands.append(a)
            specs.append(head_spec(a))
        if hp_int8:  # per-token scale and zero point [rows, Hk, tokens] of each
            for meta in (cache.sink_meta, cache.tail_meta):
                for side in ("k", "v"):
                    for n in ("scale", "zero"):
                        operands.append(meta[side][n])
                        specs.append(head_spec(meta[side][n]))

    kernel = functools.partial(
        decode_kernel, plan=plan, names=names, static_names=static_names, has_hp=cache.has_hp, has_sid=has_sid,
        block_size=cache.block_size, tail_len=max(cache.tail_len, 1), tiles_per_block=tiles_per_block,
        num_splits=splits, sm_scale=scale, window=window, tokens_major=tokens_major, parts=run.parts,
        steps=run.steps, hp_chunk=hp_chunk, ids_ahead=run.num_stages >= 3, ids_group=table.ids_group, gp=gp,
        q_rows=q_rows, written=written, normalize=normalize, sink_len=cache.sink_len, hp_int8=hp_int8,
        new_token=new_kv is not None)
    vp = plan.vp
    acc_shape = (d // vp, written) if tokens_major else (written, d // vp)
    # the Pallas merge loads all splits at once: a power-of-two axis (the padding is never written)
    s_out = split_merge.padded_splits(splits) if run.merge == "pallas" else splits
    if normalize:  # the final output [B, Hk, heads, D/vp, vp]: channel vp*i + n at [..., i, n]
        out_shape = jax.ShapeDtypeStruct((nbt, hk, grp, d // vp, vp), jnp.float32)
        out_specs = pl.BlockSpec((None, None, grp, d // vp, vp), lambda b, h, s: (b, h, 0, 0, 0))
    else:  # each split's partial output, max and sum
        out_shape = [jax.ShapeDtypeStruct((nbt, hk, s_out, vp) + acc_shape, jnp.float32),
                     jax.ShapeDtypeStruct((nbt, hk, s_out, written), jnp.float32),
                     jax.ShapeDtypeStruct((nbt, hk, s_out, written), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, vp) + acc_shape, lambda b, h, s: (b, h, s, 0, 0, 0)),
                     pl.BlockSpec((None, None, None, written), lambda b, h, s: (b, h, s, 0)),
                     pl.BlockSpec((None, None, None, written), lambda b, h, s: (b, h, s, 0))]
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=run.num_warps, num_stages=run.num_stages)
    outs = pl.pallas_call(kernel, grid=(nbt, hk, splits), in_specs=specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=interpret,
                          name=triton_options.kernel_name(f"kvarn_paged_decode_{cfg.name}", run.maxnreg),
                          **params)(*operands)
    if normalize:
        return outs.reshape(nbt, hq, d)
    acc, m, l = outs  # noqa: E741
    if new_kv is not None:
        acc, m, l = _with_new_token(acc[:, :, :splits], m[:, :, :splits], l[:, :, :splits], q_rot, new_kv,  # noqa: E741
                                    scale=scale, grp=grp, written=written, vp=vp, tokens_major=tokens_major)
        splits += 1
        if run.merge == "pallas":  # its split axis padded to a power of two again (the padding is masked)
            pad = split_merge.padded_splits(splits) - splits
            acc, m, l = (jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3)) for x in (acc, m, l))  # noqa: E741
    # merge the splits (flash-decoding), then re-interleave the value planes: channel vp*i + n
    heads_axis = -1 if tokens_major else -2
    if run.merge == "pallas":
        o = split_merge.merge_splits_pallas(acc, m, l, splits=splits, heads_axis=heads_axis, interpret=interpret)
        return o.reshape(nbt, hk, written, d)[:, :, :grp].reshape(nbt, hq, d)  # [.., Gp, D/vp, vp]: channels in order
    # the GQA group's padding dropped first: XLA's merge fusions then write the output in its
    # final layout (no separate slice after them)
    acc = acc[..., :grp] if tokens_major else acc[..., :grp, :]
    o = split_merge.merge_splits_reference(acc, m[..., :grp], l[..., :grp], splits, heads_axis)
    return o.reshape(nbt, hq, d)


def _with_new_token(acc, m, l, q_rot, new_kv, *, scale: float, grp: int, written: int, vp: int,  # noqa: E741
                    tokens_major: bool):
    """The kernel's partials (acc, m, l over S splits) with one more split holding the token new_kv
    (stored frame): its base-2 logit as that split's max, a sum of 1 and its value as the partial
    output, in the value planes' layout. Heads past the group (`written` > grp) get max NEG, sum 0."""
    nbt, hq, d = q_rot.shape
    hk = hq // grp
    k, v = (x.astype(jnp.float32) for x in new_kv)
    qs = q_rot.astype(jnp.float32).reshape(nbt, hk, grp, d) * (scale * LOG2E)    # the kernel's scaled query
    s = jnp.einsum("bhgd,bhd->bhg", qs, k, precision=jax.lax.Precision.HIGHEST)
    pad = ((0, 0), (0, 0), (0, written - grp))
    m_new = jnp.pad(s, pad, constant_values=NEG)[:, :, None]                      # [B, Hk, 1, W]
    l_new = jnp.pad(jnp.ones_like(s), pad)[:, :, None]
    planes = v.reshape(nbt, hk, d // vp, vp).transpose(0, 1, 3, 2)               # [B, Hk, vp, D/vp]
    if tokens_major:                                                             # [.., vp, D/vp, W]
        a = jnp.broadcast_to(planes[..., None], planes.shape + (written,))
    else:                                                                        # [.., vp, W, D/vp]
        a = jnp.broadcast_to(planes[:, :, :, None, :], (nbt, hk, vp, written, d // vp))
    return (jnp.concatenate([acc, a[:, :, None]], axis=2), jnp.concatenate([m, m_new], axis=2),
            jnp.concatenate([l, l_new], axis=2))
