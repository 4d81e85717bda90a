"""A small serving engine: requests, per-scheme paged cache pools, chunked prefill, batched decode.

- **Requests** carry token ids, `SamplingParams` and a `kv_cache_dtype` (default: the engine's
  `default_kv_cache_dtype`, which can be changed at any time).
- **Pools**: one per scheme, created lazily the first time a request uses it, each with its own
  per-layer `PagedKVCache`s, a page allocator and a sequence-slot allocator (the slot indexes the
  cache's high-precision sink/tail storage). The weights are loaded once and shared by all pools.
- **Per-layer schemes**: a `kv_cache_dtype` may also name a scheme per decoder layer - a sequence
  of scheme strings, or the path of a layer-scheme file written by `kvarn-jax tune` (`.json` or an
  `os.PathLike`). Its pool is keyed by the tuple of per-layer schemes and gives each layer a
  `PagedKVCache` of its own scheme. Every layer of a pool has the same number of pages (one page
  table serves all layers), so a page's bytes differ per layer and the memory report sums the
  layers. A per-layer sequence whose layers all have one scheme is that scheme (the same pool).
- **Precision switch semantics**: a sequence keeps the scheme it started with until it finishes
  (its cache is never re-quantized); requests added after a switch use the new scheme. Pools of
  schemes no longer used stay allocated until `release_pool`.
- **Admission**: a request is admitted when its pool has a free slot and enough free pages for its
  whole life (prompt + max_new_tokens - 1 cached tokens, capped by max_model_len); otherwise it
  waits, and later requests of the same pool wait behind it (FIFO per pool). Pages and slot are
  freed when it finishes (stop token or length).
- **Steps**: each `step()` runs one prefill call per pool with prompts left to process (up to
  `prefill_batch` sequences, one chunk of at most `prefill_chunk` tokens each), then one decode
  call per pool for its sequences that are generating. Shapes are bucketed to powers of two so
  that few functions get compiled.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import numpy as np

from ..cache import memory_report as layer_memory_report
from ..config import KVQuantConfig
from ..models.llama import Decoder, DecodeBatch, PrefillBatch
from .allocator import BlockAllocator
from .runner import ModelRunner, SamplingArrays
from .sampling import SamplingParams


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def blocks_needed(prompt_len: int, max_new_tokens: int, block_size: int, max_model_len: int) -> int:
    """Pages a request holds for its whole life: every token but the last generated one is cached."""
    cached = min(prompt_len + max_new_tokens, max_model_len) - 1
    return -(-cached // block_size)


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished request. finish_reason: "stop" (a stop token, kept as the last output token) or
    "length" (max_new_tokens or max_model_len reached). kv_cache_dtype: see `scheme_name`."""

    request_id: int
    prompt_ids: tuple
    output_ids: tuple
    finish_reason: str
    kv_cache_dtype: "str | tuple"  # the scheme's name, or a tuple of per-layer names for per-layer schemes


@dataclasses.dataclass
class EngineStats:
    """Run time excludes compilation, which `compile_s` counts (host syncs once per step)."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    prefill_calls: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_calls: int = 0
    steps: int = 0


@dataclasses.dataclass
class _Seq:
    request_id: int
    prompt: list
    params: SamplingParams
    cfg: "KVQuantConfig | tuple"  # the pool key (see Engine._parse)
    stop_ids: frozenset
    output: list = dataclasses.field(default_factory=list)
    blocks: list = dataclasses.field(default_factory=list)
    slot: int = -1
    computed: int = 0  # tokens written to the cache

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


def scheme_name(key) -> "str | tuple":
    """A pool key as reported: the scheme's name, or the tuple of per-layer scheme names."""
    return key.name if isinstance(key, KVQuantConfig) else tuple(c.name for c in key)


class CachePool:
    """The paged caches of one scheme (every layer) or of per-layer schemes, their page allocator and
    sequence slots. cfg: a `KVQuantConfig`, or a tuple of one per layer; `layer_schemes` lists them
    per layer either way."""

    def __init__(self, runner: ModelRunner, cfg, *, num_blocks: int, block_size: int,
                 max_seqs: int, max_blocks_per_seq: int, calibration=None):
        self.cfg = cfg
        self.layer_schemes = ([cfg] * runner.config.num_layers if isinstance(cfg, KVQuantConfig) else list(cfg))
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.caches = runner.new_caches(cfg, num_blocks=num_blocks, block_size=block_size, max_seqs=max_seqs,
                                        calibration=calibration)
        self.blocks = BlockAllocator(num_blocks, "KV-cache pages")
        self.slots = BlockAllocator(max_seqs, "sequence slots")
        self.running: list[_Seq] = []

    def layer_caches(self) -> list:
        return [s["attn"]["kv_cache"].get_value() for s in self.caches]


class Engine:
    """Serve a `Decoder` with kvarn-jax paged caches.

    kv_cache_dtype: the default scheme of new requests: any `KVQuantConfig` string, or per-layer
      schemes (a sequence with one scheme per decoder layer, or a layer-scheme file from
      `kvarn-jax tune`: a `.json` path or `os.PathLike`). The same forms work wherever a
      kv_cache_dtype is taken (`add_request`, `generate`, `pool`, `memory_report`, ...).
    block_size: tokens per page (a multiple of the scheme's tile: 128 for *_g128).
    max_seqs: sequences served at once per pool (sizes each pool's high-precision sink/tail).
    max_model_len: prompt + generated tokens per sequence at most (default: the model's
      max_position_embeddings, capped at 2048).
    num_blocks: pages per pool (default: max_seqs full-length sequences).
    prefill_chunk / prefill_batch: tokens per sequence and sequences per prefill call.
    layers_per_call: decoder layers per compiled call (see `ModelRunner`; None = all).
    impl: decode attention ("auto": Pallas kernel on NVIDIA GPUs, reference elsewhere).
    calibration: a `kvarn_jax.Calibration` of all layers, for static schemes.
    """

    def __init__(self, model: Decoder, *, kv_cache_dtype="kvarn_k4v2_g128", block_size: int = 128,
                 max_seqs: int = 8, max_model_len: int | None = None, num_blocks: int | None = None,
                 prefill_chunk: int = 512, prefill_batch: int = 8, layers_per_call: int | None = 1,
                 impl: str = "auto", calibration=None):
        for name, val in (("block_size", block_size), ("max_seqs", max_seqs), ("prefill_chunk", prefill_chunk),
                          ("prefill_batch", prefill_batch)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.runner = ModelRunner(model, layers_per_call=layers_per_call, impl=impl)
        self.config = model.config
        cap = self.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(cap, 2048)
        if not isinstance(max_model_len, int) or not 2 <= max_model_len <= cap:
            raise ValueError(f"max_model_len must be an int in [2, {cap}] (the model's max_position_embeddings), "
                             f"got {max_model_len!r}")
        self.block_size, self.max_seqs, self.max_model_len = block_size, max_seqs, max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.num_blocks = max_seqs * self.max_blocks_per_seq if num_blocks is None else num_blocks
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.prefill_chunk, self.prefill_batch = prefill_chunk, prefill_batch
        self.calibration = calibration
        self._default = self._parse(kv_cache_dtype)
        self.pools: dict = {}  # pool key (KVQuantConfig, or a tuple of one per layer) -> CachePool
        self.waiting: list[_Seq] = []
        self._next_id = 0
        self._finished: dict[int, Result] = {}
        self.stats = EngineStats()

    # ------------------------------------------------------------------ schemes and pools
    def _check(self, cfg: KVQuantConfig, where: str = "") -> None:
        try:
            cfg.check_head_dim(self.config.head_dim, "the model's head_dim")
            cfg.check_block_size(self.block_size)
            if cfg.static and self.calibration is None:
                raise ValueError(f"kv_cache_dtype {cfg.name} needs static scales: create the Engine with calibration=")
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None

    def _parse(self, kv_cache_dtype):
        """The pool key of a kv_cache_dtype: a `KVQuantConfig`, or a tuple of one per layer when the
        layers' schemes differ. ValueError naming the file / layer for anything invalid."""
        n = self.config.num_layers
        if isinstance(kv_cache_dtype, os.PathLike) or (
                isinstance(kv_cache_dtype, str) and kv_cache_dtype.lower().endswith(".json")):
            from ..layer_config import load_layer_config
            where = f"layer config {os.fspath(kv_cache_dtype)!r}: "
            try:
                layers = load_layer_config(kv_cache_dtype, num_layers=n)
            except FileNotFoundError:
                raise ValueError(f"{where}no such file") from None
        elif isinstance(kv_cache_dtype, (str, KVQuantConfig)):
            cfg = KVQuantConfig.parse(kv_cache_dtype)
            self._check(cfg)
            return cfg
        elif isinstance(kv_cache_dtype, Sequence) and not isinstance(kv_cache_dtype, (bytes, bytearray)):
            layers, where = list(kv_cache_dtype), "kv_cache_dtype "
            if len(layers) != n:
                raise ValueError(f"kv_cache_dtype has {len(layers)} per-layer schemes but the model has "
                                 f"num_layers={n}")
        else:
            raise TypeError("kv_cache_dtype must be a scheme string, a KVQuantConfig, a sequence of one scheme "
                            f"per layer or the path of a layer-scheme file, got {type(kv_cache_dtype).__name__}")
        cfgs = []
        for i, s in enumerate(layers):
            try:
                cfg = KVQuantConfig.parse(s)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}layer {i}: {e}") from None
            self._check(cfg, f"{where}layer {i}: ")
            cfgs.append(cfg)
        # one scheme everywhere is that scheme: the same pool (and tokens) as asking for it directly
        return cfgs[0] if len(set(cfgs)) == 1 else tuple(cfgs)

    @property
    def default_kv_cache_dtype(self) -> "str | tuple":
        """The default scheme's name (a tuple of per-layer names for per-layer schemes)."""
        return scheme_name(self._default)

    @default_kv_cache_dtype.setter
    def default_kv_cache_dtype(self, value) -> None:
        """Switch the scheme of requests added from now on (running sequences keep theirs)."""
        self._default = self._parse(value)

    def pool(self, kv_cache_dtype=None) -> CachePool:
        """The pool of a scheme (default: the engine's default), created on first use."""
        cfg = self._default if kv_cache_dtype is None else self._parse(kv_cache_dtype)
        if cfg not in self.pools:
            self.pools[cfg] = CachePool(self.runner, cfg, num_blocks=self.num_blocks, block_size=self.block_size,
                                        max_seqs=self.max_seqs, max_blocks_per_seq=self.max_blocks_per_seq,
                                        calibration=self.calibration)
        return self.pools[cfg]

    def release_pool(self, kv_cache_dtype) -> None:
        """Free the memory of an idle scheme's pool (ValueError if sequences still use it)."""
        cfg = self._parse(kv_cache_dtype)
        pool = self.pools.get(cfg)
        if pool is None:
            return
        if pool.running or any(s.cfg == cfg for s in self.waiting):
            raise ValueError(f"the {scheme_name(cfg)} pool still has requests; release it when they have finished")
        del self.pools[cfg]

    def memory_report(self, kv_cache_dtype=None) -> dict:
        """`kvarn_jax.memory_report` of a pool, summed over layers (creates the pool if needed).

        With per-layer schemes, "scheme" summarizes them ("per-layer: 16 x a, 14 x b") and
        "layer_schemes" lists them; every byte count is the sum of the layers' own.
        """
        pool = self.pool(kv_cache_dtype)
        caches = pool.layer_caches()
        layers = [layer_memory_report(c) for c in caches]
        out = dict(layers[0])
        for key in ("code_bytes", "metadata_bytes", "page_bytes", "sink_bytes", "tail_bytes", "static_bytes",
                    "total_bytes", "fp16_bytes"):
            out[key] = sum(r[key] for r in layers)
        out["layers"] = len(layers)
        out["bytes_per_token_per_head"] = out["page_bytes"] / (len(layers) * out["tokens"] * caches[0].num_kv_heads)
        out["capacity_vs_fp16"] = out["fp16_bytes"] / out["total_bytes"]
        out["layer_schemes"] = [c.name for c in pool.layer_schemes]
        if not isinstance(pool.cfg, KVQuantConfig):
            counts = {}
            for c in pool.layer_schemes:
                counts[c.name] = counts.get(c.name, 0) + 1
            out["scheme"] = "per-layer: " + ", ".join(f"{n} x {name}" for name, n in counts.items())
        return out

    # ------------------------------------------------------------------ requests
    def blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Pages a request holds for its whole life (see the module-level `blocks_needed`)."""
        return blocks_needed(prompt_len, max_new_tokens, self.block_size, self.max_model_len)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                    kv_cache_dtype=None) -> int:
        """Queue a request; returns its id. The scheme is fixed for the request's whole life."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
            raise ValueError(f"prompt_ids must be in [0, {self.config.vocab_size}) (the vocabulary)")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len={self.max_model_len} leaves no room "
                             "to generate")
        need = self.blocks_needed(len(prompt), params.max_new_tokens)
        if need > self.num_blocks:
            raise ValueError(f"the request needs {need} pages of {self.block_size} tokens but a pool has only "
                             f"num_blocks={self.num_blocks}")
        cfg = self._default if kv_cache_dtype is None else self._parse(kv_cache_dtype)
        stop = self.config.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        seq = _Seq(self._next_id, prompt, params, cfg, frozenset() if params.ignore_eos else frozenset(stop))
        self._next_id += 1
        self.waiting.append(seq)
        return seq.request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(p.running for p in self.pools.values())

    def _admit(self) -> None:
        still, blocked = [], set()
        for seq in self.waiting:
            pool = self.pool(seq.cfg)
            need = self.blocks_needed(len(seq.prompt), seq.params.max_new_tokens)
            # FIFO per pool: once a request waits, later ones of its pool wait behind it (no starvation)
            if seq.cfg not in blocked and pool.slots.can_allocate(1) and pool.blocks.can_allocate(need):
                seq.slot = pool.slots.allocate(1)[0]
                seq.blocks = pool.blocks.allocate(need)
                pool.running.append(seq)
            else:
                blocked.add(seq.cfg)
                still.append(seq)
        self.waiting = still

    def _finish(self, pool: CachePool, seq: _Seq, reason: str) -> None:
        pool.blocks.free(seq.blocks)
        pool.slots.free([seq.slot])
        seq.blocks, seq.slot = [], -1
        pool.running.remove(seq)
        self._finished[seq.request_id] = Result(seq.request_id, tuple(seq.prompt), tuple(seq.output), reason,
                                                scheme_name(seq.cfg))

    def _accept(self, pool: CachePool, seq: _Seq, token: int) -> None:
        seq.output.append(token)
        if token in seq.stop_ids:
            self._finish(pool, seq, "stop")
        elif len(seq.output) >= seq.params.max_new_tokens or seq.length >= self.max_model_len:
            self._finish(pool, seq, "length")

    # ------------------------------------------------------------------ batches
    def _slots(self, seq: _Seq, positions: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return np.asarray(seq.blocks, np.int32)[positions // bs] * bs + positions % bs

    def _table(self, rows: list) -> np.ndarray:
        # A fixed width (one compiled shape); unused entries point at page 0 and are masked by length.
        table = np.zeros((len(rows), self.max_blocks_per_seq), np.int32)
        for i, seq in enumerate(rows):
            if seq is not None:
                table[i, :len(seq.blocks)] = seq.blocks
        return table

    def _sampling(self, rows: list) -> SamplingArrays:
        n = len(rows)
        samp = SamplingArrays(np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.uint32),
                              np.zeros(n, np.int32))
        for i, s in enumerate(rows):
            if s is not None:
                samp.temperature[i], samp.top_p[i] = s.params.temperature, s.params.top_p
                samp.seeds[i], samp.steps[i] = s.params.seed, len(s.output)
        return samp

    def _prefill(self, pool: CachePool) -> None:
        todo = [s for s in pool.running if s.computed < len(s.prompt)][: self.prefill_batch]
        if not todo:
            return
        takes = [min(self.prefill_chunk, len(s.prompt) - s.computed) for s in todo]
        p = _pow2(len(todo))
        c = min(_pow2(max(takes + [16])), self.prefill_chunk)
        tokens = np.zeros((p, c), np.int32)
        positions = np.tile(np.arange(c, dtype=np.int32), (p, 1))
        slots = np.full((p, c), -1, np.int32)
        seq_ids, start, last = np.zeros(p, np.int32), np.zeros(p, np.int32), np.zeros(p, np.int32)
        for i, (s, t) in enumerate(zip(todo, takes)):
            pos = np.arange(s.computed, s.computed + t, dtype=np.int32)
            tokens[i, :t] = s.prompt[s.computed:s.computed + t]
            positions[i] = s.computed + np.arange(c, dtype=np.int32)
            slots[i, :t] = self._slots(s, pos)
            seq_ids[i], start[i], last[i] = s.slot, s.computed, t - 1
        rows = todo + [None] * (p - len(todo))
        batch = PrefillBatch(tokens, positions, slots, seq_ids, self._table(rows), start, last)
        next_tok = self._run("prefill", pool, batch, rows, sum(takes))
        for i, (s, t) in enumerate(zip(todo, takes)):
            s.computed += t
            if s.computed == len(s.prompt):
                self._accept(pool, s, int(next_tok[i]))

    def _decode(self, pool: CachePool, todo: list) -> None:
        b = _pow2(len(todo))
        tokens, positions = np.zeros(b, np.int32), np.zeros(b, np.int32)
        slots, seq_ids = np.full(b, -1, np.int32), np.zeros(b, np.int32)
        for i, s in enumerate(todo):
            pos = s.length - 1  # the last generated token is written now
            tokens[i], positions[i], seq_ids[i] = s.output[-1], pos, s.slot
            slots[i] = self._slots(s, np.array([pos]))[0]
        rows = todo + [None] * (b - len(todo))
        batch = DecodeBatch(tokens, positions, slots, seq_ids, self._table(rows))
        next_tok = self._run("decode", pool, batch, rows, len(todo))
        for i, s in enumerate(todo):
            s.computed += 1
            self._accept(pool, s, int(next_tok[i]))

    def _run(self, kind: str, pool: CachePool, batch, rows: list, tokens: int) -> np.ndarray:
        """One compiled prefill or decode call on `pool`; its time (less compilation) goes to the stats."""
        samp = self._sampling(rows)
        t0, c0 = time.perf_counter(), self.runner.stats.compile_s
        next_tok, _, pool.caches = getattr(self.runner, kind)(pool.caches, batch, samp)
        next_tok = np.asarray(next_tok)
        st, run_s = self.stats, time.perf_counter() - t0 - (self.runner.stats.compile_s - c0)
        setattr(st, f"{kind}_s", getattr(st, f"{kind}_s") + run_s)
        setattr(st, f"{kind}_tokens", getattr(st, f"{kind}_tokens") + tokens)
        setattr(st, f"{kind}_calls", getattr(st, f"{kind}_calls") + 1)
        return next_tok

    # ------------------------------------------------------------------ driving
    def step(self) -> list[Result]:
        """Admit, then one prefill call and one decode call per pool with work; returns the requests
        that finished in this step."""
        before = set(self._finished)
        self._admit()
        pools = list(self.pools.values())
        decoding = {id(p): [s for s in p.running if s.computed >= len(s.prompt) and s.output] for p in pools}
        for pool in pools:
            self._prefill(pool)
        for pool in pools:
            if decoding[id(pool)]:
                self._decode(pool, decoding[id(pool)])
        self.stats.steps += 1
        return [self._finished[i] for i in sorted(set(self._finished) - before)]

    def run(self) -> dict[int, Result]:
        """Step until every request has finished; returns all finished results by request id."""
        while self.has_unfinished():
            self.step()
        return dict(self._finished)

    def pop_result(self, request_id: int) -> Result:
        return self._finished.pop(request_id)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 kv_cache_dtype=None) -> list[Result]:
        """Run a batch of prompts to completion; results in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp, kv_cache_dtype=kv_cache_dtype) for p, sp in zip(prompts, plist)]
        self.run()
        return [self.pop_result(i) for i in ids]
