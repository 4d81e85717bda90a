"""`PagedKVCache`: one layer's paged, quantized KV cache, and its write path (jnp; completed blocks are
quantized by the same jnp math or by the Pallas kernel in `quantize_pallas.py`).

Layout (all pytree leaves; sizes are static aux data):
- `pages[side][field]`: [num_blocks, Hk, tiles_per_block, *field shape] - the quantized blocks. A
  tile is `cfg.tile_tokens` tokens of one head; for per-token schemes tiles_per_block = block_size.
  One exception (`tokens_last`): per-token int and fp8 value codes are stored [num_blocks, Hk, D*b/8,
  block_size], the block's tokens contiguous; `fields_from_pages` / `pages_from_fields` convert.
- `sink[side]`: [max_seqs, Hk, sink_len, D] - the attention sink of every sequence (its first
  `cfg.sink_tokens` tokens, or its whole first block) in high precision for the sequence's whole
  life: float values, or with `cfg.hp = "int8"` uint8 codes whose per-token scale and zero point
  are `sink_meta[side]["scale" | "zero"]` [max_seqs, Hk, sink_len] (`kvarn_jax.cache.hp`).
- `tail[side]`: [max_seqs, Hk, tail_blocks * block_size, D] (and `tail_meta` for int8) - a ring
  indexed by `position % (tail_blocks * block_size)` holding the not-yet-full block of every
  sequence in the same format.
- `dropped_tokens`: int32 count of tokens a jitted write did not store as given: not stored at all
  (an invalid slot, sequence id or position; a block completed beyond the write's static bound)
  or stored altered (a non-finite K/V value: the token stored as zeros; a value beyond the storage
  range: saturated, see `kvarn_jax.storage`; a block whose fp16 KVarN metadata saturated). Non-zero
  means some input was bad; eager calls raise instead, naming the reason.

High-precision storage is indexed by a sequence id in [0, max_seqs) (a serving slot, e.g. the row
of a request in the batch), so its size is fixed by `max_seqs` and reported by `memory_report`; an
id out of range is an error, never a silent cap. For rotated schemes (KVarN) the sink and tail hold
rotated values, so attention runs entirely in the rotated frame. Passthrough schemes (fp16/bf16)
store every token straight into its page and have no sink or tail.

A block that is only ever served from high precision needs no page: a whole-block sink, and a
sequence's last block (read from the ring while it is the query's own). A serving layer maps such
blocks to `NO_PAGE` in its slots and block tables: their tokens go to the sink and ring only and
are never quantized, and reads never touch a page for them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from .. import schemes
from ..config import KVQuantConfig
from ..impl import resolve_impl
from . import hp as hp_storage
from ..storage import storage_values
from ..validation import (check_array, check_count, check_finite, check_range, is_concrete,
                          require_compiled_backend)
from .quantize_pallas import quantize_blocks_pallas, supports as pallas_quantize_supports

# Slot / block-table / commit entry of a block held only in high precision (see the module docstring);
# -1 stays padding.
NO_PAGE = -2


def carries_token(slot_mapping):
    """Which slot_mapping entries carry a token (not padding): a slot, or `NO_PAGE`."""
    return (slot_mapping >= 0) | (slot_mapping == NO_PAGE)


def tokens_last(cfg: KVQuantConfig, side: str, name: str) -> bool:
    """Whether the page field is stored with the block's token axis last (swapped with the field's
    own axis): per-token int and fp8 value codes, [.., D*b/8, block_size] instead of
    [.., block_size, D*b/8].

    Why: the decode kernel's value product contracts over tokens, and the matrix unit takes pairs of
    consecutive tokens of one channel; with a token's channel bytes contiguous the GPU kernel
    gathered them one byte at a time from shared memory (int8 heads-major: 1,182 -> 928 loop
    instructions per 64 tokens per warp offline; on the H200 1.019 -> 0.686 ms at B=32/L=32K with
    tokens-major products, benchmarks/results/2026-12-02_decode_value_layout_h200.md).
    The tiled schemes store their value codes the same way (`packing.store_tiled`)."""
    return cfg.method in ("int", "fp8") and side == "v" and name == "codes"


def pages_from_fields(cfg: KVQuantConfig, side: str, fields: dict) -> dict:
    """Quantized fields {name: [..., tiles_per_block, *shape]} -> the pages' layout (`tokens_last`)."""
    return {n: (jnp.swapaxes(f, -1, -2) if tokens_last(cfg, side, n) else f) for n, f in fields.items()}


def fields_from_pages(cfg: KVQuantConfig, side: str, pages: dict) -> dict:
    """The inverse of `pages_from_fields` (the same swap)."""
    return pages_from_fields(cfg, side, pages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    pages: dict
    sink: Union[dict, None]
    tail: Union[dict, None]
    static: Union[dict, None]
    dropped_tokens: jnp.ndarray
    sink_meta: Union[dict, None]
    tail_meta: Union[dict, None]
    cfg: KVQuantConfig = dataclasses.field(metadata=dict(static=True))
    num_blocks: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    num_kv_heads: int = dataclasses.field(metadata=dict(static=True))
    head_dim: int = dataclasses.field(metadata=dict(static=True))
    max_seqs: int = dataclasses.field(metadata=dict(static=True))
    tail_blocks: int = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))

    @property
    def tiles_per_block(self) -> int:
        return self.block_size // self.cfg.tile_tokens

    @property
    def tail_len(self) -> int:
        return self.tail_blocks * self.block_size

    @property
    def has_hp(self) -> bool:
        """Whether the cache keeps sink/tail blocks in high precision (every quantized scheme does)."""
        return not self.cfg.is_passthrough

    @property
    def hp_format(self) -> str:
        """"int8" or the float dtype name of the sink and tail ("" for passthrough: `hp.hp_format`)."""
        return hp_storage.hp_format(self.cfg, self.dtype)

    @property
    def sink_len(self) -> int:
        """Tokens of each sequence's sink: `cfg.sink_tokens`, or a whole block (0 for passthrough)."""
        return hp_storage.sink_len(self.cfg, self.block_size)

    @property
    def paged_from(self) -> int:
        """The first position whose block is stored in a page (`hp.paged_from`)."""
        return hp_storage.paged_from(self.cfg, self.block_size)

    @property
    def value_dtype(self) -> str:
        """The dtype written values are rounded and saturated to (`hp.value_dtype`)."""
        return hp_storage.value_dtype(self.cfg, self.dtype)

    def hp_fields(self, part: str, side: str) -> dict:
        """The high-precision fields of `part` ("sink" or "tail") and side: {"values": ...} or
        {"codes", "scale", "zero"} (int8), each [max_seqs, Hk, tokens, ...]."""
        main, meta = (self.sink, self.sink_meta) if part == "sink" else (self.tail, self.tail_meta)
        name = "codes" if self.hp_format == "int8" else "values"
        return {name: main[side], **(meta[side] if meta else {})}

    @classmethod
    def create(cls, cfg: Union[str, KVQuantConfig], *, num_blocks: int, block_size: int,
               num_kv_heads: int, head_dim: int, max_seqs: int | None = None, dtype=jnp.float16,
               tail_blocks: int = 1, calibration=None) -> "PagedKVCache":
        """An empty cache for one layer.

        max_seqs: how many sequences can be live at once (sizes the high-precision sink/tail
          storage: max_seqs sinks and max_seqs * tail_blocks blocks). Required for quantized schemes.
        dtype: model dtype of K/V; scales and zero points of the pages are kept in it, the sink and
          tail as `cfg.hp` says (`kvarn_jax.cache.hp`: by default never wider than 16 bits).
        tail_blocks: blocks per sequence in the high-precision ring. 1 suffices for ordinary
          decoding; use 2 with speculative decoding so that rejected draft tokens that spilled into
          the next block never overwrite the previous block's high-precision copy.
        calibration: one layer's `Calibration`, required by static schemes.
        """
        cfg = KVQuantConfig.parse(cfg)
        num_blocks = check_count(num_blocks, "num_blocks")
        num_kv_heads = check_count(num_kv_heads, "num_kv_heads")
        head_dim = check_count(head_dim, "head_dim")
        block_size = check_count(block_size, "block_size")
        cfg.check_head_dim(head_dim)
        cfg.check_block_size(block_size)
        try:
            dtype = jnp.dtype(dtype)
        except TypeError:
            dtype = None
        if dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        if cfg.is_passthrough:
            dtype, max_seqs, tail_blocks = cfg.dtype, 0, 0
        else:
            max_seqs = check_count(max_seqs, "max_seqs",
                                   f" for {cfg.name} (it bounds the high-precision sink/tail storage)")
            if tail_blocks not in (1, 2) or isinstance(tail_blocks, bool):
                raise ValueError(f"tail_blocks must be 1 or 2, got {tail_blocks!r}")
            tail_blocks = int(tail_blocks)
        from ..quantize import _static_params  # the same calibration rules as `quantize`
        static = _static_params(cfg, calibration, num_kv_heads, head_dim, dtype)
        tpb = block_size // cfg.tile_tokens
        pages = {side: {name: jnp.zeros((num_blocks, num_kv_heads) + (
                            shape + (tpb,) if tokens_last(cfg, side, name) else (tpb,) + shape), dt)
                        for name, (shape, dt) in schemes.side_fields(cfg, side, head_dim, dtype).items()}
                 for side in schemes.SIDES}
        hp = {}
        if not cfg.is_passthrough:
            lens = {"sink": hp_storage.sink_len(cfg, block_size), "tail": tail_blocks * block_size}
            for part, n in lens.items():
                made = {s: {name: jnp.zeros((max_seqs, num_kv_heads, n) + shape, dt)
                            for name, (shape, dt) in hp_storage.fields(cfg, head_dim, dtype).items()}
                        for s in schemes.SIDES}
                hp[part] = {s: made[s].pop("codes", None) if "codes" in made[s] else made[s].pop("values")
                            for s in schemes.SIDES}
                hp[part + "_meta"] = made if made["k"] else None
        return cls(pages=pages, sink=hp.get("sink"), tail=hp.get("tail"), static=static,
                   dropped_tokens=jnp.zeros((), jnp.int32), sink_meta=hp.get("sink_meta"),
                   tail_meta=hp.get("tail_meta"),
                   cfg=cfg, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, max_seqs=max_seqs, tail_blocks=tail_blocks,
                   dtype=jnp.dtype(dtype).name)


def stack_layers(caches: Sequence[PagedKVCache]) -> PagedKVCache:
    """Stack per-layer caches into one with a leading layer axis on every leaf (for `jax.vmap`/`lax.scan`)."""
    caches = list(caches)
    if not caches:
        raise ValueError("caches is empty")
    treedefs = {jax.tree_util.tree_structure(c) for c in caches}
    if len(treedefs) != 1:
        raise ValueError("caches must all have the same scheme, sizes and dtype to be stacked")
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *caches)


# ---------------------------------------------------------------------------------------- write
def _quantize_blocks(cache: PagedKVCache, side: str, blocks: jnp.ndarray, quantizer: str = "reference") -> dict:
    """[M, Hk, block_size, D] storage-frame values -> page fields [M, Hk, tiles_per_block, ...].

    quantizer: "reference" (jnp, here) or "pallas" / "pallas_interpret" (`quantize_pallas.py`,
    the same math inside a kernel; bit-identical except KVarN near-ties, see `write`).
    """
    if quantizer != "reference":
        return quantize_blocks_pallas(blocks, cache.static[side] if cache.static else None, cfg=cache.cfg,
                                      side=side, interpret=quantizer == "pallas_interpret", dtype=cache.dtype)
    g = cache.cfg.tile_tokens
    m, h, b, d = blocks.shape
    tiles = blocks if g == 1 else blocks.reshape(m, h, b // g, g, d)
    st = schemes.expand_static(cache.cfg, cache.static[side], 1) if cache.static else None
    return schemes.quantize_side(tiles, cache.cfg, side, st, dtype=cache.dtype)


def saturated_blocks(cache: PagedKVCache, fields: dict) -> jnp.ndarray:
    """[M] bool: quantized blocks ({side: {field: [M, ...]}}) whose metadata reached the largest finite
    value of its dtype. Only KVarN's folded scales can (fp16 caches: a zero point of a column scale
    below 1 over values near 65,504); elsewhere the data's own range bounds them, so an int scheme's
    zero point of exactly -65,504 is a value, not a saturation."""
    m = next(iter(fields["k"].values())).shape[0]
    if cache.cfg.method != "kvarn":
        return jnp.zeros((m,), bool)
    big = float(jnp.finfo(jnp.dtype(cache.dtype)).max)
    out = jnp.zeros((m,), bool)
    for side in schemes.SIDES:
        for name, f in fields[side].items():
            if name != "codes":
                out |= jnp.any(jnp.abs(f.astype(jnp.float32)).reshape(m, -1) >= big, axis=1)
    return out


def completed_block_bound(cache: PagedKVCache, num_tokens: int) -> int:
    """Static bound on blocks one write of `num_tokens` can complete.

    A completed block's tokens come from this write or from the sequence's ring, which holds at most
    `tail_blocks` partial blocks per sequence, so at most num_tokens // block_size + max_seqs *
    tail_blocks blocks complete (and never more than num_tokens).
    """
    return max(1, min(num_tokens, num_tokens // cache.block_size + cache.max_seqs * cache.tail_blocks))


class WritePlan(NamedTuple):
    """Where each token of one write goes (`write_plan`); shared by `write_reference` and the vLLM
    bridge, which stores the same rows into torch buffers. Per token: `xs` the K/V rows in the storage
    frame (`storage.storage_values`: non-finite tokens zeroed, values saturated to the storage range),
    block `blk` and offset `off` of its slot; for quantized schemes the clipped sequence id `seq_c`,
    and masks: to the sink, to the tail ring, and `completes` (fills a block's last slot). Counts of
    the tokens stored (not padding): `dropped` invalid ones (not stored), `nonfinite` stored as zeros,
    `saturated` stored clipped; `changed` [tokens] marks the tokens those three count."""
    xs: dict
    blk: jnp.ndarray
    off: jnp.ndarray
    in_range: jnp.ndarray
    dropped: jnp.ndarray
    seq: jnp.ndarray | None = None
    seq_c: jnp.ndarray | None = None
    pos: jnp.ndarray | None = None
    is_sink: jnp.ndarray | None = None
    rest: jnp.ndarray | None = None
    in_ring: jnp.ndarray | None = None
    completes: jnp.ndarray | None = None
    nonfinite: jnp.ndarray | None = None
    saturated: jnp.ndarray | None = None
    changed: jnp.ndarray | None = None


def write_plan(cache: PagedKVCache, k, v, slot_mapping, seq_ids, positions, *,
               one_per_sequence: bool = False, past_sink: bool = False) -> WritePlan:
    """The routing of a write (no checks; invalid tokens are masked out and counted in `dropped`).
    Values are rounded to the cache's `value_dtype`; slot `NO_PAGE` routes a token of a quantized
    scheme to its sink or ring only. one_per_sequence: the caller guarantees that no sequence writes
    two tokens (a decode step), so every token past the sink goes to the ring without the scatter
    that finds each sequence's last position. past_sink: the caller guarantees that every token lies
    past the sink (position >= `sink_len`), so the write has no sink route (`is_sink` None): on GPUs
    its scatters are kernels of their own even when they store nothing. A token that breaks the
    promise is invalid: dropped and counted, never stored."""
    nb, bs = cache.num_blocks, cache.block_size
    slot = slot_mapping.astype(jnp.int32)
    blk, off = slot // bs, slot % bs
    in_range = (slot >= 0) & (slot < nb * bs)
    k_s, v_s, nonfinite, saturated = storage_values(cache.cfg, k, v, cache.value_dtype)
    xs = {"k": k_s, "v": v_s}
    count = lambda m: jnp.sum(m, dtype=jnp.int32)  # noqa: E731
    if cache.cfg.is_passthrough:
        return WritePlan(xs, blk, off, in_range, count(~in_range & (slot != -1)),
                         nonfinite=count(in_range & nonfinite), saturated=count(in_range & saturated),
                         changed=(~in_range & (slot != -1)) | (in_range & (nonfinite | saturated)))
    ns, r = cache.max_seqs, cache.tail_len
    seq = seq_ids.astype(jnp.int32)
    pos = positions.astype(jnp.int32)
    no_page = slot == NO_PAGE
    off = jnp.where(no_page, pos % bs, off)
    valid = (in_range | no_page) & (seq >= 0) & (seq < ns) & (pos >= 0) & (pos % bs == off)
    if past_sink:
        valid &= pos >= cache.sink_len
    rest = valid & (pos >= cache.paged_from)
    # Ring: the last `r` positions each sequence writes (a longer write would collide in the ring;
    # its earlier tokens are only needed by blocks this write completes, which read them directly).
    seq_c = jnp.clip(seq, 0, ns - 1)
    if one_per_sequence:
        in_ring = rest
    else:
        maxpos = jnp.full((ns,), -1, jnp.int32).at[jnp.where(rest, seq, ns)].max(pos, mode="drop")
        in_ring = rest & (pos > maxpos[seq_c] - r)
    return WritePlan(xs, blk, off, in_range, count(~valid & (slot != -1)), seq=seq,
                     seq_c=seq_c, pos=pos, is_sink=None if past_sink else valid & (pos < cache.sink_len), rest=rest,
                     in_ring=in_ring, completes=rest & in_range & (off == bs - 1),
                     nonfinite=count(valid & nonfinite), saturated=count(valid & saturated),
                     changed=(~valid & (slot != -1)) | (valid & (nonfinite | saturated)))


def _store_hp(cache: PagedKVCache, p: WritePlan) -> dict:
    """The sink (unless the plan has no sink route), tail and their metadata after storing the plan's
    tokens (`dataclasses.replace` kwargs)."""
    ns, r = cache.max_seqs, cache.tail_len
    routes = {"tail": (jnp.where(p.in_ring, p.seq, ns), p.pos % r)}
    if p.is_sink is not None:
        routes["sink"] = (jnp.where(p.is_sink, p.seq, ns), p.off)
    out = {}
    for part, (rows, cols) in routes.items():
        new = {}
        for side in schemes.SIDES:
            f = hp_storage.store(cache.cfg, p.xs[side], cache.dtype)           # {name: [n, Hk, ...]}
            new[side] = {n: a.at[rows, :, cols].set(f[n], mode="drop") for n, a in cache.hp_fields(part, side).items()}
        out.update(_split_hp(cache, part, new))
    return out


def _split_hp(cache: PagedKVCache, part: str, new: dict) -> dict:
    """{side: {field: array}} of `part` -> its main leaf and metadata leaf (`PagedKVCache` fields)."""
    main = {s: f.pop("codes") if "codes" in f else f.pop("values") for s, f in ((s, dict(f)) for s, f in new.items())}
    meta = {s: {n: a for n, a in f.items() if n not in ("codes", "values")} for s, f in new.items()}
    return {part: main, part + "_meta": meta if meta["k"] else None}


def _page_input(cache: PagedKVCache, blocks: jnp.ndarray) -> jnp.ndarray:
    """Blocks as the high-precision storage gives them (float32) -> what `_quantize_blocks` takes:
    in the cache's dtype (exact for the float formats, which are never wider; int8 codes times
    their scale rounded to it)."""
    return blocks.astype(cache.dtype)


def _ring_blocks(cache: PagedKVCache, side: str, seqs: jnp.ndarray, first_positions: jnp.ndarray) -> jnp.ndarray:
    """The ring's tokens of blocks starting at `first_positions` [M] of sequences `seqs` [M], as
    float32 [M, bs, Hk, D]."""
    idx = (first_positions[:, None] + jnp.arange(cache.block_size)[None, :]) % cache.tail_len   # [M, bs]
    f = {n: a[seqs[:, None], :, idx] for n, a in cache.hp_fields("tail", side).items()}
    return hp_storage.load(cache.cfg, f)


def completion_sizes(cache: PagedKVCache, num_tokens: int) -> list[int]:
    """The static numbers of completed blocks a write of `num_tokens` quantizes in; the smallest that
    holds its completions is used: 2 (decode steps), then 8, 32, 128, ... up to the bound, so a
    prefill quantizes at most ~4x the blocks it completes rather than the bound (which counts every
    sequence's ring). The vLLM bridge picks from the same sizes, so its pages equal `write`'s."""
    m = completed_block_bound(cache, num_tokens)
    sizes, size = {m}, 2
    while size < m:
        sizes.add(size)
        size *= 4
    return sorted(sizes)


# What `_write` counts, in order: tokens not stored (invalid metadata), stored as zeros (non-finite),
# stored saturated, not quantized (completed beyond the static bound), and of blocks whose
# metadata saturated.
WRITE_COUNTS = ("invalid", "nonfinite", "saturated", "beyond_bound", "metadata_saturated")


@functools.partial(jax.jit, static_argnames=("quantizer", "max_completed"))
def write_reference(cache: PagedKVCache, k: jnp.ndarray, v: jnp.ndarray, slot_mapping: jnp.ndarray,
                    seq_ids: jnp.ndarray | None, positions: jnp.ndarray | None,
                    quantizer: str = "reference", max_completed: int | None = None) -> PagedKVCache:
    """The write path without checks (see `write`). Never writes outside the named slots.

    Everything is jnp except the quantization of completed blocks, done by `quantizer`.
    max_completed: a caller's static bound on the blocks this write completes (e.g. sequences x
    ceil(chunk / block_size) for a prefill chunk): completions are quantized in one batch of that
    size, with no branch on their count; completions beyond it are dropped and counted.
    """
    return _write(cache, k, v, slot_mapping, seq_ids, positions, quantizer, max_completed)[0]


def _write(cache, k, v, slot_mapping, seq_ids, positions, quantizer, max_completed):
    """`write_reference`, also returning int32 [len(WRITE_COUNTS)]: why tokens were not stored as given."""
    n = k.shape[0]
    nb, bs = cache.num_blocks, cache.block_size
    p = write_plan(cache, k, v, slot_mapping, seq_ids, positions)
    zero = jnp.zeros((), jnp.int32)
    if cache.cfg.is_passthrough:
        b_idx = jnp.where(p.in_range, p.blk, nb)  # out of bounds -> dropped
        pages = {s: {"values": cache.pages[s]["values"].at[b_idx, :, p.off].set(p.xs[s], mode="drop")}
                 for s in schemes.SIDES}
        counts = jnp.stack([p.dropped, p.nonfinite, p.saturated, zero, zero])
        return dataclasses.replace(cache, pages=pages, dropped_tokens=cache.dropped_tokens + jnp.sum(counts)), counts

    hp = _store_hp(cache, p)

    # Blocks whose last slot this write fills: assembled from the ring and this write's tokens,
    # quantized, stored in their pages. Shapes are static, so the work is sized for a bound on
    # completions; most decode steps complete no block and few complete more than a couple, so the
    # quantization runs in the smallest of a few sizes that holds this call's completions (none at
    # all when nothing completes).
    sizes = completion_sizes(cache, n) if max_completed is None else [max(1, min(int(max_completed), n))]
    m = sizes[-1]
    count = jnp.sum(p.completes, dtype=jnp.int32)
    overflow = jnp.maximum(count - m, 0)

    def store(size):
        def branch(pages):
            c_m, fields = completed_blocks(cache, p, size, quantizer)
            bad = jnp.sum(saturated_blocks(cache, fields) & (c_m < nb), dtype=jnp.int32) * bs
            return {s: {name: pages[s][name].at[c_m].set(f.astype(pages[s][name].dtype), mode="drop")
                        for name, f in fields[s].items()} for s in schemes.SIDES}, bad
        return branch

    if max_completed is not None:
        pages, meta_bad = store(m)(cache.pages)
    else:
        branches = [lambda pages: (pages, zero)] + [store(size) for size in sizes]
        which = jnp.int32(0)
        for i, size in enumerate(reversed(sizes)):  # smallest size that holds `count`
            which = jnp.where(count <= size, len(sizes) - i, which)
        which = jnp.where(count == 0, 0, jnp.where(count > m, len(sizes), which))
        pages, meta_bad = jax.lax.switch(which, branches, cache.pages)
    counts = jnp.stack([p.dropped, p.nonfinite, p.saturated, overflow * bs, meta_bad])
    return dataclasses.replace(cache, pages=pages, dropped_tokens=cache.dropped_tokens + jnp.sum(counts), **hp), counts


def completed_blocks(cache: PagedKVCache, p: WritePlan, size: int, quantizer: str = "reference"):
    """Up to `size` blocks a write completes, quantized: (physical block ids [size], num_blocks where
    a slot is unused; {side: {field: [size, Hk, tiles_per_block, ...]}} in the pages' layout,
    `tokens_last`). Each block is assembled from the sequence's ring (tokens of earlier writes)
    overlaid with this write's tokens as the ring keeps them (`hp.roundtrip`)."""
    c_m, _, blocks = completed_block_values(cache, p, size)
    return c_m, quantized_fields(cache, blocks, quantizer)


def quantized_fields(cache: PagedKVCache, blocks: dict, quantizer: str = "reference") -> dict:
    """{side: [M, Hk, block_size, D] float32 block values (`completed_block_values`)} -> {side:
    {field: [M, Hk, tiles_per_block, ...]}}: the blocks quantized, in the pages' layout."""
    return {s: pages_from_fields(cache.cfg, s, _quantize_blocks(cache, s, _page_input(cache, blocks[s]), quantizer))
            for s in schemes.SIDES}


def completed_block_values(cache: PagedKVCache, p: WritePlan, size: int):
    """What `completed_blocks` quantizes: (physical block ids [size], num_blocks where a slot is
    unused; the blocks' sequence slots [size]; {side: [size, Hk, block_size, D] float32}, each block
    from the sequence's ring overlaid with this write's tokens as the ring keeps them, a partial
    sink's positions excluded as `hp.exclude_sink` does)."""
    n = p.blk.shape[0]
    nb, bs = cache.num_blocks, cache.block_size
    (ti,) = jnp.nonzero(p.completes, size=size, fill_value=n)
    ok = ti < n
    tc = jnp.minimum(ti, n - 1)
    c_m = jnp.where(ok, p.blk[tc], nb)                      # physical block of each completion
    s_m = p.seq_c[tc]
    start = (p.pos[tc] // bs) * bs                          # first position of the block
    blk2m = jnp.full((nb,), size, jnp.int32).at[c_m].set(jnp.arange(size, dtype=jnp.int32), mode="drop")
    m_t = jnp.where(p.rest & p.in_range, blk2m[jnp.clip(p.blk, 0, nb - 1)], size)
    m_t = jnp.where(s_m[jnp.minimum(m_t, size - 1)] == p.seq, m_t, size)  # a block belongs to one sequence
    # Which token of this write fills each (completion, offset), -1 where the ring holds it: an int32
    # scatter, then row gathers (scattering whole K/V rows is much slower than gathering them on GPUs).
    src = jnp.full((size + 1, bs), -1, jnp.int32).at[m_t, p.off].set(jnp.arange(n, dtype=jnp.int32))[:size]
    from_write = (src >= 0)[..., None, None]
    src = jnp.clip(src, 0, n - 1)
    blocks = {}
    for s in schemes.SIDES:
        ring = _ring_blocks(cache, s, s_m, start)              # [size, bs, Hk, D]
        buf = jnp.where(from_write, hp_storage.roundtrip(cache.cfg, p.xs[s][src], cache.dtype), ring)
        blocks[s] = hp_storage.exclude_sink(cache.cfg, buf.transpose(0, 2, 1, 3), start)
    return c_m, s_m, blocks


def stage_tokens(cache: PagedKVCache, k: jnp.ndarray, v: jnp.ndarray, slot_mapping: jnp.ndarray, *,
                 seq_ids: jnp.ndarray | None = None, positions: jnp.ndarray | None = None,
                 one_per_sequence: bool = False, past_sink: bool = False) -> PagedKVCache:
    """The first half of a decode-step write: store tokens without quantizing any block.

    Same arguments as `write`, no checks (for compiled serving steps whose metadata comes from their
    own scheduler). Quantized schemes keep the tokens in the high-precision sink and tail ring only:
    a scatter of the given rows, whatever the cache's size. A block whose last slot this fills must
    then be quantized into its page by `commit_blocks` before its sequence writes past the ring
    (`tail_len` positions later); reads are right in between, since the query's own block is served
    from the ring. Passthrough schemes store into the pages directly (nothing to commit). Invalid
    tokens are dropped and counted as by `write`. one_per_sequence, past_sink: as in `write_plan` (a decode
    step's write; a sequence that writes two tokens then may keep the wrong one in its ring).
    """
    cache, changed = stage_tokens_uncounted(cache, k, v, slot_mapping, seq_ids=seq_ids, positions=positions,
                                            one_per_sequence=one_per_sequence, past_sink=past_sink)
    return dataclasses.replace(cache, dropped_tokens=cache.dropped_tokens + jnp.sum(changed, dtype=jnp.int32))


def stage_tokens_uncounted(cache: PagedKVCache, k, v, slot_mapping, *, seq_ids=None, positions=None,
                           one_per_sequence: bool = False, past_sink: bool = False):
    """`stage_tokens` without adding to `dropped_tokens`: (cache, bool [tokens] - the tokens it
    would count). For callers that count many writes at once (`LayerCaches.open_tally`)."""
    p = write_plan(cache, k, v, slot_mapping, seq_ids, positions, one_per_sequence=one_per_sequence,
                   past_sink=past_sink)
    if cache.cfg.is_passthrough:
        b_idx = jnp.where(p.in_range, p.blk, cache.num_blocks)
        pages = {s: {"values": cache.pages[s]["values"].at[b_idx, :, p.off].set(p.xs[s], mode="drop")}
                 for s in schemes.SIDES}
        return dataclasses.replace(cache, pages=pages), p.changed
    return dataclasses.replace(cache, **_store_hp(cache, p)), p.changed


def commit_blocks(cache: PagedKVCache, block_ids: jnp.ndarray, seq_ids: jnp.ndarray, first_positions: jnp.ndarray,
                  *, quantizer: str = "reference") -> PagedKVCache:
    """The second half of a decode-step write: quantize whole blocks from the ring into their pages.

    block_ids, seq_ids, first_positions: [M] int - the physical block, the sequence slot whose ring
    holds its tokens, and the block's first position (a multiple of block_size). Entries with
    block_id -1 are padding (a fixed M serves any number of completions); `NO_PAGE`, and blocks
    before `paged_from` (a whole-block sink), are kept only in high precision (nothing to do); other
    invalid entries are dropped and counted (block_size tokens each). quantizer: as in
    `write_reference` ("reference", "pallas" or "pallas_interpret"); `auto_quantizer` picks one.
    The pages equal those `write` stores for the same tokens.
    """
    if cache.cfg.is_passthrough:
        return cache
    nb, bs, ns = cache.num_blocks, cache.block_size, cache.max_seqs
    blk, seq, start = (a.astype(jnp.int32) for a in (block_ids, seq_ids, first_positions))
    ok = (blk >= 0) & (blk < nb) & (seq >= 0) & (seq < ns) & (start >= 0) & (start % bs == 0)
    # a block before `paged_from` (a whole-block sink) stays in high precision: nothing to do (per-layer
    # schemes commit one list of blocks for every layer, and other layers may page it)
    skip = ok & (start < cache.paged_from)
    ok &= ~skip
    c_m = jnp.where(ok, blk, nb)
    s_m = jnp.clip(seq, 0, ns - 1)
    fields = quantized_fields(cache, {s: hp_storage.exclude_sink(
        cache.cfg, _ring_blocks(cache, s, s_m, start).transpose(0, 2, 1, 3), start) for s in schemes.SIDES}, quantizer)
    pages = {s: {name: cache.pages[s][name].at[c_m].set(f.astype(cache.pages[s][name].dtype), mode="drop")
                 for name, f in fields[s].items()} for s in schemes.SIDES}
    dropped = jnp.sum(~ok & ~skip & (blk != -1) & (blk != NO_PAGE), dtype=jnp.int32) * bs
    dropped += jnp.sum(ok & saturated_blocks(cache, fields), dtype=jnp.int32) * bs
    return dataclasses.replace(cache, pages=pages, dropped_tokens=cache.dropped_tokens + dropped)


def _check_write_args(cache, k, v, slot_mapping, seq_ids, positions):
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    for name, x in (("k", k), ("v", v)):
        check_array(x, name, ndim=3, floating=True)
        if tuple(x.shape[1:]) != (cache.num_kv_heads, cache.head_dim):
            raise ValueError(f"{name} must be [tokens, {cache.num_kv_heads}, {cache.head_dim}] for this cache, "
                             f"got {tuple(x.shape)}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k ({tuple(k.shape)} {k.dtype}) and v ({tuple(v.shape)} {v.dtype}) must have the same "
                         "shape and dtype")
    n = k.shape[0]
    check_array(slot_mapping, "slot_mapping", ndim=1, integer=True)
    if slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {n} tokens")
    check_range(slot_mapping, "slot_mapping", 0, cache.num_blocks * cache.block_size,
                f"slots are block_id * block_size + offset with block_id < num_blocks={cache.num_blocks} "
                f"and block_size={cache.block_size} (-1 marks padding"
                + (f", {NO_PAGE} a token of a block kept only in high precision)" if cache.has_hp else ")"),
                allow=(-1, NO_PAGE) if cache.has_hp else (-1,))
    if cache.has_hp:
        for name, x in (("seq_ids", seq_ids), ("positions", positions)):
            if x is None:
                raise ValueError(f"{name} is required by {cache.cfg.name}: the sink block and the partial tail "
                                 "block of each sequence are kept in high precision, indexed by sequence id "
                                 "and position")
            check_array(x, name, ndim=1, integer=True)
            if x.shape[0] != n:
                raise ValueError(f"{name} has {x.shape[0]} entries for {n} tokens")
        if is_concrete(slot_mapping, seq_ids, positions):
            # numpy, not jnp: arrays closed over by a jitted caller are concrete, but jnp ops on them
            # inside the trace would give tracers
            sm, sid, pos = np.asarray(slot_mapping), np.asarray(seq_ids), np.asarray(positions)
            live = sm != -1
            check_range(np.where(live, sid, 0), "seq_ids", 0, cache.max_seqs,
                        f"sequence ids index the high-precision storage and must be < max_seqs={cache.max_seqs}")
            check_range(np.where(live, pos, 0), "positions", 0, 2 ** 31 - 1, "positions must be >= 0")
            mism = live & (sm != NO_PAGE) & (pos % cache.block_size != sm % cache.block_size)
            if mism.any():
                i = int(np.argmax(mism))
                raise ValueError(f"positions[{i}] = {int(pos[i])} and slot_mapping[{i}] = {int(sm[i])} "
                                 f"disagree: a token's offset in its block (slot % block_size) must equal "
                                 f"position % block_size (block_size={cache.block_size})")
    check_finite(k, "k")
    check_finite(v, "v")


WRITE_IMPLS = ("auto", "pallas", "reference")


def auto_quantizer(cache: PagedKVCache) -> str:
    """The quantizer `write(impl="auto")` uses: "pallas" or "reference", as `impl.resolve_impl` rules
    for the write path (the kernel on GPUs for the schemes where it beats XLA, the jnp path elsewhere)."""
    return resolve_impl("auto", "write", cache.cfg, pallas_quantize_supports(cache.cfg, cache.block_size,
                                                                               cache.head_dim))


def write(cache: PagedKVCache, k: jnp.ndarray, v: jnp.ndarray, slot_mapping: jnp.ndarray, *,
          seq_ids: jnp.ndarray | None = None, positions: jnp.ndarray | None = None, impl: str = "auto",
          interpret: bool | None = None) -> PagedKVCache:
    """Store tokens and return the new cache (functional; donate `cache` under jit to update in place).

    k, v: [tokens, Hk, D] of one dtype. slot_mapping: [tokens] int, vLLM's convention - token i goes
    to slot `block_id * block_size + offset`; -1 marks padding and is skipped. Quantized schemes also
    need seq_ids ([tokens], the sequence's slot in [0, max_seqs)) and positions ([tokens], the
    token's position in its sequence; position % block_size must equal the slot's offset).

    Semantics: tokens of a sequence's sink (its first `cfg.sink_tokens` tokens, or its whole first
    block) go to its high-precision sink; tokens of every block stored in a page (all blocks after a
    whole-block sink; all of them with a shorter one) go to the high-precision tail ring, and the
    block is quantized into its page in the same call that writes its last slot. Slot `NO_PAGE`
    marks a token whose block has no page (kept only in high precision: never quantized). Writing a slot again (speculative decoding after a rejection) replaces the
    token; if that re-fills a block's last slot the block is quantized again from the ring, which
    is exact as long as the rollback stays within the ring (tail_blocks=2 covers drafts that cross
    one block boundary). Reads decide by sequence length: a block is read from its page only when
    it is full, not the sink, and not the block of the query (position seq_len - 1) - so a token
    never sees a quantized version of its own block; the ring still holds a just-completed block.
    Values are kept as `cfg.hp` says (`kvarn_jax.cache.hp`), and a page is the quantization of its
    tokens as the ring keeps them, whichever way they arrive.

    Called eagerly, every token is stored as given or the call raises ValueError naming why (bad
    metadata, a NaN/Inf value, a value the cache cannot hold - see `kvarn_jax.storage`); completed
    blocks are quantized however many there are. Traced (under jit) nothing can be read back: such
    tokens are dropped or stored altered (NaN/Inf tokens as zeros, out-of-range values saturated,
    completions past `completed_block_bound` not quantized) and counted in `cache.dropped_tokens`.

    impl: how completed blocks are quantized - "pallas" (the kernel in `quantize_pallas.py`;
    interpreted when `interpret` is true, the default on CPU), "reference" (jnp, compiled by XLA) or
    "auto": the kernel on GPUs for the schemes where it beats XLA on the H200 (KVarN, fp8:
    benchmarks/results/2026-12-01_quantize_parity_h200.md), the jnp path otherwise (KIVI and the
    int schemes, CPU, TPU). Interpreted, the kernel's pages equal the jnp path's bit for bit, except
    that KVarN's Sinkhorn sums reduce in a shape-dependent order, so a few codes may flip at
    near-ties (within the golden-tile tolerance) and fp16 scales may differ in their last bits.
    Compiled on a GPU, the kernel divides in IEEE fp32 as the CPU does and XLA's GPU build does
    not, so there the two differ at exact .5 quotients by one code step (`schemes/arith.py`).
    """
    if impl not in WRITE_IMPLS:
        raise ValueError(f"impl must be one of {list(WRITE_IMPLS)}, got {impl!r}")
    _check_write_args(cache, k, v, slot_mapping, seq_ids, positions)
    quantizer = auto_quantizer(cache) if impl == "auto" else "reference"
    if impl == "pallas":
        why = pallas_quantize_supports(cache.cfg, cache.block_size, cache.head_dim)
        if why:
            raise ValueError(f"impl='pallas' cannot quantize this cache: {why}; use impl='reference' or 'auto'")
        interpret = jax.default_backend() == "cpu" if interpret is None else bool(interpret)
        require_compiled_backend(interpret, "write(impl='pallas')")
        quantizer = "pallas_interpret" if interpret else "pallas"
    if not is_concrete(*jax.tree.leaves(cache), k, v, slot_mapping, seq_ids, positions):
        return write_reference(cache, k, v, slot_mapping, seq_ids, positions, quantizer=quantizer)
    size = None
    if cache.has_hp:  # quantize every completed block, in the smallest of the usual sizes that holds them
        sm, pos = np.asarray(slot_mapping), np.asarray(positions)
        bs = cache.block_size
        done = int(np.sum((sm >= 0) & (pos >= cache.paged_from) & (pos % bs == bs - 1)))
        size = next((m for m in completion_sizes(cache, k.shape[0]) if m >= done), done)
    new, counts = _write_eager(cache, k, v, slot_mapping, seq_ids, positions, quantizer, size)
    counts = np.asarray(counts)
    if counts.any():
        raise ValueError(f"write: {_describe_counts(cache, counts)}; nothing was written")
    return new


_write_eager = jax.jit(_write, static_argnums=(6, 7))


def _describe_counts(cache: PagedKVCache, counts) -> str:
    """The reasons of a `_write`'s counts, for an eager caller's error."""
    dt, vt = cache.dtype, cache.value_dtype
    wider = ("a bfloat16 or float32 cache holds them" if vt == dt else
             f"the cache keeps its sink and tail in {vt} ({cache.cfg.name}): the suffix _hpbf16 or _hpfp32 holds them")
    why = {
        "invalid": "token(s) with an invalid slot, sequence id or position",
        "nonfinite": "token(s) with a NaN or Inf value in k or v",
        "saturated": (f"token(s) with values the cache cannot hold: beyond ±{2.0 ** 50:.3g} (every cache clips "
                      f"there) or, after {'the Hadamard rotation, ' if cache.cfg.rotated else ''}beyond "
                      f"{vt}'s range ({'a KVarN cache stores rotated values: a token whose L2 norm exceeds ' if cache.cfg.rotated else ''}"
                      f"{float(jnp.finfo(jnp.dtype(vt)).max):,.0f}); {wider}"),
        "beyond_bound": "token(s) of blocks completed beyond the write's static bound",
        "metadata_saturated": (f"token(s) of blocks whose KVarN scales or zero points exceed {dt}'s range "
                               "(values near its maximum with a column scale below 1); a bfloat16 or float32 "
                               "cache holds them"),
    }
    return "; ".join(f"{int(c)} {why[name]}" for name, c in zip(WRITE_COUNTS, counts) if c)


# ---------------------------------------------------------------------------------------- read
def gather_dense(cache: PagedKVCache, block_tables: jnp.ndarray, seq_lens: jnp.ndarray,
                 seq_ids: jnp.ndarray | None = None):
    """Dense fp32 K and V of each sequence as attention sees them: ([B, Hk, L, D], [B, Hk, L, D]).

    L = max_blocks * block_size; positions >= seq_lens hold garbage (finite) and must be masked.
    Values are in the storage frame (rotated for KVarN). Full blocks before the one holding position
    seq_len - 1 come from the quantized pages (`read_from_page`), except a whole-block sink; the sink
    and the last (partial or just-completed) block from high precision. Block table entries of
    blocks read only from high precision may be `NO_PAGE`.

    Quantized schemes dequantize only the blocks read from pages: a loop over blocks up to the
    longest sequence's last full one (the sink block and the blocks past it cost nothing), over a
    buffer that starts as the ring laid over every block.
    """
    nbt, mb = block_tables.shape
    bs, hk, d = cache.block_size, cache.num_kv_heads, cache.head_dim
    tbl, paged, hp = _dense_sources(cache, block_tables, seq_lens, seq_ids)
    if not hp:
        return tuple(dense_blocks(cache, side, tbl).transpose(0, 2, 1, 3, 4).reshape(nbt, hk, mb * bs, d)
                     for side in schemes.SIDES)
    out = []
    for side in schemes.SIDES:
        sink, ring = hp[side]
        reps = -(-(mb * bs) // cache.tail_len)
        x = jnp.broadcast_to(ring[:, :, None], (nbt, hk, reps, cache.tail_len, d))
        x = x.reshape(nbt, hk, reps * cache.tail_len, d)[:, :, :mb * bs]   # position p: ring[p % tail_len]

        def page_block(j, x, side=side):
            blk = dense_blocks(cache, side, jax.lax.dynamic_slice_in_dim(tbl, j, 1, axis=1))[:, 0]  # [B, Hk, bs, D]
            cur = jax.lax.dynamic_slice_in_dim(x, j * bs, bs, axis=2)
            return jax.lax.dynamic_update_slice_in_dim(x, jnp.where((j < paged)[:, None, None, None], blk, cur),
                                                       j * bs, axis=2)
        x = jax.lax.fori_loop(cache.paged_from // bs, jnp.max(paged), page_block, x)
        out.append(jax.lax.dynamic_update_slice_in_dim(x, sink, 0, axis=2))
    return tuple(out)


def _dense_sources(cache: PagedKVCache, block_tables, seq_lens, seq_ids):
    """What `gather_dense` and `dense_tiles` read, after `check_read_args`: the block table clamped
    into range (unchecked indices - traced, or the decode entry's check_values=False - are clamped),
    per row the count of leading blocks served from pages (full and before the query's block), and
    per side its (sink, ring) rows [B, Hk, S | R, D] in float32 ({} for a cache without them)."""
    check_read_args(cache, block_tables, seq_lens, seq_ids)
    nbt, mb = block_tables.shape
    bs = cache.block_size
    tbl = jnp.clip(block_tables.astype(jnp.int32), 0, cache.num_blocks - 1)
    seq_lens = jnp.clip(seq_lens.astype(jnp.int32), 0, mb * bs)
    paged = jnp.maximum((seq_lens - 1) // bs, 0)
    hp = {}
    if cache.has_hp:
        sid = jnp.clip((jnp.arange(nbt) if seq_ids is None else seq_ids).astype(jnp.int32), 0, cache.max_seqs - 1)
        hp = {side: tuple(hp_storage.load(cache.cfg, {n: a[sid] for n, a in cache.hp_fields(part, side).items()})
                          for part in ("sink", "tail")) for side in schemes.SIDES}
    return tbl, paged, hp


def dense_tiles(cache: PagedKVCache, block_tables: jnp.ndarray, seq_lens: jnp.ndarray,
                seq_ids: jnp.ndarray | None = None):
    """`gather_dense` a key tile at a time: returns (read, L), where read(off, tile) -> (K, V), float32
    [B, Hk, tile, D], equals `gather_dense(...)[side][:, :, off:off + tile]` for any traced off in
    [0, L - tile] (tile static), L = max_blocks * block_size. Only the blocks the tile touches are
    dequantized, so a caller walking the context holds one tile, not the whole context."""
    nbt, mb = block_tables.shape
    bs = cache.block_size
    tbl, paged, hp = _dense_sources(cache, block_tables, seq_lens, seq_ids)

    def read(off, tile: int):
        m = min(mb, -(-tile // bs) + 1)                     # blocks a tile of this size can touch
        first = jnp.clip(off // bs, 0, mb - m)
        pos = off + jnp.arange(tile)
        local = pos - first * bs
        cols = jax.lax.dynamic_slice_in_dim(tbl, first, m, axis=1)
        out = []
        for side in schemes.SIDES:
            x = dense_blocks(cache, side, cols).transpose(0, 2, 1, 3, 4).reshape(nbt, cache.num_kv_heads, m * bs, -1)
            x = jnp.take(x, local, axis=2)
            if hp:
                sink, ring = hp[side]
                j = pos // bs
                from_page = (j[None, :] >= cache.paged_from // bs) & (j[None, :] < paged[:, None])   # [B, tile]
                x = jnp.where(from_page[:, None, :, None], x, jnp.take(ring, pos % cache.tail_len, axis=2))
                s = sink.shape[2]
                if s:
                    x = jnp.where((pos < s)[None, None, :, None], jnp.take(sink, jnp.clip(pos, 0, s - 1), axis=2), x)
            out.append(x)
        return tuple(out)
    return read, mb * bs


def dense_blocks(cache: PagedKVCache, side: str, tbl: jnp.ndarray) -> jnp.ndarray:
    """Pages of block ids tbl [B, m] (in range) dequantized: float32 [B, m, Hk, block_size, D]."""
    f = fields_from_pages(cache.cfg, side, {name: a[tbl] for name, a in cache.pages[side].items()})
    st = schemes.expand_static(cache.cfg, cache.static[side], 1) if cache.static else None
    x = schemes.dequantize_side(f, cache.cfg, side, cache.head_dim, st)
    return x.reshape(tbl.shape + (cache.num_kv_heads, cache.block_size, cache.head_dim))


def read_from_page(cache: PagedKVCache, positions: jnp.ndarray, seq_lens: jnp.ndarray) -> jnp.ndarray:
    """[B, P] bool: whether sequences of `seq_lens` [B] read positions [P] from their pages. A block
    is served quantized once it is full and the query (position seq_len - 1) is past it, and only
    from `paged_from` on: the token that completes a block still reads that block from the ring,
    exactly, and a whole-block sink is never read from a page. (Positions of a shorter sink are
    served from the sink whatever this says.)"""
    bs = cache.block_size
    j = positions // bs
    full = (j[None, :] + 1) * bs <= seq_lens[:, None] - 1
    return (positions[None, :] >= cache.paged_from) & full if cache.has_hp else jnp.ones_like(full)


def check_read_args(cache, block_tables, seq_lens, seq_ids, batch: int | None = None, values: bool = True):
    """Shared checks of the decode entry points (reference and kernels). values=False: shapes and
    dtypes only (the range checks read concrete arrays back to the host)."""
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    check_array(block_tables, "block_tables", ndim=2, integer=True)
    check_array(seq_lens, "seq_lens", ndim=1, integer=True)
    nbt, mb = block_tables.shape
    if seq_lens.shape[0] != nbt or (batch is not None and nbt != batch):
        raise ValueError(f"block_tables has {nbt} rows, seq_lens {seq_lens.shape[0]}"
                         + ("" if batch is None else f", the batch {batch}") + ": they must agree")
    bs = cache.block_size
    if values:
        check_range(seq_lens, "seq_lens", 0, mb * bs + 1,
                    f"lengths must be >= 0 and at most block_tables.shape[1] * block_size = {mb * bs} tokens")
    if values and is_concrete(block_tables, seq_lens):
        lens = np.asarray(seq_lens)[:, None]
        first = np.arange(mb)[None, :] * bs
        used = first < lens
        tbl = np.asarray(block_tables)
        if cache.has_hp:  # a block served from high precision only may have no page (NO_PAGE)
            paged = used & (first >= cache.paged_from) & (first + bs <= lens - 1)
            tbl = np.where(~paged & (tbl == NO_PAGE), 0, tbl)
        check_range(np.where(used, tbl, 0), "block_tables", 0, cache.num_blocks,
                    f"block ids must be < num_blocks={cache.num_blocks} for the blocks a sequence uses"
                    + (f" ({NO_PAGE}, no page, only for blocks served from high precision: the sink block, the "
                       "query's own block)" if cache.has_hp else ""))
    if seq_ids is not None:
        check_array(seq_ids, "seq_ids", ndim=1, integer=True)
        if seq_ids.shape[0] != nbt:
            raise ValueError(f"seq_ids has {seq_ids.shape[0]} entries for {nbt} sequences")
        if cache.has_hp and values:
            check_range(seq_ids, "seq_ids", 0, cache.max_seqs, f"sequence ids must be < max_seqs={cache.max_seqs}")
    elif cache.has_hp and nbt > cache.max_seqs:
        raise ValueError(f"block_tables has {nbt} rows but max_seqs={cache.max_seqs}: pass seq_ids")
