"""High-precision storage: how a quantized cache keeps the tokens it serves exactly.

Every quantized cache keeps two kinds of tokens out of its pages: each sequence's attention sink
(its first `sink_tokens` tokens, or its whole first block) and the block each sequence is filling
(the tail ring; a block is quantized into its page once it is full). `KVQuantConfig.hp` chooses
their format:

- a float dtype ("fp16", "bf16", "fp32"): the storage-frame values rounded to it;
- "int8": per token and head, the int8 scheme's asymmetric row (8-bit codes, a 16-bit scale and
  zero point per D channels: 8.25 bits per element at D = 128 instead of 16);
- "auto" (the default): the model dtype if it is 16-bit, else float16 (`float_dtype`). int8 and a
  shorter sink raised the KL to the unquantized model too much to be the default
  (benchmarks/results/2026-12-05_hp_storage.md); they are options for memory-bound serving.

Never wider than 16 bits unless asked: a float32 model keeps its sink and tail in float16, as
KVarN's own code keeps them in 16 bits; against float32 it moved the KL to the unquantized model
less than bfloat16 did (benchmarks/results/2026-12-05_hp_storage.md). Its price is the range: a
stored (for KVarN: rotated) value beyond 65,504 saturates, counted like any value a cache cannot
hold (`_hpbf16` keeps float32's range, `_hpfp32` everything).

A page is always the quantization of its tokens as this storage holds them, whether they reach it
through the ring (decode) or straight from a write (prefill), so both give the same page.

A sink shorter than a block leaves the rest of the first block to the pages: that block is
quantized like any other once full, with its sink positions replaced by the mean of its other
tokens first (`exclude_sink`): they are served from the sink, and a few outlier tokens (a sink's
keys often are) would otherwise stretch the block's scales for all of its tokens.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..config import KVQuantConfig
from ..schemes import per_token

FLOAT_FORMATS = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def float_dtype(dtype) -> str:
    """The 16-bit float a model dtype's high-precision tokens (or their int8 scales) are kept in:
    the model dtype if it is 16-bit, else float16 (see the module docstring)."""
    name = jnp.dtype(dtype).name
    return name if name in ("float16", "bfloat16") else "float16"


def hp_format(cfg: KVQuantConfig, dtype) -> str:
    """"int8" or the float dtype name the sink and tail of a `dtype` cache of `cfg` are stored in
    ("" for passthrough schemes, which have none)."""
    if cfg.is_passthrough:
        return ""
    if cfg.hp == "int8":
        return "int8"
    return FLOAT_FORMATS.get(cfg.hp) or float_dtype(dtype)


def value_dtype(cfg: KVQuantConfig, dtype) -> str:
    """The dtype stored values are rounded (and saturated) to before they are kept: the float
    format, or for int8 the dtype of its scales (whose range the codes span). Passthrough: `dtype`."""
    fmt = hp_format(cfg, dtype)
    if not fmt:
        return jnp.dtype(dtype).name
    return float_dtype(dtype) if fmt == "int8" else fmt


def sink_len(cfg: KVQuantConfig, block_size: int) -> int:
    """Tokens of a sequence's sink (0 for passthrough)."""
    if cfg.is_passthrough:
        return 0
    return cfg.sink_tokens or block_size


def paged_from(cfg: KVQuantConfig, block_size: int) -> int:
    """The first position whose block is stored in a page: block_size with a whole-block sink (the
    first block never is), 0 with a shorter sink or passthrough."""
    return block_size if not cfg.is_passthrough and not cfg.sink_tokens else 0


def fields(cfg: KVQuantConfig, head_dim: int, dtype) -> dict:
    """{name: (shape per token, dtype name)} of the high-precision storage: "values" [D] for a float
    format; "codes" [D] uint8 and "scale", "zero" [] for int8."""
    fmt = hp_format(cfg, dtype)
    if fmt == "int8":
        meta = float_dtype(dtype)
        return {"codes": ((head_dim,), "uint8"), "scale": ((), meta), "zero": ((), meta)}
    return {"values": ((head_dim,), fmt)}


def bytes_per_token(cfg: KVQuantConfig, head_dim: int, dtype) -> int:
    """Bytes of one token of one head in the high-precision storage, K and V together."""
    n = 0
    for shape, dt in fields(cfg, head_dim, dtype).values():
        size = jnp.dtype(dt).itemsize
        for s in shape:
            size *= s
        n += size
    return 2 * n


def store(cfg: KVQuantConfig, x: jnp.ndarray, dtype) -> dict:
    """Values [..., D] in the storage frame (already in `value_dtype`) -> the fields, [...] + shape."""
    if hp_format(cfg, dtype) == "int8":
        f = per_token.int_quantize(x, 8, x.shape[-1], meta=jnp.dtype(float_dtype(dtype)))
        return {"codes": f["codes"], "scale": f["scale"][..., 0], "zero": f["zero"][..., 0]}
    return {"values": x.astype(hp_format(cfg, dtype))}


def load(cfg: KVQuantConfig, f: dict) -> jnp.ndarray:
    """The fields [...] + shape -> float32 values [..., D]."""
    if "codes" in f:
        return (f["codes"].astype(jnp.float32) * f["scale"].astype(jnp.float32)[..., None]
                + f["zero"].astype(jnp.float32)[..., None])
    return f["values"].astype(jnp.float32)


def roundtrip(cfg: KVQuantConfig, x: jnp.ndarray, dtype) -> jnp.ndarray:
    """What the high-precision storage gives back for values x [..., D] (storage frame), float32."""
    return load(cfg, store(cfg, x.astype(value_dtype(cfg, dtype)), dtype))


def exclude_sink(cfg: KVQuantConfig, blocks: jnp.ndarray, first_positions: jnp.ndarray) -> jnp.ndarray:
    """blocks [M, Hk, block_size, D] whose first positions are `first_positions` [M]: in a sequence's
    first block (position 0) with a sink shorter than the block, the sink positions are replaced by
    the mean of the block's other tokens (served from the sink, never from the page; the mean
    stretches no channel's range). Other blocks, and whole-block sinks, unchanged."""
    s = cfg.sink_tokens
    if not s:
        return blocks
    mean = jnp.mean(blocks[:, :, s:], axis=2, keepdims=True)
    first = (first_positions == 0)[:, None, None, None] & (jnp.arange(blocks.shape[2]) < s)[None, None, :, None]
    return jnp.where(first, mean, blocks)


def held(cfg: KVQuantConfig, k: jnp.ndarray, v: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """What a `dtype` cache of `cfg` (not passthrough) holds in its sink and ring for tokens k, v
    [tokens, Hk, D] (the model's frame): stored as a write stores them (`storage.storage_values`:
    rotated for KVarN, rounded to `value_dtype`), kept as `cfg.hp` says and loaded back: float32 in
    the storage frame. A full block is quantized from exactly these values (after `exclude_sink`)."""
    from ..storage import storage_values

    if cfg.is_passthrough:
        raise ValueError(f"{cfg.name} keeps no high-precision sink or ring (passthrough: every token is in its page)")
    ks, vs, _, _ = storage_values(cfg, k, v, value_dtype(cfg, dtype))
    return roundtrip(cfg, ks, dtype), roundtrip(cfg, vs, dtype)


def served(cfg: KVQuantConfig, k: jnp.ndarray, v: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """What a `dtype` cache of `cfg` serves from its sink and ring for tokens k, v [tokens, Hk, D]
    (the model's frame, float32 out): `held`, rotated back. For evaluations that reproduce the
    cache's reads outside it (`evaluation.serving_attention`)."""
    from ..hadamard import unrotate

    if cfg.is_passthrough:  # no high-precision storage: every token is in its page
        return k.astype(jnp.float32), v.astype(jnp.float32)
    return tuple(unrotate(x, jnp.float32) if cfg.rotated else x for x in held(cfg, k, v, dtype))
