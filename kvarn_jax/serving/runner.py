"""Runs a `Decoder` step by step over per-layer cache state: compiled once per shape, caches updated in place.

The model is split once into its weights (`nnx.Param`, shared by every cache pool) and per-layer
`KVCache` state (one set per pool/scheme). A step runs as: embed -> groups of `layers_per_call`
decoder layers -> final norm, logits and sampling, each a compiled function whose cache arguments
are donated, so the library's scatter writes update the cache buffers in place. One compiled
function serves every group of layers (all layers have the same structure), so compile time grows
with `layers_per_call`, not with depth; the price is one dispatch per group and step (negligible
next to a CPU step; on a GPU, small batches gain from more layers per call).

Per-layer schemes (a pool whose layers have different cache schemes): a group's layers run one after
the other inside its compiled function (unrolled, not a `lax.scan`), so layers of different schemes
can share a group. The cache schemes are part of the function's key, so each distinct sequence of
schemes in a group compiles once: with `layers_per_call=1`, one function per scheme; with larger
groups, one per distinct combination that occurs.

Compiled functions are compiled ahead of time (so `stats` reports compile time apart from run
time) and cached process-wide by the model's structure, `impl` and the argument shapes: engines
over models of the same architecture (e.g. the same weights under several engines) share them.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..attention.paged_decode import IMPLS
from ..cache import PagedKVCache
from ..config import KVQuantConfig
from ..models.llama import Decoder, DecodeBatch, KVCache, PrefillBatch
from .sampling import sample


_COMPILED: dict = {}       # (function, model structure, impl, argument shapes) -> executable
_COMPILED_MAX = 512        # oldest entries are dropped beyond this


@dataclasses.dataclass
class RunnerStats:
    compiles: int = 0
    compile_s: float = 0.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling inputs [B]: temperature, top_p, seed, step (index of the token generated)."""

    temperature: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray


class ModelRunner:
    def __init__(self, model: Decoder, *, layers_per_call: int | None = 1, impl: str = "auto"):
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a kvarn_jax.models.Decoder, got {type(model).__name__}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
        n = model.config.num_layers
        k = n if layers_per_call is None else layers_per_call
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n:
            raise ValueError(f"layers_per_call must be an int in [1, {n}] (or None = all layers), "
                             f"got {layers_per_call!r}")
        self.config = model.config
        self.dtype = model.dtype
        self.impl = impl
        self.layers_per_call = k
        self.stats = RunnerStats()
        self._model = model  # kept for cache creation only; the weights live in the split states
        model.attach_caches(None)
        self._embed_gd, self._embed = nnx.split(model.embed)
        self._norm_gd, self._norm = nnx.split(model.norm)
        self._head_gd, self._head = nnx.split(model.lm_head) if model.lm_head is not None else (None, None)
        self._inv_freq = model.inv_freq[...]
        self._layer_gd = None
        self._layers = []
        for layer in model.layers:
            gd, params, _ = nnx.split(layer, nnx.Param, KVCache)
            if self._layer_gd is None:
                self._layer_gd = gd
            elif gd != self._layer_gd:
                raise ValueError("decoder layers differ in structure; they must share one definition")
            self._layers.append(params)
        # everything the compiled functions close over besides their arguments
        self._structure = (self._layer_gd, self._embed_gd, self._norm_gd, self._head_gd, impl)

    @property
    def params(self) -> list:
        """The per-layer weight states (shared by every cache pool)."""
        return self._layers

    # ------------------------------------------------------------------ caches
    def new_caches(self, kv_cache_dtype, *, num_blocks: int, block_size: int, max_seqs: int,
                   calibration=None) -> list:
        """Fresh per-layer KVCache states: of one scheme, or of a per-layer sequence of schemes (one
        entry per decoder layer; every layer gets the same num_blocks, block_size and max_seqs)."""
        if isinstance(kv_cache_dtype, (str, KVQuantConfig)):
            caches = self._model.create_caches(kv_cache_dtype, num_blocks=num_blocks, block_size=block_size,
                                               max_seqs=max_seqs, calibration=calibration)
        else:
            schemes = [KVQuantConfig.parse(s) for s in kv_cache_dtype]
            n = self.config.num_layers
            if len(schemes) != n:
                raise ValueError(f"kv_cache_dtype has {len(schemes)} per-layer schemes but the model has "
                                 f"num_layers={n}")
            # One layer at a time, with the arguments Decoder.create_caches passes for every layer.
            caches = []
            for i, cfg in enumerate(schemes):
                if cfg.static and calibration is None:
                    raise ValueError(f"kv_cache_dtype layer {i}: {cfg.name} needs a calibration (static scales)")
                caches.append(PagedKVCache.create(
                    cfg, num_blocks=num_blocks, block_size=block_size, num_kv_heads=self.config.num_kv_heads,
                    head_dim=self.config.head_dim, max_seqs=max_seqs, dtype=self.dtype,
                    calibration=None if calibration is None else calibration.layer(i)))
        self._model.attach_caches(caches)
        # tree_map rebuilds the Variables, so detaching the model's own ones below leaves these intact
        states = jax.tree.map(lambda a: a, [nnx.state(layer, KVCache) for layer in self._model.layers])
        self._model.attach_caches(None)
        return states

    # ------------------------------------------------------------------ compiled pieces
    def _executable(self, name, fn, args, donate=()):
        structure = self._structure if name.startswith("decode") else self._structure[:-1]  # impl: decode only
        key = (name, structure, jax.tree.structure(args),
               tuple((x.shape, x.dtype) for x in jax.tree.leaves(args)))
        exe = _COMPILED.get(key)
        if exe is None:
            t = time.perf_counter()
            exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
            self.stats.compile_s += time.perf_counter() - t
            self.stats.compiles += 1
            if len(_COMPILED) >= _COMPILED_MAX:
                del _COMPILED[next(iter(_COMPILED))]
            _COMPILED[key] = exe
        return exe

    def _embed_fn(self, embed, tokens):
        return nnx.merge(self._embed_gd, embed)(tokens)

    def _layers_fn(self, kind):
        gd, impl = self._layer_gd, self.impl

        def run(params, caches, inv_freq, x, batch):
            new = []
            for p, c in zip(params, caches):
                layer = nnx.merge(gd, p, c)
                x = layer.prefill(x, batch, inv_freq) if kind == "prefill" else layer.decode(x, batch, inv_freq, impl)
                new.append(nnx.state(layer, KVCache))
            return x, tuple(new)
        return run

    def _head_fn(self, kind):
        def run(embed, norm, head, x, last, samp: SamplingArrays):
            if kind == "prefill":
                x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
            h = nnx.merge(self._norm_gd, norm)(x)
            if head is None:
                logits = nnx.merge(self._embed_gd, embed).attend(h)
            else:
                logits = jnp.dot(h, nnx.merge(self._head_gd, head).kernel[...], preferred_element_type=jnp.float32)
            logits = logits.astype(jnp.float32)
            return sample(logits, samp.temperature, samp.top_p, samp.seeds, samp.steps), logits
        return run

    def _run(self, kind, caches: list, batch, last, samp: SamplingArrays):
        samp = jax.tree.map(jnp.asarray, samp)
        batch = jax.tree.map(jnp.asarray, batch)
        args = (self._embed, batch.tokens)
        x = self._executable("embed", self._embed_fn, args)(*args)
        k = self.layers_per_call
        new, exes = [], {}
        for i in range(0, len(self._layers), k):
            group = tuple(caches[i:i + k])
            args = (tuple(self._layers[i:i + k]), group, self._inv_freq, x, batch)
            # Groups with the same cache structure (schemes are static in it) and shapes share one
            # executable: look it up once per distinct group, not per group (the full key flattens the weights).
            sig = (jax.tree.structure(group), tuple((a.shape, a.dtype) for a in jax.tree.leaves(group)))
            exe = exes.get(sig)
            if exe is None:
                exe = exes[sig] = self._executable(f"{kind}_layers", self._layers_fn(kind), args, donate=(1,))
            x, c = exe(*args)
            new.extend(c)
        args = (self._embed, self._norm, self._head, x, last, samp)
        tokens, logits = self._executable(f"{kind}_head", self._head_fn(kind), args)(*args)
        return tokens, logits, new

    def prefill(self, caches: list, batch: PrefillBatch, samp: SamplingArrays):
        """(next tokens [P] device array, logits [P, V], new caches); the given caches are donated."""
        return self._run("prefill", caches, batch, jnp.asarray(batch.last), samp)

    def decode(self, caches: list, batch: DecodeBatch, samp: SamplingArrays):
        """(next tokens [B] device array, logits [B, V], new caches); the given caches are donated."""
        return self._run("decode", caches, batch, jnp.zeros((), jnp.int32), samp)
