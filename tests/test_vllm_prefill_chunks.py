"""The CPU prefill of a quantized cache through vLLM's CPU attention op
(`kvarn_vllm.torch_ops._prefill_rule`): each query block a request over the served blocks before it
and its own block's high-precision rows (`StepPlan.prefill_requests`), masked causally. Its results
must be the library's attention, and a row's the same bits whatever else is in the step."""

import numpy as np
import pytest
import torch

from kvarn_vllm.plan import StepPlan
from test_vllm_torch_ops import _bind, _sequences, _serve, _snapshot
from helpers import allocate_tables

# sequence 0 prefilled in chunks that start inside blocks and end on or off block boundaries, alone,
# beside a decode row of sequence 1, and as the first chunk (no earlier block); then it decodes
STEPS = [[(1, 40)], [(0, 64)], [(0, 60), (1, 1)], [(0, 100)], [(0, 26), (1, 1)]] + [[(0, 1), (1, 1)]] * 3
LENS = [253, 45]


def test_prefill_requests_follow_the_rule():
    """A step with a decode row and two prefill rows, one starting mid-block: one request per query
    block, its queries the row's new tokens in that block, its keys the row's served entries of the
    earlier blocks then its own block's staged rows (after the N served entries), its length the
    block's last query's position + 1."""
    bs = 32
    q_lens, ctx = [1, 50, 20], [70, 40, 0]
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.asarray(ctx) + np.asarray(q_lens)
    plan = StepPlan.build(block_size=bs, max_seqs=4, query_start_loc=qsl, seq_lens=lens, seq_ids=np.arange(3),
                          block_table=torch.zeros((3, 8), dtype=torch.int32), slot_mapping=torch.zeros(71, dtype=torch.int64))
    entries, _, offsets, _ = plan.served_entries(False)
    n = entries.shape[1]
    starts, seq_lens, table = plan.prefill_requests()
    # row 1: positions 40..89 in blocks 1 (40..63) and 2 (64..89); row 2: positions 0..19 in block 0
    np.testing.assert_array_equal(starts, [0, 24, 50, 70])
    np.testing.assert_array_equal(seq_lens, [64, 90, 20])
    np.testing.assert_array_equal(table[0, :2], [offsets[1], n])
    np.testing.assert_array_equal(table[1, :3], [offsets[1], offsets[1] + 1, n + 1])
    assert table[2, 0] == n + 2
    # the own rows of query block i sit in slots [i * bs, (i + 1) * bs) of `own_blocks`: row 1's first
    # block holds its earlier positions 32..39 (in the ring) then step tokens 1..24
    own = plan.own_blocks()
    np.testing.assert_array_equal(own[0, :bs], [2] * 8 + [0] * 24)
    np.testing.assert_array_equal(own[1, 8:bs], np.arange(1, 25))
    np.testing.assert_array_equal(own[1, 2 * bs:2 * bs + 20], np.arange(51, 71))
    assert (own[0, 2 * bs + 20:3 * bs] == 3).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_matches_the_library_and_not_the_batch(dtype):
    """Sequence 0's chunks alone or beside sequence 1's decode rows: against the library's reference
    (float32: to 2e-4), and the same bits for its prefill rows whether sequence 1 decodes beside them
    or not. bfloat16: the op reads the rotated query and the served keys and values rounded to bf16,
    and these keys have outlier channels, so a large score moves by ~2^-8 of itself: every element
    to 5e-2 of the output's scale, their mean to 2e-3 (over 11 seeds the largest error was 3.4% of
    the scale, the mean 0.09%; a block or position attended wrongly moves many elements by far more)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    seqs, queries = _sequences(rng, LENS)
    tables = allocate_tables(rng, LENS, 32, 16)
    outs = []
    for steps in (STEPS, [[(1, 40)], [(0, 64)], [(0, 60)], [(0, 100)], [(0, 26)]]):
        bound, _ = _bind("kvarn_k4v2_g32", np.random.default_rng(seed), num_blocks=16, dtype=dtype)
        got, want, _ = _serve(bound, _snapshot(bound) if not outs else None, seqs, queries, tables, steps)
        outs.append(got[0][:250])
        if want[0] is not None:
            for i in range(len(LENS)):
                assert np.isfinite(got[i]).all()
                scale = np.abs(want[i]).max()
                tol = 2e-4 if dtype == "float32" else 5e-2 * scale
                np.testing.assert_allclose(got[i], want[i], rtol=0 if dtype != "float32" else 2e-4, atol=tol,
                                           err_msg=f"sequence {i} (seed {seed})")
                if dtype != "float32":
                    assert np.abs(got[i] - want[i]).mean() <= 2e-3 * scale, f"sequence {i} (seed {seed})"
    np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"seed {seed}")
