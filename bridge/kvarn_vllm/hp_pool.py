"""High-precision sink and tail rows kept in the block pool, paid by live requests only.

The kvarn KV-cache spec (`spec.KvarnAttentionSpec`) makes vLLM's block manager give each request
`hp_blocks` blocks at the front of its block table, besides the blocks of its tokens, for as long as
it holds KV cache; they count against the pool like any block, so the scheduler admits, queues and
preempts knowing them. A sequence's sink and tail rows live in the page bytes of those blocks, in
units scattered over the page fields (`layout.HpUnits`).

The cache that JAX and `torch_ops` read keeps its sink/tail as dense `[max_num_seqs, ...]` arrays
indexed by slot. Here those arrays are one staging area per scheme, shared by every layer of the
engine, with one slot per batch row: before a layer's forward (`HpPool.gather`) each row's rows are
copied from its blocks into slot r (zeros for a row starting its sequence this step); after it
(`HpPool.scatter`) the rows the step wrote are copied back. Memory: the staging area (max_num_seqs
rows of one layer, outside the KV budget) instead of max_num_seqs rows of every layer; work: one
indexed copy of the batch's rows per layer and step.

A decode-only step on the CPU in which no sequence starts skips the staging (`HpPool.in_place`):
torch copies the rows' sink and last ring block from the pool's blocks into a buffer its XLA
computation reads (one indexed copy: XLA's CPU gather costs more per byte), and stores the new rows
there, one indexed copy per layer; the ring blocks the step fills are quantized from that
computation's output (`torch_ops._decode_step_served`).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import torch

from . import torch_ops
from .layout import HpUnits, PageLayout, allocate_hp
from .plan import bucket

HP_BLOCKS = "hp_blocks"  # the plan's cache key: [rows, H] block ids (the first H of each block table)
HP_FRESH = "hp_fresh"    # [rows] bool: the row starts its sequence at position 0 in this step
HP_LEAVES = ("sink.k", "sink.v", "tail.k", "tail.v")  # the staging leaves, in allocation order

_LOCK = threading.Lock()
_STAGING: dict = {}


def staging(layout: PageLayout, engine_key, device) -> dict | None:
    """The staging sink/tail tensors for `layout` (one per engine and scheme, every layer shares
    them), or None for passthrough schemes."""
    if not layout.hp_seq_bytes:
        return None
    key = (engine_key, layout)
    with _LOCK:
        if key not in _STAGING:
            _STAGING[key] = allocate_hp(layout, device)
        return _STAGING[key]


def _units_view(t: torch.Tensor, unit: int) -> torch.Tensor:
    """A contiguous tensor's bytes as [n, unit] uint8."""
    flat = t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)
    return flat.view(-1, unit)


@dataclasses.dataclass(frozen=True)
class InPlace:
    """A decode step's sink/tail rows used where they live (`HpPool.in_place`): the layer's buffer
    as [n, unit] bytes (buffer_units); hp_src [B, 4 * Hk * bs * row_units] int64: per padded row, the
    units of its sink K, sink V, last ring block K and V (`torch_ops` copies them, one indexed copy,
    into a buffer the computation reads); dst / src: the write's indexed copy, destination units in
    the buffer and source units in the rows [2, B, Hk, D] as bytes (None: all of them, in order)."""

    unit: int
    buffer_units: torch.Tensor
    hp_src: torch.Tensor
    dst: torch.Tensor
    src: torch.Tensor | None


class HpPool:
    """One layer's side of the pool: its units map (rebuilt when vLLM hands it a new buffer)."""

    def __init__(self, layout: PageLayout, staging_rows: dict | None):
        self.layout = layout
        self.staging = staging_rows
        self._units: tuple | None = None  # (buffer data_ptr, num_blocks, HpUnits, buffer units)

    @property
    def active(self) -> bool:
        return self.staging is not None

    def units(self, bound) -> HpUnits:
        return self._bound_units(bound)[0]

    def _bound_units(self, bound) -> tuple:
        """(HpUnits, the buffer as [n, unit] bytes): built when the buffer is first seen."""
        key = (bound.buffer.data_ptr(), bound.num_blocks)
        if self._units is None or self._units[:2] != key:
            hu = HpUnits.build(self.layout, bound.num_blocks)
            self._units = key + (hu, _units_view(bound.buffer, hu.unit))
        return self._units[2:]

    def in_place(self, bound, plan, decode_impl: str) -> InPlace | None:
        """What a decode-only step needs to use its rows' sink and tail in the pool's blocks
        (`torch_ops.forward(pooled=)`), or None when the step takes the staging (`gather` /
        `scatter`): steps with prefill rows, rows starting their sequence, completed blocks the fused
        step does not quantize (`torch_ops.fuses_completions`), or decode rows not on the CPU's served
        decode. Index arrays made once per step."""
        if not self.active or not plan.num_rows or plan.num_decodes != plan.num_rows or decode_impl != "served" \
                or (plan.completing and not torch_ops.fuses_completions(bound)) or plan.cache[HP_FRESH].any() \
                or bound.buffer.device.type != "cpu":
            return None
        hu, buf = self._bound_units(bound)
        seq, _, _, _, _ = self._indices(bound, plan)[1]
        bb = bucket(plan.num_decodes, 1)

        def make():
            lay = self.layout
            hk, bs, tl, ru, nd = lay.num_kv_heads, lay.block_size, plan.tail_len, hu.row_units, plan.num_decodes
            last = (plan.seq_len[:nd] - 1) // bs
            ring = (last * bs) % tl                                                        # first ring position
            at = np.arange(bs)[None, :, None] * ru + np.arange(ru)[None, None, :]         # [1, bs, ru]
            heads = np.arange(hk)[:, None, None]
            within = []
            for leaf, length in (("sink.k", bs), ("sink.v", bs), ("tail.k", tl), ("tail.v", tl)):
                per_row = hu.leaf_start[leaf] + heads * length * ru + at                  # [Hk, bs, ru]
                first = np.zeros(nd, np.int64) if leaf.startswith("sink") else ring * ru
                within.append(per_row.reshape(-1)[None, :] + first[:, None])
            within = np.concatenate(within, 1)                                             # [nd, 4 * Hk * bs * ru]
            rows = np.concatenate([np.arange(nd), np.zeros(bb - nd, np.int64)])
            rows_t = torch.from_numpy(rows)
            src_units = seq[rows_t[:, None], torch.from_numpy(np.concatenate([within, within[:1].repeat(bb - nd, 0)]))]
            # the new token of row r (position seq_len - 1): its row in the sink or the ring, per side and head
            pos = plan.seq_len[:nd] - 1
            in_sink = pos < bs
            dst, src = [], []
            for side in (0, 1):
                leaf = np.where(in_sink, hu.leaf_start[("sink.k", "sink.v")[side]],
                                hu.leaf_start[("tail.k", "tail.v")[side]])
                length = np.where(in_sink, bs, tl)
                w = (leaf[:, None, None] + (np.arange(hk)[None, :, None] * length[:, None, None]
                                             + (pos % length)[:, None, None]) * ru + np.arange(ru)[None, None, :])
                dst.append(seq[torch.from_numpy(np.repeat(np.arange(nd), hk * ru)), torch.from_numpy(w.reshape(-1))])
                src.append((((side * bb + np.arange(nd))[:, None] * hk + np.arange(hk)[None, :])[:, :, None] * ru
                            + np.arange(ru)[None, None, :]).reshape(-1))
            src = np.concatenate(src)
            every = bb == nd
            return src_units.to(torch.int64).contiguous(), torch.cat(dst), None if every else torch.from_numpy(src)
        hp_src, dst, src = plan.cached(("hp_in_place", self.layout, bound.num_blocks), make)
        return InPlace(hu.unit, buf, hp_src, dst, src)

    def forward(self, bound, query, key, value, plan, *, scale: float, impl: str, out: torch.Tensor) -> torch.Tensor:
        """One attention layer of a step on a pooled cache (what vLLM's impl runs): `torch_ops.forward`
        with the rows' sink and tail used in place (`in_place`) or staged around it (`gather`,
        `scatter`)."""
        pooled = self.in_place(bound, plan, torch_ops.decode_impl(impl))
        if pooled is None:
            self.gather(bound, plan)
        torch_ops.forward(bound, query, key, value, plan, scale=scale, impl=impl, out=out, pooled=pooled)
        if pooled is None:
            self.scatter(bound, plan)
        return out

    def _indices(self, bound, plan):
        """Once per step for every layer of this scheme and buffer size, on the cache's device: the
        rows' units in the buffer and in the staging slots ([rows, U] each), the gather's source and
        destination units (rows continuing their sequence) and the staging units to zero (fresh rows)."""
        hu = self.units(bound)

        def make():
            hb = plan.cache[HP_BLOCKS]
            if hb.shape[1] * hu.block_base.shape[0] < hu.units_per_seq:
                raise RuntimeError(f"kvarn: requests hold {hb.shape[1]} blocks for their sink and tail but "
                                   f"{self.layout.cfg.name} needs {self.layout.hp_blocks_per_seq}")
            fresh = plan.cache[HP_FRESH]
            seq, stage = hu.seq_units(hb), hu.stage_units(hb.shape[0], hb.device)
            cont, new = (torch.from_numpy(np.nonzero(m)[0]).to(hb.device) for m in (~fresh, fresh))
            return seq, stage, seq[cont].reshape(-1), stage[cont].reshape(-1), stage[new].reshape(-1)
        return hu, plan.cached(("hp_units", self.layout, bound.num_blocks), make)

    def gather(self, bound, plan) -> None:
        """Stage the step's rows' sink and tail: slot r <- row r's blocks (zeros for fresh rows)."""
        if not self.active or not plan.num_rows:
            return
        hu, (_, _, src, dst, zero) = self._indices(bound, plan)
        stg = self._stage_view(hu)
        if src.numel():
            stg.index_copy_(0, dst, _units_view(bound.buffer, hu.unit).index_select(0, src))
        if zero.numel():
            stg.index_fill_(0, zero, 0)

    def _stage_view(self, hu: HpUnits) -> torch.Tensor:
        """The staging leaves (back to back in one allocation, `allocate_hp`) as [n, unit] bytes."""
        first = self.staging[HP_LEAVES[0]]
        total = sum(t.numel() for t in self.staging.values())
        flat = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,))
        return _units_view(flat, hu.unit)

    def scatter(self, bound, plan) -> None:
        """Copy the rows this step wrote from the staging slots back to the rows' blocks (all of a
        fresh row's units, so its blocks hold zeros past what it wrote)."""
        if not self.active or not plan.num_rows:
            return
        hu, (seq, stage, _, _, _) = self._indices(bound, plan)

        def make():
            r, j = self._written(hu, plan, plan.cache[HP_FRESH])
            r_t, j_t = (torch.from_numpy(x).to(seq.device) for x in (r, j))
            return seq[r_t, j_t], stage[r_t, j_t]
        src_seq, src_stage = plan.cached(("hp_written", self.layout, bound.num_blocks), make)
        buf = _units_view(bound.buffer, hu.unit)
        stg = self._stage_view(hu)
        buf.index_copy_(0, src_seq, stg.index_select(0, src_stage))

    def _written(self, hu: HpUnits, plan, fresh: np.ndarray):
        """(row, unit) of every unit the step wrote in the staging slots: the sink and ring rows of
        its tokens (`StepPlan.stored`), and every unit of the fresh rows."""
        lay = self.layout
        hk, bs, tl = lay.num_kv_heads, lay.block_size, plan.tail_len
        in_sink, in_ring = plan.stored()
        row, pos = plan.token_row, plan.positions
        keep = ~fresh[row]
        rows, units = [], []
        ru = np.arange(hu.row_units)
        for mask, leaves, length in ((in_sink & keep, (0, 1), bs), (in_ring & keep, (2, 3), tl)):
            t = np.nonzero(mask)[0]
            for leaf in (HP_LEAVES[i] for i in leaves):
                # unit of (token, head h, part p) within the slot: ((h * length + pos % length) * row_units + p)
                within = ((np.arange(hk)[None, :] * length + (pos[t] % length)[:, None])[:, :, None] * hu.row_units
                          + ru[None, None, :])
                units.append((hu.leaf_start[leaf] + within).reshape(-1))
                rows.append(np.repeat(row[t], hk * hu.row_units))
        f = np.nonzero(fresh)[0]
        rows.append(np.repeat(f, hu.units_per_seq))
        units.append(np.tile(np.arange(hu.units_per_seq), f.shape[0]))
        return np.concatenate(rows).astype(np.int64), np.concatenate(units).astype(np.int64)
