"""How one layer's flat uint8 vLLM KV-cache buffer maps, without copies, onto a `kvarn_jax.PagedKVCache`.

vLLM hands every attention layer a contiguous byte buffer of `num_blocks` pages (layer-outer layout,
so one layer's pages are one run of bytes). The bridge does not keep vLLM's block-major order inside
that run: it carves the buffer into one contiguous, 64-byte-aligned region per `PagedKVCache` page
leaf (field-major), because XLA imports a buffer through DLPack without copying only when it is dense
and 64-byte aligned. vLLM never reads the bytes itself (no zeroing, swapping or prefix-cache copies
are enabled for this backend), so the order inside the run is ours to choose.

    [pages.k.<field 0> for all blocks][pages.k.<field 1>]...[pages.v.<field n>]

The page fields come from the cache's pytree structure (`jax.eval_shape` of `PagedKVCache.create`),
never from a per-scheme table. The engine keeps each sequence's high-precision sink and tail rows in
blocks of the same pool (`HpUnits`: `hp_blocks_per_seq` blocks per live request, which vLLM allocates
and frees with the request; see `hp_pool`). `regions` / `carve` can also place sink/tail regions
after the pages (`hp_in_buffer`), as `torch_ops.bind` accepts for a cache used outside vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kvarn_jax
from kvarn_jax import KVQuantConfig

ALIGN = 64  # bytes: XLA's CPU client imports DLPack buffers zero-copy only at this alignment


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _keystr(path) -> str:
    """'pages.k.codes' from a pytree key path (attribute and dict keys only)."""
    parts = []
    for p in path:
        parts.append(str(getattr(p, "name", getattr(p, "key", p))))
    return ".".join(parts)


@dataclasses.dataclass(frozen=True)
class Field:
    """One leaf of the cache that lives in the vLLM buffer.

    key: pytree path ('pages.k.codes', 'sink.v', ...). shape: per block for pages (the leaf is
    [num_blocks, *shape]), the whole leaf for sink/tail. nbytes: bytes per block (pages) or in all (hp).
    """

    key: str
    shape: tuple
    dtype: str
    nbytes: int

    @property
    def per_block(self) -> bool:
        return self.key.startswith("pages.")


def _dummy_calibration(num_kv_heads: int, head_dim: int):
    z = jnp.zeros((num_kv_heads, head_dim), jnp.float32)
    return kvarn_jax.Calibration(z - 1, z + 1, z - 1, z + 1, tokens=1)


def unsupported(cfg: KVQuantConfig) -> str | None:
    """Why the bridge cannot serve a scheme, or None: its decode and its pool of sink/tail rows keep
    a whole block of 16-bit (or fp32) rows per sequence as the sink."""
    if cfg.sink_tokens:
        return (f"a {cfg.sink_tokens}-token sink (_sink{cfg.sink_tokens}); the bridge keeps the first block whole "
                "(drop the suffix)")
    if cfg.hp == "int8":
        return "int8 sink and tail rows (_hpint8); the bridge's pool keeps float rows (drop the suffix)"
    return None


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """The byte layout of one layer's cache for given scheme and sizes (independent of num_blocks).

    dtype: model dtype name, kept by the sink/tail. max_seqs: high-precision slots (vLLM's
    max_num_seqs). tail_blocks: 1, or 2 with speculative decoding (see `PagedKVCache.create`).
    """

    cfg: KVQuantConfig
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_seqs: int
    tail_blocks: int = 1

    def __post_init__(self):
        object.__setattr__(self, "cfg", KVQuantConfig.parse(self.cfg))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        why = unsupported(self.cfg)
        if why:
            raise ValueError(f"kvarn: the vLLM bridge does not support {self.cfg.name}: {why}")
        self.cfg.check_head_dim(self.head_dim)
        self.cfg.check_block_size(self.block_size)
        if not isinstance(self.max_seqs, int) or self.max_seqs <= 0:
            raise ValueError(f"max_seqs must be a positive int (vLLM's max_num_seqs), got {self.max_seqs!r}")

    # ------------------------------------------------------------------ structure
    def abstract_cache(self, num_blocks: int) -> kvarn_jax.PagedKVCache:
        """The cache's pytree with ShapeDtypeStruct leaves (nothing allocated)."""
        cal = _dummy_calibration(self.num_kv_heads, self.head_dim) if self.cfg.static else None
        return jax.eval_shape(lambda: kvarn_jax.PagedKVCache.create(
            self.cfg, num_blocks=num_blocks, block_size=self.block_size, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, max_seqs=self.max_seqs, dtype=self.dtype, tail_blocks=self.tail_blocks,
            calibration=cal))

    @functools.cached_property
    def fields(self) -> tuple:
        """Buffer-resident leaves in buffer order: page fields (per block), then sink and tail."""
        out = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.abstract_cache(1))[0]:
            key = _keystr(path)
            if not key.startswith(("pages.", "sink.", "tail.")):
                continue  # static calibration params and the dropped-token counter are small and separate
            shape = tuple(leaf.shape[1:]) if key.startswith("pages.") else tuple(leaf.shape)
            nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
            out.append(Field(key, shape, jnp.dtype(leaf.dtype).name, nbytes))
        pages = [f for f in out if f.per_block]
        hp = [f for f in out if not f.per_block]
        return tuple(pages + hp)

    @property
    def format_page_bytes(self) -> int:
        """Bytes the format needs per block (all page fields of K and V, metadata included)."""
        return sum(f.nbytes for f in self.fields if f.per_block)

    @property
    def hp_bytes(self) -> int:
        """Bytes of the high-precision sink + tail storage: max_seqs * (1 + tail_blocks) blocks in `dtype`."""
        return sum(_round_up(f.nbytes, ALIGN) for f in self.fields if not f.per_block)

    @property
    def alignment_slack(self) -> int:
        """Bytes per block reserved so that every page region can start 64-byte aligned.

        Zero in the usual case (every field's bytes per block are a multiple of 64, e.g. block sizes
        that are multiples of 32); otherwise one alignment unit per field.
        """
        pages = [f for f in self.fields if f.per_block]
        return 0 if all(f.nbytes % ALIGN == 0 for f in pages) else ALIGN * len(pages)

    # ------------------------------------------------------------------ sizing for vLLM
    def vllm_page_bytes(self, hp_share: int = 0) -> int:
        """The page size to declare to vLLM: format bytes + alignment slack + `hp_share`, rounded up
        so that it is a whole number of bytes per token (vLLM's page is [1, block_size, C]) and a
        multiple of 64 (so every layer's run of pages starts aligned)."""
        need = self.format_page_bytes + self.alignment_slack + hp_share
        unit = self.block_size * ALIGN // math.gcd(self.block_size, ALIGN)
        return _round_up(need, unit)

    @property
    def hp_seq_bytes(self) -> int:
        """Bytes of one sequence's high-precision sink + tail (all four leaves, this layer)."""
        return sum(f.nbytes for f in self.fields if not f.per_block) // self.max_seqs

    @property
    def hp_blocks_per_seq(self) -> int:
        """Blocks of this layer's pages that hold one sequence's sink and tail rows (`HpUnits`)."""
        return -(-self.hp_seq_bytes // self.format_page_bytes) if self.hp_seq_bytes else 0

    # ------------------------------------------------------------------ placement
    def regions(self, num_blocks: int, hp_in_buffer: bool) -> dict:
        """{key: (byte offset, full leaf shape, dtype)} of every buffer-resident leaf, and the total
        bytes they span, as ('__end__', total)."""
        out = {}
        off = 0
        for f in self.fields:
            if not f.per_block and not hp_in_buffer:
                continue
            off = _round_up(off, ALIGN)
            shape = (num_blocks,) + f.shape if f.per_block else f.shape
            out[f.key] = (off, shape, f.dtype)
            off += f.nbytes * (num_blocks if f.per_block else 1)
        out["__end__"] = off
        return out


# ---------------------------------------------------------------------- one page size for several schemes
# With per-layer schemes (a layer config) every layer still declares the same page size to vLLM: its
# `customize_spec` hook is told the spec, not which layer it belongs to, so a per-layer size could
# only be matched to its layer by call order. Every page is therefore padded to the largest layer's
# need; a layer of a smaller scheme leaves the rest of each page unused (`padding_report`).
def shared_page_bytes(layouts) -> int:
    """The page size every layer declares: the largest of the layers' `vllm_page_bytes`."""
    return max(lay.vllm_page_bytes() for lay in set(layouts))


def hp_blocks_per_seq(layouts) -> int:
    """Blocks each live sequence holds for its sink and tail: the most any layer needs (every layer
    keeps a sequence's rows in the same blocks, each in its own buffer)."""
    return max(lay.hp_blocks_per_seq for lay in set(layouts))


def padding_report(layouts, page_bytes: int) -> dict:
    """How much of a shared page each scheme's layers use: {scheme: (layers, format bytes per block,
    fraction of the page unused by the format)}."""
    out = {}
    for lay in layouts:
        n = out.get(lay.cfg.name, (0,))[0] + 1
        out[lay.cfg.name] = (n, lay.format_page_bytes, 1 - lay.format_page_bytes / page_bytes)
    return out


def carve(buffer, layout: PageLayout, num_blocks: int, hp_buffers: dict | None = None) -> dict:
    """Torch views {key: tensor} of every buffer-resident leaf of `layout` inside `buffer`.

    buffer: a contiguous 1-D torch uint8 tensor (one layer's pages, as vLLM allocated them).
    hp_buffers: {'sink.k': tensor, ...} when the sink/tail live outside the buffer (KV budget found
      by profiling); None when they are carved from the buffer after the pages.
    Every view shares `buffer`'s (or the hp tensor's) memory; nothing is copied.
    """
    import torch

    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"buffer must be a contiguous 1-D uint8 tensor, got {buffer.dtype} "
                         f"shape {tuple(buffer.shape)}")
    if buffer.data_ptr() % ALIGN:
        raise ValueError(f"buffer must start {ALIGN}-byte aligned for zero-copy DLPack import "
                         f"(address % {ALIGN} = {buffer.data_ptr() % ALIGN})")
    regions = layout.regions(num_blocks, hp_in_buffer=hp_buffers is None)
    end = regions.pop("__end__")
    if end > buffer.numel():
        raise ValueError(f"the KV cache buffer has {buffer.numel()} bytes but {layout.cfg.name} with {num_blocks} "
                         f"blocks{' and its sink/tail' if hp_buffers is None else ''} needs {end}")
    views = {}
    for key, (off, shape, dtype) in regions.items():
        tdt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
        views[key] = buffer[off:off + n].view(tdt).view(shape)
    if hp_buffers is not None:
        for f in layout.fields:
            if f.per_block:
                continue
            t = hp_buffers.get(f.key)
            if t is None or tuple(t.shape) != f.shape or str(t.dtype) != f"torch.{f.dtype}":
                raise ValueError(f"hp_buffers[{f.key!r}] must be a {f.dtype} tensor of shape {f.shape}")
            views[f.key] = t
    return views


def allocate_hp(layout: PageLayout, device) -> dict:
    """Zeroed sink/tail tensors outside vLLM's buffer, `max_seqs` rows each: views of one
    allocation, back to back in `fields` order (as `regions` places them inside a buffer), so that
    the bridge writes them with one indexed copy. The engine uses them as the step's staging rows
    (`hp_pool`)."""
    import torch

    hp = [f for f in layout.fields if not f.per_block]
    dtypes = {f.dtype for f in hp}
    if len(dtypes) != 1:
        raise ValueError(f"{layout.cfg.name}: the sink/tail leaves have several dtypes {sorted(dtypes)}; the bridge "
                         "keeps them in one allocation of one dtype")
    sizes = [int(np.prod(f.shape, dtype=np.int64)) for f in hp]
    flat = torch.zeros(sum(sizes), dtype=getattr(torch, dtypes.pop()), device=device)
    out, off = {}, 0
    for f, n in zip(hp, sizes):
        out[f.key] = flat[off:off + n].view(f.shape)
        off += n
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class HpUnits:
    """Where a sequence's sink and tail rows live in the pages of the blocks it holds for them.

    The bytes of block b are one run of `n_i` bytes in every page field's region (field-major), so
    a sequence's rows are cut into units of `unit` bytes (a divisor of a row and of every field run
    and region offset) and unit j of its rows goes to the j-th unit of its blocks, block by block,
    field by field. The staging rows (`allocate_hp`, one slot per batch row) use the same units:
    slot r's unit j is at `stage_base[j] + r * stage_step[j]`. Both as unit indices into the bytes.

    block_base / block_step: [units per block] - block b's k-th unit is block_base[k] + b * block_step[k].
    row_units: units per row (one token and head of one leaf); leaf_start: {leaf key: its first unit}.
    """

    unit: int
    units_per_seq: int
    block_base: np.ndarray
    block_step: np.ndarray
    stage_base: np.ndarray
    stage_step: np.ndarray
    row_units: int
    leaf_start: dict

    @classmethod
    def build(cls, layout: PageLayout, num_blocks: int) -> "HpUnits":
        regions = layout.regions(num_blocks, hp_in_buffer=False)
        pages = [f for f in layout.fields if f.per_block]
        hp = [f for f in layout.fields if not f.per_block]
        keys = tuple(f.key for f in hp)
        if keys != ("sink.k", "sink.v", "tail.k", "tail.v"):
            raise ValueError(f"kvarn: {layout.cfg.name} keeps {keys} in high precision; the pool holds sink.k, "
                             "sink.v, tail.k, tail.v rows")
        row = layout.head_dim * jnp.dtype(hp[0].dtype).itemsize
        slot_bytes = [f.nbytes // layout.max_seqs for f in hp]
        unit = math.gcd(row, *(f.nbytes for f in pages), *(regions[f.key][0] for f in pages))
        if unit < 8:
            raise ValueError(f"kvarn: {layout.cfg.name} at block_size={layout.block_size} has page fields of "
                             f"{[f.nbytes for f in pages]} B per block, which share no 8-byte unit with its "
                             f"{row}-byte high-precision rows; use a block size that is a multiple of 32")
        base, step = [], []
        for f in pages:
            n = f.nbytes // unit
            base.append(regions[f.key][0] // unit + np.arange(n))
            step.append(np.full(n, n))
        sbase, sstep, start, off = [], [], [], 0
        for f, b in zip(hp, slot_bytes):
            start.append(sum(x.shape[0] for x in sbase))
            sbase.append(off // unit + np.arange(b // unit))
            sstep.append(np.full(b // unit, b // unit))
            off += f.nbytes
        return cls(unit, sum(slot_bytes) // unit, np.concatenate(base), np.concatenate(step),
                   np.concatenate(sbase), np.concatenate(sstep), row // unit, dict(zip(keys, start)))

    def seq_units(self, hp_blocks):
        """[rows, units_per_seq] unit indices of each row's rows in its blocks (hp_blocks: [rows, H]
        block ids, torch, on the cache's device)."""
        import torch

        dev = hp_blocks.device
        base = torch.from_numpy(self.block_base).to(dev)
        step = torch.from_numpy(self.block_step).to(dev)
        units = base[None, None, :] + hp_blocks.to(torch.int64)[:, :, None] * step[None, None, :]
        return units.reshape(hp_blocks.shape[0], -1)[:, :self.units_per_seq]

    def stage_units(self, rows: int, device):
        """[rows, units_per_seq] unit indices of staging slots 0..rows-1."""
        import torch

        base = torch.from_numpy(self.stage_base).to(device)
        step = torch.from_numpy(self.stage_step).to(device)
        return base[None, :] + torch.arange(rows, device=device)[:, None] * step[None, :]


def to_jax(views: dict, layout: PageLayout, num_blocks: int, static: Any = None) -> kvarn_jax.PagedKVCache:
    """The `PagedKVCache` whose leaves are the torch `views`, imported through DLPack without copies.

    static: the calibrated parameters of a static scheme (the `static` field of a cache created with
    the layer's `Calibration`); None otherwise.
    """
    abstract = layout.abstract_cache(num_blocks)

    def leaf(path, sds):
        key = _keystr(path)
        if key in views:
            arr = jax.dlpack.from_dlpack(views[key])
            if arr.shape != sds.shape or arr.dtype != sds.dtype:
                raise ValueError(f"{key}: view {arr.shape} {arr.dtype} does not match the cache leaf "
                                 f"{sds.shape} {sds.dtype}")
            return arr
        if key == "dropped_tokens":
            return jnp.zeros((), jnp.int32)
        if key.startswith("static."):
            if static is None:
                raise ValueError(f"{layout.cfg.name} needs its calibrated parameters (static)")
            val = static
            for part in key.split(".")[1:]:
                val = val[part]
            return jnp.asarray(val, sds.dtype)
        raise ValueError(f"cache leaf {key} has no storage")

    return jax.tree_util.tree_map_with_path(leaf, abstract)

