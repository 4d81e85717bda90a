"""The sink and tail rows kept in the pool's blocks (`kvarn_vllm.hp_pool`, `layout.HpUnits`): where
they land, and that staging them per layer gives exactly what slot-indexed storage gives. No vLLM
engine: the torch entry points on CPU tensors."""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="kvarn_vllm needs vLLM")

from kvarn_vllm import torch_ops  # noqa: E402
from kvarn_vllm.hp_pool import HP_BLOCKS, HP_FRESH, HpPool  # noqa: E402
from kvarn_vllm.layout import ALIGN, HpUnits, PageLayout, allocate_hp  # noqa: E402
from kvarn_vllm.plan import StepPlan  # noqa: E402


def _owner(lay: PageLayout, num_blocks: int, byte: np.ndarray) -> np.ndarray:
    """The block whose page owns each byte offset of the buffer (field-major regions), -1 if none."""
    regions = lay.regions(num_blocks, hp_in_buffer=False)
    out = np.full(byte.shape, -1)
    for f in lay.fields:
        if f.per_block:
            off = regions[f.key][0]
            inside = (byte >= off) & (byte < off + f.nbytes * num_blocks)
            out[inside] = (byte[inside] - off) // f.nbytes
    return out


@pytest.mark.parametrize("scheme, bs, dtype", [("kvarn_k4v2_g128", 128, "bfloat16"), ("kvarn_k4v2_g32", 32, "float32"),
                                              ("int4", 64, "float16"), ("kivi_k2v2_g32", 32, "bfloat16")])
def test_a_sequences_rows_fill_only_its_own_blocks(scheme, bs, dtype):
    lay = PageLayout(scheme, block_size=bs, num_kv_heads=3, head_dim=64, dtype=dtype, max_seqs=4)
    h = lay.hp_blocks_per_seq
    n = 3 * h + 5
    hu = HpUnits.build(lay, n)
    rng = np.random.default_rng(0)
    blocks = torch.from_numpy(rng.permutation(n)[:3 * h].reshape(3, h))
    units = hu.seq_units(blocks).numpy()
    assert units.shape == (3, hu.units_per_seq) and hu.units_per_seq * hu.unit == lay.hp_seq_bytes
    assert len(np.unique(units)) == units.size  # no two rows, no two sequences share a unit
    starts = units * hu.unit
    for r in range(3):  # every byte of every unit is a page byte of one of the sequence's own blocks
        owner = _owner(lay, n, (starts[r][:, None] + np.arange(hu.unit)[None, :]).reshape(-1))
        assert set(owner.tolist()) <= set(blocks[r].tolist())
    # fewer blocks would not hold the rows
    assert (h - 1) * lay.format_page_bytes < lay.hp_seq_bytes
    # the staging units tile the staging allocation exactly
    stage = hu.stage_units(lay.max_seqs, "cpu").numpy()
    total = sum(t.numel() * t.element_size() for t in allocate_hp(lay, "cpu").values())
    assert sorted(stage.reshape(-1).tolist()) == list(range(total // hu.unit))


def _buffer(lay, num_blocks, hp_in_buffer, fill):
    page = lay.vllm_page_bytes(-(-lay.hp_bytes // num_blocks) if hp_in_buffer else 0)
    raw = torch.full((num_blocks * page + ALIGN,), fill, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + num_blocks * page].view(num_blocks, 1, lay.block_size, page // lay.block_size)


def _plan(lay, rows, num_blocks_cols, seq_ids):
    """rows: [(context, q_len, page blocks)] decodes first."""
    bs = lay.block_size
    qsl = np.concatenate([[0], np.cumsum([q for _, q, _ in rows])])
    lens = np.array([c + q for c, q, _ in rows])
    table = torch.zeros((len(rows), num_blocks_cols), dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(rows):
        table[i, :len(blocks)] = torch.tensor(blocks)
    slots = []
    for i, (c, q, blocks) in enumerate(rows):
        for p in range(c, c + q):
            slots.append(blocks[p // bs] * bs + p % bs)
    return StepPlan.build(block_size=bs, max_seqs=lay.max_seqs, query_start_loc=qsl, seq_lens=lens, seq_ids=seq_ids,
                          block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64))


@pytest.mark.parametrize("scheme, dtype", [("kvarn_k4v2_g32", "bfloat16"), ("kivi_k2v2_g32", "float32")])
def test_staged_rows_attend_exactly_like_slot_storage(scheme, dtype):
    """Three sequences through prefills, chunked prefills and decodes, in changing batch orders: the
    pooled cache (rows in each sequence's own blocks, staged per step into row-indexed slots, the
    buffer starting as 0xFF bytes - NaN as floats) gives bit for bit the outputs of slot storage
    (each sequence a fixed slot, as the bridge kept them before)."""
    bs, hk, d, hq = 32, 3, 64, 9
    tdt = getattr(torch, dtype)
    lay = PageLayout(scheme, block_size=bs, num_kv_heads=hk, head_dim=d, dtype=dtype, max_seqs=4)
    h = lay.hp_blocks_per_seq
    n = 6 + 3 * h
    ref = torch_ops.bind(_buffer(lay, n, True, 0), lay)
    pool = HpPool(lay, allocate_hp(lay, "cpu"))
    pooled = torch_ops.bind(_buffer(lay, n, False, 0xFF), lay, hp_buffers=pool.staging)
    pages = {"a": [0, 1, 2], "b": [3, 4], "c": [5]}
    hp = {s: list(range(6 + i * h, 6 + (i + 1) * h)) for i, s in enumerate("abc")}
    slot = {"a": 0, "b": 2, "c": 3}
    # (sequence, context, new tokens) per step, decodes (one token) first
    steps = [[("a", 0, 40), ("b", 0, 10)],
             [("b", 10, 1), ("a", 40, 1)],
             [("a", 41, 1), ("b", 11, 30), ("c", 0, 5)],
             [("c", 5, 1), ("b", 41, 1), ("a", 42, 23)],
             [("a", 65, 1), ("c", 6, 1), ("b", 42, 1)]]
    rng = torch.Generator().manual_seed(0)
    for step in steps:
        rows = [(c, q, pages[s]) for s, c, q in step]
        t = sum(q for _, _, q in step)
        q_, k_, v_ = (torch.randn((t, heads, d), generator=rng).to(tdt) for heads in (hq, hk, hk))
        p_ref = _plan(lay, rows, 4, [slot[s] for s, _, _ in step])
        p_pool = _plan(lay, rows, 4, list(range(len(step))))
        p_pool.cache[HP_BLOCKS] = torch.tensor([hp[s] for s, _, _ in step], dtype=torch.int32)
        p_pool.cache[HP_FRESH] = np.array([c == 0 for _, c, _ in step])
        out_ref = torch_ops.forward(ref, q_, k_, v_, p_ref)
        pool.gather(pooled, p_pool)
        out_pool = torch_ops.forward(pooled, q_, k_, v_, p_pool)
        pool.scatter(pooled, p_pool)
        assert torch.isfinite(out_pool).all()
        assert torch.equal(out_pool, out_ref)


@pytest.mark.parametrize("scheme, dtype, bs", [("kvarn_k4v2_g128", "bfloat16", 128), ("kvarn_k4v2_g32", "float32", 32),
                                               ("kivi_k2v2_g32", "float16", 32)])
def test_decode_in_the_pools_blocks_equals_staging(scheme, dtype, bs):
    """Decode-only steps that use the sink/tail rows where they live (`HpPool.in_place`: read in the
    layer's buffer - by the CPU kernel for KVarN, from a copy by XLA's operations for other schemes
    and for KVarN steps that complete blocks - new rows stored there) give bit for bit the outputs
    and buffer bytes of staging them (gather / forward / scatter), across steps that fill the sink,
    wrap the ring, complete blocks (both sides quantize them from the fused step's output), pad the
    batch (5 rows -> 8) and start sequences - the pooled side given q, k and v as views of one qkv
    tensor, as vLLM gives them. (`test_vllm_torch_ops.py` checks the fused step's pages against
    `write`'s.)"""
    hk, d, hq = 3, 64, 9
    tdt = getattr(torch, dtype)
    lay = PageLayout(scheme, block_size=bs, num_kv_heads=hk, head_dim=d, dtype=dtype, max_seqs=8)
    h = lay.hp_blocks_per_seq
    seqs, per_seq = 5, 6
    n = seqs * (per_seq + h) + 3
    caches, pools = [], []
    for _ in range(2):
        pool = HpPool(lay, allocate_hp(lay, "cpu"))
        caches.append(torch_ops.bind(_buffer(lay, n, False, 0xFF), lay, hp_buffers=pool.staging))
        pools.append(pool)
    rng = np.random.default_rng(1)
    ids = rng.permutation(n)
    pages = [ids[i * per_seq:(i + 1) * per_seq].tolist() for i in range(seqs)]
    hp = [ids[seqs * per_seq + i * h: seqs * per_seq + (i + 1) * h].tolist() for i in range(seqs)]
    ctx = [1, 3, bs - 2, bs + 5, 2 * bs - 3]  # prompt lengths: across the sink, ring and block ends
    gen = torch.Generator().manual_seed(3)
    used = {True: 0, False: 0}
    completed_in_place = 0
    for step in range(bs + 4):
        order = list(rng.permutation(seqs))  # rows in a changing order: slots are rows
        if step == 0:
            rows = [(0, ctx[s], pages[s]) for s in order]
        else:
            rows = [(ctx[s], 1, pages[s]) for s in order]
        t = sum(q for _, q, _ in rows)
        q_, k_, v_ = (torch.randn((t, heads, d), generator=gen).to(tdt) for heads in (hq, hk, hk))
        # the pooled side gets q, k and v as vLLM hands them: column ranges of one qkv tensor
        qkv = torch.cat((q_, k_, v_), 1).reshape(t, -1)
        views = [x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], 1)]
        outs = []
        for i, (bound, pool) in enumerate(zip(caches, pools)):
            plan = _plan(lay, rows, per_seq, list(range(seqs)))
            plan.cache[HP_BLOCKS] = torch.tensor([hp[s] for s in order], dtype=torch.int32)
            plan.cache[HP_FRESH] = np.array([c == 0 for c, _, _ in rows])
            pooled = pool.in_place(bound, plan, "served") if i == 0 else None
            if i == 0:
                used[pooled is not None] += 1
                completed_in_place += bool(pooled is not None and plan.completing)
            if pooled is None:
                pool.gather(bound, plan)
            outs.append(torch_ops.forward(bound, *(views if i == 0 else (q_, k_, v_)), plan, pooled=pooled))
            if pooled is None:
                pool.scatter(bound, plan)
        assert torch.isfinite(outs[0]).all()
        assert torch.equal(outs[0], outs[1]), f"step {step}"
        assert torch.equal(caches[0].buffer, caches[1].buffer), f"step {step}"
        if step:
            ctx = [c + 1 for c in ctx]
    # both paths ran: in place (steps that complete blocks included: quantized in the fused step) and
    # staged (the prefill)
    assert used[True] > bs // 2 and used[False] >= 1 and completed_in_place >= 2
