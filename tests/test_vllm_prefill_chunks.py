"""The split prefill's two ways of running a step's parts (`kvarn_vllm.torch_ops._prefill_split`): a
step with one prefill row whose queries are most of the step (a long prompt's chunk) runs the parts
on all of the step's queries and hands torch's outputs to the merge as they are; other steps copy
each row's parts into buffers. Both must give the same bits, and the library's attention."""

import numpy as np
import pytest
import torch

from kvarn_vllm import torch_ops
from test_vllm_torch_ops import _bind, _sequences, _serve, _snapshot
from helpers import allocate_tables

# sequence 0 prefilled in chunks that start inside blocks and end on or off block boundaries, as its
# only prefill row - alone, beside a decode row of sequence 1, with no earlier block (the first
# chunk) - then decodes
STEPS = [[(1, 40)], [(0, 64)], [(0, 60), (1, 1)], [(0, 100)], [(0, 26), (1, 1)]] + [[(0, 1), (1, 1)]] * 3
LENS = [253, 45]


def _run(rng_seed, dtype, whole, monkeypatch, oracle=False):
    rng = np.random.default_rng(rng_seed)
    bound, _ = _bind("kvarn_k4v2_g32", rng, num_blocks=16, dtype=dtype)
    seqs, queries = _sequences(rng, LENS)
    tables = allocate_tables(rng, LENS, 32, 16)
    taken = []
    original = torch_ops._whole_step_row

    def spy(plan, nb):
        row = original(plan, nb) if whole else None
        taken.append(row is not None)
        return row
    monkeypatch.setattr(torch_ops, "_whole_step_row", spy)
    got, want, _ = _serve(bound, _snapshot(bound) if oracle else None, seqs, queries, tables, STEPS)
    return got, want, taken


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_step_parts_equal_the_per_row_buffers(dtype, monkeypatch):
    seed = int(np.random.default_rng().integers(1 << 30))
    whole, want, taken = _run(seed, dtype, True, monkeypatch, oracle=dtype == "float32")
    assert taken.count(True) == 4, taken  # the four chunks of sequence 0 took the whole-step path
    rows, _, taken_rows = _run(seed, dtype, False, monkeypatch)
    assert not any(taken_rows)
    for i in range(len(LENS)):
        assert np.isfinite(whole[i]).all()
        np.testing.assert_array_equal(whole[i], rows[i], err_msg=f"sequence {i} (seed {seed})")
        if want[0] is not None:
            np.testing.assert_allclose(whole[i], want[i], rtol=2e-4, atol=2e-4, err_msg=f"sequence {i} (seed {seed})")


def test_whole_step_row_takes_only_one_long_prefill_row():
    from kvarn_vllm.plan import StepPlan

    def plan(q_lens, ctx):
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        lens = np.asarray(ctx) + np.asarray(q_lens)
        n = int(qsl[-1])
        return StepPlan.build(block_size=32, max_seqs=4, query_start_loc=qsl, seq_lens=lens,
                              seq_ids=np.arange(len(q_lens)), block_table=torch.zeros((len(q_lens), 16), dtype=torch.int32),
                              slot_mapping=torch.zeros(n, dtype=torch.int64))
    assert torch_ops._whole_step_row(plan([1, 60], [40, 64]), 64) is not None   # a decode row beside it
    assert torch_ops._whole_step_row(plan([30, 30], [0, 0]), 64) is None         # two prefill rows
    assert torch_ops._whole_step_row(plan([40], [0]), 64) is None                # padding beyond a quarter
