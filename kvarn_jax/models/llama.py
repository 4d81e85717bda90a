"""A Llama/Qwen2-family decoder in Flax NNX whose attention layers read and write a `PagedKVCache`.

Architecture (what Llama, Mistral without sliding window, and Qwen2 share): token embedding, N
pre-norm blocks of RMSNorm -> GQA attention with RoPE (Qwen2: bias on q/k/v) -> residual, RMSNorm ->
SwiGLU MLP -> residual, final RMSNorm, LM head (tied to the embedding or not).

Every attention layer holds its cache as `nnx` state (a `KVCache` variable holding a
`kvarn_jax.PagedKVCache`). The cache is not part of the weights: `nnx.split(model, nnx.Param,
KVCache)` separates them, so a serving engine keeps one copy of the weights and swaps in the cache
state of whichever scheme a batch uses (see `kvarn_jax.serving`).

Two entry points, both pure functions of (weights, cache, batch metadata) once split:
- `prefill(PrefillBatch)`: a chunk of prompt tokens for each of P sequences. A chunk's queries see the
  sequence's earlier tokens exactly as the cache serves them (`gather_dense`: high-precision sink and
  partial tail, full blocks dequantized) plus the chunk's own keys/values causally, in the model
  dtype; then the chunk is written through `kvarn_jax.write`.
- `decode(DecodeBatch)`: one token per sequence; written first, then `paged_decode_attention`
  (impl "auto": the reference on CPU, the Pallas kernel on NVIDIA GPUs).
Norms, RoPE, softmax and logits are computed in float32 whatever the model dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import cache as kv_cache
from ..attention.paged_decode import IMPLS, paged_decode_attention
from ..config import KVQuantConfig
from ..hadamard import rotate, unrotate

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


# SmolLM2-135M(-Instruct): the default model's architecture, embedded so that benchmarks can build
# it with random weights where no checkpoint can be carried (e.g. a GPU machine without network).
SMOLLM2_135M = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,), model_type="llama")


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


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """Rotate channel pairs (i, i + D/2) of x [..., H, D] by position * inv_freq (HF's rotate_half form)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq          # [..., D/2]
    cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]   # broadcast over heads
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ------------------------------------------------------------------------------------------ batches
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """A chunk of prompt tokens for each of P sequences, padded to C tokens (padding: slot -1, at the end).

    tokens, positions, slot_mapping: [P, C]. seq_ids: [P] high-precision cache slots. block_tables:
    [P, W]. start: [P] tokens of the sequence already in the cache (the chunk's first position).
    last: [P] index in the chunk of the token whose logits are wanted (its last real token).
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

    Padding rows have slot -1 and seq_lens 0 (`positions` is then ignored).
    """

    tokens: jnp.ndarray
    positions: jnp.ndarray
    slot_mapping: jnp.ndarray
    seq_ids: jnp.ndarray
    block_tables: jnp.ndarray

    @property
    def seq_lens(self) -> jnp.ndarray:
        return jnp.where(self.slot_mapping >= 0, self.positions + 1, 0).astype(jnp.int32)


# ------------------------------------------------------------------------------------------ modules
class KVCache(nnx.Variable):
    """nnx state holding one attention layer's `kvarn_jax.PagedKVCache` (None until caches are attached)."""


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] (HF stores [out, in])."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs, std: float = 0.02):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32).astype(dtype) * std)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x):
        y = jnp.dot(x, self.kernel[...])
        return y + self.bias[...] if self.bias is not None else y


class Embedding(nnx.Module):
    """Token embedding [vocab, hidden]; `attend` is the tied LM head (logits against the table)."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs, std: float = 0.02):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), jnp.float32).astype(dtype) * std)

    def __call__(self, tokens):
        return self.embedding[...][tokens]

    def attend(self, h):
        return jnp.dot(h, self.embedding[...].T, preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, std: float):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs, std=std)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs, std=std)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs, std=std)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_bias, dtype=dtype, rngs=rngs, std=std)
        self.kv_cache = KVCache(None)

    def _qkv(self, x, positions, inv_freq):
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(lead + (self.num_heads, self.head_dim))
        k = self.k_proj(x).reshape(lead + (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(lead + (self.num_kv_heads, self.head_dim))
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def prefill(self, x, batch: PrefillBatch, inv_freq):
        """x [P, C, hidden] -> [P, C, hidden]; writes the chunk's K/V into the cache."""
        cache: kv_cache.PagedKVCache = self.kv_cache.get_value()
        p, c, _ = x.shape
        hk, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q, k, v = self._qkv(x, batch.positions, inv_freq)
        scale = 1.0 / math.sqrt(d)
        qf = q.astype(jnp.float32).reshape(p, c, hk, g, d)
        # Earlier tokens as the cache serves them (storage frame: rotated for KVarN), read before this
        # chunk is written (writing may overwrite the high-precision ring they come from).
        kc, vc = kv_cache.gather_dense(cache, batch.block_tables, batch.start, batch.seq_ids)  # [P, Hk, L, D]
        qc = rotate(qf) if cache.cfg.rotated else qf
        s_cache = jnp.einsum("pchgd,phld->phgcl", qc, kc, precision="highest") * scale
        cached = jnp.arange(kc.shape[2])[None, :] < batch.start[:, None]                   # [P, L]
        s_cache = jnp.where(cached[:, None, None, None, :], s_cache, -jnp.inf)
        # The chunk's own tokens, causally, as computed (padding sits after the real tokens, so real
        # queries never see it; padded queries see at least themselves and stay finite).
        kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
        s_self = jnp.einsum("pchgd,pthd->phgct", qf, kf, precision="highest") * scale
        causal = jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]                           # [C, C]
        s_self = jnp.where(causal, s_self, -jnp.inf)
        s = jnp.concatenate([s_cache, s_self], axis=-1)
        prob = jax.nn.softmax(s, axis=-1)
        p_cache, p_self = prob[..., :kc.shape[2]], prob[..., kc.shape[2]:]
        o_cache = jnp.einsum("phgcl,phld->pchgd", p_cache, vc, precision="highest")
        if cache.cfg.rotated:
            o_cache = unrotate(o_cache)
        o = o_cache + jnp.einsum("phgct,pthd->pchgd", p_self, vf, precision="highest")
        self.kv_cache.set_value(kv_cache.write(
            cache, k.reshape(p * c, hk, d), v.reshape(p * c, hk, d), batch.slot_mapping.reshape(-1),
            seq_ids=jnp.repeat(batch.seq_ids, c), positions=batch.positions.reshape(-1)))
        return self.o_proj(o.reshape(p, c, self.num_heads * d).astype(x.dtype))

    def decode(self, x, batch: DecodeBatch, inv_freq, impl: str):
        """x [B, hidden] -> [B, hidden]; writes the token's K/V, then attends over the cache."""
        cache: kv_cache.PagedKVCache = self.kv_cache.get_value()
        b = x.shape[0]
        q, k, v = self._qkv(x, batch.positions, inv_freq)
        cache = kv_cache.write(cache, k, v, batch.slot_mapping, seq_ids=batch.seq_ids, positions=batch.positions)
        self.kv_cache.set_value(cache)
        o = paged_decode_attention(q, cache, batch.block_tables, batch.seq_lens, seq_ids=batch.seq_ids, impl=impl)
        return self.o_proj(o.reshape(b, self.num_heads * self.head_dim).astype(x.dtype))


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, std: float):
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, bias=b, dtype=dtype, rngs=rngs, std=std)
        self.up_proj = Linear(h, i, bias=b, dtype=dtype, rngs=rngs, std=std)
        self.down_proj = Linear(i, h, bias=b, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs, std: float):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, std=std)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, std=std)

    def prefill(self, x, batch, inv_freq):
        x = x + self.attn.prefill(self.input_norm(x), batch, inv_freq)
        return x + self.mlp(self.post_norm(x))

    def decode(self, x, batch, inv_freq, impl):
        x = x + self.attn.decode(self.input_norm(x), batch, inv_freq, impl)
        return x + self.mlp(self.post_norm(x))


class Decoder(nnx.Module):
    """The causal LM. Build with random weights (`Decoder(cfg, rngs=...)`) or from a checkpoint
    (`kvarn_jax.models.load_model`). `dtype` is the weights' and activations' dtype."""

    def __init__(self, cfg: LlamaConfig, *, dtype="float32", rngs: nnx.Rngs, init_std: float = 0.02):
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"cfg must be a LlamaConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.dtype = model_dtype(dtype)
        dt = jnp.dtype(self.dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dt, rngs=rngs, std=init_std)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dt, rngs=rngs, std=init_std) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dt, rngs=rngs, std=init_std)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))  # not a Param: never loaded

    # -------------------------------------------------------------- caches
    def create_caches(self, kv_cache_dtype, *, num_blocks: int, block_size: int, max_seqs: int,
                      calibration=None) -> list:
        """One empty `PagedKVCache` per layer (sink/tail in the model dtype). calibration: a
        `kvarn_jax.Calibration` of every layer, for static schemes."""
        cfg = KVQuantConfig.parse(kv_cache_dtype)
        if cfg.static and calibration is None:
            raise ValueError(f"kv_cache_dtype {cfg.name} needs a calibration (static scales)")
        return [kv_cache.PagedKVCache.create(
            cfg, num_blocks=num_blocks, block_size=block_size, num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim, max_seqs=max_seqs, dtype=self.dtype,
            calibration=None if calibration is None else calibration.layer(i))
            for i in range(self.config.num_layers)]

    def attach_caches(self, caches: Sequence | None) -> None:
        """Put one cache per layer into the layers' `KVCache` state (None detaches them all)."""
        caches = [None] * self.config.num_layers if caches is None else list(caches)
        if len(caches) != self.config.num_layers:
            raise ValueError(f"caches has {len(caches)} entries for {self.config.num_layers} layers")
        for layer, c in zip(self.layers, caches):
            layer.attn.kv_cache.set_value(c)

    def caches(self) -> list:
        return [layer.attn.kv_cache.get_value() for layer in self.layers]

    # -------------------------------------------------------------- forward
    def logits(self, h):
        """float32 logits of final hidden states h [..., hidden]."""
        h = self.norm(h)
        if self.lm_head is None:
            return self.embed.attend(h).astype(jnp.float32)
        return jnp.dot(h, self.lm_head.kernel[...], preferred_element_type=jnp.float32).astype(jnp.float32)

    def prefill(self, batch: PrefillBatch, *, all_logits: bool = False) -> jnp.ndarray:
        """Logits [P, V] of each row's `last` token (or [P, C, V] with all_logits); updates the caches."""
        x = self.embed(batch.tokens)
        inv = self.inv_freq[...]
        for layer in self.layers:
            x = layer.prefill(x, batch, inv)
        if not all_logits:
            x = jnp.take_along_axis(x, batch.last[:, None, None], axis=1)[:, 0]
        return self.logits(x)

    def decode(self, batch: DecodeBatch, *, impl: str = "auto") -> jnp.ndarray:
        """Logits [B, V] of the next token of each row; updates the caches."""
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
        x = self.embed(batch.tokens)
        inv = self.inv_freq[...]
        for layer in self.layers:
            x = layer.decode(x, batch, inv, impl)
        return self.logits(x)


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
    """{dotted name: nnx.Param} of a model, e.g. 'layers.0.attn.q_proj.kernel' (the converted-weight names)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        out[".".join(str(p) for p in path)] = var
    return out


def from_params(cfg: LlamaConfig, params: Mapping[str, np.ndarray], *, dtype="float32") -> Decoder:
    """A Decoder holding the given weights (dotted names as `param_names`, JAX layout), cast to dtype.

    Every parameter must be given with its exact shape; extra names are an error too.
    """
    dtype = model_dtype(dtype)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    flat = nnx.to_flat_state(state)
    names = {".".join(str(p) for p in path): path for path, _ in flat}
    missing, extra = sorted(set(names) - set(params)), sorted(set(params) - set(names))
    if missing or extra:
        more = lambda xs: "..." if len(xs) > 8 else ""  # noqa: E731
        raise ValueError(f"params do not match the {cfg.model_type} architecture: missing {missing[:8]}"
                         f"{more(missing)}, unexpected {extra[:8]}{more(extra)}")
    leaves = []
    for path, var in flat:
        name = ".".join(str(p) for p in path)
        arr = params[name]
        if tuple(arr.shape) != tuple(var.shape):
            raise ValueError(f"param {name} has shape {tuple(arr.shape)}, the architecture needs {tuple(var.shape)}")
        leaves.append((path, var.replace(jnp.asarray(arr, dtype=dtype))))
    model = nnx.merge(graphdef, nnx.from_flat_state(leaves), rest)
    model.inv_freq.set_value(jnp.asarray(rope_inv_freq(cfg)))  # the only other array; never loaded
    model.attach_caches(None)
    return model
