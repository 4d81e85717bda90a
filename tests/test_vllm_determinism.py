"""The bridge repeats itself: a request's attention outputs are the same bits whatever else is in the
batch and on every run. No vLLM engine: vLLM's impl path (`HpPool.forward`: the sink and tail in the
pool's blocks, used in place or staged) on steps planned as vLLM's metadata builder plans them
(decode rows first, a row's high-precision slot its row index), on SmolLM2's attention shapes - at
which XLA:CPU picks different code for different batch sizes - in a float32 model (outputs in
float32 show the one-ulp differences that bfloat16 outputs mostly round away)."""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="kvarn_vllm needs vLLM")

from kvarn_vllm.hp_pool import HP_BLOCKS, HP_FRESH, HpPool  # noqa: E402
from kvarn_vllm.layout import ALIGN, PageLayout, allocate_hp  # noqa: E402
from kvarn_vllm import torch_ops  # noqa: E402
from kvarn_vllm.plan import StepPlan  # noqa: E402

HK, HQ, D = 3, 9, 64  # SmolLM2-135M's attention
T = 0                 # the request whose outputs are compared
DTYPE = torch.float32


def _lengths(bs: int) -> dict:
    """Tokens each sequence ever holds: T's prompt ends two tokens before a block end (its second
    decode completes a block), the others are short, long and in between."""
    return {T: 3 * bs + 2, 1: bs // 2 + 6, 2: bs + 6, 3: 2 * bs + 4, 4: 9, 5: 5}


def _steps(bs: int, crowd: bool) -> list:
    """Per step, (sequence, new tokens). T's own steps are the same in every schedule: a prompt of
    3 * bs - 2 tokens in three chunks (the second completes a block), then four decodes (the second
    completes a block). crowd=False: T alone. crowd=True: its chunks beside other prefills and
    decodes (other padded token counts, another block completing in the same write), its decodes in
    mixed steps (another row prefilling; 5 decode rows: bucket 8), the block-completing one among
    them, and in decode-only steps of 2 and 3 rows (row buckets 2, 4)."""
    c1, c2, c3 = 2 * bs - 40, bs + 30, 8
    if not crowd:
        return [[(T, c1)], [(T, c2)], [(T, c3)]] + [[(T, 1)]] * 4
    return [[(1, bs // 2), (T, c1)],
            [(1, 1), (T, c2), (3, 2 * bs)],
            [(1, 1), (3, 1), (T, c3), (2, bs + 2)],
            [(3, 1), (2, 1), (T, 1), (1, 1), (4, 7)],
            [(T, 1), (4, 1), (1, 1), (2, 1), (3, 1), (5, 5)],
            [(2, 1), (T, 1)],
            [(T, 1), (1, 1), (2, 1)]]


def _tokens(lens: dict) -> dict:
    """Each sequence's q, k, v for all its positions, the same in every run."""
    out = {}
    for s, n in lens.items():
        g = torch.Generator().manual_seed(100 + s)
        out[s] = tuple((torch.randn((n, h, D), generator=g) * 2).to(DTYPE) for h in (HQ, HK, HK))
    return out


def _serve(scheme: str, bs: int, steps: list, seed: int) -> list:
    """Run the steps through the bridge as vLLM's impl does, on a buffer of random bytes with block
    ids drawn from `seed`. Returns T's output rows per step it is in."""
    lay = PageLayout(scheme, block_size=bs, num_kv_heads=HK, head_dim=D, dtype=str(DTYPE).split(".")[-1], max_seqs=8)
    lens = _lengths(bs)
    h = lay.hp_blocks_per_seq
    need = {s: -(-n // bs) for s, n in lens.items()}
    n_blocks = sum(need.values()) + h * len(lens) + 3
    rng = np.random.default_rng(seed)
    page = lay.vllm_page_bytes(0)
    raw = torch.from_numpy(rng.integers(0, 256, n_blocks * page + ALIGN, dtype=np.uint8))
    start = (-raw.data_ptr()) % ALIGN
    pool = HpPool(lay, allocate_hp(lay, "cpu"))
    bound = torch_ops.bind(raw[start:start + n_blocks * page].view(n_blocks, 1, bs, page // bs), lay,
                           hp_buffers=pool.staging)
    ids = iter(rng.permutation(n_blocks).tolist())
    pages = {s: [next(ids) for _ in range(need[s])] for s in lens}
    hp = {s: [next(ids) for _ in range(h)] for s in lens}
    width = max(need.values()) + 1
    data = _tokens(lens)
    done = dict.fromkeys(lens, 0)
    got = []
    for step in steps:
        rows = sorted(step, key=lambda r: 0 if r[1] == 1 and done[r[0]] else 1)  # decodes first
        qsl = np.concatenate([[0], np.cumsum([n for _, n in rows])])
        # junk block ids past the blocks each row uses
        table = torch.from_numpy(rng.integers(0, n_blocks, (len(rows), width)).astype(np.int32))
        slots = []
        for r, (s, n) in enumerate(rows):
            table[r, :need[s]] = torch.tensor(pages[s])
            slots += [pages[s][p // bs] * bs + p % bs for p in range(done[s], done[s] + n)]
        plan = StepPlan.build(block_size=bs, max_seqs=lay.max_seqs, query_start_loc=qsl,
                              seq_lens=[done[s] + n for s, n in rows], seq_ids=np.arange(len(rows)), block_table=table,
                              slot_mapping=torch.tensor(slots, dtype=torch.int64))
        plan.cache[HP_BLOCKS] = torch.tensor([hp[s] for s, _ in rows], dtype=torch.int32)
        plan.cache[HP_FRESH] = np.array([done[s] == 0 for s, _ in rows])
        q, k, v = (torch.cat([data[s][i][done[s]:done[s] + n] for s, n in rows]) for i in range(3))
        out = torch.full_like(q, float("nan"))
        pool.forward(bound, q, k, v, plan, scale=D ** -0.5, impl="auto", out=out)
        r = [s for s, _ in rows].index(T) if T in dict(rows) else None
        if r is not None:
            got.append(out[int(qsl[r]):int(qsl[r + 1])].clone())
        for s, n in rows:
            done[s] += n
    return got


@pytest.mark.parametrize("scheme, bs", [("kvarn_k4v2_g128", 128), ("int8", 32)])
def test_a_requests_outputs_do_not_depend_on_the_batch_or_the_run(scheme, bs):
    """T's prefill chunks (alone: the one-row split; beside another prefill: per-row buffers) and its
    decodes (alone: decode-only steps of row bucket 1; in the crowd: decode-only steps of buckets 2
    and 4, mixed steps next to a prefill with buckets 4 and 8, and the decode that completes a block
    once alone and once in a mixed step): bit-identical outputs alone, in a crowd, and in the same
    crowd again on other block ids and other stale bytes."""
    alone = _serve(scheme, bs, _steps(bs, False), seed=1)
    crowd = _serve(scheme, bs, _steps(bs, True), seed=2)
    again = _serve(scheme, bs, _steps(bs, True), seed=3)
    assert len(alone) == len(crowd) == len(again) == 7
    for i, (a, b, c) in enumerate(zip(alone, crowd, again)):
        assert torch.isfinite(a).all(), f"step {i}"
        assert torch.equal(b, c), f"T's step {i}: the same batch on another run differs"
        assert torch.equal(a, b), (f"T's step {i} ({'prefill' if a.shape[0] > 1 else 'decode'}): alone and in a "
                                   f"batch differ by up to {(a.float() - b.float()).abs().max().item():.3g}")
