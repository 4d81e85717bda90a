"""`LayerCaches`: every decoder layer's paged cache in a few buffers, for whole-model compiled steps.

The layers that share a scheme share one `PagedKVCache` (a *group*) whose pages, sink and tail hold
all of them back to back: layer j of a group of n layers owns blocks [j*num_blocks, (j+1)*num_blocks)
and sequence rows [j*max_seqs, (j+1)*max_seqs). A layer is addressed by offsetting block ids, slots
and sequence ids, so one kernel call reads one layer without slicing (or copying) its buffers, and
a compiled step over all layers carries a handful of arrays whatever the depth. One page table and
one set of sequence slots serve every layer. Static (calibrated) schemes keep each layer's
parameters stacked beside the group.

`stage`/`gather_dense`/`read_view` take layer-local ids (as the page table holds them) and a layer:
a static index, or (group, index in the group) with a traced index; `write_all` stores tokens and
`commit` quantizes completed blocks of every layer at once. Writes count, per sequence slot, the
tokens with a NaN or Inf key or value (`nonfinite`; stored as zeros, see `kvarn_jax.storage`), so
that a server can tell which request's model output went bad. A step that stages one write per
layer counts them all at once (`open_tally` / `close_tally`): per layer the counts are then running
elementwise sums, not a reduction and a scatter each (on GPUs, two kernels per layer). A group's
buffers stay under 2^31 elements (the kernels' 32-bit offsets): a scheme's layers are split into
several groups if needed.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import jax
import jax.numpy as jnp

from ..config import KVQuantConfig
from ..storage import token_absmax
from . import paged
from .memory import tree_bytes, memory_report
from .paged import PagedKVCache


MAX_BUFFER_ELEMENTS = 2 ** 31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCaches:
    """groups[g]: one `PagedKVCache` holding all layers of scheme g (num_blocks and max_seqs are the
    per-layer sizes times the group's layer count); statics[g]: those layers' static parameters
    stacked [n, ...] (None for dynamic schemes); layer_group / layer_index: where each decoder layer
    lives. num_blocks, max_seqs: the sizes of one layer. nonfinite: int32 [max_seqs], per sequence
    slot, the (token, layer) pairs written with a non-finite key or value (never reset: compare
    before and after a step)."""

    groups: tuple
    statics: tuple
    nonfinite: jnp.ndarray
    layer_group: tuple = dataclasses.field(metadata=dict(static=True))
    layer_index: tuple = dataclasses.field(metadata=dict(static=True))
    num_blocks: int = dataclasses.field(metadata=dict(static=True))
    max_seqs: int = dataclasses.field(metadata=dict(static=True))
    # per group while a tally is open: int32 [tokens] pairs, the (token, layer) writes since
    # `open_tally` with a non-finite value, and those `dropped_tokens` counts
    tally: tuple | None = None

    @classmethod
    def create(cls, schemes: Union[str, KVQuantConfig, Sequence], num_layers: int, *, num_blocks: int,
               block_size: int, num_kv_heads: int, head_dim: int, max_seqs: int, dtype=jnp.float16,
               calibration=None) -> "LayerCaches":
        """Empty caches: `schemes` is one scheme for every layer or a sequence of one per layer.
        calibration: a `Calibration` of all layers, for static schemes. Arguments are checked as
        `PagedKVCache.create` checks them (one layer at a time, naming it)."""
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        cfgs = ([KVQuantConfig.parse(schemes)] * num_layers if isinstance(schemes, (str, KVQuantConfig))
                else [KVQuantConfig.parse(s) for s in schemes])
        if len(cfgs) != num_layers:
            raise ValueError(f"{len(cfgs)} per-layer schemes for num_layers={num_layers}")
        # Groups: the layers of one scheme, in runs small enough that every buffer of a group holds
        # fewer than 2^31 elements (the Pallas kernels address a buffer with 32-bit offsets).
        members = []
        for cfg in dict.fromkeys(cfgs):
            one = jax.eval_shape(lambda cfg=cfg: PagedKVCache.create(
                cfg, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                max_seqs=max_seqs, dtype=dtype, calibration=None if not cfg.static or calibration is None
                else calibration.layer(cfgs.index(cfg))))
            per_layer = max(a.size for a in jax.tree.leaves(one) if a.ndim)
            if per_layer > MAX_BUFFER_ELEMENTS:
                raise ValueError(f"one layer's {cfg.name} cache needs a buffer of {per_layer} elements; at most "
                                 f"{MAX_BUFFER_ELEMENTS} are supported (fewer num_blocks or max_seqs)")
            step = max(1, MAX_BUFFER_ELEMENTS // per_layer)
            layers = [i for i, c in enumerate(cfgs) if c == cfg]
            members += [(cfg, layers[a:a + step]) for a in range(0, len(layers), step)]
        layer_group = [0] * num_layers
        layer_index = [0] * num_layers
        for g, (_, layers) in enumerate(members):
            for j, i in enumerate(layers):
                layer_group[i], layer_index[i] = g, j
        layer_group, layer_index = tuple(layer_group), tuple(layer_index)
        groups, statics = [], []
        for g, (cfg, layers) in enumerate(members):
            cal = calibration.layer(layers[0]) if cfg.static and calibration is not None else None
            flat = PagedKVCache.create(cfg, num_blocks=len(layers) * num_blocks, block_size=block_size,
                                       num_kv_heads=num_kv_heads, head_dim=head_dim,
                                       max_seqs=None if cfg.is_passthrough else len(layers) * max_seqs,
                                       dtype=dtype, calibration=cal)
            groups.append(dataclasses.replace(flat, static=None))
            if not cfg.static:
                statics.append(None)
                continue
            per_layer = []
            for i in layers:  # each layer's own calibrated parameters (checked as a one-layer cache checks them)
                try:
                    per_layer.append(PagedKVCache.create(
                        cfg, num_blocks=1, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        max_seqs=1, dtype=dtype, calibration=calibration.layer(i)).static)
                except ValueError as e:
                    raise ValueError(f"layer {i}: {e}") from None
            statics.append(jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer))
        return cls(groups=tuple(groups), statics=tuple(statics), nonfinite=jnp.zeros((max_seqs,), jnp.int32),
                   layer_group=layer_group, layer_index=layer_index, num_blocks=num_blocks, max_seqs=max_seqs)

    # ---------------------------------------------------------------- facts
    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def layer_schemes(self) -> list:
        return [self.groups[g].cfg for g in self.layer_group]

    @property
    def uniform(self) -> bool:
        """Every layer has the same scheme."""
        return len({c.cfg for c in self.groups}) == 1

    def runs(self) -> list:
        """[(group, first layer, layer count)]: consecutive layers that live in one group (a run's
        layers can be picked by a traced index within the group, e.g. in a `lax.scan`)."""
        out = []
        for i, g in enumerate(self.layer_group):
            if out and out[-1][0] == g and self.layer_index[i] == self.layer_index[i - 1] + 1:
                out[-1][2] += 1
            else:
                out.append([g, i, 1])
        return [tuple(r) for r in out]

    @property
    def dropped_tokens(self) -> jnp.ndarray:
        """(token, layer) pairs the writes did not store as given (see `PagedKVCache.dropped_tokens`);
        those with a non-finite value are also counted in `nonfinite`."""
        return sum(c.dropped_tokens for c in self.groups)

    def _count_nonfinite(self, k, v, slot_mapping, seq_ids) -> jnp.ndarray:
        """`nonfinite` plus the tokens of k, v ([..., tokens, Hk, D]; leading axes: layers) stored with
        a NaN or Inf (those the cache writes count: a slot and a sequence slot in range)."""
        bad = token_absmax(k, v) == jnp.inf  # the write's own test (one reduction, shared with it)
        bad = bad.reshape(-1, bad.shape[-1]).sum(0, dtype=jnp.int32)           # per token, over layers
        ok = self._counted(slot_mapping, seq_ids)
        return self.nonfinite.at[jnp.where(ok, seq_ids, self.max_seqs)].add(bad, mode="drop")

    def _counted(self, slot_mapping, seq_ids):
        """The tokens whose non-finite values `nonfinite` counts: a slot and a sequence slot in range."""
        return paged.carries_token(slot_mapping) & (seq_ids >= 0) & (seq_ids < self.max_seqs)

    # ---------------------------------------------------------------- one layer
    def locate(self, layer):
        """(group, index in the group) of a layer: a static int layer index, or a (group, index in the
        group) pair whose index may be traced (see `runs`)."""
        if isinstance(layer, tuple):
            return layer
        return self.layer_group[layer], self.layer_index[layer]

    def layer_cache(self, layer) -> tuple:
        """(the layer's group cache with the layer's static parameters, block offset, sequence offset)."""
        g, j = self.locate(layer)
        cache = self.groups[g]
        st = self.statics[g]
        if st is not None:
            cache = dataclasses.replace(cache, static=jax.tree.map(lambda a: a[j], st))
        return cache, j * self.num_blocks, j * self.max_seqs

    def _replace(self, layer, cache: PagedKVCache) -> "LayerCaches":
        g, _ = self.locate(layer)
        groups = list(self.groups)
        groups[g] = dataclasses.replace(cache, static=None)
        return dataclasses.replace(self, groups=tuple(groups))

    def _ids(self, cache, boff, soff, slot_mapping, seq_ids):
        # -1 (padding) and NO_PAGE keep their meaning in every layer
        slots = jnp.where(slot_mapping >= 0, slot_mapping + boff * cache.block_size, slot_mapping)
        return slots, None if seq_ids is None else seq_ids + soff

    def stage(self, layer, k, v, slot_mapping, seq_ids, positions, *,
              one_per_sequence: bool = False, past_sink: bool = False) -> "LayerCaches":
        """`paged.stage_tokens` into one layer (the decode step's write; blocks committed later). While
        a tally is open (`open_tally`) its counts are added to the tally; else counted right away.
        one_per_sequence, past_sink: as in `paged.write_plan`."""
        if self.tally is None:
            staged = self.open_tally(k.shape[0]).stage(layer, k, v, slot_mapping, seq_ids, positions,
                                                       one_per_sequence=one_per_sequence, past_sink=past_sink)
            return staged.close_tally(slot_mapping, seq_ids)
        cache, boff, soff = self.layer_cache(layer)
        slots, sid = self._ids(cache, boff, soff, slot_mapping, seq_ids)
        staged, changed = paged.stage_tokens_uncounted(cache, k, v, slots, seq_ids=sid, positions=positions,
                                                       one_per_sequence=one_per_sequence, past_sink=past_sink)
        g, _ = self.locate(layer)
        bad = (token_absmax(k, v) == jnp.inf) & self._counted(slot_mapping, seq_ids)
        tally = list(self.tally)
        # running sums, elementwise: GPUs fuse them into the write's own reduction
        tally[g] = tuple(t + f.astype(jnp.int32) for t, f in zip(tally[g], (bad, changed)))
        return dataclasses.replace(self._replace(layer, staged), tally=tuple(tally))

    def open_tally(self, tokens: int) -> "LayerCaches":
        """Start counting staged writes of `tokens` tokens in a tally (see `close_tally`)."""
        if self.tally is not None:
            raise ValueError("a tally is already open")
        z = jnp.zeros((tokens,), jnp.int32)
        return dataclasses.replace(self, tally=tuple((z, z) for _ in self.groups))

    def close_tally(self, slot_mapping, seq_ids) -> "LayerCaches":
        """Add the counts staged since `open_tally` to `nonfinite` (per sequence slot: slot_mapping and
        seq_ids, the writes' own) and each group's `dropped_tokens`, in one scatter and one sum per
        group; the tally is closed."""
        if self.tally is None:
            raise ValueError("no tally is open")
        groups = tuple(dataclasses.replace(c, dropped_tokens=c.dropped_tokens + jnp.sum(ch, dtype=jnp.int32))
                       for c, (_, ch) in zip(self.groups, self.tally))
        bad = sum(nf for nf, _ in self.tally)
        ok = self._counted(slot_mapping, seq_ids)
        nonfinite = self.nonfinite.at[jnp.where(ok, seq_ids, self.max_seqs)].add(bad, mode="drop")
        return dataclasses.replace(self, groups=groups, nonfinite=nonfinite, tally=None)

    def write_all(self, k, v, slot_mapping, seq_ids, positions, *, max_completed: int,
                  quantizer: str = "auto") -> "LayerCaches":
        """`paged.write_reference` of every layer's tokens in one call per scheme group: k, v [layers,
        tokens, Hk, D]; slot_mapping, seq_ids, positions [tokens] (the same for every layer).
        max_completed: a bound on the blocks the write completes in one layer (e.g. sequences x
        ceil(chunk / block_size) for a prefill chunk); completed blocks of all the group's layers are
        quantized together. quantizer: as in `commit`."""
        groups = list(self.groups)
        n = k.shape[1]
        for g, cache in enumerate(self.groups):
            layers = [i for i, gi in enumerate(self.layer_group) if gi == g]
            q = paged.auto_quantizer(cache) if quantizer == "auto" else quantizer
            kg, vg = k[jnp.asarray(layers)], v[jnp.asarray(layers)]                     # [n_g, tokens, Hk, D]
            off = jnp.arange(len(layers), dtype=jnp.int32)[:, None]
            if self.statics[g] is None:
                slots = jnp.where(slot_mapping[None] >= 0, slot_mapping[None] + off * self.num_blocks * cache.block_size,
                                  slot_mapping[None]).reshape(-1)
                sid = (seq_ids[None] + off * self.max_seqs).reshape(-1)
                pos = jnp.broadcast_to(positions[None], (len(layers), n)).reshape(-1)
                flat = (kg.reshape((-1,) + kg.shape[2:]), vg.reshape((-1,) + vg.shape[2:]))
                groups[g] = paged.write_reference(cache, *flat, slots, sid, pos, quantizer=q,
                                                  max_completed=len(layers) * max_completed)
                continue

            def one(c, xs, g=g, q=q):
                j, kj, vj = xs
                lc = dataclasses.replace(c, static=jax.tree.map(lambda a: a[j], self.statics[g]))
                slots = jnp.where(slot_mapping >= 0, slot_mapping + j * self.num_blocks * cache.block_size, slot_mapping)
                lc = paged.write_reference(lc, kj, vj, slots, seq_ids + j * self.max_seqs, positions, quantizer=q,
                                           max_completed=max_completed)
                return dataclasses.replace(lc, static=None), None
            groups[g] = jax.lax.scan(one, cache, (jnp.arange(len(layers)), kg, vg))[0]
        return dataclasses.replace(self, groups=tuple(groups),
                                   nonfinite=self._count_nonfinite(k, v, slot_mapping, seq_ids))

    def read_view(self, layer, block_tables, seq_ids):
        """(cache, block_tables, seq_ids) that address `layer` in its group: the arguments that
        `paged_decode_attention` or `gather_dense` take to read that layer."""
        cache, boff, soff = self.layer_cache(layer)
        return cache, jnp.where(block_tables >= 0, block_tables + boff, block_tables), seq_ids + soff

    def gather_dense(self, layer, block_tables, seq_lens, seq_ids):
        """`paged.gather_dense` of one layer."""
        cache, tables, sid = self.read_view(layer, block_tables, seq_ids)
        return paged.gather_dense(cache, tables, seq_lens, sid)

    def dense_tiles(self, layer, block_tables, seq_lens, seq_ids):
        """`paged.dense_tiles` of one layer."""
        cache, tables, sid = self.read_view(layer, block_tables, seq_ids)
        return paged.dense_tiles(cache, tables, seq_lens, sid)

    # ---------------------------------------------------------------- all layers
    def commit(self, block_ids, seq_ids, first_positions, *, quantizer: str = "auto") -> "LayerCaches":
        """`paged.commit_blocks` of the same blocks in every layer (entries with block id -1 are padding):
        one quantization over all layers of a group (a loop over layers for static schemes).
        quantizer: "auto" (`paged.auto_quantizer` per scheme), "reference", "pallas" or "pallas_interpret"."""
        groups = list(self.groups)
        for g, cache in enumerate(self.groups):
            if cache.cfg.is_passthrough:
                continue
            q = paged.auto_quantizer(cache) if quantizer == "auto" else quantizer
            n = self.layer_group.count(g)
            if self.statics[g] is None:
                off = jnp.arange(n, dtype=jnp.int32)[:, None]
                blk = jnp.where(block_ids[None] >= 0, block_ids[None] + off * self.num_blocks, -1).reshape(-1)
                sid = (seq_ids[None] + off * self.max_seqs).reshape(-1)
                pos = jnp.broadcast_to(first_positions[None], (n,) + first_positions.shape).reshape(-1)
                groups[g] = paged.commit_blocks(cache, blk, sid, pos, quantizer=q)
                continue

            def one(c, j, g=g, q=q):
                lc = dataclasses.replace(c, static=jax.tree.map(lambda a: a[j], self.statics[g]))
                blk = jnp.where(block_ids >= 0, block_ids + j * self.num_blocks, -1)
                lc = paged.commit_blocks(lc, blk, seq_ids + j * self.max_seqs, first_positions, quantizer=q)
                return dataclasses.replace(lc, static=None), None
            groups[g] = jax.lax.scan(one, cache, jnp.arange(n))[0]
        return dataclasses.replace(self, groups=tuple(groups))

    @property
    def paged_from(self) -> int:
        """The first position whose block some layer stores in a page (`PagedKVCache.paged_from`; 0
        with a passthrough layer, which pages every block): one page table serves every layer, so a
        block needs a page if any layer reads it from one."""
        return min(c.paged_from for c in self.groups)

    @property
    def sink_len(self) -> int:
        """The longest sink of any layer (0 if every layer is passthrough): a write whose positions are
        all at least this writes no sink (`stage(past_sink=True)`)."""
        return max(c.sink_len for c in self.groups)

    @property
    def hp_only_blocks(self) -> bool:
        """Whether blocks served only from high precision may go without a page (`paged.NO_PAGE`):
        every layer is quantized (a passthrough layer stores every token in its page)."""
        return all(c.has_hp for c in self.groups)

    def memory_report(self, *, hp_only_blocks: bool = False) -> dict:
        """`kvarn_jax.memory_report` summed over layers, counted per layer (tokens and max_seqs of one
        layer; "layers" the depth); with several schemes, "scheme" summarizes them. hp_only_blocks:
        as in `memory_report`, for the blocks no layer reads from a page (`paged_from`)."""
        reps = [memory_report(cache) for cache in self.groups]
        for g, r in enumerate(reps):
            if self.statics[g] is not None:
                st = tree_bytes(self.statics[g])
                r["static_bytes"] += st
                r["total_bytes"] += st
        out = dict(reps[0])
        for key in ("code_bytes", "metadata_bytes", "page_bytes", "sink_bytes", "tail_bytes", "static_bytes",
                    "total_bytes"):
            out[key] = sum(r[key] for r in reps)
        hp = any(c.has_hp for c in self.groups)
        held = 0
        if hp_only_blocks and self.hp_only_blocks:
            held = self.max_seqs * (1 + (self.paged_from > 0)) * self.block_size
        hk, d = self.groups[0].num_kv_heads, self.groups[0].head_dim
        out["layers"] = self.num_layers
        out["tokens"] = self.num_blocks * self.block_size + held
        out["hp_only_tokens"] = held
        out["max_seqs"] = self.max_seqs if hp else 0
        out["fp16_bytes"] = self.num_layers * out["tokens"] * hk * d * 4
        out["bytes_per_token_per_head"] = out["page_bytes"] / (self.num_layers * self.num_blocks * self.block_size * hk)
        out["capacity_vs_fp16"] = out["fp16_bytes"] / out["total_bytes"]
        out["layer_schemes"] = [c.name for c in self.layer_schemes]
        if not self.uniform:
            counts = {}
            for c in self.layer_schemes:
                counts[c.name] = counts.get(c.name, 0) + 1
            out["scheme"] = "per-layer: " + ", ".join(f"{n} x {name}" for name, n in counts.items())
        return out

    def layer(self, layer: int) -> PagedKVCache:
        """A standalone one-layer `PagedKVCache` (a copy of that layer's part; for inspection and tests)."""
        cache, boff, soff = self.layer_cache(layer)
        nb, ns = self.num_blocks, self.max_seqs
        pages = jax.tree.map(lambda a: a[boff:boff + nb], cache.pages)
        rows = {part: None if getattr(cache, part) is None else
                jax.tree.map(lambda a: a[soff:soff + ns], getattr(cache, part))
                for part in ("sink", "tail", "sink_meta", "tail_meta")}
        return dataclasses.replace(cache, pages=pages, num_blocks=nb, max_seqs=ns if cache.has_hp else 0, **rows)
