"""Teacher-forced perplexity, KL to the unquantized model and top-1 agreement, per KV-cache scheme.

Windowing (the issue's bar): the text from `start_char` on is tokenized without special tokens and cut
into `num_windows` consecutive, independent windows of `window` tokens; each window is one sequence
starting at position 0 (so its first block is the attention sink). Every window predicts its tokens
1..window-1 from the ones before. The reference is the same model with exact attention (no cache
quantization); each scheme runs with serving semantics (`serving_attention`).

Windows run in batches (one forward per configuration per batch, up to `max_batch_tokens` tokens).
A forward returns the final hidden states only; the output head and the log-softmax run on a few
hundred positions at a time, for the reference and every scheme together, so memory does not grow
with the vocabulary times the batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence, Union

import torch

from .serving_attention import serving_semantics

REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """Metrics of one scheme over all windows (predicted tokens counted once each).

    ppl: exp(mean NLL); kl_mean: mean over predicted positions of KL(p_reference || p_scheme) in nats;
    top1_agreement: fraction of positions whose argmax equals the reference's.
    """

    name: str
    tokens: int
    nll: float
    ppl: float
    kl_mean: float
    top1_agreement: float


def token_windows(token_ids: Sequence[int], window: int, num_windows: int) -> torch.Tensor:
    """[num_windows, window] consecutive, non-overlapping windows from the start of `token_ids`."""
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2, got {window!r}")
    if not isinstance(num_windows, int) or num_windows < 1:
        raise ValueError(f"num_windows must be a positive int, got {num_windows!r}")
    need = window * num_windows
    if len(token_ids) < need:
        raise ValueError(f"the text has {len(token_ids)} tokens but {num_windows} windows of {window} need {need}; "
                         "use fewer tokens or a longer text")
    return torch.tensor(list(token_ids[:need]), dtype=torch.long).reshape(num_windows, window)


def text_token_ids(tokenizer, text: str, start_char: int = 5000) -> list[int]:
    """Token ids of text[start_char:], without special tokens (BOS/EOS)."""
    if not isinstance(start_char, int) or not 0 <= start_char < len(text):
        raise ValueError(f"start_char must be an int in [0, {len(text)}), got {start_char!r}")
    return tokenizer(text[start_char:], add_special_tokens=False)["input_ids"]


class _Accumulator:
    # Positions per step: [rows, vocab] fp32 temporaries stay ~150 MB at a 150K vocabulary.
    ROWS = 256

    def __init__(self):
        self.nll = self.kl = 0.0
        self.agree = self.n = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref_lp: torch.Tensor, ref_top: torch.Tensor):
        for a in range(0, targets.shape[0], self.ROWS):
            sl = slice(a, a + self.ROWS)
            lp = torch.log_softmax(logits[sl].float(), dim=-1)
            r = ref_lp[sl]
            self.nll += float(-lp.gather(1, targets[sl, None]).double().sum())
            self.kl += float((r.exp() * (r - lp)).sum(-1).double().sum())
            self.agree += int((lp.argmax(-1) == ref_top[sl]).sum())
        self.n += targets.shape[0]

    def result(self, name: str) -> PerplexityResult:
        nll = self.nll / self.n
        return PerplexityResult(name, self.n, nll, math.exp(nll), self.kl / self.n, self.agree / self.n)


def _decoder_and_head(model):
    """(decoder returning the final hidden states, output head), checked to reproduce `model(x).logits`
    on a few tokens: a model that transforms its logits further (soft-capping, scaling) is refused."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is None or head is None:
        raise ValueError(f"{type(model).__name__} has no decoder/output head to evaluate")
    vocab = head.weight.shape[0]
    x = torch.arange(8, dtype=torch.long)[None] % vocab
    with torch.no_grad():
        want = model(x, use_cache=False).logits
        got = head(decoder(input_ids=x, use_cache=False).last_hidden_state)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise ValueError(f"{type(model).__name__}: logits are not the output head applied to the final hidden "
                         "states (logit soft-capping or scaling?); this evaluation does not support it")
    return decoder, head


def evaluate_perplexity(model, windows: torch.Tensor,
                        schemes: Mapping[str, Union[str, Sequence[str], None]], *, block_size: int = 128,
                        quantize_own_full_block: bool = False, progress: bool = True,
                        max_batch_tokens: int = 4096) -> dict[str, PerplexityResult]:
    """Perplexity of `model` on `windows` [N, T] under each named scheme, plus the exact REFERENCE.

    schemes: {display name: scheme string, per-layer list of strings, or None (exact)}.
    max_batch_tokens: windows per forward = max(1, max_batch_tokens // T).
    Returns {REFERENCE: ..., name: ...} in that order.
    """
    if not isinstance(windows, torch.Tensor) or windows.ndim != 2 or windows.dtype != torch.long:
        raise ValueError("windows must be a LongTensor [num_windows, window] (see token_windows)")
    if REFERENCE in schemes:
        raise ValueError(f"{REFERENCE!r} is reserved for the unquantized model; rename that scheme")
    if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}")
    from tqdm.auto import tqdm

    decoder, head = _decoder_and_head(model)
    configs = {REFERENCE: None, **schemes}
    accs = {name: _Accumulator() for name in configs}
    n, t = windows.shape
    per_batch = max(1, max_batch_tokens // t)
    # progress in tokens, counted twice: once through the decoder, once through the output head
    bar = tqdm(total=2 * n * t * len(configs), desc=f"perplexity ({len(configs)} configs x {n} windows)",
               unit="tok", unit_scale=True, disable=not progress)
    with torch.no_grad():
        for start in range(0, n, per_batch):
            x = windows[start:start + per_batch]
            hidden = {}
            for name, scheme in configs.items():
                bar.set_postfix_str(name)
                with serving_semantics(model, scheme, block_size=block_size,
                                       quantize_own_full_block=quantize_own_full_block and scheme is not None):
                    hidden[name] = decoder(input_ids=x, use_cache=False).last_hidden_state[:, :-1].flatten(0, 1)
                bar.update(x.numel())
            targets = x[:, 1:].flatten()
            bar.set_postfix_str("output head")
            for a in range(0, targets.shape[0], _Accumulator.ROWS):
                sl = slice(a, a + _Accumulator.ROWS)
                ref_lp = torch.log_softmax(head(hidden[REFERENCE][sl]).float(), dim=-1)
                ref_top = ref_lp.argmax(-1)
                for name, h in hidden.items():
                    lp = ref_lp if name == REFERENCE else head(h[sl])
                    accs[name].add(lp, targets[sl], ref_lp, ref_top)
                bar.update(len(configs) * targets[sl].shape[0])
            bar.update(len(configs) * x.shape[0])   # the last position of each window predicts nothing
            del hidden
    bar.close()
    return {name: acc.result(name) for name, acc in accs.items()}
