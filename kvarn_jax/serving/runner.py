"""Compiled whole-model steps: one executable per prefill chunk shape and per decode batch size, and
one that stores tokens and quantizes blocks.

`ModelRunner` splits a `Decoder` into its graph and weights once. Each step is one call of one
compiled function of (weights, caches, last tokens, packed metadata): the model (all layers: decode
as a Python loop over the layers on GPUs and TPUs, a `lax.scan` on CPUs whose products read per-layer
arrays through a `lax.switch`, `decode_loop`; either way layers with a KVarN cache multiply their
still-rotated attention output by an o_proj that holds the Hadamard rotation, `decode_kernels`;
prefill as a scan), the logits of the rows that need
them, sampling, and the sampled tokens stored into `last_tokens` - a per-sequence-slot device array
from which the next decode step reads its input tokens, so a step never waits for the host to learn
the previous step's tokens. The caches and
`last_tokens` are donated (updated in place). Host metadata travels as two or three packed arrays
per call.

Writes: a decode step scatters one token per sequence into high-precision storage (into the ring
only, when the host sees every row past its sink: `DecodeBatch.past_sink`). A prefill call
only reads the caches and returns its chunk's keys and values in block-sized pieces, which `store`
writes one piece at a time (the tokens staged, then the blocks they complete quantized); the blocks
a decode step completes are quantized by the same executable with no tokens (`commit`; the engine
knows from positions alone when one is due: about once per `block_size` steps per sequence). The
quantization - most of what a quantized cache adds to compilation - is thus compiled once per
(rows, blocks) size, not once per chunk length. Nothing in a step branches on device data (whether
any row samples is a static choice of the host's), so the host never waits for the device inside
a step.

Executables are compiled ahead of time (so `stats` reports compile time apart from run time) and
cached process-wide by the model's structure, `impl` and the argument shapes and dtypes: engines
over models of the same architecture share them. On CPUs `store` and `commit`, which run a few
times per block_size tokens, are compiled at XLA's backend optimization level 1 (`store_options`):
on CPUs they then compile faster and run about as fast.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ..attention.paged_decode import IMPLS
from ..cache.layers import LayerCaches
from ..cache.paged import carries_token
from ..cache import sharding as cache_sharding
from ..cache.sharding import HeadParallel
from ..hadamard import rotate_rows
from ..models.llama import LAYER_LOOPS, Decoder, DecodeBatch, PrefillBatch, head_parallel_specs, store_tokens
from .sampling import sample_rows

_COMPILED: dict = {}       # (kind, model structure, impl, static args, argument shapes) -> executable
_COMPILED_MAX = 256        # oldest entries are dropped beyond this


def store_options() -> dict | None:
    """XLA compile options of the `store`/`commit` executable: backend optimization level 1 on CPUs
    (default 2), unless XLA_FLAGS sets the level for every executable; None elsewhere."""
    if jax.default_backend() != "cpu" or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return None
    return {"xla_backend_optimization_level": 1}


# Column layout of the packed per-row int32 metadata (block table columns follow).
DECODE_COLS = ("positions", "slots", "seq_ids", "seeds", "steps")
PREFILL_COLS = ("seq_ids", "start", "last", "finishes", "seeds", "steps")


@dataclasses.dataclass
class RunnerStats:
    compiles: int = 0
    compile_s: float = 0.0


class _HashedOnce:
    """A key part whose hash is computed once: hashing a model's graph definition took ~40 us, on
    every step's executable lookup."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, _HashedOnce) and self._hash == other._hash and self.value == other.value)


def _u32(a):
    """Seeds travel as int32 bit patterns (the packed array is int32); back to uint32."""
    return jax.lax.bitcast_convert_type(a, jnp.uint32)


def _nonfinite(caches: LayerCaches, seq_ids):
    """Per row: the non-finite (token, layer) writes its sequence slot has had (`LayerCaches.nonfinite`)."""
    return caches.nonfinite[jnp.clip(seq_ids, 0, caches.max_seqs - 1)]


def _with_flags(tok, bad):
    """What a step returns for the host: int32 [2, B], the sampled tokens and, per row, 1 if its keys
    or values were non-finite in this step (one array: one transfer per step)."""
    return jnp.stack([tok.astype(jnp.int32), bad.astype(jnp.int32)])


class ModelRunner:
    """Compiled prefill / decode / commit steps of one `Decoder` (weights shared by every cache)."""

    def __init__(self, model: Decoder, *, impl: str = "auto", decode_loop: str = "auto",
                 tp: HeadParallel | None = None):
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a kvarn_jax.models.Decoder, got {type(model).__name__}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
        if decode_loop not in ("auto",) + LAYER_LOOPS:
            raise ValueError(f"decode_loop must be one of {['auto', *LAYER_LOOPS]}, got {decode_loop!r}")
        self.config = model.config
        self.dtype = model.dtype
        self.impl = impl
        self.stats = RunnerStats()
        self._model = model  # for cache creation
        self.tp = tp
        self._graphdef, self._weights = nnx.split(model)
        if tp is not None:  # each device holds its heads' and MLP units' part of the weights
            tp.check(model.config)
            self._weights = jax.device_put(self._weights, self._named(head_parallel_specs(model, tp.axis)))
        # GPUs read each layer's statically sliced weights in place. XLA's CPU backend copies a slice
        # (static or dynamic) before a matrix product, and compiles one loop body much faster than a
        # body per layer: there a scan whose products pick per-layer arrays with a lax.switch
        # ("switch": those arrays are a second copy of the layers' matrices, made here once).
        if decode_loop == "switch" and tp is not None:
            raise ValueError("decode_loop='switch' runs on one device; use 'scan' or 'unroll' with tensor_parallel")
        cpu = jax.default_backend() == "cpu"
        self.decode_loop = decode_loop if decode_loop != "auto" else (
            ("switch" if tp is None else "scan") if cpu else "unroll")
        self._kernels = model.layer_kernels() if self.decode_loop == "switch" else None
        self._rotated_kernels: dict = {}  # rotated layers -> `_kernels` with their o_proj rotated
        self._structure = _HashedOnce((self._graphdef, impl, self.decode_loop, tp))
        self._zeros: dict = {}  # (tokens, dtype) -> zero k/v pieces (`commit`)
        self._signatures: dict = {}  # id -> `_signature` of the weights and per-layer matrices

    @property
    def weights(self):
        """The model's state (every parameter; shared by every cache pool)."""
        return self._weights

    def _named(self, specs):
        return jax.tree.map(lambda s: NamedSharding(self.tp.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    def new_caches(self, kv_cache_dtype, *, num_blocks: int, block_size: int, max_seqs: int,
                   calibration=None) -> LayerCaches:
        """Empty caches of every layer (one scheme, or a sequence of one per layer); under tensor
        parallelism created directly split over the devices (never whole on one)."""
        def make():
            return self._model.new_caches(kv_cache_dtype, num_blocks=num_blocks, block_size=block_size,
                                          max_seqs=max_seqs, calibration=calibration)
        if self.tp is None:
            return make()
        return jax.jit(make, out_shardings=cache_sharding.shardings(jax.eval_shape(make), self.tp.mesh,
                                                                       self.tp.axis))()

    def new_tokens(self, max_seqs: int):
        """The per-slot last-token array (replicated under tensor parallelism)."""
        z = jnp.zeros((max_seqs,), jnp.int32)
        return z if self.tp is None else jax.device_put(z, NamedSharding(self.tp.mesh, P()))

    # ------------------------------------------------------------------ compiled functions
    def _signature(self, arg):
        """(tree structure, leaf shapes and dtypes) of one argument: computed once for the runner's
        own weights and per-layer matrices (flattening the weights' variables on every step's
        lookup took ~60 us of a GPU step's host time), on each call for the rest."""
        own = arg is self._weights or (arg is not None and (arg is self._kernels or any(
            arg is k for k in self._rotated_kernels.values())))
        sig = self._signatures.get(id(arg)) if own else None
        if sig is None:
            sig = (jax.tree.structure(arg), tuple((x.shape, x.dtype) for x in jax.tree.leaves(arg)))
            if own:  # these objects live as long as the runner, so their ids are not reused
                self._signatures[id(arg)] = sig
        return sig

    def _executable(self, kind: str, fn, args, donate=(), static=(), options=None):
        key = (kind, self._structure, static, tuple(self._signature(a) for a in args))
        exe = _COMPILED.get(key)
        if exe is None:
            t = time.perf_counter()
            exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile(compiler_options=options)
            self.stats.compile_s += time.perf_counter() - t
            self.stats.compiles += 1
            if len(_COMPILED) >= _COMPILED_MAX:
                del _COMPILED[next(iter(_COMPILED))]
            _COMPILED[key] = exe
        return exe

    def decode_kernels(self, layer_schemes) -> tuple:
        """(per-layer matrices, whether their o_proj holds the rotation) a decode step of caches with
        these per-layer schemes reads. The o_proj matrices of the layers with a rotated (KVarN) cache
        are replaced by ones that hold the rotation (`hadamard.rotate_rows`; made once per set of
        such layers): their attention output is then not unrotated, one matrix product and its clip
        fewer per layer and step. Under "switch" they replace those of the per-layer copy the loop
        reads anyway; under "unroll" they are a copy of those layers' o_proj next to the weights
        (`rotated_bytes`: 1 GiB for Llama-3-8B in bf16), read instead of the originals, so a step
        reads as many bytes. "scan" (CPUs under tensor parallelism) unrotates."""
        rotated = tuple(c.rotated for c in layer_schemes)
        if self.decode_loop == "scan" or not any(rotated):
            return self._kernels, False
        kernels = self._rotated_kernels.get(rotated)
        if kernels is None:
            d = self.config.head_dim
            if self._kernels is not None:
                kernels = {**self._kernels, "attn.o_proj": tuple(
                    rotate_rows(a, d) if r else a for a, r in zip(self._kernels["attn.o_proj"], rotated))}
            else:
                o = self._weights["layers"]["attn"]["o_proj"]["kernel"][...]
                place = (lambda a: a) if self.tp is None else functools.partial(  # a layer's slice, placed as o
                    jax.device_put, device=self._named(P(*o.sharding.spec[1:])))
                kernels = {"attn.o_proj": tuple(place(rotate_rows(o[i], d)) if r else None
                                                for i, r in enumerate(rotated))}
            self._rotated_kernels[rotated] = kernels
        return kernels, True

    def drop_rotations(self, keep) -> None:
        """Free the rotated o_proj matrices that no caches with per-layer schemes in `keep` (an iterable of
        `layer_schemes`) read."""
        kept = {tuple(c.rotated for c in schemes) for schemes in keep}
        for rotated in set(self._rotated_kernels) - kept:
            del self._rotated_kernels[rotated]

    def rotated_bytes(self) -> int:
        """Bytes of the rotated o_proj matrices held next to the weights (`decode_kernels`)."""
        own = {id(a) for a in self._kernels["attn.o_proj"]} if self._kernels is not None else set()
        return sum(a.nbytes for k in self._rotated_kernels.values() for a in k["attn.o_proj"]
                   if a is not None and id(a) not in own)

    def _decode_fn(self, weights, caches, last_tokens, meta, fmeta, kernels, *, sampled: bool, past_sink: bool,
                   rotated_o_proj: bool):
        model = nnx.merge(self._graphdef, weights)
        cols = {n: meta[:, i] for i, n in enumerate(DECODE_COLS)}
        live = carries_token(cols["slots"])
        seq = cols["seq_ids"]
        batch = DecodeBatch(tokens=last_tokens[jnp.clip(seq, 0, last_tokens.shape[0] - 1)],
                            positions=cols["positions"], slot_mapping=cols["slots"], seq_ids=seq,
                            block_tables=meta[:, len(DECODE_COLS):], past_sink=past_sink,
                            rotated_o_proj=rotated_o_proj)
        before = _nonfinite(caches, seq)
        logits, caches = model.decode(caches, batch, impl=self.impl, commit=False, layer_loop=self.decode_loop,
                                      tp=self.tp, kernels=kernels)
        tok = sample_rows(logits, fmeta[:, 0], fmeta[:, 1], _u32(cols["seeds"]), cols["steps"], sampled)
        last_tokens = last_tokens.at[jnp.where(live, seq, last_tokens.shape[0])].set(tok, mode="drop")
        return _with_flags(tok, live & (_nonfinite(caches, seq) > before)), caches, last_tokens

    def _prefill_fn(self, weights, caches, last_tokens, tokens, slots, meta, fmeta, *, sampled: bool):
        model = nnx.merge(self._graphdef, weights)
        cols = {n: meta[:, i] for i, n in enumerate(PREFILL_COLS)}
        p, c = tokens.shape
        batch = PrefillBatch(tokens=tokens, positions=cols["start"][:, None] + jnp.arange(c, dtype=jnp.int32)[None],
                             slot_mapping=slots, seq_ids=cols["seq_ids"], block_tables=meta[:, len(PREFILL_COLS):],
                             start=cols["start"], last=cols["last"])
        logits, (k, v) = model.prefill_kv(caches, batch, layer_loop="scan", tp=self.tp)
        tok = sample_rows(logits, fmeta[:, 0], fmeta[:, 1], _u32(cols["seeds"]), cols["steps"], sampled)
        # a row whose prompt ends in this chunk hands its first generated token to the decode steps
        idx = jnp.where(cols["finishes"] > 0, cols["seq_ids"], last_tokens.shape[0])
        # what the caches' `nonfinite` count will say once the chunk is stored (`store_tokens`)
        finite = jnp.all(jnp.isfinite(k), axis=(0, 3, 4)) & jnp.all(jnp.isfinite(v), axis=(0, 3, 4))  # [P, C]
        bad = jnp.any(carries_token(slots) & ~finite, axis=1) & (cols["seq_ids"] >= 0) & (cols["seq_ids"] < caches.max_seqs)
        bs = caches.block_size
        return _with_flags(tok, bad), last_tokens.at[idx].set(tok, mode="drop"), self._pieces(k, bs), self._pieces(v, bs)

    def _pieces(self, x, bs: int):
        """[layers, P, C, Hk, D] -> the chunk's block_size-token pieces, each [layers, P * block_size, Hk, D]
        (C padded to a multiple of block_size): what `store` takes."""
        n, p, c = x.shape[:3]
        x = jnp.pad(x, ((0, 0), (0, 0), (0, -c % bs), (0, 0), (0, 0)))
        out = tuple(x[:, :, i * bs:(i + 1) * bs].reshape((n, p * bs) + x.shape[3:]) for i in range(x.shape[2] // bs))
        return tuple(self._kv_sharded(o) for o in out)

    def _kv_sharded(self, x):
        # token pieces and the zero pieces of `commit` have one placement: heads split, as the caches'
        return x if self.tp is None else jax.lax.with_sharding_constraint(x, self._named(P(None, None, self.tp.axis)))

    def _store_fn(self, caches, k, v, meta, blocks):
        return store_tokens(caches, k, v, meta[:, 0], meta[:, 1], meta[:, 2], blocks, tp=self.tp)

    # ------------------------------------------------------------------ steps
    def decode(self, caches: LayerCaches, last_tokens, meta: np.ndarray, fmeta: np.ndarray):
        """One decode step of every row: (int32 [2, B] device array - the sampled tokens, and 1 where
        the row's key or value was NaN/Inf in some layer (stored as zeros) -, caches, last_tokens).

        meta: int32 [B, 5 + W] - columns `DECODE_COLS` (seeds as int32 bit patterns), then the block
        table; fmeta: float32 [B, 2] temperature and top_p. The input token of each row is
        last_tokens[seq_id]. caches and last_tokens are donated. A step whose rows all lie past the
        caches' sinks (padding rows, slot -1, store nothing) runs an executable without the sinks'
        writes (`DecodeBatch.past_sink`)."""
        kernels, rotated = self.decode_kernels(caches.layer_schemes)
        args = (self._weights, caches, last_tokens, meta, fmeta, kernels)
        sampled = bool((fmeta[:, 0] > 0).any())
        past_sink = self._past_sink(caches, meta)
        fn = functools.partial(self._decode_fn, sampled=sampled, past_sink=past_sink, rotated_o_proj=rotated)
        return self._executable("decode", fn, args, donate=(1, 2), static=(sampled, past_sink, rotated))(*args)

    @staticmethod
    def _past_sink(caches: LayerCaches, meta: np.ndarray) -> bool:
        live = meta[:, DECODE_COLS.index("slots")] != -1
        return caches.sink_len > 0 and bool((meta[live, DECODE_COLS.index("positions")] >= caches.sink_len).all())

    def prefill(self, caches: LayerCaches, last_tokens, tokens: np.ndarray, slots: np.ndarray, meta: np.ndarray,
                fmeta: np.ndarray):
        """The model over one prefill chunk per row, reading the caches (not storing the chunk):
        (int32 [2, P]: tokens sampled from each row's last real token and the rows whose chunk had a
        NaN/Inf key or value, last_tokens, k pieces, v pieces). tokens, slots: int32 [P, C]; meta:
        int32 [P, 6 + W] - columns `PREFILL_COLS`, then the block table; fmeta: float32 [P, 2].
        last_tokens is donated. The pieces - ceil(C / block_size) arrays [layers, P * block_size, Hk,
        D], piece i holding tokens [i * block_size, (i + 1) * block_size) of each row's chunk - go to
        `store`, in order."""
        args = (self._weights, caches, last_tokens, tokens, slots, meta, fmeta)
        sampled = bool((fmeta[:, 0] > 0).any())
        fn = functools.partial(self._prefill_fn, sampled=sampled)
        return self._executable("prefill", fn, args, donate=(2,), static=(sampled,))(*args)

    def store(self, caches: LayerCaches, k, v, meta: np.ndarray, blocks: np.ndarray) -> LayerCaches:
        """Store tokens of every layer (k, v: a prefill piece; meta int32 [T, 3] = slot, sequence slot,
        position per token, slot -1 for padding) and quantize the blocks they complete (blocks int32
        [M, 3] = block id, sequence slot, first position; block id -1 for padding): `store_tokens`.
        One executable per (T, M) serves prefill chunks of every length. caches are donated."""
        args = (caches, k, v, meta, blocks)
        return self._executable("store", self._store_fn, args, donate=(0,), options=store_options())(*args)

    def commit(self, caches: LayerCaches, blocks: np.ndarray) -> LayerCaches:
        """Quantize completed blocks of every layer: blocks int32 [M, 3] = (block id, sequence slot,
        first position), block id -1 for padding, M a power of two. caches are donated."""
        args = self._commit_args(caches, blocks)
        return self._executable("store", self._store_fn, args, donate=(0,), options=store_options())(*args)

    def _commit_args(self, caches: LayerCaches, blocks: np.ndarray) -> tuple:
        """`store`'s arguments for quantizing `blocks` with no tokens. On CPUs, where compiling costs
        more than the work, the tokens are M blocks of padding, so the executable is the one that
        stores M rows' prefill pieces; elsewhere one padding token per block (staging M blocks of
        padding would cost each commit a pass over them)."""
        m = blocks.shape[0]
        tokens = m * caches.block_size if jax.default_backend() == "cpu" else m
        key = (tokens, self.dtype)
        z = self._zeros.get(key)
        if z is None:
            shape = (self.config.num_layers, tokens, self.config.num_kv_heads, self.config.head_dim)
            # from the host: a jitted constructor would be one more compile per engine
            z = np.zeros(shape, self.dtype)
            z = self._zeros[key] = jax.device_put(z) if self.tp is None else jax.device_put(
                z, self._named(P(None, None, self.tp.axis)))
        meta = np.full((tokens, 3), -1, np.int32)
        meta[:, 1:] = 0
        return caches, z, z, meta, blocks

    def precompile_decode(self, caches: LayerCaches, last_tokens, batch: int, table_width: int) -> None:
        """Compile (not run) the decode step of `batch` rows (with and without the sinks' writes) and the
        commits of up to `batch` blocks."""
        meta = np.zeros((batch, len(DECODE_COLS) + table_width), np.int32)
        kernels, rotated = self.decode_kernels(caches.layer_schemes)
        for past_sink in (False, True) if caches.sink_len else (False,):
            fn = functools.partial(self._decode_fn, sampled=False, past_sink=past_sink, rotated_o_proj=rotated)
            self._executable("decode", fn,
                             (self._weights, caches, last_tokens, meta, np.zeros((batch, 2), np.float32), kernels),
                             donate=(1, 2), static=(False, past_sink, rotated))
        m = 1
        while m <= batch:
            self._executable("store", self._store_fn, self._commit_args(caches, np.zeros((m, 3), np.int32)), donate=(0,),
                             options=store_options())
            m *= 2
