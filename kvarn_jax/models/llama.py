"""A Llama/Qwen2-family decoder in Flax NNX whose attention reads and writes kvarn-jax paged caches.

Architecture (what Llama, Mistral without sliding window, and Qwen2 share): token embedding, N
pre-norm blocks of RMSNorm -> GQA attention with RoPE (Qwen2: bias on q/k/v) -> residual, RMSNorm ->
SwiGLU MLP -> residual, final RMSNorm, LM head (tied to the embedding or not).

The decoder layers' weights are stacked (every parameter of `Decoder.layers` has a leading layer
axis), and the KV caches of all layers live outside the model in one `kvarn_jax.cache.LayerCaches`,
so a forward pass is a pure function of (weights, caches, batch) that `jax.jit` compiles whole:
- `prefill(caches, PrefillBatch)`: a chunk of prompt tokens for each of P sequences. A chunk's
  queries see the sequence's earlier tokens exactly as the cache serves them (`gather_dense`: the
  high-precision sink and partial tail, full blocks dequantized) plus the chunk's own keys and
  values causally; then the chunk is written (blocks it completes are quantized in the same call).
- `decode(caches, DecodeBatch)`: one token per sequence; stored in high precision first, then
  `paged_decode_attention` (impl "auto": the Pallas kernel on NVIDIA GPUs, the C++ kernel for KVarN
  caches on CPUs, the reference otherwise);
  blocks the batch completes are quantized by `LayerCaches.commit` (in the call, or by a serving
  engine when it knows they exist).
The layers run in a Python loop over static layer indices (each layer's weights are a static slice
of the stacked ones; on GPUs a `lax.scan` would copy every layer's weights per step) or, for
prefill with one scheme in every layer, a `lax.scan` (one layer compiled once; prefill is
compute-bound, so the weight copies cost little), or a scan whose matrix products pick their
layer's own array with a `lax.switch` ("switch", for XLA's CPU backend, which copies any slice
before a product). Norms, RoPE, softmax and logits are computed in
float32 whatever the model dtype; attention products take model-dtype operands with float32
accumulation, exactly float32 for float32 models.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..attention.paged_decode import IMPLS, paged_decode_attention
from ..cache.sharding import HeadParallel, on_heads
from ..cache.layers import LayerCaches
from ..cache.paged import carries_token
from ..hadamard import SAFE_ABS, rotate, unrotate
from ..storage import QUANT_MAX

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MODEL_DTYPES = ("float32", "bfloat16", "float16")


# ------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The architecture facts the JAX model needs, read from a Hugging Face `config.json`.

    rope_scaling: the HF rope parameters other than theta, as sorted (key, value) pairs so the config
    stays hashable; () means plain RoPE. eos_token_ids: every id that ends generation.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    model_type: str = "llama"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates channel pairs)")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; "
                             f"supported: {list(SUPPORTED_MODEL_TYPES)}")
        rope_type = dict(self.rope_scaling).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")

    @classmethod
    def from_hf(cls, d: Mapping, generation: Mapping | None = None) -> "LlamaConfig":
        """From a Hugging Face config dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters`); `generation` (generation_config.json) may add EOS ids."""
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config model_type {mt!r} is not a Llama/Qwen2-family model; supported: "
                             f"{list(SUPPORTED_MODEL_TYPES)}")
        if (d.get("use_sliding_window") or (mt == "mistral" and d.get("sliding_window"))
                or any(t != "full_attention" for t in d.get("layer_types") or ())):
            raise ValueError("sliding-window attention is not supported (the config enables it)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if d.get("rope_scaling"):
            rope.update(d["rope_scaling"])
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope["rope_type"] == "default":
            rope = {}
        eos = _ids(d.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            rope_scaling=tuple(sorted((k, _hashable(v)) for k, v in rope.items())),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or mt == "qwen2", o_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos)), model_type=mt)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "LlamaConfig":
        """From `config.json` in a HF checkpoint folder; `generation_config.json` adds EOS ids if present."""
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: not a Hugging Face checkpoint folder")
        gen = folder / "generation_config.json"
        return cls.from_hf(json.loads(path.read_text()), json.loads(gen.read_text()) if gen.is_file() else None)

    @property
    def num_params(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        qo = 2 * h * self.num_heads * d
        kv = 2 * h * self.num_kv_heads * d
        per_layer = qo + kv + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h


def _ids(x) -> tuple:
    return () if x is None else tuple(int(i) for i in x) if isinstance(x, (list, tuple)) else (int(x),)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


# Published architectures (from their config.json files), embedded so that benchmarks can build
# them with random weights where no checkpoint can be carried (e.g. a GPU machine without network).
# SmolLM2-135M(-Instruct) is also the default model's.
SMOLLM2_135M = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,), model_type="llama")
# Llama-3.1-8B: Llama 3's 8B architecture with its 128K-token RoPE scaling.
LLAMA3_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                  ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
    max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), model_type="llama")
QWEN25_7B = LlamaConfig(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
    head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, max_position_embeddings=32768,
    bos_token_id=151643, eos_token_ids=(151643, 151645), model_type="qwen2")
ARCHITECTURES = {"smollm2-135m": SMOLLM2_135M, "llama3-8b": LLAMA3_8B, "qwen2.5-7b": QWEN25_7B}


# ------------------------------------------------------------------------------------------ RoPE
def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """[head_dim/2] float32 inverse frequencies, with linear or llama3 scaling as the config says."""
    d = cfg.head_dim
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(np.float32)
    sc = dict(cfg.rope_scaling)
    kind = sc.get("rope_type", "default")
    if kind == "linear":
        inv = inv / np.float32(sc["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled).astype(np.float32)
    return inv


_HALF_SIGNS = np.array([[-1.0], [1.0]], np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """Rotate channel pairs (i, i + D/2) of x [..., H, D] by position * inv_freq (HF's rotate_half form):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as the halves times cos plus the halves swapped
    times (-sin, sin). Elementwise, with no concatenation of the halves, which XLA's GPU backend
    emits as a kernel of its own per projection."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq                  # [..., D/2]
    cos, sin = jnp.cos(ang)[..., None, None, :], jnp.sin(ang)[..., None, None, :]   # over heads and halves
    halves = x.astype(jnp.float32).reshape(x.shape[:-1] + (2, x.shape[-1] // 2))
    out = halves * cos + jnp.flip(halves, axis=-2) * (sin * _HALF_SIGNS)
    return out.reshape(x.shape).astype(x.dtype)


# ------------------------------------------------------------------------------------------ batches
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """A chunk of prompt tokens for each of P sequences, padded to C tokens (padding: slot -1, at the end).

    tokens, positions, slot_mapping: [P, C]. seq_ids: [P] sequence slots (rows of the caches'
    high-precision storage). block_tables: [P, W]. start: [P] tokens of the sequence already in the
    cache (the chunk's first position). last: [P] index in the chunk of the token whose logits are
    wanted (its last real token).
    """

    tokens: jnp.ndarray
    positions: jnp.ndarray
    slot_mapping: jnp.ndarray
    seq_ids: jnp.ndarray
    block_tables: jnp.ndarray
    start: jnp.ndarray
    last: jnp.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One token per sequence. tokens, positions, slot_mapping, seq_ids: [B]; block_tables: [B, W].

    Padding rows have slot -1 and seq_lens 0 (`positions` is then ignored). Static flags:
    past_sink: the caller knows that every row's position is at least the caches' `sink_len`, so
    the step writes no sink (`LayerCaches.stage`); a row that is not is dropped and counted, never
    stored. rotated_o_proj: the o_proj matrices of the layers whose cache is rotated (KVarN) hold
    the rotation (`hadamard.rotate_rows`), so those layers' attention output is left in the stored
    frame (`paged_decode_attention(rotated_output=True)`).
    """

    tokens: jnp.ndarray
    positions: jnp.ndarray
    slot_mapping: jnp.ndarray
    seq_ids: jnp.ndarray
    block_tables: jnp.ndarray
    past_sink: bool = dataclasses.field(default=False, metadata={"static": True})
    rotated_o_proj: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def seq_lens(self) -> jnp.ndarray:
        return jnp.where(carries_token(self.slot_mapping), self.positions + 1, 0).astype(jnp.int32)

    def completions(self, block_size: int, paged_from: int | None = None):
        """(block ids, sequence ids, first positions) [B] of the blocks this step's tokens complete
        (block id -1 elsewhere): the arguments of `LayerCaches.commit`. Blocks before `paged_from`
        (default block_size: a whole-block sink; `LayerCaches.paged_from`) are never quantized."""
        pos = self.positions.astype(jnp.int32)
        start = block_size if paged_from is None else paged_from
        done = (self.slot_mapping >= 0) & (pos % block_size == block_size - 1) & (pos >= start)
        return (jnp.where(done, self.slot_mapping // block_size, -1).astype(jnp.int32), self.seq_ids,
                (pos // block_size) * block_size)


# ------------------------------------------------------------------------------------------ modules
class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] (HF stores [out, in])."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs, std: float = 0.02):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32).astype(dtype) * std)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x, product=None):
        """product: None, or (x -> x @ this layer's kernel) from per-layer arrays (`layer_kernels`)."""
        y = jnp.dot(x, self.kernel[...]) if product is None else product(x)
        return y + self.bias[...] if self.bias is not None else y


def _picked(products, name):
    """The product that replaces a layer's own matrix `name` (products: None, or {name: x -> x @ A})."""
    return None if products is None else products.get(name)


class Embedding(nnx.Module):
    """Token embedding [vocab, hidden]; `attend` is the tied LM head (logits against the table)."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs, std: float = 0.02):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), jnp.float32).astype(dtype) * std)

    def __call__(self, tokens):
        return self.embedding[...][tokens]

    def attend(self, h):
        # contract the hidden axes directly: `h @ table.T` makes XLA's CPU backend copy the table
        return jax.lax.dot_general(h, self.embedding[...], (((h.ndim - 1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def _product(spec: str, a, b, dtype):
    """einsum with float32 results: exact float32 for float32 models (and on CPUs, whose XLA backend
    has no 16-bit products with float32 results), else operands in the model dtype (the matrix
    units' native input) with float32 accumulation."""
    if jnp.dtype(dtype) == jnp.float32 or jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


# Keys per step of prefill's streaming softmax over the cached context. A step's float32 scores
# (and their exponentials) are [P, Hq, C, tile]: at 1024, 2 GiB each for 32 sequences x 32 heads
# x a 512-token chunk, a small share of a GPU next to the weights and caches, while each step's two
# products stay large matrix products (~0.27 TFLOP at that shape) that dwarf the loop's own cost.
PREFILL_KEY_TILE = 1024


def key_tiles(length: int, key_tile: int = PREFILL_KEY_TILE) -> tuple[int, int]:
    """(n, tile): the L = `length` cached positions cut into n = ceil(L / key_tile) tiles of one
    shape, ceil(L / n) rounded up to a multiple of 8 (L itself when L <= key_tile: a short context
    is not padded)."""
    n = max(1, -(-length // key_tile))
    per = -(-length // n)
    return n, min(length, -(-per // 8) * 8)


def _stream_cached(qc, read, length: int, start, scale: float, dtype, key_tile: int):
    """Online softmax of queries qc [P, C, Hk, G, D] over the cached keys and values, read a tile at a
    time (`paged.dense_tiles`: read(off, tile) -> K, V [P, Hk, tile, D] of positions off.. of the
    length L), of which row p's first start[p] positions are real: (running max m, denominator
    l: [P, Hk, G, C]; unnormalized output acc [P, Hk, G, C, D]), all float32 (m = -inf, l = acc
    = 0 where a row has no cached token).

    The L positions are cut into the `key_tiles` of one shape; the last tile lies at L - tile,
    overlapping its predecessor, whose positions it masks. Only the tiles holding some row's cached
    positions run (a first chunk runs none)."""
    p, c, hk, g, d = qc.shape
    n, tile = key_tiles(length, key_tile)

    def step(i, carry):
        m, l, acc = carry
        first = i * tile
        off = jnp.minimum(first, length - tile)
        kt, vt = read(off, tile)
        pos = off + jnp.arange(tile)
        seen = (pos[None, :] >= first) & (pos[None, :] < start[:, None])                  # [P, tile]
        s = _product("pchgd,phld->phgcl", qc, kt, dtype) * scale
        s = jnp.where(seen[:, None, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing seen yet: weights stay 0
        alpha = jnp.exp(m - base)
        e = jnp.exp(s - base[..., None])
        acc = acc * alpha[..., None] + _product("phgcl,phld->phgcd", e, vt, dtype)
        return m_new, l * alpha + jnp.sum(e, axis=-1), acc

    init = (jnp.full((p, hk, g, c), -jnp.inf, jnp.float32), jnp.zeros((p, hk, g, c), jnp.float32),
            jnp.zeros((p, hk, g, c, d), jnp.float32))
    tiles = jnp.clip(-(-jnp.max(start) // tile), 0, n)
    return jax.lax.fori_loop(0, tiles, step, init)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, std: float):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs, std=std)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs, std=std)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs, std=std)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_bias, dtype=dtype, rngs=rngs, std=std)

    def _qkv(self, x, positions, inv_freq, products=None):
        lead = x.shape[:-1]
        q = self.q_proj(x, _picked(products, "attn.q_proj")).reshape(lead + (self.num_heads, self.head_dim))
        k = self.k_proj(x, _picked(products, "attn.k_proj")).reshape(lead + (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x, _picked(products, "attn.v_proj")).reshape(lead + (self.num_kv_heads, self.head_dim))
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def prefill(self, x, caches: LayerCaches, layer, batch: PrefillBatch, inv_freq, tp=None, products=None):
        """x [P, C, hidden] -> ([P, C, hidden], (k, v) [P, C, Hk, D] to store: `Decoder.prefill` writes
        every layer's after the layers have run, so that no layer writes a cache it still reads)."""
        p, c, _ = x.shape
        q, k, v = self._qkv(x, batch.positions, inv_freq, products)
        g, j = caches.locate(layer)
        o = on_heads(tp, functools.partial(self._prefill_heads, group=g, dtype=x.dtype),
                      (caches, q, k, v, batch, j), ("caches", 2, 2, 2, "rep", "rep"), (2,))
        return self.o_proj(o.reshape(p, c, self.num_heads * self.head_dim).astype(x.dtype),
                           _picked(products, "attn.o_proj")), (k, v)

    @staticmethod
    def _prefill_heads(caches, q, k, v, batch, j, *, group, dtype, key_tile=PREFILL_KEY_TILE):
        """Attention of a chunk's queries (q [P, C, Hq, D]) over the cached tokens of layer (group,
        j) and the chunk's own k, v, for the heads these arrays hold. The cached context is read from
        the cache and streamed in tiles of at most `key_tile` keys (`_stream_cached`), so the float32
        keys, values and scores held at once are [P, Hk, tile, D] and [P, Hq, C, tile] (and [P, Hq,
        C, C] for the chunk), whatever the context length."""
        layer = (group, j)
        cache, _, _ = caches.layer_cache(layer)
        p, c, hq, d = q.shape
        hk = k.shape[2]
        scale = 1.0 / math.sqrt(d)
        qf = q.astype(jnp.float32).reshape(p, c, hk, hq // hk, d)
        # earlier tokens as the cache serves them (storage frame: rotated for KVarN)
        read, length = caches.dense_tiles(layer, batch.block_tables, batch.start, batch.seq_ids)
        qc = rotate(qf, max_abs=QUANT_MAX) if cache.cfg.rotated else qf
        m_c, l_c, acc_c = _stream_cached(qc, read, length, batch.start, scale, dtype, key_tile)
        # The chunk's own tokens, causally, as computed (padding sits after the real tokens, so real
        # queries never see it; padded queries see at least themselves and stay finite).
        s_self = _product("pchgd,pthd->phgct", qf, k, dtype) * scale
        causal = jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]                           # [C, C]
        s_self = jnp.where(causal, s_self, -jnp.inf)
        m_s = jnp.max(s_self, axis=-1)                      # finite: every query sees itself
        e_s = jnp.exp(s_self - m_s[..., None])
        # one softmax over both parts: each part's weights rescaled to the common max
        m = jnp.maximum(m_c, m_s)
        w_c, w_s = jnp.exp(m_c - m), jnp.exp(m_s - m)     # w_c = 0 where nothing was cached
        denom = l_c * w_c + jnp.sum(e_s, axis=-1) * w_s
        # the cached part normalized before it is unrotated, as the probabilities were
        o_cache = acc_c * (w_c / denom)[..., None]                                           # [P, Hk, G, C, D]
        o_cache = o_cache.transpose(0, 3, 1, 2, 4)                                           # [P, C, Hk, G, D]
        if cache.cfg.rotated:
            o_cache = unrotate(o_cache, max_abs=SAFE_ABS)
        o = o_cache + _product("phgct,pthd->pchgd", e_s * (w_s / denom)[..., None], v, dtype)
        return o.reshape(p, c, hq, d)

    def decode(self, x, caches: LayerCaches, layer, batch: DecodeBatch, inv_freq, impl: str, tp=None,
               products=None):
        """x [B, hidden] -> ([B, hidden], caches): stores the token's K/V in high precision (no block is
        quantized here), then attends over the cache."""
        b = x.shape[0]
        q, k, v = self._qkv(x, batch.positions, inv_freq, products)
        g, j = caches.locate(layer)
        o, caches = on_heads(tp, functools.partial(self._decode_heads, group=g, impl=impl),
                              (caches, q, k, v, batch, j), ("caches", 1, 1, 1, "rep", "rep"), (1, "caches"))
        return self.o_proj(o.reshape(b, self.num_heads * self.head_dim).astype(x.dtype),
                           _picked(products, "attn.o_proj")), caches

    @staticmethod
    def _decode_heads(caches, q, k, v, batch, j, *, group, impl):
        layer = (group, j)
        caches = caches.stage(layer, k, v, batch.slot_mapping, batch.seq_ids, batch.positions,
                              one_per_sequence=True, past_sink=batch.past_sink)  # one token per sequence
        cache, tables, sid = caches.read_view(layer, batch.block_tables, batch.seq_ids)
        # no value checks: under jit there are no values, and the ids come from the caller's scheduler
        o = paged_decode_attention(q, cache, tables, batch.seq_lens, seq_ids=sid, impl=impl, check_values=False,
                                   rotated_output=batch.rotated_o_proj)
        return o, caches


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, std: float):
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, bias=b, dtype=dtype, rngs=rngs, std=std)
        self.up_proj = Linear(h, i, bias=b, dtype=dtype, rngs=rngs, std=std)
        self.down_proj = Linear(i, h, bias=b, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, products=None):
        h = jax.nn.silu(self.gate_proj(x, _picked(products, "mlp.gate_proj"))) * self.up_proj(
            x, _picked(products, "mlp.up_proj"))
        return self.down_proj(h, _picked(products, "mlp.down_proj"))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, std: float):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, std=std)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, std=std)

    def prefill(self, x, caches, layer, batch, inv_freq, tp=None, products=None):
        a, kv = self.attn.prefill(self.input_norm(x), caches, layer, batch, inv_freq, tp, products)
        x = x + a
        return x + self.mlp(self.post_norm(x), products), kv

    def decode(self, x, caches, layer, batch, inv_freq, impl, tp=None, products=None):
        a, caches = self.attn.decode(self.input_norm(x), caches, layer, batch, inv_freq, impl, tp, products)
        x = x + a
        return x + self.mlp(self.post_norm(x), products), caches


LAYER_LOOPS = ("unroll", "scan", "switch")
# the matrices a "switch" loop takes as one array per layer (`Decoder.layer_kernels`)
LAYER_MATRICES = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                  "mlp.down_proj")


def _switch_products(kernels: Mapping, index) -> dict:
    """{name: x -> x @ kernels[name][index]} (index traced): a `lax.switch` whose branch i multiplies by
    array i, so the product reads that layer's array where it is (a dynamic slice of stacked
    weights is a copy on XLA's CPU backend)."""
    def product(x, name):
        arrays = kernels[name]
        branches = [functools.partial(_product_with, i=i) for i in range(len(arrays))]
        return jax.lax.switch(index, branches, x, arrays)
    return {name: functools.partial(product, name=name) for name in kernels}


def _layer_products(kernels: Mapping | None, i: int) -> dict | None:
    """{name: x -> x @ kernels[name][i]} for the matrices of layer i (a static index) that `kernels`
    replaces (an entry None keeps the layer's own matrix)."""
    if kernels is None:
        return None
    return {name: functools.partial(_product_with, arrays=arrays, i=i)
            for name, arrays in kernels.items() if arrays[i] is not None}


def _product_with(x, arrays, *, i):
    return jnp.dot(x, arrays[i])


def _stack_modules(modules) -> nnx.Module:
    """One module of the same definition whose every array has a leading axis over `modules`."""
    graphdef = nnx.graphdef(modules[0])
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(m) for m in modules]))


class Decoder(nnx.Module):
    """The causal LM. Build with random weights (`Decoder(cfg, rngs=...)`) or from a checkpoint
    (`kvarn_jax.models.load_model`). `dtype` is the weights' and activations' dtype. `layers` is one
    `DecoderLayer` whose parameters are stacked over the layers ([num_layers, ...]); `layer(i)` is
    layer i."""

    def __init__(self, cfg: LlamaConfig, *, dtype="float32", rngs: nnx.Rngs, init_std: float = 0.02):
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"cfg must be a LlamaConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.dtype = model_dtype(dtype)
        dt = jnp.dtype(self.dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dt, rngs=rngs, std=init_std)
        self.layers = _stack_modules([DecoderLayer(cfg, dtype=dt, rngs=rngs, std=init_std)
                                      for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dt, rngs=rngs, std=init_std)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))  # not a Param: never loaded

    # -------------------------------------------------------------- caches
    def new_caches(self, kv_cache_dtype, *, num_blocks: int, block_size: int, max_seqs: int,
                   calibration=None) -> LayerCaches:
        """Empty caches of every layer: one scheme, or a sequence of one per layer (sink/tail in the
        model dtype). calibration: a `kvarn_jax.Calibration` of every layer, for static schemes."""
        return LayerCaches.create(kv_cache_dtype, self.config.num_layers, num_blocks=num_blocks,
                                  block_size=block_size, num_kv_heads=self.config.num_kv_heads,
                                  head_dim=self.config.head_dim, max_seqs=max_seqs, dtype=self.dtype,
                                  calibration=calibration)

    def layer(self, i) -> DecoderLayer:
        """Decoder layer i: its slice of the stacked weights (a static slice for an int i)."""
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    def layer_kernels(self) -> dict:
        """{name: one array per layer} of the layers' matrices (`LAYER_MATRICES`): what the "switch"
        layer loop reads. New arrays (a copy of those matrices), made once by the caller."""
        _, state = nnx.split(self.layers)
        flat = {".".join(map(str, path)): a for path, a in nnx.to_flat_state(state)}
        return {name: tuple(jnp.array(a) for a in flat[f"{name}.kernel"][...]) for name in LAYER_MATRICES}

    # -------------------------------------------------------------- forward
    def logits(self, h):
        """float32 logits of final hidden states h [..., hidden]."""
        h = self.norm(h)
        if self.lm_head is None:
            return self.embed.attend(h).astype(jnp.float32)
        return jnp.dot(h, self.lm_head.kernel[...], preferred_element_type=jnp.float32).astype(jnp.float32)

    def _run_layers(self, kind: str, x, caches: LayerCaches, batch, layer_loop: str, *extra, kernels=None):
        # extra: (impl, tp) for decode, (tp,) for prefill
        """x through every decoder layer: a Python loop over static layer indices (one copy of the
        layer's program per layer; each layer's weights a static slice, which GPUs read in place) or
        a `lax.scan` over each run of layers that share a cache group (one copy of the program per
        run; each layer's weights dynamically sliced, which XLA copies) or "switch": that scan with
        the layer matrices taken from `kernels` (`layer_kernels`: one array per layer) by a
        `lax.switch` per product, which XLA's CPU backend reads in place. Decode layers update the
        caches; prefill layers only read them and return their (k, v), stacked over the layers."""
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {list(LAYER_LOOPS)}, got {layer_loop!r}")
        if layer_loop == "switch" and (kernels is None or set(kernels) != set(LAYER_MATRICES)):
            raise ValueError("layer_loop='switch' takes the per-layer matrices (kernels=model.layer_kernels())")
        if layer_loop == "scan" and kernels is not None:
            raise ValueError("layer_loop='scan' reads the stacked weights; kernels are for 'switch' and 'unroll'")
        inv = self.inv_freq[...]
        graphdef, state = nnx.split(self.layers)
        kvs = []
        for g, first, n in caches.runs():
            if layer_loop == "unroll" or n == 1:
                for i in range(first, first + n):
                    # a one-layer run under "switch" reads that layer's arrays directly (a static slice
                    # of the stacked weights would be copied too)
                    products = _layer_products(kernels, i)
                    x, out = getattr(self.layer(i), kind)(x, caches, i, batch, inv, *extra, products=products)
                    if kind == "decode":
                        caches = out
                    else:
                        kvs.append(jax.tree.map(lambda a: a[None], out))
                continue
            weights = jax.tree.map(lambda a: a[first:first + n], state)  # the matrices' slices unused under "switch"
            j0 = caches.layer_index[first]
            run = None if kernels is None else {name: tuple(a[first:first + n]) for name, a in kernels.items()}

            def products(i, run=run):
                return None if run is None else _switch_products(run, i)
            if kind == "decode":
                def body(carry, xs, g=g, products=products):
                    x, caches = carry
                    params, j, i = xs
                    return nnx.merge(graphdef, params).decode(x, caches, (g, j), batch, inv, *extra,
                                                              products=products(i)), None
                x, caches = jax.lax.scan(body, (x, caches), (weights, j0 + jnp.arange(n), jnp.arange(n)))[0]
            else:
                def read(x, xs, g=g, products=products):  # prefill: the caches are read only, not carried
                    params, j, i = xs
                    return nnx.merge(graphdef, params).prefill(x, caches, (g, j), batch, inv, *extra,
                                                               products=products(i))
                x, kv = jax.lax.scan(read, x, (weights, j0 + jnp.arange(n), jnp.arange(n)))
                kvs.append(kv)
        if kind == "decode":
            return x, caches
        return x, jax.tree.map(lambda *a: jnp.concatenate(a), *kvs)

    def prefill(self, caches: LayerCaches, batch: PrefillBatch, *, all_logits: bool = False,
                layer_loop: str = "scan", tp: HeadParallel | None = None, kernels=None):
        """(logits [P, V] of each row's `last` token (or [P, C, V] with all_logits), updated caches).
        layer_loop: "scan" (default; with per-layer schemes always a loop), "unroll" or "switch" (with
        kernels=`layer_kernels()`). tp: run tensor-parallel over a mesh (weights and caches placed as
        `head_parallel_specs` says)."""
        logits, (k, v) = self.prefill_kv(caches, batch, all_logits=all_logits, layer_loop=layer_loop, tp=tp,
                                         kernels=kernels)
        p, c = batch.tokens.shape
        n, hk, d = self.config.num_layers, self.config.num_kv_heads, self.config.head_dim
        # every layer's chunk stored in one write after the layers ran; at most ceil(C / block_size)
        # blocks complete per sequence in a chunk of C positions
        def write(caches, k, v, slots, seq_ids, positions):
            return caches.write_all(k, v, slots, seq_ids, positions, max_completed=p * -(-c // caches.block_size))
        caches = on_heads(tp, write, (caches, k.reshape(n, p * c, hk, d), v.reshape(n, p * c, hk, d),
                                       batch.slot_mapping.reshape(-1), jnp.repeat(batch.seq_ids, c),
                                       batch.positions.reshape(-1)),
                           ("caches", 2, 2, "rep", "rep", "rep"), ("caches",))
        return logits, caches

    def prefill_kv(self, caches: LayerCaches, batch: PrefillBatch, *, all_logits: bool = False,
                   layer_loop: str = "scan", tp: HeadParallel | None = None, kernels=None):
        """`prefill` without storing the chunk: (logits, (k, v) [layers, P, C, Hk, D] to store, e.g. by
        `store_tokens`). The caches are only read."""
        self._check_caches(caches)
        x, (k, v) = self._run_layers("prefill", self.embed(batch.tokens), caches, batch, layer_loop, tp,
                                     kernels=kernels)
        if not all_logits:
            x = jnp.take_along_axis(x, batch.last[:, None, None], axis=1)[:, 0]
        return self.logits(x), (k, v)

    def decode(self, caches: LayerCaches, batch: DecodeBatch, *, impl: str = "auto", commit: bool = True,
               layer_loop: str = "unroll", tp: HeadParallel | None = None, kernels=None):
        """(logits [B, V] of the next token of each row, updated caches).

        commit: quantize the blocks this batch completes before returning (a fixed batch of B, so
        every call pays for B blocks). A serving engine that knows which blocks complete passes
        False and calls `LayerCaches.commit` itself, only when some do.
        layer_loop: "unroll" (default: GPUs read each layer's weights in place), "scan" (compiles
        faster; XLA copies each layer's weights) or "switch" (a scan reading the per-layer arrays
        `kernels=layer_kernels()` in place: XLA's CPU backend). Under "unroll", kernels may replace
        some layers' matrices: {name: one array or None per layer} (None: the layer's own).
        tp: as in `prefill`.
        """
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
        self._check_caches(caches)
        # the layers' writes counted once for the step (`LayerCaches.open_tally`)
        caches = caches.open_tally(batch.tokens.shape[0])
        x, caches = self._run_layers("decode", self.embed(batch.tokens), caches, batch, layer_loop, impl, tp,
                                     kernels=kernels)
        caches = caches.close_tally(batch.slot_mapping, batch.seq_ids)
        if commit:
            caches = commit_blocks(caches, *batch.completions(caches.block_size, caches.paged_from), tp=tp)
        return self.logits(x), caches

    def _check_caches(self, caches) -> None:
        if not isinstance(caches, LayerCaches):
            raise TypeError(f"caches must be a kvarn_jax.cache.LayerCaches (Decoder.new_caches), got "
                            f"{type(caches).__name__}")
        if caches.num_layers != self.config.num_layers:
            raise ValueError(f"caches hold {caches.num_layers} layers; the model has {self.config.num_layers}")


def store_tokens(caches: LayerCaches, k, v, slot_mapping, seq_ids, positions, blocks, *,
                 tp: HeadParallel | None = None) -> LayerCaches:
    """Store tokens of every layer without quantizing (`LayerCaches.stage`: k, v [layers, T, Hk, D];
    slot_mapping, seq_ids, positions [T]), then quantize the completed blocks `blocks` int32 [M, 3] =
    (block id, sequence slot, first position), block id -1 for padding (`LayerCaches.commit`).

    Tokens of a block must reach the ring before the block is quantized from it: a call stores at
    most one block's tokens per sequence and commits the blocks those tokens complete (or, with no
    tokens, blocks an earlier call completed)."""
    def fn(caches, k, v, slots, seq, pos, blocks):
        caches = caches.open_tally(slots.shape[0])
        for g, first, n in caches.runs():
            j0 = caches.layer_index[first]

            def stage(i, caches, g=g, first=first, j0=j0):
                return caches.stage((g, j0 + i), k[first + i], v[first + i], slots, seq, pos)
            caches = jax.lax.fori_loop(0, n, stage, caches)
        return caches.close_tally(slots, seq).commit(blocks[:, 0], blocks[:, 1], blocks[:, 2])
    return on_heads(tp, fn, (caches, k, v, slot_mapping, seq_ids, positions, blocks),
                    ("caches", 2, 2, "rep", "rep", "rep", "rep"), ("caches",))


def commit_blocks(caches: LayerCaches, block_ids, seq_ids, first_positions, *, tp: HeadParallel | None = None):
    """`LayerCaches.commit`, on each device's own heads under tensor parallelism."""
    return on_heads(tp, lambda c, b, s, f: c.commit(b, s, f), (caches, block_ids, seq_ids, first_positions),
                     ("caches", "rep", "rep", "rep"), ("caches",))


# Megatron-style placement: projections into heads / MLP units split on their output axis, the
# projections back split on their input axis (XLA sums the partial products across devices).
_SPLIT_OUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_SPLIT_IN = ("o_proj", "down_proj")


def head_parallel_specs(model: "Decoder", axis: str = "tp"):
    """PartitionSpecs of a model's state (`nnx.state(model)`) for tensor parallelism over `axis`:
    the stacked layers' q/k/v and gate/up kernels (and biases) split on their output axis, o and
    down kernels on their input axis; embeddings, norms and the LM head replicated."""
    def spec(path, x):
        names = [str(p) for p in path if str(p) != "value"]  # a Variable's array sits under "value"
        if not names or names[0] != "layers":
            return P()
        if any(n in names for n in _SPLIT_OUT):
            return P(None, None, axis) if names[-1] == "kernel" else P(None, axis)
        if any(n in names for n in _SPLIT_IN) and names[-1] == "kernel":
            return P(None, axis, None)
        return P()
    return jax.tree_util.tree_map_with_path(lambda path, x: spec([getattr(k, "key", getattr(k, "name", k))
                                                                   for k in path], x), nnx.state(model))


def model_dtype(dtype) -> str:
    """Canonical name of a model dtype ("float32", "bfloat16", "float16"); ValueError otherwise."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {list(MODEL_DTYPES)}, got {dtype!r}")
    return name


def param_names(model: Decoder) -> dict:
    """{dotted name: array} of a model's weights as checkpoints name them, one entry per layer
    (e.g. 'layers.0.attn.q_proj.kernel': that layer's slice of the stacked parameter)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[0] == "layers":
            tail = ".".join(str(p) for p in path[1:])
            for i in range(model.config.num_layers):
                out[f"layers.{i}.{tail}"] = var[...][i]
        else:
            out[".".join(str(p) for p in path)] = var[...]
    return out


def from_params(cfg: LlamaConfig, params: Mapping[str, np.ndarray], *, dtype="float32") -> Decoder:
    """A Decoder holding the given weights (dotted names as `param_names`: one entry per layer,
    JAX layout), cast to dtype. Every parameter must be given with its exact shape; extra names are
    an error too."""
    dtype = model_dtype(dtype)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    flat = nnx.to_flat_state(state)
    n = cfg.num_layers

    def per_layer(path):  # the checkpoint names of one stacked parameter, or its own name
        tail = ".".join(str(p) for p in path[1:])
        return [f"layers.{i}.{tail}" for i in range(n)] if path[0] == "layers" else [".".join(str(p) for p in path)]
    names = {}
    for path, var in flat:
        shape = tuple(var.shape[1:]) if path[0] == "layers" else tuple(var.shape)
        names.update({name: shape for name in per_layer(path)})
    missing, extra = sorted(set(names) - set(params)), sorted(set(params) - set(names))
    if missing or extra:
        more = lambda xs: "..." if len(xs) > 8 else ""  # noqa: E731
        raise ValueError(f"params do not match the {cfg.model_type} architecture: missing {missing[:8]}"
                         f"{more(missing)}, unexpected {extra[:8]}{more(extra)}")
    for name, shape in names.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"param {name} has shape {tuple(params[name].shape)}, the architecture needs {shape}")
    leaves = []
    for path, var in flat:
        arrays = [jnp.asarray(params[name], dtype=dtype) for name in per_layer(path)]
        leaves.append((path, var.replace(jnp.stack(arrays) if path[0] == "layers" else arrays[0])))
    model = nnx.merge(graphdef, nnx.from_flat_state(leaves), rest)
    model.inv_freq.set_value(jnp.asarray(rope_inv_freq(cfg)))  # the only other array; never loaded
    return model
