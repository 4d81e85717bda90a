"""Greedy agreement: how long a quantized cache keeps generating the same tokens as an fp16 cache.

Each prompt is prefilled, then continued greedily (argmax, no EOS stop) for `new_tokens` steps, one
token per forward through `KVarNCache` (serving semantics: sink and own block exact, full blocks
quantized). The reference is the same loop with the reference scheme (default fp16). Reported per
scheme: the first position where the continuation differs (new_tokens if never) and the fraction of
identical tokens, position by position.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, Union

import torch

from kvarn_jax.integrations.transformers import KVarNCache, cache_kwargs


@dataclasses.dataclass(frozen=True)
class AgreementResult:
    """first_divergence: per prompt, index of the first differing new token (new_tokens = none differ);
    identical_fraction: identical tokens / all new tokens, over all prompts."""

    name: str
    new_tokens: int
    first_divergence: tuple[int, ...]
    identical_fraction: float

    @property
    def mean_first_divergence(self) -> float:
        return sum(self.first_divergence) / len(self.first_divergence)


def greedy_continuation(model, prompts: torch.Tensor, scheme: Union[str, Sequence[str]], new_tokens: int, *,
                        block_size: int = 128, progress=None) -> torch.Tensor:
    """[N, new_tokens] greedy tokens after `prompts` [N, P] (all the same length), with a KVarNCache."""
    if not isinstance(prompts, torch.Tensor) or prompts.ndim != 2 or prompts.dtype != torch.long:
        raise ValueError("prompts must be a LongTensor [num_prompts, prompt_tokens]")
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive int, got {new_tokens!r}")
    cache = KVarNCache(scheme, block_size=block_size)
    out = []
    with torch.no_grad():
        logits = model(prompts, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
        for step in range(new_tokens):
            nxt = logits.argmax(-1)
            out.append(nxt)
            if progress is not None:
                progress.update(1)
            if step + 1 < new_tokens:
                logits = model(nxt[:, None], use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
    return torch.stack(out, dim=1)


def compare_continuations(name: str, tokens: torch.Tensor, reference: torch.Tensor) -> AgreementResult:
    """Agreement of `tokens` with `reference`, both [N, new_tokens]."""
    if tokens.shape != reference.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and reference {tuple(reference.shape)} differ in shape")
    same = tokens == reference
    n = tokens.shape[1]
    first = tuple(int((~row).nonzero()[0]) if (~row).any() else n for row in same)
    return AgreementResult(name, n, first, float(same.float().mean()))


def evaluate_agreement(model, prompts: torch.Tensor, schemes: Mapping[str, Union[str, Sequence[str]]],
                       new_tokens: int = 512, *, reference: str = "fp16", block_size: int = 128,
                       progress: bool = True) -> dict[str, AgreementResult]:
    """{name: AgreementResult} of every scheme against greedy decoding with the `reference` scheme."""
    from tqdm.auto import tqdm

    bar = tqdm(total=new_tokens * (1 + len(schemes)), desc="greedy", unit="tok", disable=not progress)
    bar.set_postfix_str(reference)
    ref_tokens = greedy_continuation(model, prompts, reference, new_tokens, block_size=block_size, progress=bar)
    results = {}
    for name, scheme in schemes.items():
        bar.set_postfix_str(name)
        toks = greedy_continuation(model, prompts, scheme, new_tokens, block_size=block_size, progress=bar)
        results[name] = compare_continuations(name, toks, ref_tokens)
    bar.close()
    return results
