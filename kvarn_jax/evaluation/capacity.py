"""Capacity planner: how many tokens and sequences fit in an accelerator's memory, per KV-cache scheme.

Per model (a preset, or read from a checkpoint) and scheme, with L layers, Hk kv heads, head size D,
block size bs:

    weights              = params x weight bytes per parameter
    KV budget            = floor(gpu_mem x utilization) - weights - reserve
    page bytes / token   = kvarn_jax.bytes_per_token(scheme, D) x Hk x L     (codes + scales, exact)
    static bytes         = calibrated per-(head, channel) parameters of static schemes, per layer
    high precision / seq = L x (sink + tail_blocks x bs) x Hk x high-precision bytes per token
                           (the sink and the tail ring of every sequence slot, as the scheme's `_hp`
                           and `_sink` options keep them: kvarn_jax.cache.memory.hp_bytes_per_seq;
                           0 for fp16/bf16/fp32)
    pages / seq          = ceil(context / bs), so a sequence pays for ceil(context/bs) x bs tokens
                           (its page padding is the rest of its last block)
    max batch @ context  = (budget - static) // (pages/seq x bs x page bytes/token + high precision/seq)
    tokens that fit      = page tokens left when the high-precision storage is provisioned for that
                           batch: ((budget - static - batch x hp/seq) // (bs x page bytes/token)) x bs

These are the numbers `kvarn_jax.memory_report` gives for a cache of that size (tested).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Optional, Union

import kvarn_jax as kj
from kvarn_jax.cache.memory import hp_bytes_per_seq

WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
HP_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the planner needs of a model. params: the parameters the checkpoint stores (tied embeddings
    counted once; a GGUF that stores an untied output matrix counts it)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    params: int

    def __post_init__(self):
        for f in ("num_layers", "num_kv_heads", "head_dim", "params"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f} must be a positive int, got {v!r}")


# Published configurations (config.json of each model): layers, kv heads, head_dim, parameters.
MODEL_PRESETS = {
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 3, 64, 134_515_008),
    "qwen2.5-coder-1.5b": ModelSpec("qwen2.5-coder-1.5b", 28, 2, 128, 1_543_714_304),
    "llama3-8b": ModelSpec("llama3-8b", 32, 8, 128, 8_030_261_248),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8, 128, 70_553_706_496),
    "qwen3-8b": ModelSpec("qwen3-8b", 36, 8, 128, 8_190_735_360),
    "qwen3-32b": ModelSpec("qwen3-32b", 64, 8, 128, 32_762_123_264),
}

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: Union[str, int], arg: str = "gpu_mem") -> int:
    """'141GiB', '80GB', '512MiB', '1e9' or an int -> bytes (GiB = 2^30, GB = 10^9)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"{arg} must be positive, got {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"{arg} must be a size like '141GiB' or '80GB', got {text!r}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{arg} {text!r} is not a size; use e.g. 141GiB, 80GB, 24GiB, 512MiB (GiB = 2^30 bytes, "
                         "GB = 10^9)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{arg} must be positive, got {text!r}")
    return int(value)


def _safetensors_params(folder: Path) -> int:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors files to count parameters from")
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(info["shape"])
    return total


def _spec_from_config(name: str, cfg: dict, params: int) -> ModelSpec:
    text = cfg.get("text_config", cfg)
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return ModelSpec(name, text["num_hidden_layers"], text.get("num_key_value_heads", heads), head_dim, params)


def _spec_from_gguf(path: Path) -> ModelSpec:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key):
        f = reader.fields.get(key)
        if f is None:
            return None
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types and f.types[0].name == "STRING" else int(v[0])

    arch = field("general.architecture")
    layers = field(f"{arch}.block_count")
    heads = field(f"{arch}.attention.head_count")
    kv = field(f"{arch}.attention.head_count_kv") or heads
    head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.embedding_length") // heads
    params = sum(int(t.n_elements) for t in reader.tensors)
    return ModelSpec(path.stem, layers, kv, head_dim, params)


def model_spec(model: Union[str, os.PathLike]) -> ModelSpec:
    """A preset name (MODEL_PRESETS), a Hugging Face folder (config.json + safetensors) or a .gguf file."""
    if isinstance(model, str) and model.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[model.lower()]
    from kvarn_jax.models.checkpoints import check_model_path

    if not Path(model).expanduser().exists():
        raise ValueError(f"model {str(model)!r} is not a preset ({', '.join(MODEL_PRESETS)}) and does not exist as "
                         "a file or folder")
    path = check_model_path(model)
    if path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
        return _spec_from_config(path.name, cfg, _safetensors_params(path))
    return _spec_from_gguf(path)


def static_bytes_per_layer(cfg, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of the calibrated parameters a static scheme keeps per layer (0 for dynamic schemes)."""
    cfg = kj.parse(cfg)
    if not cfg.static:
        return 0
    import jax.numpy as jnp

    ones = jnp.ones((num_kv_heads, head_dim), jnp.float32)
    params = kj.Calibration(-ones, ones, -ones, ones, tokens=1).params(cfg, num_kv_heads, head_dim)
    return sum(int(a.nbytes) for side in params.values() for a in side.values())


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """One scheme's capacity (bytes are exact integers except page bytes/token, which can be fractional)."""

    scheme: str
    bits_per_element: float
    page_bytes_per_token: float        # all layers and kv heads, codes + scales
    hp_bytes_per_seq: int              # sink + tail of one sequence slot, all layers
    static_bytes: int                  # all layers
    padding_tokens_per_seq: int        # page padding of a sequence at `context`
    bytes_per_seq: float               # pages of one sequence at `context` + its hp storage
    weight_bytes: int
    kv_budget_bytes: int
    context: int
    max_batch: int
    tokens_that_fit: int
    batch_vs_fp16: Optional[float]     # max_batch / fp16's max_batch (None if fp16 fits none)
    tokens_vs_fp16: Optional[float]

    @property
    def weights_fit(self) -> bool:
        """False when the weights (and reserve) alone take all the usable memory: no KV cache fits."""
        return self.kv_budget_bytes > 0


def _check_int(v, name, lo=1):
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _raw_plan(spec: ModelSpec, cfg, *, budget: int, context: int, block_size: int, tail_blocks: int,
              kv_dtype: str) -> tuple:
    cfg.check_head_dim(spec.head_dim, f"head_dim of {spec.name}")
    cfg.check_block_size(block_size)
    page_bpt = kj.bytes_per_token(cfg, spec.head_dim) * spec.num_kv_heads * spec.num_layers
    hp = hp_bytes_per_seq(cfg, block_size=block_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                          dtype=kv_dtype, tail_blocks=tail_blocks, num_layers=spec.num_layers)
    static = static_bytes_per_layer(cfg, spec.num_kv_heads, spec.head_dim) * spec.num_layers
    pages = -(-context // block_size)
    per_seq = pages * block_size * page_bpt + hp
    usable = budget - static
    batch = max(int(usable // per_seq), 0) if usable > 0 else 0
    tokens = 0
    if usable > 0:
        tokens = int((usable - batch * hp) // (block_size * page_bpt)) * block_size
    return page_bpt, hp, static, pages * block_size - context, per_seq, batch, tokens


def plan_capacity(spec: ModelSpec, scheme, *, gpu_mem: Union[str, int], context: int, block_size: int = 128,
                  tail_blocks: int = 1, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                  utilization: float = 0.9, reserve: Union[str, int, None] = None) -> CapacityPlan:
    """Capacity of `spec` with `scheme` (see the module docstring for every term).

    kv_dtype: the model dtype (the high-precision sink/tail are kept as the scheme's `_hp` option says,
    by default in it if 16-bit, else in fp16); weight_dtype: bytes per weight.
    """
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be a ModelSpec (see model_spec), got {type(spec).__name__}")
    cfg = kj.parse(scheme)
    _check_int(context, "context")
    _check_int(tail_blocks, "tail_blocks")
    if tail_blocks not in (1, 2):
        raise ValueError(f"tail_blocks must be 1 or 2, got {tail_blocks!r}")
    if weight_dtype not in WEIGHT_BYTES:
        raise ValueError(f"weight_dtype must be one of {list(WEIGHT_BYTES)}, got {weight_dtype!r}")
    if kv_dtype not in HP_DTYPES:
        raise ValueError(f"kv_dtype must be one of {list(HP_DTYPES)}, got {kv_dtype!r}")
    if not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    mem = parse_bytes(gpu_mem, "gpu_mem")
    reserve_b = 0 if reserve is None else parse_bytes(reserve, "reserve")
    weights = int(math.ceil(spec.params * WEIGHT_BYTES[weight_dtype]))
    budget = int(mem * utilization) - weights - reserve_b
    common = dict(budget=budget, context=context, block_size=block_size, tail_blocks=tail_blocks,
                  kv_dtype=HP_DTYPES[kv_dtype])
    page_bpt, hp, static, pad, per_seq, batch, tokens = _raw_plan(spec, cfg, **common)
    *_, fp16_batch, fp16_tokens = _raw_plan(spec, kj.parse("fp16"), **common)
    return CapacityPlan(
        scheme=cfg.name, bits_per_element=8 * kj.bytes_per_token(cfg, spec.head_dim) / (2 * spec.head_dim),
        page_bytes_per_token=page_bpt, hp_bytes_per_seq=hp, static_bytes=static, padding_tokens_per_seq=pad,
        bytes_per_seq=per_seq, weight_bytes=weights, kv_budget_bytes=budget, context=context, max_batch=batch,
        tokens_that_fit=tokens,
        batch_vs_fp16=batch / fp16_batch if fp16_batch else None,
        tokens_vs_fp16=tokens / fp16_tokens if fp16_tokens else None)
