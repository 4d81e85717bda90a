"""Caches sharded over KV heads across a device mesh (tensor parallelism).

Every head-carrying buffer of a `PagedKVCache` has the head axis second (pages [num_blocks, Hk, ...],
sink and tail [max_seqs, Hk, ...], stacked static parameters [layers, Hk, ...]), and KVarN's
rotation, Sinkhorn and scales are per head, so splitting that axis over a mesh axis gives each
device a cache of its own heads that it writes and reads with the unchanged single-device code
under `jax.shard_map`: no gathers, no communication, and every device's part bit-identical to the
same heads of a single-device cache. Block tables, lengths and slots are the same on every device.

`on_heads` runs a function of caches and head-split arrays on each device's own heads (a
`jax.shard_map` with the specs below); `local`/`global_` switch the caches' static head count
between the whole cache and one device's part, which is what such a function sees.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .layers import LayerCaches
from .paged import PagedKVCache


def head_specs(tree, axis: str):
    """PartitionSpecs for a cache pytree (`PagedKVCache` or `LayerCaches`): head axis (second) over
    `axis` for every array of 2+ dimensions, scalars (counters) replicated."""
    return jax.tree.map(lambda a: P(None, axis) if a.ndim >= 2 else P(), tree)


def check_divides(num_kv_heads: int, shards: int, what: str = "tensor_parallel") -> None:
    if num_kv_heads % shards:
        raise ValueError(f"{what}={shards} does not divide num_kv_heads={num_kv_heads}: the KV cache is split "
                         f"over KV heads (use a divisor of {num_kv_heads})")


def _with_heads(caches, fn):
    if isinstance(caches, PagedKVCache):
        return dataclasses.replace(caches, num_kv_heads=fn(caches.num_kv_heads))
    if isinstance(caches, LayerCaches):
        return dataclasses.replace(caches, groups=tuple(_with_heads(c, fn) for c in caches.groups))
    raise TypeError(f"expected a PagedKVCache or LayerCaches, got {type(caches).__name__}")


def local(caches, shards: int):
    """The caches as one of `shards` devices holds them (static head count divided)."""
    return _with_heads(caches, lambda h: h // shards)


def global_(caches, shards: int):
    """The inverse of `local`."""
    return _with_heads(caches, lambda h: h * shards)


def shardings(tree, mesh, axis: str):
    """NamedShardings of `head_specs`, for placing or creating caches on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), head_specs(tree, axis),
                        is_leaf=lambda x: isinstance(x, P))


@dataclasses.dataclass(frozen=True)
class HeadParallel:
    """Tensor parallelism over one axis of a device mesh: attention heads, KV-cache heads and the MLP's
    hidden units split over `axis` (Megatron-style; `models.llama.head_parallel_specs` places a
    model's weights)."""

    mesh: Mesh
    axis: str = "tp"

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def check(self, cfg) -> None:
        """ValueError naming what the mesh size does not divide (cfg: a model config with num_kv_heads,
        num_heads and intermediate_size)."""
        for name in ("num_kv_heads", "num_heads", "intermediate_size"):
            if getattr(cfg, name) % self.size:
                raise ValueError(f"tensor_parallel={self.size} does not divide the model's {name}="
                                 f"{getattr(cfg, name)}: heads and MLP units are split evenly over devices")


def _agree(caches: LayerCaches, axis: str) -> LayerCaches:
    """The replicated counters made equal on every device (they count per token, and a token's heads
    live on several devices): a non-finite key or value seen on one device's heads counts everywhere."""
    if isinstance(caches, PagedKVCache):
        return dataclasses.replace(caches, dropped_tokens=jax.lax.pmax(caches.dropped_tokens, axis))
    tally = None if caches.tally is None else jax.tree.map(lambda t: jax.lax.pmax(t, axis), caches.tally)
    return dataclasses.replace(caches, nonfinite=jax.lax.pmax(caches.nonfinite, axis), tally=tally,
                               groups=tuple(_agree(c, axis) for c in caches.groups))


def on_heads(tp: HeadParallel | None, fn, args, kinds, out_kinds):
    """fn(*args), run on each device's own heads when `tp` is given (`jax.shard_map`; no
    communication). kinds / out_kinds per argument / result: "caches" (a `LayerCaches`, split on its
    head axis), "rep" (the same on every device), or an int: the position of an array's head axis."""
    if tp is None:
        return fn(*args)
    caches = next((a for a, k in zip(args, kinds) if k == "caches"), None)

    def spec(kind, x=None):
        if kind == "caches":
            return head_specs(caches, tp.axis)
        if kind == "rep":
            return jax.tree.map(lambda _: P(), x)
        return P(*([None] * kind), tp.axis)

    def local_fn(*xs):
        xs = [local(x, tp.size) if k == "caches" else x for k, x in zip(kinds, xs)]
        out = fn(*xs)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(_agree(global_(o, tp.size), tp.axis) if k == "caches" else o for k, o in zip(out_kinds, out))
    out = jax.shard_map(local_fn, mesh=tp.mesh, in_specs=tuple(spec(k, a) for k, a in zip(kinds, args)),
                        out_specs=tuple(spec(k) for k in out_kinds), check_vma=False)(*args)
    return out if len(out_kinds) > 1 else out[0]
