"""A serving engine: requests, per-scheme paged cache pools, chunked prefill, batched decode, all
steps compiled whole and dispatched asynchronously.

- **Requests** carry token ids, `SamplingParams` and a `kv_cache_dtype` (default: the engine's
  `default_kv_cache_dtype`, which can be changed at any time).
- **Pools**: one per scheme, each with the caches of every layer (`kvarn_jax.cache.LayerCaches`), a
  page allocator and a sequence-slot allocator (the slot indexes the high-precision sink/tail
  storage). A block a quantized pool serves only from high precision holds no page
  (`paged.NO_PAGE`): a whole-block sink and each request's last block (read from the tail ring
  while it is the query's own), so a request's high-precision blocks are paid once, by its slot. The default scheme's pool is created with the engine, others when a request first
  asks for them; a pool that does not fit in the device's free memory is refused then, with the
  bytes it needs. The weights are loaded once and shared by all pools.
- **Per-layer schemes**: a `kv_cache_dtype` may also name a scheme per decoder layer - a sequence
  of scheme strings, or the path of a layer-scheme file written by `kvarn-jax tune` (`.json` or an
  `os.PathLike`). Every layer of a pool has the same number of pages (one page table serves all
  layers), so a page's bytes differ per layer and the memory report sums the layers. A per-layer
  sequence whose layers all have one scheme is that scheme (the same pool).
- **Precision switch semantics**: a sequence keeps the scheme it started with until it finishes
  (its cache is never re-quantized); requests added after a switch use the new scheme. Pools of
  schemes no longer used stay allocated until `release_pool`.
- **Admission**: a request is admitted when its pool has a free slot and enough free pages for its
  whole life (prompt + max_new_tokens - 1 cached tokens, capped by max_model_len, less the blocks
  held only in high precision: `Engine.pages_needed`); otherwise it
  waits, and later requests of the same pool wait behind it (FIFO per pool). Pages and slot are
  freed when it finishes (stop token or length).
- **Steps**: each `step()` dispatches one prefill call per pool with prompts left to process (up to
  `prefill_batch` sequences, one chunk of at most `prefill_chunk` tokens each; its tokens are then
  stored a block at a time) and one decode call per pool for its generating sequences, each a single
  compiled call of the whole model (see `runner.py`); then it waits for the previous step's sampled tokens. The device thus runs step t
  while the host learns step t-1's tokens and prepares step t+1: input tokens stay on the device,
  and positions, slots and block tables are known to the host without them. The price is that a
  sequence which stops on a stop token is found one step late; the token computed for it in that
  step is discarded. Shapes are bucketed to powers of two so that few functions get compiled.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import jax
import numpy as np
import jax.numpy as jnp
from jax.sharding import Mesh

from ..config import KVQuantConfig
from ..cache.layers import LayerCaches
from ..cache.paged import NO_PAGE
from ..cache.sharding import HeadParallel
from ..models.llama import Decoder, key_tiles
from .allocator import BlockAllocator
from .runner import DECODE_COLS, PREFILL_COLS, ModelRunner
from .sampling import SamplingParams


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def blocks_needed(prompt_len: int, max_new_tokens: int, block_size: int, max_model_len: int) -> int:
    """Blocks a request fills in its whole life: every token but the last generated one is cached."""
    cached = min(prompt_len + max_new_tokens, max_model_len) - 1
    return -(-cached // block_size)


def paged_blocks(n: int, block_size: int, paged_from: int | None) -> range:
    """Which of a request's `n` blocks hold a page: all of them (paged_from None: a pool with a
    passthrough layer), else those from `paged_from` on but the last, which is read from the tail
    ring while it is the query's own and never after (the request ends there)."""
    if paged_from is None:
        return range(n)
    return range(paged_from // block_size, n - 1)


def request_pages(cfg, n: int, block_size: int) -> int:
    """Pages a request of `n` blocks holds in a pool of `cfg` (a `KVQuantConfig` or one per layer)."""
    from ..cache import hp
    cfgs = [cfg] if isinstance(cfg, KVQuantConfig) else list(cfg)
    # `LayerCaches.paged_from`, or None with a passthrough layer (every block paged)
    paged_from = None if any(c.is_passthrough for c in cfgs) else min(hp.paged_from(c, block_size) for c in cfgs)
    return len(paged_blocks(n, block_size, paged_from))


def pool_blocks(cfg, *, max_seqs: int, max_model_len: int, block_size: int) -> int:
    """The engine's default pages per pool: `max_seqs` requests of `max_model_len` tokens."""
    n = blocks_needed(max_model_len, 0, block_size, max_model_len) if max_model_len > 1 else 1
    return max(1, max_seqs * request_pages(cfg, n, block_size))


def pool_memory_report(kv_cache_dtype, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype="bfloat16",
                       max_seqs: int, max_model_len: int, block_size: int = 128, num_blocks: int | None = None) -> dict:
    """The memory report (`LayerCaches.memory_report`, as `Engine.memory_report` gives it) of the pool
    an engine creates for a model of these shapes, computed from abstract arrays: nothing is
    allocated and no model is needed (e.g. Llama-3-8B shapes on a CPU). kv_cache_dtype: one scheme
    (str or `KVQuantConfig`) or one per layer."""
    cfg = (KVQuantConfig.parse(kv_cache_dtype) if isinstance(kv_cache_dtype, (str, KVQuantConfig))
           else tuple(KVQuantConfig.parse(c) for c in kv_cache_dtype))
    if num_blocks is None:
        num_blocks = pool_blocks(cfg, max_seqs=max_seqs, max_model_len=max_model_len, block_size=block_size)
    abstract = jax.eval_shape(lambda: LayerCaches.create(cfg, num_layers, num_blocks=num_blocks, block_size=block_size,
                                                         num_kv_heads=num_kv_heads, head_dim=head_dim,
                                                         max_seqs=max_seqs, dtype=dtype))
    return abstract.memory_report(hp_only_blocks=True)


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished request. finish_reason: "stop" (a stop token, kept as the last output token),
    "length" (max_new_tokens or max_model_len reached) or "error" (then `error` says why; output_ids
    holds the tokens generated before it). kv_cache_dtype: see `scheme_name`."""

    request_id: int
    prompt_ids: tuple
    output_ids: tuple
    finish_reason: str
    kv_cache_dtype: "str | tuple"  # the scheme's name, or a tuple of per-layer names for per-layer schemes
    error: "str | None" = None


@dataclasses.dataclass
class EngineStats:
    """Device time of the steps, measured as the interval between the arrivals of consecutive steps'
    tokens (the device works through the steps back to back), less compilation, which `compile_s` of
    the runner counts. A step that ran a prefill call counts as prefill time; decode_tokens and
    decode_calls count the tokens (not those computed for a sequence already stopped, see `Engine`)
    and calls of the steps that only decoded, whose time is decode_s; mixed_decode_tokens the tokens
    decode calls generated in steps that also prefilled (their time is in prefill_s); commit_calls
    the calls that quantized completed blocks."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    prefill_calls: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_calls: int = 0
    mixed_decode_tokens: int = 0
    commit_calls: int = 0
    steps: int = 0


@dataclasses.dataclass
class _Seq:
    request_id: int
    prompt: list
    params: SamplingParams
    cfg: "KVQuantConfig | tuple"  # the pool key (see Engine._parse)
    stop_ids: frozenset
    output: list = dataclasses.field(default_factory=list)  # tokens the host has received
    blocks: list = dataclasses.field(default_factory=list)
    slot: int = -1
    computed: int = 0   # prompt tokens written to the cache
    scheduled: int = 0  # generated tokens dispatched (their values may still be on the device)
    finished: bool = False
    table: "np.ndarray | None" = None  # blocks as the packed metadata's block-table row (int32)
    seed32: int = dataclasses.field(init=False, default=0)  # the seed's int32 bit pattern (packed metadata)

    def __post_init__(self):
        self.seed32 = int(np.uint32(self.params.seed).view(np.int32))

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


def scheme_name(key) -> "str | tuple":
    """A pool key as reported: the scheme's name, or the tuple of per-layer scheme names."""
    return key.name if isinstance(key, KVQuantConfig) else tuple(c.name for c in key)


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


class CachePool:
    """The caches of one scheme (every layer) or of per-layer schemes, their page allocator, sequence
    slots and each slot's last sampled token (on the device). cfg: a `KVQuantConfig`, or a tuple of
    one per layer; `layer_schemes` lists them per layer either way."""

    def __init__(self, runner: ModelRunner, cfg, *, num_blocks: int, block_size: int,
                 max_seqs: int, max_blocks_per_seq: int, calibration=None, prefill: tuple | None = None):
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = max_blocks_per_seq
        make = lambda: runner.new_caches(cfg, num_blocks=num_blocks, block_size=block_size,  # noqa: E731
                                         max_seqs=max_seqs, calibration=calibration)
        abstract = jax.eval_shape(make)
        runner.decode_kernels(abstract.layer_schemes)  # the rotated o_proj copies first: they take memory too
        _check_fits(abstract, cfg, num_blocks, max_seqs, runner.tp, prefill)
        self.caches = make()
        self.layer_schemes = self.caches.layer_schemes
        self.last_tokens = runner.new_tokens(max_seqs)
        self.quantized = any(not c.is_passthrough for c in self.layer_schemes)
        # where blocks served only from high precision go without a page (None: every block paged)
        self.paged_from = self.caches.paged_from if self.caches.hp_only_blocks else None
        self.blocks = BlockAllocator(num_blocks, "KV-cache pages")
        self.slots = BlockAllocator(max_seqs, "sequence slots")
        self.running: list[_Seq] = []


def prefill_workspace(config, dtype, *, prefill_batch: int, prefill_chunk: int, context: int) -> int:
    """What one prefill call holds at once besides the weights and the pool, in bytes, by its largest
    buffers (a lower bound: XLA's temporaries come on top): one key tile of the cached context as
    float32 keys and values [P, Hk, tile, D] (`paged.dense_tiles`), the float32 scores over it
    [P, Hq, C, tile] and over the chunk itself [P, Hq, C, C], every layer's new keys and values
    (stored after the layers run), and the MLP's hidden activations. P: prefill_batch rounded up to
    a power of two (the call's shape), C: prefill_chunk; context: cached tokens at most."""
    c = config
    p, ch = _pow2(prefill_batch), prefill_chunk
    item = jnp.dtype(dtype).itemsize
    tile = key_tiles(context)[1]  # the tile prefill's streaming softmax reads
    return (2 * p * c.num_kv_heads * tile * c.head_dim * 4
            + p * c.num_heads * ch * (tile + ch) * 4
            + 2 * c.num_layers * p * ch * c.num_kv_heads * c.head_dim * item
            + p * ch * c.intermediate_size * item)


def _check_fits(abstract, cfg, num_blocks: int, max_seqs: int, tp=None, prefill: tuple | None = None) -> None:
    """Refuse a pool larger than the devices' free memory, saying what it needs (where a device
    reports its memory: GPUs and TPUs; the CPU backend does not), and a pool that fits but leaves
    less than a prefill call's working memory (prefill: (`prefill_workspace` bytes, the settings
    that give them, as the message names them)), which would otherwise run out of memory in the
    middle of a request. Under tensor parallelism each device holds its share of the
    heads (of the pool and of the prefill's buffers)."""
    need = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    devices = list(tp.mesh.devices.flat) if tp is not None else jax.devices()[:1]
    share = need / len(devices)
    for dev in devices:
        try:
            st = dev.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without memory statistics
            st = None
        if not st or "bytes_limit" not in st:
            continue
        free = st["bytes_limit"] - st.get("bytes_in_use", 0)
        if share > free:
            each = f" ({_gib(share)} on each of {len(devices)} devices)" if len(devices) > 1 else ""
            raise ValueError(
                f"the {scheme_name(cfg) if isinstance(cfg, KVQuantConfig) else 'per-layer'} KV cache pool needs "
                f"{_gib(need)}{each} (num_blocks={num_blocks} pages per layer, max_seqs={max_seqs}) but the device "
                f"has {_gib(free)} free of {_gib(st['bytes_limit'])}: use a quantized kv_cache_dtype, fewer "
                "num_blocks or max_seqs, a shorter max_model_len, or more devices (tensor_parallel)")
        work = prefill[0] / len(devices) if prefill else 0
        if share + work > free:
            raise ValueError(
                f"a prefill call of {prefill[1]} needs at least {_gib(work)} of working memory next to "
                f"the {scheme_name(cfg) if isinstance(cfg, KVQuantConfig) else 'per-layer'} KV cache pool's "
                f"{_gib(share)}, but the device has {_gib(free)} free of {_gib(st['bytes_limit'])}: use a smaller "
                "prefill_batch or prefill_chunk, fewer num_blocks or max_seqs, or a shorter max_model_len")


def _head_parallel(tensor_parallel, mesh) -> HeadParallel | None:
    if mesh is not None:
        if "tp" not in mesh.axis_names:
            raise ValueError(f"mesh must have an axis named 'tp' to split heads over, got axes {mesh.axis_names}")
        if tensor_parallel not in (1, mesh.shape["tp"]):
            raise ValueError(f"tensor_parallel={tensor_parallel} disagrees with the mesh's tp axis of {mesh.shape['tp']}")
        return HeadParallel(mesh) if mesh.shape["tp"] > 1 else None
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got {tensor_parallel!r}")
    if tensor_parallel == 1:
        return None
    devices = jax.devices()
    if tensor_parallel > len(devices):
        raise ValueError(f"tensor_parallel={tensor_parallel} needs that many devices; {len(devices)} are visible")
    return HeadParallel(Mesh(np.array(devices[:tensor_parallel]), ("tp",)))


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
    num_blocks: pages per pool (default: the pages of max_seqs full-length sequences of the pool's
      scheme, `pool_blocks`; blocks held only in high precision take none).
    prefill_chunk / prefill_batch: tokens per sequence and sequences per prefill call. A chunk ends on
      a block boundary unless its prompt does: from one block up, prefill_chunk counts whole blocks
      (rounded down to a multiple of block_size); below, a chunk also stops at the next boundary.
    impl: decode attention ("auto": the Pallas kernel on NVIDIA GPUs and TPUs, the C++ kernel for KVarN
      caches on CPUs, the reference otherwise; `kvarn_jax.impl`).
    calibration: a `kvarn_jax.Calibration` of all layers, for static schemes.
    decode_loop: how the decode step runs the layers (`ModelRunner`): "auto", "unroll", "scan" or
        "switch" (auto: "switch" on CPUs, "scan" there under tensor parallelism, "unroll" elsewhere).
    tensor_parallel: split attention heads, KV-cache heads and MLP units over this many devices (the
      first ones of `jax.devices()`), or `mesh`: a `jax.sharding.Mesh` with a "tp" axis to split over.
      Each step is still one compiled call, over the mesh.
    debug: after every step, read the caches' count of tokens not stored as given
      (`LayerCaches.dropped_tokens`, less the non-finite ones, which finish their request with
      finish_reason="error") and raise RuntimeError if it grew. Waits for each step: slower.
    A request whose model output put a NaN or Inf into the cache (any layer's key or value; stored
    as zeros, so its neighbours in the batch are untouched) finishes with finish_reason="error".
    """

    def __init__(self, model: Decoder, *, kv_cache_dtype="kvarn_k4v2_g128", block_size: int = 128,
                 max_seqs: int = 8, max_model_len: int | None = None, num_blocks: int | None = None,
                 prefill_chunk: int = 512, prefill_batch: int = 8, impl: str = "auto", calibration=None,
                 decode_loop: str = "auto", tensor_parallel: int = 1, mesh=None, debug: bool = False):
        for name, val in (("block_size", block_size), ("max_seqs", max_seqs), ("prefill_chunk", prefill_chunk),
                          ("prefill_batch", prefill_batch)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.runner = ModelRunner(model, impl=impl, decode_loop=decode_loop,
                                  tp=_head_parallel(tensor_parallel, mesh))
        self.config = model.config
        cap = self.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(cap, 2048)
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or not 2 <= max_model_len <= cap:
            raise ValueError(f"max_model_len must be an int in [2, {cap}] (the model's max_position_embeddings), "
                             f"got {max_model_len!r}")
        self.block_size, self.max_seqs, self.max_model_len = block_size, max_seqs, max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        if num_blocks is not None and (not isinstance(num_blocks, int) or isinstance(num_blocks, bool)
                                       or num_blocks <= 0):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self.prefill_chunk, self.prefill_batch = prefill_chunk, prefill_batch
        # (bytes, the settings that give them) of one prefill call, checked beside each pool
        self._prefill_need = (prefill_workspace(self.config, model.dtype, prefill_batch=prefill_batch,
                                                prefill_chunk=prefill_chunk,
                                                context=self.max_blocks_per_seq * block_size),
                              f"prefill_batch={prefill_batch} sequences x prefill_chunk={prefill_chunk} tokens")
        self.calibration = calibration
        self._default = self._parse(kv_cache_dtype)
        self.pools: dict = {}  # pool key (KVQuantConfig, or a tuple of one per layer) -> CachePool
        self.waiting: list[_Seq] = []
        self._next_id = 0
        self._finished: dict[int, Result] = {}
        self._inflight: list = []      # what the last step dispatched, collected by the next step
        self._last_arrival = None      # (time, compile seconds) when the previous step's tokens arrived
        self.stats = EngineStats()
        if not isinstance(debug, bool):
            raise ValueError(f"debug must be a bool, got {debug!r}")
        self.debug = debug
        self._unexplained_drops: dict = {}  # debug: pool key -> dropped less non-finite, as last checked
        self.pool()                    # the default pool exists from the start: a size error surfaces here

    @property
    def num_blocks(self) -> int:
        """Pages of the default scheme's pool (each pool's: `pool(s).num_blocks`)."""
        return self._pool_blocks(self._default)

    def _pool_blocks(self, cfg) -> int:
        if self._num_blocks is not None:
            return self._num_blocks
        return pool_blocks(cfg, max_seqs=self.max_seqs, max_model_len=self.max_model_len, block_size=self.block_size)

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
        return self._pool(cfg)

    def _pool(self, cfg) -> CachePool:
        if cfg not in self.pools:
            try:
                self.pools[cfg] = CachePool(self.runner, cfg, num_blocks=self._pool_blocks(cfg),
                                            block_size=self.block_size, max_seqs=self.max_seqs,
                                            max_blocks_per_seq=self.max_blocks_per_seq, calibration=self.calibration,
                                            prefill=self._prefill_need)
            except Exception:  # a refused pool leaves no rotated o_proj copy behind
                self.runner.drop_rotations(p.layer_schemes for p in self.pools.values())
                raise
        return self.pools[cfg]

    def release_pool(self, kv_cache_dtype) -> None:
        """Free the memory of an idle scheme's pool (ValueError if sequences still use it)."""
        cfg = self._parse(kv_cache_dtype)
        pool = self.pools.get(cfg)
        if pool is None:
            return
        if pool.running or any(s.cfg == cfg for s in self.waiting):
            raise ValueError(f"the {scheme_name(cfg)} pool still has requests; release it when they have finished")
        self._drain()
        del self.pools[cfg]
        self._unexplained_drops.pop(cfg, None)
        self.runner.drop_rotations(p.layer_schemes for p in self.pools.values())

    def memory_report(self, kv_cache_dtype=None) -> dict:
        """`kvarn_jax.memory_report` of a pool, summed over layers (creates the pool if needed); its
        tokens count the blocks every slot holds only in high precision (`pool_memory_report` gives
        the same for a model of any size without allocating).

        With per-layer schemes, "scheme" summarizes them ("per-layer: 16 x a, 14 x b") and
        "layer_schemes" lists them; every byte count is the sum of the layers' own. "devices" and
        "per_device_bytes": under tensor parallelism each device holds 1/devices of every buffer.
        """
        report = self.pool(kv_cache_dtype).caches.memory_report(hp_only_blocks=True)
        n = 1 if self.runner.tp is None else self.runner.tp.size
        report["devices"] = n
        report["per_device_bytes"] = report["total_bytes"] / n  # every buffer is split over the heads
        return report

    def precompile(self, decode_batches: Sequence[int] | None = None, kv_cache_dtype=None) -> None:
        """Compile a pool's decode steps (and block commits) now rather than at their first use:
        for the given batch sizes, or every power of two up to max_seqs (the sizes steps use)."""
        pool = self.pool(kv_cache_dtype)
        sizes = decode_batches or [1 << i for i in range(_pow2(self.max_seqs).bit_length())]
        for b in sorted({_pow2(b) for b in sizes}):
            self.runner.precompile_decode(pool.caches, pool.last_tokens, b, self.max_blocks_per_seq)

    # ------------------------------------------------------------------ requests
    def blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks a request fills in its whole life (see the module-level `blocks_needed`)."""
        return blocks_needed(prompt_len, max_new_tokens, self.block_size, self.max_model_len)

    def pages_needed(self, prompt_len: int, max_new_tokens: int, kv_cache_dtype=None) -> int:
        """Pages a request of that scheme (default: the engine's) holds for its whole life: its blocks
        but those held only in high precision (`paged_blocks`)."""
        cfg = self._default if kv_cache_dtype is None else self._parse(kv_cache_dtype)
        return request_pages(cfg, self.blocks_needed(prompt_len, max_new_tokens), self.block_size)

    def _request(self, prompt_ids, params, kv_cache_dtype) -> _Seq:
        """A checked request (not queued): ValueError/TypeError naming what is wrong."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        arr = np.asarray(prompt_ids)
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ValueError(f"prompt_ids must be integer token ids, got {arr.dtype} values")
        prompt = [int(t) for t in arr.reshape(-1)]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
            raise ValueError(f"prompt_ids must be in [0, {self.config.vocab_size}) (the vocabulary)")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len={self.max_model_len} leaves no room "
                             "to generate")
        cfg = self._default if kv_cache_dtype is None else self._parse(kv_cache_dtype)
        need = request_pages(cfg, self.blocks_needed(len(prompt), params.max_new_tokens), self.block_size)
        if need > self._pool_blocks(cfg):
            raise ValueError(f"the request needs {need} pages of {self.block_size} tokens but its pool has only "
                             f"num_blocks={self._pool_blocks(cfg)}")
        stop = self.config.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        return _Seq(-1, prompt, params, cfg, frozenset() if params.ignore_eos else frozenset(stop))

    def _queue(self, seq: _Seq) -> int:
        self._pool(seq.cfg)  # created now: an error (e.g. it does not fit) belongs to this request
        seq.request_id = self._next_id
        self._next_id += 1
        self.waiting.append(seq)
        return seq.request_id

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                    kv_cache_dtype=None) -> int:
        """Queue a request; returns its id. The scheme is fixed for the request's whole life."""
        return self._queue(self._request(prompt_ids, params, kv_cache_dtype))

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self._inflight) or any(p.running for p in self.pools.values())

    def _admit(self) -> None:
        still, blocked = [], set()
        for seq in self.waiting:
            pool = self._pool(seq.cfg)
            n = self.blocks_needed(len(seq.prompt), seq.params.max_new_tokens)
            paged = paged_blocks(n, self.block_size, pool.paged_from)
            # FIFO per pool: once a request waits, later ones of its pool wait behind it (no starvation)
            if seq.cfg not in blocked and pool.slots.can_allocate(1) and pool.blocks.can_allocate(len(paged)):
                seq.slot = pool.slots.allocate(1)[0]
                pages = iter(pool.blocks.allocate(len(paged)))
                seq.blocks = [next(pages) if j in paged else NO_PAGE for j in range(n)]
                seq.table = np.zeros(pool.max_blocks_per_seq, np.int32)
                seq.table[:n] = seq.blocks
                pool.running.append(seq)
            else:
                blocked.add(seq.cfg)
                still.append(seq)
        self.waiting = still

    def _finish(self, pool: CachePool, seq: _Seq, reason: str, error: str | None = None) -> None:
        # Work already dispatched for this sequence may still write its old pages and slot; it runs
        # before anything dispatched later (one device stream, caches passed from call to call), and a
        # later owner reads only what it wrote itself, so freeing now is safe.
        pool.blocks.free([b for b in seq.blocks if b != NO_PAGE])
        pool.slots.free([seq.slot])
        seq.blocks, seq.slot, seq.finished, seq.table = [], -1, True, None
        pool.running.remove(seq)
        self._finished[seq.request_id] = Result(seq.request_id, tuple(seq.prompt), tuple(seq.output), reason,
                                                scheme_name(seq.cfg), error)

    def _accept(self, pool: CachePool, seq: _Seq, token: int) -> None:
        seq.output.append(token)
        if token in seq.stop_ids:
            self._finish(pool, seq, "stop")
        elif len(seq.output) >= seq.params.max_new_tokens or seq.length >= self.max_model_len:
            self._finish(pool, seq, "length")

    # ------------------------------------------------------------------ batches
    def _slots(self, seq: _Seq, positions: np.ndarray) -> np.ndarray:
        bs = self.block_size
        blk = seq.table[positions // bs]
        return np.where(blk == NO_PAGE, NO_PAGE, blk * bs + positions % bs).astype(np.int32)

    def _meta(self, rows: list, cols: int, table: bool = True):
        """Packed per-row metadata: int32 [n, cols + W] (block table last) and float32 [n, 2]."""
        n, w = len(rows), self.max_blocks_per_seq
        meta = np.zeros((n, cols + w), np.int32)
        fmeta = np.zeros((n, 2), np.float32)
        fmeta[:, 1] = 1.0
        real = [i for i, s in enumerate(rows) if s is not None]
        if real:
            meta[real, cols:] = np.stack([rows[i].table for i in real])
            fmeta[real] = [(rows[i].params.temperature, rows[i].params.top_p) for i in real]
        return meta, fmeta

    def _take(self, seq: _Seq) -> int:
        """Prompt tokens of `seq` in its next chunk: at most prefill_chunk, and a chunk never ends
        inside a block unless the prompt does (whole blocks of prefill_chunk rounded down to a
        multiple of block_size, or, below one block, up to the next block boundary), so that each
        block's tokens reach the caches in one store (`ModelRunner.store`)."""
        left, bs = len(seq.prompt) - seq.computed, self.block_size
        if self.prefill_chunk >= bs:
            return min(left, self.prefill_chunk // bs * bs)
        return min(left, self.prefill_chunk, bs - seq.computed % bs)

    def _prefill(self, pool: CachePool) -> list:
        todo = [s for s in pool.running if s.computed < len(s.prompt)][: self.prefill_batch]
        if not todo:
            return []
        takes = [self._take(s) for s in todo]
        p = _pow2(len(todo))
        c = min(_pow2(max(takes + [16])), self.prefill_chunk)
        bs = self.block_size
        tokens = np.zeros((p, c), np.int32)
        slots = np.full((p, c), -1, np.int32)
        rows = todo + [None] * (p - len(todo))
        meta, fmeta = self._meta(rows, len(PREFILL_COLS))
        col = {n: i for i, n in enumerate(PREFILL_COLS)}
        pieces = -(-c // bs)
        store = np.full((pieces, p * bs, 3), -1, np.int32)   # per piece: slot, sequence slot, position per token
        store[:, :, 1:] = 0
        commits = np.full((pieces, p, 3), -1, np.int32)      # per piece: the block each row completes
        commits[:, :, 1:] = 0
        finishing = []  # whether the row's sampled token is its first generated one
        for i, (s, t) in enumerate(zip(todo, takes)):
            pos = np.arange(s.computed, s.computed + t, dtype=np.int32)
            tokens[i, :t] = s.prompt[s.computed:s.computed + t]
            slots[i, :t] = self._slots(s, pos)
            for j in range(-(-t // bs)):
                part = slice(j * bs, min(t, (j + 1) * bs))
                n = part.stop - part.start
                store[j, i * bs:i * bs + n] = np.stack([slots[i, part], np.full(n, s.slot), pos[part]], axis=1)
                last = int(pos[part.stop - 1])
                if pool.quantized and last % bs == bs - 1 and s.blocks[last // bs] != NO_PAGE:
                    commits[j, i] = (s.blocks[last // bs], s.slot, last - bs + 1)
            done = s.computed + t == len(s.prompt)
            meta[i, [col["seq_ids"], col["start"], col["last"], col["finishes"], col["seeds"], col["steps"]]] = (
                s.slot, s.computed, t - 1, int(done), s.seed32, 0)
            s.computed += t
            if done:
                s.scheduled = 1
            finishing.append(done)
        tok, pool.last_tokens, kp, vp = self.runner.prefill(pool.caches, pool.last_tokens, tokens, slots, meta, fmeta)
        tok.copy_to_host_async()  # as in `_decode`
        for j in range(pieces):
            if (store[j, :, 0] != -1).any():
                pool.caches = self.runner.store(pool.caches, kp[j], vp[j], store[j], commits[j])
        self.stats.prefill_tokens += sum(takes)
        self.stats.prefill_calls += 1
        return [(pool, todo, tok, "prefill", finishing)]

    def _decode(self, pool: CachePool, todo: list) -> list:
        b = _pow2(len(todo))
        rows = todo + [None] * (b - len(todo))
        meta, fmeta = self._meta(rows, len(DECODE_COLS))
        meta[:, DECODE_COLS.index("slots")] = -1
        bs = self.block_size
        commits, cols = [], []
        for s in todo:
            pos = len(s.prompt) + s.scheduled - 1  # the last generated token is written now
            blk = s.blocks[pos // bs]  # one position: `_slots` without its array round trip
            cols.append((pos, NO_PAGE if blk == NO_PAGE else blk * bs + pos % bs, s.slot, s.seed32, s.scheduled))
            # its block is full after this step and has a page to be quantized into
            if pool.quantized and pos % bs == bs - 1 and blk != NO_PAGE:
                commits.append((blk, s.slot, pos - bs + 1))
            s.scheduled += 1
        meta[:len(todo), :len(DECODE_COLS)] = cols  # one conversion for the batch
        tok, pool.caches, pool.last_tokens = self.runner.decode(pool.caches, pool.last_tokens, meta, fmeta)
        # the tokens' copy to the host queued behind the step now, not when they are collected a
        # step later (H100, SmolLM2 32 x 2K: collecting 0.22-0.35 ms instead of 0.38-0.58 in
        # engine_step_ab; generate.py's step unchanged)
        tok.copy_to_host_async()
        if commits:
            blocks = np.full((_pow2(len(commits)), 3), -1, np.int32)
            blocks[:len(commits)] = commits
            blocks[len(commits):, 1:] = 0
            pool.caches = self.runner.commit(pool.caches, blocks)
            self.stats.commit_calls += 1
        return [(pool, todo, tok, "decode", [True] * len(todo))]

    def _generating(self, pool: CachePool) -> list:
        """Sequences whose next token can be computed now: prompt in the cache, a token sampled, not
        finished (as far as the host knows), and room left."""
        return [s for s in pool.running if s.computed == len(s.prompt) and s.scheduled >= 1 and not s.finished
                and s.scheduled < s.params.max_new_tokens and len(s.prompt) + s.scheduled < self.max_model_len]

    # ------------------------------------------------------------------ driving
    def _collect(self, launched: list, kind: str, dispatched_at: float, compiled_at: float) -> None:
        """Receive a step's sampled tokens (waits for the device) and account its time: the interval
        since the previous step's tokens arrived (or since this step's dispatch, after idling), less
        the compilation done in it (compiling happens on the host while dispatching)."""
        arrived = [np.asarray(entry[2]).tolist() for entry in launched]  # [2, rows]: tokens, non-finite flags
        now, compiled = time.perf_counter(), self.runner.stats.compile_s
        start, start_compiled = ((dispatched_at, compiled_at) if self._last_arrival is None
                                 else self._last_arrival)
        dt = max(0.0, now - start - (compiled - start_compiled))
        self._last_arrival = (now, compiled)
        if kind == "prefill":
            self.stats.prefill_s += dt
        else:
            self.stats.decode_s += dt
        for (pool, rows, _, call, takes), (toks, bad) in zip(launched, arrived):
            self.stats.decode_calls += call == "decode" and kind == "decode"
            for seq, t, b, take in zip(rows, toks, bad, takes):
                if seq.finished:
                    continue
                if b:
                    where = "its prompt" if call == "prefill" else f"output token {len(seq.output)}"
                    self._finish(pool, seq, "error", f"the model produced a NaN or Inf key or value while "
                                 f"processing {where}; it was stored as zeros (no other request is affected) "
                                 "and the request stopped")
                elif take:
                    self._accept(pool, seq, t)
                    if call == "decode" and kind == "decode":
                        self.stats.decode_tokens += 1
                    elif call == "decode":
                        self.stats.mixed_decode_tokens += 1

    def _drain(self) -> None:
        if self._inflight:
            launched, kind, at, compiled_at = self._inflight
            self._inflight = []
            self._collect(launched, kind, at, compiled_at)
            if self.debug:
                self._check_drops()

    def _check_drops(self) -> None:
        """debug: RuntimeError if a pool's caches did not store tokens as given, beyond the non-finite
        ones (reported per request). Reads the latest caches: waits for every dispatched step."""
        for key, pool in self.pools.items():
            unexplained = int(pool.caches.dropped_tokens) - int(jnp.sum(pool.caches.nonfinite))
            if unexplained > self._unexplained_drops.get(key, 0):
                raise RuntimeError(
                    f"debug: the {scheme_name(key)} cache did not store {unexplained - self._unexplained_drops.get(key, 0)} "
                    "(token, layer) write(s) as given in the last step: invalid slots, sequence ids or positions "
                    "(an engine bug), more completed blocks than a call's bound, or values beyond what the cache "
                    "can hold (kvarn_jax.storage: e.g. a float16 KVarN token of L2 norm above 65,504)")
            self._unexplained_drops[key] = unexplained

    def step(self) -> list[Result]:
        """Admit, dispatch one prefill and one decode call per pool with work, then receive the
        previous step's tokens; returns the requests that finished in this step."""
        before = set(self._finished)
        self._admit()
        pools = list(self.pools.values())
        decoding = {id(p): self._generating(p) for p in pools}
        at, c0 = time.perf_counter(), self.runner.stats.compile_s
        launched, kind = [], "decode"
        for pool in pools:
            pre = self._prefill(pool)
            if pre:
                kind = "prefill"
            launched += pre
        for pool in pools:
            if decoding[id(pool)]:
                launched += self._decode(pool, decoding[id(pool)])
        self._drain()
        if launched:
            self._inflight = (launched, kind, at, c0)
            self.stats.steps += 1
        else:
            self._last_arrival = None  # idle: the next step's time starts at its dispatch
        return [self._finished[i] for i in sorted(set(self._finished) - before)]

    def run(self) -> dict[int, Result]:
        """Step until every request has finished; returns all finished results by request id."""
        while self.has_unfinished():
            self.step()
        self._last_arrival = None
        return dict(self._finished)

    def pop_result(self, request_id: int) -> Result:
        return self._finished.pop(request_id)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 kv_cache_dtype=None) -> list[Result]:
        """Run a batch of prompts to completion; results in prompt order. All or nothing: every
        request is checked before any is queued, so a refused batch leaves no state behind."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        seqs = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                seqs.append(self._request(p, sp, kv_cache_dtype))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        existing = set(self.pools)
        try:
            for s in seqs:
                self._pool(s.cfg)  # every pool exists before anything is queued
        except Exception:
            for key in set(self.pools) - existing:  # nor does a pool created for the refused batch stay
                del self.pools[key]
            raise
        ids = [self._queue(s) for s in seqs]
        self.run()
        return [self.pop_result(i) for i in ids]
