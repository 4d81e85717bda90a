"""Exact byte accounting: per-token cost of a scheme and the full footprint of a cache."""

from __future__ import annotations

from typing import Union

import jax.numpy as jnp

from .. import schemes
from ..config import KVQuantConfig
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
    token: see `memory_report`.
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
    from the tail ring even when it is full). dtype: the cache's model dtype (its sink and tail)."""
    cfg = KVQuantConfig.parse(cfg)
    per_token = bytes_per_token(cfg, head_dim, dtype) * num_kv_heads
    bs = block_size
    hp_tokens = 0 if cfg.is_passthrough else ctx if ctx <= bs else bs + (ctx - 1) % bs + 1
    hp_bytes = hp_tokens * num_kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize
    return int((ctx - hp_tokens) * per_token + hp_bytes)


def _num_layers(cache: PagedKVCache) -> int:
    """1 for a single layer; L for a cache made by `stack_layers` (leaves carry extra leading axes)."""
    name, (shape, _) = next(iter(schemes.side_fields(cache.cfg, "k", cache.head_dim).items()))
    a = cache.pages["k"][name]
    layers = 1
    for s in a.shape[: a.ndim - 3 - len(shape)]:
        layers *= s
    return layers


def memory_report(cache: PagedKVCache) -> dict:
    """Exact bytes of every part of a cache (one layer, or all layers of a stacked cache).

    Keys: scheme, layers, tokens (num_blocks * block_size), max_seqs, code_bytes, metadata_bytes,
    page_bytes (codes + metadata), sink_bytes, tail_bytes, static_bytes, total_bytes, fp16_bytes
    (the same token capacity stored as fp16), bytes_per_token_per_head (pages only), and
    capacity_vs_fp16 = fp16_bytes / total_bytes: how many times more tokens fit in the same memory,
    with the high-precision sink/tail storage counted.
    """
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    layers = _num_layers(cache)
    tokens = cache.num_blocks * cache.block_size
    codes = meta = 0
    for side in schemes.SIDES:
        for name, a in cache.pages[side].items():
            if name in ("codes", "values"):
                codes += a.nbytes
            else:
                meta += a.nbytes
    sink = sum(a.nbytes for a in cache.sink.values()) if cache.sink else 0
    tail = sum(a.nbytes for a in cache.tail.values()) if cache.tail else 0
    static = sum(a.nbytes for d in cache.static.values() for a in d.values()) if cache.static else 0
    total = codes + meta + sink + tail + static
    fp16 = layers * tokens * cache.num_kv_heads * cache.head_dim * 2 * 2
    return {
        "scheme": cache.cfg.name, "layers": layers, "tokens": tokens, "max_seqs": cache.max_seqs,
        "code_bytes": codes, "metadata_bytes": meta, "page_bytes": codes + meta, "sink_bytes": sink,
        "tail_bytes": tail, "static_bytes": static, "total_bytes": total, "fp16_bytes": fp16,
        "bytes_per_token_per_head": (codes + meta) / (layers * tokens * cache.num_kv_heads),
        "capacity_vs_fp16": fp16 / total,
    }


def format_memory_report(report: dict) -> str:
    """One human-readable line of a `memory_report`."""
    mib = 1 / 2 ** 20
    return (f"{report['scheme']}: {report['total_bytes'] * mib:.2f} MiB for {report['tokens']} tokens x "
            f"{report['layers']} layer(s) (pages {report['page_bytes'] * mib:.2f} MiB, high-precision sink+tail "
            f"{(report['sink_bytes'] + report['tail_bytes']) * mib:.2f} MiB for {report['max_seqs']} seqs); "
            f"fp16 would need {report['fp16_bytes'] * mib:.2f} MiB -> {report['capacity_vs_fp16']:.2f}x")
