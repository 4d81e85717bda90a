"""One step's batch, worked out once on the host and shared by every attention layer of the step.

vLLM builds its attention metadata once per step; the bridge turns it into a `StepPlan` there
(`StepPlan.build`): each token's position and high-precision slot, which tokens the write stores in
the sink or the tail ring, how many blocks the write completes, which blocks each row's attention
reads. Everything a layer needs beyond its own q, k and v is derived from the plan once, on first
use, and cached on it (`cached`): index tensors on the model's device, the per-step JAX arrays, the
prefill masks. So a layer's host work does not grow with the number of layers.

Rows follow vLLM's order: rows [0, num_decodes) have one query token (decodes), the others several
(prefill and chunked prefill).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


def bucket(n: int, lo: int = 16) -> int:
    """n rounded up to a power of two (at least lo): few distinct shapes, few compilations."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def bucket_fine(n: int, lo: int = 4) -> int:
    """n rounded up to m * 2^e with m in 4..7: at most 25% padding, four shapes per octave."""
    n = max(int(n), lo)
    e = max(0, n.bit_length() - 3)
    m = -(-n // (1 << e))
    return m << e


@dataclasses.dataclass
class StepPlan:
    """The host's view of one step (see the module docstring).

    Per row r: q_start/q_len (its query tokens are [q_start, q_start + q_len) of the step), seq_len
    (tokens in the cache after this step), seq_id (high-precision slot). Per token: positions,
    token_seq. block_table: the step's [rows, W] block table on the model's device (vLLM's tensor);
    slot_mapping: [tokens] slots on the device (-1: padding). Derived: context = seq_len - q_len;
    completing: blocks the step's write completes (a token at position >= block_size filling its
    block's last slot); stored: whether the write keeps each token in the sink or ring (the last
    tail_len positions a sequence writes in one step).
    """

    block_size: int
    tail_len: int
    max_seqs: int
    num_decodes: int
    q_start: np.ndarray
    q_len: np.ndarray
    seq_len: np.ndarray
    seq_id: np.ndarray
    positions: np.ndarray
    token_seq: np.ndarray
    token_row: np.ndarray
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    cache: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, *, block_size: int, max_seqs: int, query_start_loc, seq_lens, seq_ids, block_table: torch.Tensor,
              slot_mapping: torch.Tensor, num_decodes: int | None = None, tail_blocks: int = 1) -> "StepPlan":
        """query_start_loc [R + 1], seq_lens [R], seq_ids [R]: host arrays (numpy or CPU tensors).
        num_decodes: rows at the front with one query each (default: counted). Raises ValueError on
        inconsistent input (every name refers to the argument)."""
        qsl = np.asarray(query_start_loc, np.int64).reshape(-1)
        lens = np.asarray(seq_lens, np.int64).reshape(-1)
        sid = np.asarray(seq_ids, np.int64).reshape(-1)
        r = lens.shape[0]
        if qsl.shape[0] != r + 1 or sid.shape[0] != r:
            raise ValueError(f"query_start_loc must have {r + 1} entries and seq_ids {r} (one per row of seq_lens), "
                             f"got {qsl.shape[0]} and {sid.shape[0]}")
        q_len = np.diff(qsl)
        if np.any(q_len < 0) or np.any(q_len > lens):
            raise ValueError("query_start_loc must be non-decreasing with at most seq_lens[r] queries per row")
        if np.any((sid < 0) | (sid >= max_seqs)):
            raise ValueError(f"seq_ids must be in [0, max_seqs={max_seqs})")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] < r:
            raise ValueError(f"block_table must be a [rows >= {r}, max_blocks] tensor, got "
                             f"{getattr(block_table, 'shape', type(block_table).__name__)}")
        n = int(qsl[-1] - qsl[0])
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 or slot_mapping.shape[0] < n:
            raise ValueError(f"slot_mapping must be a 1-D tensor of at least {n} entries")
        if np.any(lens > block_table.shape[1] * block_size):
            raise ValueError(f"seq_lens exceed the block table's capacity of {block_table.shape[1] * block_size} tokens")
        if num_decodes is None:
            num_decodes = int(np.argmax(q_len != 1)) if np.any(q_len != 1) else r
        if np.any(q_len[:num_decodes] != 1):
            raise ValueError(f"rows [0, num_decodes={num_decodes}) must have one query token each")
        row = np.repeat(np.arange(r), q_len)
        pos = (lens - q_len)[row] + (np.arange(n) - np.repeat(qsl[:-1] - qsl[0], q_len))
        return cls(block_size=block_size, tail_len=block_size * tail_blocks, max_seqs=max_seqs, num_decodes=num_decodes,
                   q_start=qsl[:-1] - qsl[0], q_len=q_len, seq_len=lens, seq_id=sid, positions=pos, token_seq=sid[row],
                   token_row=row, block_table=block_table[:r], slot_mapping=slot_mapping[:n])

    # ------------------------------------------------------------------ host-side facts
    @property
    def num_rows(self) -> int:
        return int(self.seq_len.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def context(self) -> np.ndarray:
        return self.seq_len - self.q_len

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    def cached(self, key, make):
        """make() once per step and key (every layer of the step shares the result)."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    @property
    def completing(self) -> int:
        """Blocks this step's write completes (quantized by it)."""
        return self.cached("completing", lambda: int(np.sum(self._completes())))

    def _completes(self) -> np.ndarray:
        bs = self.block_size
        return (self.positions >= bs) & (self.positions % bs == bs - 1)

    def stored(self) -> tuple:
        """(in the sink, in the ring) per token: what a quantized cache keeps in high precision. A
        sequence writing more than tail_len tokens in one step keeps only its last tail_len in the
        ring (the earlier ones live in the blocks this write completes)."""
        def make():
            bs, pos, seq = self.block_size, self.positions, self.token_seq
            sink = pos < bs
            rest = ~sink
            maxpos = np.full(self.max_seqs, -1, np.int64)
            np.maximum.at(maxpos, seq[rest], pos[rest])
            return sink, rest & (pos > maxpos[seq] - self.tail_len)
        return self.cached("stored", make)

    @property
    def max_decode_len(self) -> int:
        return int(self.seq_len[:self.num_decodes].max(initial=0))

    def to_device(self, a: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        """A host array on the model's device; to a GPU through pinned memory, queued on the stream
        (a copy from pageable memory would make the host wait)."""
        t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ what each row's attention reads
    def served_entries(self, passthrough: bool) -> tuple:
        """The blocks each prefill row's attention reads from the cache (`torch_ops` dequantizes them
        in one call per layer), one entry per block in position order: block 0 (the sink) and the
        full blocks before the row's last block from the pages - its own blocks come from the step's
        new rows - or, for passthrough caches (every token stored exactly), all its blocks. Decode
        rows read nothing here (`decode_entries`).

        Returns (entries [2, N] int32: row of block_table and column; hp [3, M] int32: entry index,
        seq id, kind - 0 the sink; offsets [R + 1]: row r's entries are [offsets[r], offsets[r + 1]);
        the live count of N). N and M are padded to few shapes: padding entries read column 0 of
        row 0, padding hp entries have index N (dropped)."""
        return self.cached(("served_entries", passthrough), lambda: self._served_entries(passthrough))

    def decode_entries(self, passthrough: bool) -> tuple:
        """What the decode rows' fused attention (`torch_ops`) reads, padded to few shapes:
        (entries [3, N] int32: row, block-table column, valid positions - the pages each row reads in
        position order, blocks 1 .. last-1 for quantized caches (all full), 0 .. last for passthrough
        ones (the last one partial); rows_info [7, B] int32 per row: seq id, sink positions, ring
        offset, ring positions - the high-precision part of quantized caches, the sink (block 0, all
        of it once the row is past it) and the row's last block from the ring - then where the row's
        new token sits: its index in that part (-1 for padding rows), its entry and offset in the
        pages (passthrough)). Padding entries belong to row B (dropped); padding rows have no
        positions."""
        def make():
            bs, nd = self.block_size, self.num_decodes
            lens = self.seq_len[:nd]
            last = (lens - 1) // bs
            first = np.zeros(nd, np.int64) if passthrough else np.ones(nd, np.int64)
            end = last + 1 if passthrough else last
            n = np.maximum(end - first, 0)
            row = np.repeat(np.arange(nd), n)
            col = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + np.repeat(first, n)
            valid = np.where(col < last[row], bs, lens[row] - last[row] * bs)
            nb, bb = bucket_fine(max(1, col.shape[0])), bucket(nd, 1)
            entries = np.zeros((3, nb), np.int32)
            entries[0] = bb
            entries[0, :col.shape[0]], entries[1, :col.shape[0]], entries[2, :col.shape[0]] = row, col, valid
            info = np.zeros((7, bb), np.int32)
            info[4] = -1
            info[4, :nd] = np.where(last == 0, lens - 1, lens - 1 - last * bs)
            info[5, :nd] = np.cumsum(n) - 1
            info[6, :nd] = (lens - 1) % bs
            info[0, :nd] = self.seq_id[:nd]
            if not passthrough:
                info[1, :nd] = np.where(last == 0, lens, bs)
                info[2, :nd] = (last * bs) % self.tail_len
                info[3, :nd] = np.where(last == 0, 0, lens - last * bs)
            return entries, info
        return self.cached(("decode_entries", passthrough), make)

    def own_blocks(self) -> tuple:
        """The prefill queries' own blocks, for the CPU prefill (`torch_ops._prefill_rule`): the step's
        query blocks are each prefill row's blocks fb .. last (fb: the block its chunk starts in), in
        row order, block_size slots each; slot j of a query block holds position block * bs + j.

        Returns own [4, M] int32 per slot - kind: 0 a token of this step, 1 an earlier row in the
        sink, 2 one in the ring, 3 none; the step token; the seq id; the position in the sink or
        ring. M = NQB * block_size with NQB = `query_block_bound`."""
        def make():
            bs, tl, nd, r = self.block_size, self.tail_len, self.num_decodes, self.num_rows
            ctx, lens = self.context, self.seq_len
            fb, last = ctx // bs, (lens - 1) // bs
            nq = np.where((np.arange(r) >= nd) & (self.q_len > 0), last - fb + 1, 0)
            base = np.concatenate([[0], np.cumsum(nq)]) * bs
            m = self.query_block_bound() * bs
            own = np.zeros((4, m), np.int32)
            own[0] = 3
            for i in np.nonzero(nq)[0]:
                slot = base[i] + np.arange(nq[i] * bs)
                p = fb[i] * bs + np.arange(nq[i] * bs)
                new, old = (p >= ctx[i]) & (p < lens[i]), p < ctx[i]
                tok = self.q_start[i] + p - ctx[i]
                own[0, slot] = np.where(new, 0, np.where(old, np.where(p < bs, 1, 2), 3))
                own[1, slot] = np.where(new, tok, 0)
                own[2, slot] = self.seq_id[i]
                own[3, slot] = np.where(p < bs, p, p % tl)
            return own
        return self.cached("own_blocks", make)

    def query_block_bound(self) -> int:
        """How many own-block slots (`own_blocks`) a step of this many tokens pads to: a bound that
        depends only on the padded token count, so the shapes do not vary with how the step's
        tokens split into rows (each distinct shape compiles)."""
        n = bucket(self.num_tokens)
        return bucket(n // self.block_size + min(self.max_seqs, n), 1)

    def prefill_requests(self) -> tuple:
        """The prefill queries as requests of vLLM's CPU attention op (`torch_ops._prefill_rule`), one
        per query block in `own_blocks`' order: (query_start_loc [R + 1] int32 into the step's
        prefill tokens (those from `num_decodes` on); seq_lens [R] int32, the block's last query's
        position + 1; block_table [R, W] int32: the served entries (`served_entries`) of the blocks
        before the query block, then N + i for query block i - its own rows, staged after the N
        padded served entries). The op aligns a request's queries to the end of its keys and masks
        causally: a query sees the blocks before its own in full and its own block's rows up to
        itself, the rule."""
        def make():
            bs, nd, r = self.block_size, self.num_decodes, self.num_rows
            entries, _, offsets, _ = self.served_entries(False)
            ctx, lens = self.context, self.seq_len
            starts, ends, tables, i = [], [], [], 0
            for row in range(nd, r):
                if self.q_len[row] == 0:
                    continue
                for blk in range(ctx[row] // bs, (lens[row] - 1) // bs + 1):
                    lo, hi = max(ctx[row], blk * bs), min(lens[row], (blk + 1) * bs)
                    starts.append(self.q_start[row] + lo - ctx[row] - nd)
                    ends.append(hi)
                    tables.append(np.append(offsets[row] + np.arange(blk), entries.shape[1] + i))
                    i += 1
            table = np.zeros((i, max(t.shape[0] for t in tables)), np.int32)
            for j, t in enumerate(tables):
                table[j, :t.shape[0]] = t
            qsl = np.append(starts, self.num_tokens - nd).astype(np.int32)
            return qsl, np.asarray(ends, np.int32), table
        return self.cached("prefill_requests", make)

    def _served_entries(self, passthrough: bool):
        bs, r, nd = self.block_size, self.num_rows, self.num_decodes
        last = (self.seq_len - 1) // bs
        n = np.where(np.arange(r) < nd, 0, last + 1 if passthrough else last)
        offsets = np.concatenate([[0], np.cumsum(n)])
        ent_row = np.repeat(np.arange(r), n)
        ent_col = np.arange(offsets[-1]) - np.repeat(offsets[:-1], n)
        sink = np.zeros(r, bool) if passthrough else n > 0
        hp_idx, hp_seq = offsets[:-1][sink], self.seq_id[sink]
        count, m = int(offsets[-1]), int(hp_idx.shape[0])
        entries = np.zeros((2, bucket(count, 4)), np.int32)
        entries[0, :count], entries[1, :count] = ent_row, ent_col
        hp = np.zeros((3, bucket(m, 4)), np.int32)
        hp[0] = entries.shape[1]
        hp[0, :m], hp[1, :m] = hp_idx, hp_seq
        return entries, hp, offsets, count


@dataclasses.dataclass
class KvarnMetadata:
    """The attention metadata the kvarn backend hands every layer of a step: the step's plan."""

    plan: StepPlan

    @property
    def num_actual_tokens(self) -> int:
        return self.plan.num_tokens
