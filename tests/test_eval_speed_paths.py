"""The fast paths of `kvarn-jax eval` against the straightforward ones they replace: every scheme's
greedy continuation in one batch (prompt prefilled once, one token per step) equals a KVarNCache loop
per scheme; windows batched per forward with the output head applied in row chunks equal one window
at a time; and a model whose logits are not head(hidden) is refused rather than mis-measured."""

import pytest
import torch

from kvarn_jax.evaluation.agreement import (ServingCache, compare_continuations, evaluate_agreement,
                                            greedy_continuation, greedy_continuations)
from kvarn_jax.evaluation.perplexity import REFERENCE, evaluate_perplexity
from test_eval_support import one_torch_thread, tiny_llama

BS = 32
_one_thread = pytest.fixture(autouse=True)(one_torch_thread)


def test_batched_greedy_equals_one_kvarn_cache_loop_per_scheme():
    model = tiny_llama(num_layers=2, seed=1, init=0.5)
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    # 40 + 60 tokens cross blocks 1 and 2 mid-generation: each is stored quantized from the next step on
    # _hpfp32: KVarNCache's prefill reads the prompt's own tokens as its sink and ring keep them, a
    # serving prefill (the engine's, ServingCache's) as computed. With the float32 model's default
    # float16 sink and tail the two prefills differ by that rounding, which changes these tokens
    # (kvarn_k4v2_g32 from step 5, int2_g32 from 28); in float32 they agree. (ServingCache against
    # the engine, with every high-precision option: test_eval_agreement_cache.py.)
    schemes = ["fp16", "kvarn_k4v2_g32_hpfp32", "int2_g32_hpfp32", ["int8_hpfp32", "int2_g32_hpfp32"]]
    got = greedy_continuations(model, x, schemes, 60, block_size=BS)
    loops = [greedy_continuation(model, x, s, 60, block_size=BS) for s in schemes]
    for scheme, g, want in zip(schemes, got, loops):
        assert g.shape == (2, 60)
        assert torch.equal(g, want), scheme
    assert not torch.equal(got[0], got[2])   # int2 does change the tokens: the comparison can fail
    # a prompt whose prefill already fills two blocks after the sink
    y = torch.randint(0, 97, (1, 3 * BS + 5), generator=torch.Generator().manual_seed(6))
    (g,) = greedy_continuations(model, y, [schemes[2]], 12, block_size=BS)
    assert torch.equal(g, greedy_continuation(model, y, schemes[2], 12, block_size=BS))
    res = evaluate_agreement(model, x, {"int2_g32": schemes[2], "mixed": schemes[3]}, 60,
                             reference="fp16", block_size=BS, progress=False)
    assert res["int2_g32"] == compare_continuations("int2_g32", loops[2], loops[0])
    assert res["mixed"] == compare_continuations("mixed", loops[3], loops[0])


def test_serving_cache_checks():
    cache = ServingCache(2, block_size=BS, capacity=8)
    with pytest.raises(ValueError, match="prefill"):
        cache.split(["int8"])
    with pytest.raises(ValueError, match="block_size"):
        ServingCache(2, block_size=0, capacity=8)
    model = tiny_llama(num_layers=2)
    with pytest.raises(ValueError, match="block_size"):
        greedy_continuations(model, torch.zeros(1, 4, dtype=torch.long), ["kvarn_k4v2_g128"], 2, block_size=BS)
    with pytest.raises(ValueError, match="new_tokens"):
        greedy_continuations(model, torch.zeros(1, 4, dtype=torch.long), ["int8"], 0, block_size=BS)


def test_batched_windows_equal_one_window_per_forward():
    model = tiny_llama(num_layers=2, seed=2, init=0.5)
    windows = torch.randint(0, 97, (3, 4 * BS), generator=torch.Generator().manual_seed(3))
    schemes = {"int2_g32": "int2_g32", "kvarn_k4v2_g32": "kvarn_k4v2_g32"}
    one = evaluate_perplexity(model, windows, schemes, block_size=BS, progress=False, max_batch_tokens=1)
    all_ = evaluate_perplexity(model, windows, schemes, block_size=BS, progress=False)
    for name in (REFERENCE, *schemes):
        a, b = one[name], all_[name]
        assert a.tokens == b.tokens == 3 * (4 * BS - 1)
        assert a.nll == pytest.approx(b.nll, rel=1e-5) and a.kl_mean == pytest.approx(b.kl_mean, rel=1e-4, abs=1e-9)
        assert a.top1_agreement == b.top1_agreement
    # and the reference is the plain model's own perplexity
    with torch.no_grad():
        lp = torch.log_softmax(model(windows).logits[:, :-1].double(), -1)
    nll = float(-lp.gather(-1, windows[:, 1:, None]).mean())
    assert all_[REFERENCE].nll == pytest.approx(nll, rel=1e-5)
    assert all_["int2_g32"].kl_mean > all_["kvarn_k4v2_g32"].kl_mean > 0


def test_a_model_with_transformed_logits_is_refused():
    model = tiny_llama(num_layers=2)
    forward = model.forward

    def capped(*a, **k):
        out = forward(*a, **k)
        out.logits = 30 * torch.tanh(out.logits / 30)   # soft-capping, as some families do
        return out
    model.forward = capped
    with pytest.raises(ValueError, match="soft-capping"):
        evaluate_perplexity(model, torch.zeros(1, 8, dtype=torch.long), {"int8": "int8"}, block_size=4,
                            progress=False)
