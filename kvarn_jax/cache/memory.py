"""Exact byte accounting: per-token cost of a scheme, what one sequence holds, and the full
footprint of a cache (also of an abstract one from `jax.eval_shape`: nothing is allocated)."""

from __future__ import annotations

import math
from typing import Union

import jax.numpy as jnp

from .. import schemes
from ..config import KVQuantConfig
from . import hp as hp_storage
from .paged import PagedKVCache


def _field_bytes(cfg: KVQuantConfig, head_dim: int, dtype="float16"):
    """(code bytes, metadata bytes) per tile, K and V together."""
    codes = meta = 0
    for side in schemes.SIDES:
        for name, (shape, dt) in schemes.side_fields(cfg, side, head_dim, dtype).items():
            n = jnp.dtype(dt).itemsize
            for s in shape:
                n *= s
            if name in ("codes", "values"):
                codes += n
            else:
                meta += n
    return codes, meta


def bytes_per_token(cfg: Union[str, KVQuantConfig], head_dim: int, dtype="float16") -> float:
    """Bytes one token costs per KV head in the quantized pages, K and V together, metadata included.

    dtype: the cache's model dtype, in which scales and zero points are stored (fp16 and bf16: the
    same bytes; fp32 caches pay twice for their metadata). E.g. kvarn_k4v2_g128 at head_dim 128:
    108.0 (fp16: 512.0, i.e. 4.74x). High-precision sink/tail storage is per sequence, not per
    token: see `sequence_bytes` and `memory_report`.
    """
    cfg = KVQuantConfig.parse(cfg)
    cfg.check_head_dim(head_dim)
    codes, meta = _field_bytes(cfg, head_dim, dtype)
    return (codes + meta) / cfg.tile_tokens


def decode_read_bytes(cfg: Union[str, KVQuantConfig], ctx: int, *, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype="float16") -> int:
    """Bytes one decode step must read from one layer's cache for one sequence of `ctx` tokens: the
    quantized pages of the full blocks between the sink and the query's own block, and the
    high-precision sink and query's block (`gather_dense` serves the block holding position ctx - 1
    from the tail ring even when it is full). dtype: the cache's model dtype (the sink and tail are
    kept as `cfg.hp` says, `kvarn_jax.cache.hp`)."""
    cfg = KVQuantConfig.parse(cfg)
    per_token = bytes_per_token(cfg, head_dim, dtype) * num_kv_heads
    if cfg.is_passthrough:
        return int(ctx * per_token)
    bs = block_size
    own = (ctx - 1) % bs + 1 if ctx else 0                      # tokens of the query's own block
    hp_tokens = min(ctx, hp_storage.sink_len(cfg, bs)) + max(0, min(own, ctx - hp_storage.sink_len(cfg, bs)))
    hp_bytes = hp_tokens * num_kv_heads * hp_storage.bytes_per_token(cfg, head_dim, dtype)
    return int((ctx - hp_tokens) * per_token + hp_bytes)


def page_blocks(cfg: Union[str, KVQuantConfig], tokens: int, block_size: int) -> int:
    """Pages a sequence of `tokens` cached tokens needs when blocks served only from high precision
    hold none (`paged.NO_PAGE`): every block but its last (read from the ring while it is the
    query's) and, with a whole-block sink, its first. Passthrough: every block."""
    cfg = KVQuantConfig.parse(cfg)
    n = -(-tokens // block_size)
    if cfg.is_passthrough:
        return n
    return max(0, n - 1 - hp_storage.paged_from(cfg, block_size) // block_size)


def hp_bytes_per_seq(cfg: Union[str, KVQuantConfig], *, block_size: int, num_kv_heads: int, head_dim: int,
                     dtype="float16", tail_blocks: int = 1, num_layers: int = 1) -> int:
    """Bytes of one sequence slot's high-precision storage: its sink (`sink_tokens`, or a block) and
    its tail ring (`tail_blocks` blocks), K and V, all layers (0 for passthrough)."""
    cfg = KVQuantConfig.parse(cfg)
    if cfg.is_passthrough:
        return 0
    tokens = hp_storage.sink_len(cfg, block_size) + tail_blocks * block_size
    return num_layers * tokens * num_kv_heads * hp_storage.bytes_per_token(cfg, head_dim, dtype)


def sequence_bytes(cfg: Union[str, KVQuantConfig], tokens: int, *, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype="float16", tail_blocks: int = 1, num_layers: int = 1) -> dict:
    """What one sequence of `tokens` cached tokens holds when blocks served only from high precision
    have no page: {"page_bytes", "hp_bytes", "total_bytes", "fp16_bytes" (its blocks in fp16),
    "ratio" = fp16_bytes / total_bytes}. Static (calibrated) parameters are per pool, not here."""
    cfg = KVQuantConfig.parse(cfg)
    pages = page_blocks(cfg, tokens, block_size) * block_size * num_kv_heads * num_layers
    page_bytes = int(round(pages * bytes_per_token(cfg, head_dim, dtype)))
    hp = hp_bytes_per_seq(cfg, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                          tail_blocks=tail_blocks, num_layers=num_layers)
    fp16 = -(-tokens // block_size) * block_size * num_kv_heads * num_layers * head_dim * 4
    total = page_bytes + hp
    return {"page_bytes": page_bytes, "hp_bytes": hp, "total_bytes": total, "fp16_bytes": fp16,
            "ratio": fp16 / total if total else math.inf}


def _num_layers(cache: PagedKVCache) -> int:
    """1 for a single layer; L for a cache made by `stack_layers` (leaves carry extra leading axes)."""
    name, (shape, _) = next(iter(schemes.side_fields(cache.cfg, "k", cache.head_dim).items()))
    a = cache.pages["k"][name]
    layers = 1
    for s in a.shape[: a.ndim - 3 - len(shape)]:
        layers *= s
    return layers


def tree_bytes(tree) -> int:
    """Bytes of every array in a pytree (concrete arrays or `jax.ShapeDtypeStruct`s)."""
    import jax
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def memory_report(cache: PagedKVCache, *, hp_only_blocks: bool = False) -> dict:
    """Exact bytes of every part of a cache (one layer, or all layers of a stacked cache; also an
    abstract cache from `jax.eval_shape`).

    Keys: scheme, layers, tokens, max_seqs, code_bytes, metadata_bytes, page_bytes (codes +
    metadata), sink_bytes, tail_bytes (with the scales of an int8 sink/tail), static_bytes,
    total_bytes, fp16_bytes (the same token capacity stored as fp16), bytes_per_token_per_head
    (pages only), and capacity_vs_fp16 = fp16_bytes / total_bytes: how many times more tokens fit
    in the same memory, with the high-precision sink/tail storage counted.

    tokens: the cache's capacity - its pages' tokens (num_blocks * block_size), plus, with
    hp_only_blocks (a serving layer that gives no page to blocks served only from high precision,
    `paged.NO_PAGE`, as the engine does), the blocks every sequence slot holds that way: its last
    block and a whole-block sink ("hp_only_tokens").
    """
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    layers = _num_layers(cache)
    codes = meta = 0
    for side in schemes.SIDES:
        for name, a in cache.pages[side].items():
            if name in ("codes", "values"):
                codes += tree_bytes(a)
            else:
                meta += tree_bytes(a)
    sink = tree_bytes((cache.sink, cache.sink_meta))
    tail = tree_bytes((cache.tail, cache.tail_meta))
    static = tree_bytes(cache.static)
    total = codes + meta + sink + tail + static
    held = 0
    if hp_only_blocks and cache.has_hp:
        held = cache.max_seqs * (1 + (cache.paged_from > 0)) * cache.block_size
    tokens = cache.num_blocks * cache.block_size + held
    fp16 = layers * tokens * cache.num_kv_heads * cache.head_dim * 2 * 2
    return {
        "scheme": cache.cfg.name, "layers": layers, "tokens": tokens, "hp_only_tokens": held,
        "max_seqs": cache.max_seqs, "hp_format": cache.hp_format, "sink_tokens": cache.sink_len,
        "code_bytes": codes, "metadata_bytes": meta, "page_bytes": codes + meta, "sink_bytes": sink,
        "tail_bytes": tail, "static_bytes": static, "total_bytes": total, "fp16_bytes": fp16,
        "bytes_per_token_per_head": (codes + meta) / (layers * cache.num_blocks * cache.block_size * cache.num_kv_heads),
        "capacity_vs_fp16": fp16 / total,
    }


def format_memory_report(report: dict) -> str:
    """One human-readable line of a `memory_report`."""
    mib = 1 / 2 ** 20
    return (f"{report['scheme']}: {report['total_bytes'] * mib:.2f} MiB for {report['tokens']} tokens x "
            f"{report['layers']} layer(s) (pages {report['page_bytes'] * mib:.2f} MiB, high-precision sink+tail "
            f"{(report['sink_bytes'] + report['tail_bytes']) * mib:.2f} MiB for {report['max_seqs']} seqs); "
            f"fp16 would need {report['fp16_bytes'] * mib:.2f} MiB -> {report['capacity_vs_fp16']:.2f}x")
