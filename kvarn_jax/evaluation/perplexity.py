"""Teacher-forced perplexity, KL to the unquantized model and top-1 agreement, per KV-cache scheme.

Windowing (the issue's bar): the text from `start_char` on is tokenized without special tokens and cut
into `num_windows` consecutive, independent windows of `window` tokens; each window is one sequence
starting at position 0 (so its first block is the attention sink). Every window predicts its tokens
1..window-1 from the ones before. The reference is the same model with exact attention (no cache
quantization); each scheme runs with serving semantics (`serving_attention`).

Long windows probe error that builds up with context: `position_buckets` splits every metric by the
position of the predicted token in its window (e.g. 1-255, 256-1023, 1024-4095, 4096-8191).

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
class BucketResult:
    """The metrics of `PerplexityResult` over predicted positions start <= position < end."""

    start: int
    end: int
    tokens: int
    nll: float
    ppl: float
    kl_mean: float
    top1_agreement: float


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """Metrics of one scheme over all windows (predicted tokens counted once each).

    ppl: exp(mean NLL); kl_mean: mean over predicted positions of KL(p_reference || p_scheme) in nats;
    top1_agreement: fraction of positions whose argmax equals the reference's; buckets: the same by
    position in the window (`evaluate_perplexity(position_buckets=...)`), else empty.
    """

    name: str
    tokens: int
    nll: float
    ppl: float
    kl_mean: float
    top1_agreement: float
    buckets: tuple = ()


def bucket_edges(window: int, boundaries: Sequence[int] = ()) -> tuple[int, ...]:
    """Edges [1, b1, b2, ..., window) of the predicted positions' buckets (position p predicts token
    p from tokens 0..p-1, so positions run 1..window-1). Boundaries outside (1, window) are refused."""
    b = sorted(set(boundaries))
    if any(not isinstance(x, int) or not 1 < x < window for x in b):
        raise ValueError(f"position buckets {list(boundaries)} must be ints in (1, {window}) (the window)")
    return (1, *b, window)


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
    """Sums of NLL, KL and top-1 agreement per position bucket (`edges`)."""
    # Positions per step: [rows, vocab] fp32 temporaries stay ~150 MB at a 150K vocabulary.
    ROWS = 256

    def __init__(self, edges: Sequence[int]):
        self.edges = torch.tensor(list(edges))
        k = len(edges) - 1
        self.nll, self.kl = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
        self.agree, self.n = torch.zeros(k, dtype=torch.long), torch.zeros(k, dtype=torch.long)

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref_lp: torch.Tensor, ref_top: torch.Tensor,
            positions: torch.Tensor):
        k = len(self.edges) - 1
        for a in range(0, targets.shape[0], self.ROWS):
            sl = slice(a, a + self.ROWS)
            lp = torch.log_softmax(logits[sl].float(), dim=-1)
            r = ref_lp[sl]
            bucket = torch.bucketize(positions[sl], self.edges, right=True) - 1
            self.nll += torch.bincount(bucket, -lp.gather(1, targets[sl, None])[:, 0].double(), minlength=k)
            self.kl += torch.bincount(bucket, (r.exp() * (r - lp)).sum(-1).double(), minlength=k)
            self.agree += torch.bincount(bucket[lp.argmax(-1) == ref_top[sl]], minlength=k)
            self.n += torch.bincount(bucket, minlength=k)

    @staticmethod
    def _metrics(nll, kl, agree, n):
        n = max(int(n), 1)
        mean = float(nll) / n
        return n, mean, math.exp(mean), float(kl) / n, int(agree) / n

    def result(self, name: str) -> PerplexityResult:
        e = self.edges.tolist()
        buckets = tuple(BucketResult(e[i], e[i + 1], *self._metrics(self.nll[i], self.kl[i], self.agree[i], self.n[i]))
                        for i in range(len(e) - 1)) if len(e) > 2 else ()
        total = self._metrics(self.nll.sum(), self.kl.sum(), self.agree.sum(), self.n.sum())
        return PerplexityResult(name, *total, buckets=buckets)


def decoder_and_head(model):
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
                        max_batch_tokens: int = 4096, position_buckets: Sequence[int] = ()
                        ) -> dict[str, PerplexityResult]:
    """Perplexity of `model` on `windows` [N, T] under each named scheme, plus the exact REFERENCE.

    schemes: {display name: scheme string, per-layer list of strings, or None (exact)}.
    max_batch_tokens: windows per forward = max(1, max_batch_tokens // T).
    position_buckets: boundaries splitting the predicted positions 1..T-1 (`bucket_edges`); each
    result then also has `buckets`.
    Returns {REFERENCE: ..., name: ...} in that order.
    """
    if not isinstance(windows, torch.Tensor) or windows.ndim != 2 or windows.dtype != torch.long:
        raise ValueError("windows must be a LongTensor [num_windows, window] (see token_windows)")
    if REFERENCE in schemes:
        raise ValueError(f"{REFERENCE!r} is reserved for the unquantized model; rename that scheme")
    if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}")
    from tqdm.auto import tqdm

    n, t = windows.shape
    edges = bucket_edges(t, position_buckets)
    decoder, head = decoder_and_head(model)
    configs = {REFERENCE: None, **schemes}
    accs = {name: _Accumulator(edges) for name in configs}
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
            positions = torch.arange(1, t).repeat(x.shape[0])
            bar.set_postfix_str("output head")
            for a in range(0, targets.shape[0], _Accumulator.ROWS):
                sl = slice(a, a + _Accumulator.ROWS)
                ref_lp = torch.log_softmax(head(hidden[REFERENCE][sl]).float(), dim=-1)
                ref_top = ref_lp.argmax(-1)
                for name, h in hidden.items():
                    lp = ref_lp if name == REFERENCE else head(h[sl])
                    accs[name].add(lp, targets[sl], ref_lp, ref_top, positions[sl])
                bar.update(len(configs) * targets[sl].shape[0])
            bar.update(len(configs) * x.shape[0])   # the last position of each window predicts nothing
            del hidden
    bar.close()
    return {name: acc.result(name) for name, acc in accs.items()}
