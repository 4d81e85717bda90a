"""Fused paged decode attention as a Pallas TPU (Mosaic) kernel, with scalar-prefetched block tables.

Oracle: `reference.py` beside this file (`paged_decode_attention_reference`). Same math as the GPU
kernel (`paged_decode_pallas/`); what differs is how it is laid out for a TPU:

- Grid (sequence, kv head, block). The block tables, sequence lengths and sequence ids are scalar-
  prefetched into SMEM, so the BlockSpec index maps pick each step's physical page (and the
  sequence's high-precision sink / tail-ring block) and Pallas pipelines the page DMAs behind the
  compute. Steps past the sequence clamp their page index to one already fetched, so they cost no
  DMA, and skip the compute.
- One grid step handles one whole block: the high-precision sink at step 0, the quantized pages at
  steps 1 .. n-1, and at step n the query's own block from the high-precision ring (a token never
  sees its own block quantized). With a sink of S tokens shorter than a block, step 0 also reads the
  rest of block 0 from its page (or from the ring while it is the query's block), its first S
  positions masked. An int8 sink and ring are dequantized with their per-token scale and zero point. The online softmax state lives in VMEM scratch across the block
  axis ("arbitrary"); the sequence and head axes are "parallel" (megacore).
- TPU vectors have no cheap strided lane access, and codes are packed so that bit plane j of a byte
  holds elements j, j + 8/bits, ... (docs/design.md §1.5). Instead of re-interleaving lanes, planes are
  moved into natural order with small 0/1 selection matmuls on the otherwise idle matrix unit
  (exact at HIGHEST precision): key-plane scores -> token order, value-plane outputs -> channel
  order, per-group scales -> per-channel. Scales stay outside the code products as in the GPU kernel.
- fp8 (e4m3) codes are decoded with integer ops and a 32-bit bitcast, not an 8-bit float type.

The kernel works in the stored frame (rotated for KVarN); `paged_decode_attention` rotates the query
once before and the output once after. In CI it runs in interpret mode on CPU, and its lowering to
Mosaic for an abstract TPU is checked (jax can lower for TPU without one); it has not been compiled
or timed on a TPU here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..cache.paged import tokens_last
from ..config import KVQuantConfig

NEG = -1e30
HIGHEST = lax.Precision.HIGHEST


def supports(cfg: KVQuantConfig, block_size: int, head_dim: int) -> str | None:
    """None if the TPU kernel handles this cache, else the reason (the reference must be used)."""
    if block_size % 8:
        return f"block_size={block_size} (the TPU kernel needs a multiple of 8: whole sublane tiles)"
    if head_dim % 8:
        return f"head_dim={head_dim} (the TPU kernel needs a multiple of 8)"
    if cfg.method == "int":
        for side in ("k", "v"):
            planes = 8 // cfg.bits(side)
            if cfg.channel_group(side, head_dim) % planes:
                return f"channel group {cfg.channel_group(side, head_dim)} not a multiple of {planes}"
    return None


# ----------------------------------------------------------------------------- in-kernel helpers
def _dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """a [M, K] . b [N, K]^T -> [M, N]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def _plane(c, bits: int, j: int):
    """Bit plane j of packed codes (int32): element j of every byte, as f32."""
    if bits == 8:
        return c.astype(jnp.float32)
    return jnp.bitwise_and(jnp.right_shift(c, j * bits), (1 << bits) - 1).astype(jnp.float32)


def _select(rows: int, cols: int, fn):
    """0/1 f32 matrix [rows, cols] with ones where fn(row index, col index)."""
    r = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return fn(r, c).astype(jnp.float32)


def _planes_to_natural(n: int, planes: int, j: int):
    """[n, n*planes] selection: column t takes row a of plane j when t == a * planes + j."""
    return _select(n, n * planes, lambda a, t: t == a * planes + j)


def _groups_to_plane(groups: int, width: int, planes: int, j: int, group: int):
    """[groups, width] selection: plane-j column i (channel j + planes*i) takes its channel group."""
    return _select(groups, width, lambda g, i: lax.div(j + planes * i, jnp.int32(group)) == g)


def _fp8_e4m3(c):
    """e4m3 bit patterns (int32 0..255) -> f32. Normal: (1 + m/8) 2^(e-7); subnormal: m 2^-9."""
    sign = jnp.left_shift(jnp.right_shift(c, 7), 31)
    e = jnp.bitwise_and(jnp.right_shift(c, 3), 15)
    m = jnp.bitwise_and(c, 7)
    normal = lax.bitcast_convert_type(sign | jnp.left_shift(e + 120, 23) | jnp.left_shift(m, 20), jnp.float32)
    sub = m.astype(jnp.float32) * (2.0 ** -9)
    sub = jnp.where(sign != 0, -sub, sub)
    return jnp.where(e == 0, sub, normal)


def _own_block(length, bs: int):
    """Block of position length - 1 (0 for an empty sequence). lax.div, not //: the operands are
    non-negative, and jnp's floor division emits a sign correction Mosaic lowers per TPU generation."""
    return lax.div(jnp.maximum(length - 1, 0), jnp.int32(bs))


# ----------------------------------------------------------------------------- per-scheme blocks
class _Plan:
    """Per-scheme scores and values of one block (all its tiles) in natural token/channel order."""

    def __init__(self, cfg: KVQuantConfig, head_dim: int, block_size: int):
        self.cfg, self.d, self.bs = cfg, head_dim, block_size
        self.tiled = cfg.method in ("kvarn", "kivi")
        self.t = cfg.tile_tokens if self.tiled else block_size
        self.tpb = block_size // self.t
        self.kp = 8 // cfg.k_bits if cfg.method in ("kvarn", "kivi", "int") else 1   # key code planes
        self.vp = 8 // cfg.v_bits if cfg.method in ("kvarn", "kivi", "int") else 1   # value code planes

    def page_view(self, name: str, a):
        """Page field [nb, Hk, tiles, *shape] -> the array the kernel's BlockSpec slices (free reshapes)."""
        if self.tiled:
            return a
        nb, hk = a.shape[:2]
        if a.ndim == 3:                 # fp8 per-token scale [nb, Hk, bs] -> a lane row [nb, Hk, 1, bs]
            return a.reshape(nb, hk, 1, a.shape[2])
        return a

    def static_view(self, side: str, a):
        """Static params -> [Hk, planes, D/planes] (int: per-channel, plane-split here, they are tiny)
        or [Hk, 1, 1] (fp8 per-head scale)."""
        if self.cfg.method == "int":
            planes = self.kp if side == "k" else self.vp
            return a.reshape(a.shape[0], a.shape[1] // planes, planes).transpose(0, 2, 1).astype(jnp.float32)
        return a.reshape(a.shape[0], 1, 1).astype(jnp.float32)

    # ---- keys: scores [Gp, t] (natural token order) of tile u of the block in `f` (refs of one block)
    def scores(self, q, qp, f, st, u):
        cfg = self.cfg
        if self.tiled:
            kc, t = self.kp, self.t
            c = f["codes"][u].astype(jnp.int32)                                  # [t*b/8, D]
            sname, zname = ("scale_chan", "zero_chan") if cfg.method == "kvarn" else ("scale", "zero")
            sc = f[sname][pl.ds(u, 1), :].astype(jnp.float32)                     # [1, D]
            zr = f[zname][pl.ds(u, 1), :].astype(jnp.float32)
            qs = q * sc
            s = 0.0
            for j in range(kc):
                sj = _dot_nt(qs, _plane(c, cfg.k_bits, j))                        # tokens j, j+kc, ...
                s = s + (_dot(sj, _planes_to_natural(t // kc, kc, j)) if kc > 1 else sj)
            s = s + jnp.sum(q * zr, axis=1, keepdims=True)
            if cfg.method == "kvarn":
                s = s * f["scale_tok"][pl.ds(u, 1), :].astype(jnp.float32)        # [1, t]
            return s
        if cfg.method == "int":
            k = self._int_planes("k", f, st)                                     # pk x [bs, D/pk]
            return sum(_dot_nt(qp[n], k[n]) for n in range(self.kp))
        if cfg.method == "fp8":
            s = _dot_nt(q, _fp8_e4m3(f["codes"][...].astype(jnp.int32)))        # [Gp, bs]
            return s * (st["k"]["scale"] if cfg.static else f["scale"][...].astype(jnp.float32))
        return _dot_nt(q, f["values"][...].astype(jnp.float32))

    def _int_planes(self, side, f, st):
        """Dequantized channel planes of a per-token int block: list over n of [bs, D/planes]."""
        cfg, d = self.cfg, self.d
        planes = self.kp if side == "k" else self.vp
        bits = cfg.bits(side)
        c = f["codes"][...].astype(jnp.int32)                                   # [bs, D*b/8]
        if tokens_last(cfg, side, "codes"):                                      # stored [D*b/8, bs]
            c = c.T
        if cfg.static:
            sc, zr = st[side]["scale"], st[side]["zero"]                         # [planes, D/planes]
            return [_plane(c, bits, n) * sc[n:n + 1] + zr[n:n + 1] for n in range(planes)]
        cg = cfg.channel_group(side, d)
        sc = f["scale"][...].astype(jnp.float32)                                 # [bs, D/cg]
        zr = f["zero"][...].astype(jnp.float32)
        out = []
        for n in range(planes):
            if sc.shape[1] == 1:
                out.append(_plane(c, bits, n) * sc + zr)
            else:
                r = _groups_to_plane(d // cg, d // planes, planes, n, cg)
                out.append(_plane(c, bits, n) * _dot(sc, r) + _dot(zr, r))
        return out

    # ---- values: probabilities [Gp, t] of tile u -> output contribution [Gp, D] (natural channel order)
    def values(self, p, f, st, u):
        cfg, d, vp = self.cfg, self.d, self.vp
        to_nat = lambda o, n: _dot(o, _planes_to_natural(d // vp, vp, n)) if vp > 1 else o  # noqa: E731
        if self.tiled:
            c = f["codes"][u].astype(jnp.int32)                                  # [D*b/8, t]
            o = 0.0
            if cfg.method == "kvarn":
                pv = p * f["scale_tok"][pl.ds(u, 1), :].astype(jnp.float32)
                zp = jnp.sum(p * f["zero_tok"][pl.ds(u, 1), :].astype(jnp.float32), axis=1, keepdims=True)
                for n in range(vp):
                    o = o + to_nat(_dot_nt(pv, _plane(c, cfg.v_bits, n)) + zp, n)
                return o * f["scale_chan"][pl.ds(u, 1), :].astype(jnp.float32)
            c = c.T                                                               # kivi: [t, D*b/8]
            cg = cfg.channel_group("v", d)                                        # per-token groups
            sc = f["scale"][u].astype(jnp.float32)                               # [t, D/cg]
            zr = f["zero"][u].astype(jnp.float32)
            for n in range(vp):
                if sc.shape[1] == 1:
                    vn = _plane(c, cfg.v_bits, n) * sc + zr
                else:
                    r = _groups_to_plane(d // cg, d // vp, vp, n, cg)
                    vn = _plane(c, cfg.v_bits, n) * _dot(sc, r) + _dot(zr, r)
                o = o + to_nat(_dot(p, vn), n)
            return o
        if cfg.method == "int":
            v = self._int_planes("v", f, st)
            return sum(to_nat(_dot(p, v[n]), n) for n in range(vp))
        if cfg.method == "fp8":
            v = _fp8_e4m3(f["codes"][...].astype(jnp.int32))
            if tokens_last(cfg, "v", "codes"):                                   # stored [D, bs]
                v = v.T
            if cfg.static:
                return _dot(p, v) * st["v"]["scale"]
            return _dot(p * f["scale"][...].astype(jnp.float32), v)
        return _dot(p, f["values"][...].astype(jnp.float32))


# ----------------------------------------------------------------------------- the kernel
def _kernel(bt_ref, len_ref, sid_ref, *refs, plan, names, static_names, has_hp, max_blocks, sm_scale,
            window, sink_len=0, hp_int8=False):
    it = iter(refs)
    q_ref = next(it)
    qp_ref = next(it) if plan.cfg.method == "int" else None
    pages = {side: {n: next(it) for n in names[side]} for side in ("k", "v")}
    static = {side: {n: next(it) for n in static_names[side]} for side in ("k", "v")}
    if has_hp:
        sink_k, sink_v, tail_k, tail_v = next(it), next(it), next(it), next(it)
        metas = [(next(it), next(it)) for _ in range(4)] if hp_int8 else [None] * 4
    o_ref = next(it)
    m_ref, l_ref, acc_ref = next(it), next(it), next(it)

    def hp_values(ref, meta):
        """A high-precision block [n, D] as fp32: float storage, or int8 codes x scale + zero ([n, 1])."""
        x = ref[...].astype(jnp.float32)
        return x if meta is None else x * meta[0][...].astype(jnp.float32) + meta[1][...].astype(jnp.float32)

    b, i = pl.program_id(0), pl.program_id(2)
    bs = plan.bs
    length = len_ref[b]
    ws = jnp.maximum(length - window, 0) if window is not None else jnp.int32(0)
    own = _own_block(length, bs)                    # the query's block (high precision)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = q_ref[...].astype(jnp.float32)                                          # [Gp, D]
    qp = [qp_ref[n] for n in range(plan.kp)] if qp_ref is not None else None
    st = {side: {n: r[...] for n, r in static[side].items()} for side in ("k", "v")}

    def update(s, value_fn, start=0, lo=None):
        """Online softmax over scores s [Gp, n] of positions i*bs + start + [0, n), then acc += value_fn(p).
        Positions below `lo` (default: the window's start) are masked."""
        pos = i * bs + start + lax.broadcasted_iota(jnp.int32, (1, s.shape[1]), 1)
        valid = (pos >= (ws if lo is None else lo)) & (pos < length)
        s = jnp.where(valid, s * sm_scale, NEG)
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + value_fn(p)
        m_ref[...] = m_new

    in_window = (i + 1) * bs > ws
    if has_hp:
        # a sink shorter than a block: block 0 is read like the others (page or ring), its sink
        # positions masked (they come from the sink)
        partial = sink_len < bs
        first_paged = 0 if partial else 1
        lo = jnp.maximum(ws, sink_len) if partial else ws

        @pl.when((i == 0) & (length > 0) & (sink_len > ws))
        def _sink():
            update(_dot_nt(q, hp_values(sink_k, metas[0])), lambda p: _dot(p, hp_values(sink_v, metas[1])))

        @pl.when((i >= first_paged) & (i < own) & in_window)
        def _page():
            for u in range(plan.tpb):
                update(plan.scores(q, qp, pages["k"], st, u), lambda p, u=u: plan.values(p, pages["v"], st, u),
                       start=u * plan.t, lo=lo)

        @pl.when((i >= first_paged) & (i == own) & in_window)
        def _tail():
            update(_dot_nt(q, hp_values(tail_k, metas[2])), lambda p: _dot(p, hp_values(tail_v, metas[3])), lo=lo)
    else:
        @pl.when((i * bs < length) & in_window)
        def _page():
            for u in range(plan.tpb):
                update(plan.scores(q, qp, pages["k"], st, u), lambda p, u=u: plan.values(p, pages["v"], st, u),
                       start=u * plan.t)

    @pl.when(i == max_blocks - 1)
    def _finish():
        l = l_ref[...]
        o_ref[...] = acc_ref[...] / jnp.where(l > 0, l, 1.0)


@functools.partial(jax.jit, static_argnames=("scale", "window", "interpret"))
def paged_decode_tpu(q_rot, cache, block_tables, seq_lens, seq_ids, *, scale: float, window: int | None,
                     interpret: bool = False):
    """Kernel entry: q_rot [B, Hq, D] in the stored frame -> output [B, Hq, D] fp32 in the stored frame."""
    cfg = cache.cfg
    nbt, hq, d = q_rot.shape
    hk, bs, nb = cache.num_kv_heads, cache.block_size, cache.num_blocks
    grp = hq // hk
    gp = max(8, 1 << (grp - 1).bit_length())          # query rows: whole sublane tiles
    mb = block_tables.shape[1]
    plan = _Plan(cfg, d, bs)
    has_hp = cache.has_hp
    tail_blocks = max(cache.tail_blocks, 1)
    sink_len = cache.sink_len if has_hp else 0
    first_paged = 0 if has_hp and sink_len < bs else 1
    hp_int8 = cache.hp_format == "int8"

    qg = q_rot.astype(jnp.float32).reshape(nbt, hk, grp, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - grp), (0, 0)))
    operands = [qg]
    specs = [pl.BlockSpec((None, None, gp, d), lambda b, h, i, *_: (b, h, 0, 0))]
    if cfg.method == "int":  # query channel planes n, n + pk, ... matching the key codes' planes
        qp = qg.reshape(nbt, hk, gp, d // plan.kp, plan.kp).transpose(0, 1, 4, 2, 3)
        operands.append(qp)
        specs.append(pl.BlockSpec((None, None, plan.kp, gp, d // plan.kp), lambda b, h, i, *_: (b, h, 0, 0, 0)))

    def page_index(b, i, bt, lens):
        # the block this step reads; steps that read no page repeat a fetched index (no DMA) and the
        # table entry is clamped so that unused entries never address memory outside the pages
        if has_hp:
            own = _own_block(lens[b], bs)
            j = jnp.clip(i, first_paged, jnp.maximum(own - 1, first_paged))
        else:
            j = jnp.clip(i, 0, _own_block(lens[b], bs))
        return jnp.clip(bt[b * mb + j], 0, nb - 1)

    names = {}
    for side in ("k", "v"):
        names[side] = sorted(cache.pages[side])
        for n in names[side]:
            a = plan.page_view(n, cache.pages[side][n])
            operands.append(a)
            specs.append(pl.BlockSpec((None, None) + a.shape[2:],
                                      lambda b, h, i, bt, lens, sid, nd=a.ndim - 2: (page_index(b, i, bt, lens), h)
                                      + (0,) * nd))
    static_names = {}
    for side in ("k", "v"):
        static_names[side] = sorted(cache.static[side]) if cache.static else []
        for n in static_names[side]:
            a = plan.static_view(side, cache.static[side][n])
            operands.append(a)
            specs.append(pl.BlockSpec((None,) + a.shape[1:], lambda b, h, i, *_: (h, 0, 0)))
    if has_hp:
        sink_at = lambda b, h, i, bt, lens, sid: (sid[b], h, 0, 0)  # noqa: E731
        tail_at = lambda b, h, i, bt, lens, sid: (sid[b], h, lax.rem(_own_block(lens[b], bs), tail_blocks), 0)  # noqa: E731
        for a in (cache.sink["k"], cache.sink["v"]):
            operands.append(a)
            specs.append(pl.BlockSpec((None, None, sink_len, d), sink_at))
        for a in (cache.tail["k"], cache.tail["v"]):
            operands.append(a)
            specs.append(pl.BlockSpec((None, None, bs, d), tail_at))
        if hp_int8:  # per-token scale and zero [rows, Hk, n] viewed [rows, Hk, n, 1]: whole trailing dims
            for meta, n, at in ((cache.sink_meta, sink_len, sink_at), (cache.tail_meta, bs, tail_at)):
                for side in ("k", "v"):
                    for name in ("scale", "zero"):
                        operands.append(meta[side][name][..., None])
                        specs.append(pl.BlockSpec((None, None, n, 1), at))

    kernel = functools.partial(_kernel, plan=plan, names=names, static_names=static_names, has_hp=has_hp,
                               max_blocks=mb, sm_scale=scale, window=window, sink_len=sink_len, hp_int8=hp_int8)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(nbt, hk, mb), in_specs=specs,
        out_specs=pl.BlockSpec((None, None, gp, d), lambda b, h, i, *_: (b, h, 0, 0)),
        scratch_shapes=[pltpu.VMEM((gp, 1), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                        pltpu.VMEM((gp, d), jnp.float32)])
    params = {}
    if not interpret:
        params["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    out = pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((nbt, hk, gp, d), jnp.float32),
                         interpret=interpret, name=f"kvarn_paged_decode_tpu_{cfg.name}", **params)(
        # lengths and sequence ids clamped into range (block ids are, in `page_index`): unchecked
        # indices must not make the DMAs address memory outside the cache
        block_tables.astype(jnp.int32).reshape(-1), jnp.clip(seq_lens.astype(jnp.int32), 0, mb * bs),
        jnp.clip(seq_ids.astype(jnp.int32), 0, (cache.max_seqs - 1) if has_hp else 0), *operands)
    return out[:, :, :grp].reshape(nbt, hq, d)
