"""Greedy agreement: how long a quantized cache keeps generating the same tokens as an fp16 cache.

Each prompt is prefilled, then continued greedily (argmax, no EOS stop) for `new_tokens` steps with
serving semantics: every step reads the cache as kvarn_jax's paged cache serves it (its engine's
tokens, tested): the sink and the block being written in the scheme's high-precision format (`_hp`:
by default 16 bits, `kvarn_jax.cache.hp`), every other full block from its page (with a sink of S
tokens, `_sink{S}`, block 0's other positions too), quantized once the block is full from the values
its ring held. The reference is the same loop with the reference scheme (default fp16). Reported
per scheme: the first position where the continuation differs (new_tokens if never) and the
fraction of identical tokens, position by position. With
`score=True`, also the unquantized model's mean NLL of each prompt's continuation (teacher-forced,
exact attention): once two continuations differ, identical tokens stop meaning much, but a scheme
whose text the unquantized model finds as likely as its own has not drifted into worse text.

`evaluate_agreement` runs every scheme at once: the prompts are prefilled once (a one-chunk prefill
reads its own tokens as computed, so it is the same for every scheme), the cache is copied once per
scheme, and each step is one forward of one token for all (scheme, prompt) rows. A block is
quantized and dequantized once, when it fills (`ServingCache`): a step costs one token's forward, not
a pass over the prompt. `greedy_continuation` is the same loop for one scheme through `KVarNCache`,
the transformers cache that stores quantized codes; its prefill reads the prompt as its sink and ring
keep it, so the two give the same tokens with `_hpfp32` (tested), not always with 16-bit formats.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping, Optional, Sequence, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import kvarn_jax as kj
from kvarn_jax.integrations.transformers import KVarNCache, cache_kwargs


@dataclasses.dataclass(frozen=True)
class AgreementResult:
    """first_divergence: per prompt, index of the first differing new token (new_tokens = none differ);
    identical_fraction: identical tokens / all new tokens, over all prompts; continuation_nll /
    reference_nll: per prompt, the unquantized model's mean NLL (nats per token) of this scheme's
    continuation and of the reference's (`evaluate_agreement(score=True)`, else empty)."""

    name: str
    new_tokens: int
    first_divergence: tuple[int, ...]
    identical_fraction: float
    continuation_nll: tuple[float, ...] = ()
    reference_nll: tuple[float, ...] = ()

    @property
    def mean_first_divergence(self) -> float:
        return sum(self.first_divergence) / len(self.first_divergence)

    @property
    def median_first_divergence(self) -> float:
        return statistics.median(self.first_divergence)

    @property
    def mean_continuation_nll(self) -> Optional[float]:
        return statistics.fmean(self.continuation_nll) if self.continuation_nll else None

    @property
    def mean_reference_nll(self) -> Optional[float]:
        return statistics.fmean(self.reference_nll) if self.reference_nll else None


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


class _ServingLayer(CacheLayerMixin):
    """One layer's K/V for a batch of rows in a preallocated [B, H, capacity, D] buffer holding what
    each row's cache serves: the prompt as computed while it is prefilled (a one-chunk prefill reads
    its own tokens so), then from `split` on every token as the row's scheme keeps it
    (`serving_attention.ring_values`): sink and ring tokens in its high-precision format (`_hp`),
    and once a block after the sink is full (with a shorter sink, `_sink{S}`, block 0 too) its page
    (`serving_attention.page_reads`), quantized from the values the ring held for its tokens, right
    before the first step that reads it: a step reads its own block from the ring."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, block_size: int, capacity: int):
        super().__init__()
        self.block_size, self.capacity = block_size, capacity
        self.length = 0
        self.stored_blocks = 0            # blocks whose pages are read from the next step on
        self.groups: list[tuple[slice, Optional[kj.KVQuantConfig]]] = []
        self.rings: list = []             # per group: ring K, V [rows, H, block_size, D] (None: exact)

    def lazy_initialization(self, key_states, value_states, *args, **kwargs):
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buf = key_states.new_zeros((b, h, self.capacity, d))
        self.value_buf = value_states.new_zeros((b, h, self.capacity, d))
        self.is_initialized = True

    def _first_paged(self, cfg) -> int:
        """The first position read from a page, as `serving_attention` has it: 0 with a shorter sink
        (whose own positions `_read_pages` skips), else block_size: a whole-block sink is never read
        from a page (and serving_attention keeps a passthrough scheme's block 0 exact too)."""
        return 0 if cfg.sink_tokens else self.block_size

    def _serve(self, g: int, key, value, position: int) -> None:
        """Tokens key, value [rows, H, T, D] (as computed) at positions [position, position + T) of
        group g's rows, T = 1 or a prompt from position 0: into the buffers as served, into the
        group's ring as it holds them; a prompt's full blocks are read from their pages at once."""
        from .serving_attention import ring_values

        sel, cfg = self.groups[g]
        k, v, k_ring, v_ring = ring_values(key, value, cfg)
        t, bs = key.shape[2], self.block_size
        self.key_buf[sel, :, position:position + t] = k.to(self.dtype)
        self.value_buf[sel, :, position:position + t] = v.to(self.dtype)
        full = bs * ((position + t) // bs) if position == 0 else 0   # 0: a step's token stays in the ring
        if full > self._first_paged(cfg):
            a = self._first_paged(cfg)
            self._read_pages(g, k_ring[:, :, a:full], v_ring[:, :, a:full], a)
        a = max(position, full)   # the tokens of the block being filled
        for ring, x in zip(self.rings[g], (k_ring, v_ring)):
            ring[:, :, a % bs:a % bs + position + t - a] = x[:, :, a - position:]

    def _read_pages(self, g: int, k_ring, v_ring, position: int) -> None:
        """Blocks [position, position + T) of group g's rows, as their ring held them, from now on
        read from their pages."""
        from .serving_attention import page_reads

        sel, cfg = self.groups[g]
        k_hat, v_hat = page_reads(k_ring, v_ring, cfg, self.block_size, position, str(self.dtype).split(".")[-1])
        skip = max(cfg.sink_tokens - position, 0)      # served from the sink, never from its page
        end = position + k_ring.shape[2]
        self.key_buf[sel, :, position + skip:end] = k_hat[:, :, skip:].to(self.dtype)
        self.value_buf[sel, :, position + skip:end] = v_hat[:, :, skip:].to(self.dtype)

    def split(self, groups: Sequence[tuple[slice, Optional[kj.KVQuantConfig]]]) -> None:
        """Rows are copied once per group (module docstring); the prefilled prompt is from now on
        read as each group's cache serves it."""
        rows, (_, h, _, d) = self.key_buf.shape[0], self.key_buf.shape
        raw_k, raw_v = self.key_buf[:, :, :self.length].clone(), self.value_buf[:, :, :self.length].clone()
        self.key_buf = self.key_buf.repeat(len(groups), 1, 1, 1)
        self.value_buf = self.value_buf.repeat(len(groups), 1, 1, 1)
        self.groups = list(groups)
        for g, (_, cfg) in enumerate(self.groups):
            if cfg is None:
                self.rings.append(None)
                continue
            # the ring holds float32 storage-frame values; a passthrough scheme's, tokens as computed
            dt = self.dtype if cfg.is_passthrough else torch.float32
            self.rings.append(tuple(torch.zeros((rows, h, self.block_size, d), dtype=dt, device=self.device)
                                    for _ in range(2)))
            self._serve(g, raw_k, raw_v, 0)
        self.stored_blocks = self.length // self.block_size

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        if self.length + t > self.capacity:
            raise ValueError(f"{self.length + t} tokens exceed this cache's capacity of {self.capacity}")
        pos, bs = self.length, self.block_size
        if pos and not self.groups:   # a later chunk would read the earlier ones as computed, not as served
            raise ValueError("a ServingCache prefills its prompts in one call, then split()")
        self.key_buf[:, :, pos:pos + t] = key_states      # the prefill's, and exact rows'
        self.value_buf[:, :, pos:pos + t] = value_states
        if self.groups:
            if t != 1:
                raise ValueError(f"after split() a ServingCache takes one token per step, got {t}")
            if pos // bs > self.stored_blocks:   # the ring's block is full: read from its page from now on
                a = self.stored_blocks * bs
                for g, (_, cfg) in enumerate(self.groups):
                    if cfg is not None and a >= self._first_paged(cfg):
                        self._read_pages(g, *self.rings[g], a)
                self.stored_blocks = pos // bs
            for g, (sel, cfg) in enumerate(self.groups):
                if cfg is not None:
                    self._serve(g, key_states[sel], value_states[sel], pos)
        self.length += t
        self.keys, self.values = self.key_buf[:, :, :self.length], self.value_buf[:, :, :self.length]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        raise ValueError("ServingCache is built for one run; make a new one")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("ServingCache cannot be cropped")


class ServingCache(Cache):
    """A transformers cache for greedy evaluation of several schemes in one batch (module docstring).

    Prefill the prompts in one call (a one-chunk prefill reads its own tokens as computed, as the
    engine's does), then `split(schemes)` copies the rows once per scheme; row g * prompts + p is
    prompt p under schemes[g]. Each scheme is one scheme string, None (exact) or a per-layer list.
    From then on every step (one token per row) reads each row's K/V as its scheme's paged cache
    serves them (`_ServingLayer`)."""

    def __init__(self, num_layers: int, *, block_size: int, capacity: int):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        super().__init__(layers=[_ServingLayer(block_size, capacity) for _ in range(num_layers)])
        self.block_size = block_size

    def split(self, schemes: Sequence) -> None:
        from .serving_attention import per_layer_schemes

        if any(not layer.is_initialized for layer in self.layers):
            raise ValueError("prefill the prompts before split()")
        if self.layers[0].groups:
            raise ValueError("split() was called already: a ServingCache is split once")
        rows = self.layers[0].key_buf.shape[0]
        per_layer = [per_layer_schemes(s, len(self.layers)) for s in schemes]
        head_dim = self.layers[0].key_buf.shape[3]
        for cfgs in per_layer:   # checked before any block is quantized, which may be many steps later
            for li, cfg in enumerate(cfgs):
                if cfg is not None:
                    cfg.check_block_size(self.block_size)
                    cfg.check_head_dim(head_dim, f"head_dim of layer {li}")
                    if cfg.static:
                        raise ValueError(f"layer {li}: scheme {cfg.name} needs a calibration; use a dynamic scheme")
        for li, layer in enumerate(self.layers):
            layer.split([(slice(g * rows, (g + 1) * rows), cfgs[li]) for g, cfgs in enumerate(per_layer)])


def greedy_continuations(model, prompts: torch.Tensor, schemes: Sequence, new_tokens: int, *,
                         block_size: int = 128, progress=None) -> list[torch.Tensor]:
    """[N, new_tokens] greedy tokens after `prompts` [N, P] for each scheme, all in one batch."""
    if not isinstance(prompts, torch.Tensor) or prompts.ndim != 2 or prompts.dtype != torch.long:
        raise ValueError("prompts must be a LongTensor [num_prompts, prompt_tokens]")
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive int, got {new_tokens!r}")
    from .serving_attention import attention_modules

    n, g = prompts.shape[0], len(schemes)
    cache = ServingCache(len(attention_modules(model)), block_size=block_size,
                         capacity=prompts.shape[1] + new_tokens)
    kw = cache_kwargs(model, cache)
    out = []
    with torch.no_grad():
        logits = model(prompts, use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
        cache.split(schemes)
        nxt = logits.argmax(-1).repeat(g)
        for step in range(new_tokens):
            out.append(nxt)
            if progress is not None:
                progress.update(1)
            if step + 1 < new_tokens:
                nxt = model(nxt[:, None], use_cache=True, logits_to_keep=1, **kw).logits[:, -1].argmax(-1)
    tokens = torch.stack(out, dim=1)
    return [tokens[i * n:(i + 1) * n] for i in range(g)]


def continuation_nll(model, prompts: torch.Tensor, tokens: torch.Tensor, *, max_batch_tokens: int = 4096
                     ) -> torch.Tensor:
    """[N] mean NLL (nats per token) the model, attention exact and no cache, gives `tokens` [N, M]
    after `prompts` [N, P]: teacher-forced, the output head applied to the M predicting positions only."""
    from .perplexity import decoder_and_head

    if prompts.shape[0] != tokens.shape[0]:
        raise ValueError(f"prompts {tuple(prompts.shape)} and tokens {tuple(tokens.shape)} differ in rows")
    decoder, head = decoder_and_head(model)
    seq = torch.cat([prompts, tokens], dim=1)
    p, m = prompts.shape[1], tokens.shape[1]
    rows = max(1, max_batch_tokens // seq.shape[1])
    out = []
    with torch.no_grad():
        for a in range(0, seq.shape[0], rows):
            h = decoder(input_ids=seq[a:a + rows, :-1], use_cache=False).last_hidden_state[:, p - 1:]
            nll = torch.zeros(h.shape[0], dtype=torch.float64)
            for c in range(0, m, 256):  # [rows, 256, vocab] logits at a time
                lp = torch.log_softmax(head(h[:, c:c + 256]).float(), dim=-1)
                nll -= lp.gather(2, tokens[a:a + rows, c:c + 256, None])[..., 0].double().sum(1)
            out.append(nll / m)
    return torch.cat(out)


def evaluate_agreement(model, prompts: torch.Tensor, schemes: Mapping[str, Union[str, Sequence[str]]],
                       new_tokens: int = 512, *, reference: str = "fp16", block_size: int = 128,
                       progress: bool = True, score: bool = False) -> dict[str, AgreementResult]:
    """{name: AgreementResult} of every scheme against greedy decoding with the `reference` scheme;
    score: also the unquantized model's NLL of every continuation (`continuation_nll`)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=new_tokens, desc=f"greedy ({len(schemes) + 1} configs x {prompts.shape[0]} prompts)",
               unit="step", disable=not progress)
    ref, *got = greedy_continuations(model, prompts, [reference, *schemes.values()], new_tokens,
                                     block_size=block_size, progress=bar)
    bar.close()
    res = {name: compare_continuations(name, toks, ref) for name, toks in zip(schemes, got)}
    if not score:
        return res
    ref_nll = tuple(continuation_nll(model, prompts, ref).tolist())
    for name, toks in zip(schemes, got):
        nll = tuple(continuation_nll(model, prompts, toks).tolist())
        res[name] = dataclasses.replace(res[name], continuation_nll=nll, reference_nll=ref_nll)
    return res
