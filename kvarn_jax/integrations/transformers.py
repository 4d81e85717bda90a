"""`KVarNCache`: a transformers `Cache` whose full blocks are quantized by kvarn_jax.

    from kvarn_jax.integrations.transformers import KVarNCache
    out = model.generate(**inputs, past_key_values=KVarNCache("kvarn_k4v2_g128"), max_new_tokens=200)

Like transformers' own quantized caches (`QuantizedLayer`: quantized storage plus a high-precision
residual, dequantized on every update) but with kvarn_jax's schemes and the serving semantics of its
paged cache: per layer and sequence, the first `block_size` tokens (the attention sink) and the
partially filled last block stay in high precision, kept as the paged cache keeps them (the scheme's
`_hp` format: by default 16 bits, `kvarn_jax.cache.hp`); every other block is quantized, from those
values, once it is full. Every token a step attends to, its own included, is what that storage gives
back. A sink shorter than a block (`_sink{S}`) is the paged cache's and the engine's only.
A decode step attends to its own block in high precision (the block is quantized for storage right
after the step that fills it), exactly as `kvarn_jax.evaluation.serving_attention` does in teacher
forcing. A prefill attends to its own new tokens in high precision (as a serving prefill does) and to
earlier quantized blocks dequantized.

Memory and copies: new K/V enter kvarn_jax through DLPack (zero-copy for CPU and CUDA tensors; measured
here on CPU and on the H200, docs/design.md §5; CI tests CPU). The one copy on the way in is the
[B, H, T, D] -> [T, B*H, D] permute of each completed block (one block per layer every block_size
tokens, quantized one block per call so one compiled shape serves a whole generation). Quantized blocks
stay as jax arrays on the tensors' device, in a buffer that doubles when full (the jitted dequantize
compiles for O(log n) shapes). Each update dequantizes them in one call and hands the result to torch
zero-copy, then concatenates sink, blocks, tail and the new tokens (a torch copy: transformers caches
return one contiguous tensor). Static schemes (which need a calibration) are rejected. Beam search
reordering, batch selection and repetition are supported; cropping (assisted decoding) is not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

import jax
import jax.numpy as jnp
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import kvarn_jax as kj
from kvarn_jax.config import KVQuantConfig

from .dlpack import check_bhtd, quantize_bhtd, served_bhtd, to_torch, tokens_to_bhtd

Scheme = Union[str, KVQuantConfig]


def cache_kwargs(model, cache) -> dict:
    """Keyword arguments that pass `cache` to `model(...)`: transformers 5.20+ names the forward
    argument `cache`, earlier 5.x `past_key_values` (an unknown name would be silently ignored)."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _check_scheme(scheme: Scheme, block_size: int, arg: str = "scheme") -> KVQuantConfig:
    cfg = kj.parse(scheme)
    if cfg.static:
        raise ValueError(f"{arg} {cfg.name!r} needs per-head static scales from a Calibration; KVarNCache takes "
                         "dynamic schemes (e.g. kvarn_k4v2_g128, int8, fp8)")
    cfg.check_block_size(block_size)
    if cfg.sink_tokens:
        raise ValueError(f"{arg} {cfg.name!r}: KVarNCache keeps the whole first block as the sink; a shorter sink "
                         "(_sink) is served by kvarn_jax's paged cache and engine")
    return cfg


class KVarNLayer(CacheLayerMixin):
    """One decoder layer's cache: high-precision sink and tail, quantized full blocks in between."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, scheme: Scheme = "kvarn_k4v2_g128", block_size: int = 128):
        super().__init__()
        self.cfg = _check_scheme(scheme, block_size)
        self.block_size = block_size
        self.cumulative_length = 0
        self._reset_storage()

    def _reset_storage(self):
        self.sink_keys = self.sink_values = None    # [B, H, <= block_size, D], model dtype
        self.tail_keys = self.tail_values = None    # [B, H, < block_size, D], tokens after the quantized blocks
        self.quantized = None                       # QuantizedKV over capacity blocks, heads axis = B*H
        self.num_quantized_blocks = 0
        self.capacity_blocks = 0

    def __repr__(self):
        return f"KVarNLayer({self.cfg.name}, block_size={self.block_size}, tokens={self.cumulative_length})"

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_bhtd(key_states, "key_states")
        check_bhtd(value_states, "value_states")
        self.cfg.check_head_dim(key_states.shape[-1], "head_dim (key_states.shape[-1])")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        empty = key_states[:, :, :0]
        self.sink_keys = self.sink_values = self.tail_keys = self.tail_values = empty
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; return all K/V [B, H, tokens so far, D] for this step's attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_bhtd(key_states, "key_states")
        if key_states.shape != value_states.shape:
            raise ValueError(f"key_states {tuple(key_states.shape)} and value_states "
                             f"{tuple(value_states.shape)} must have the same shape")
        expect = (self.batch_size, self.num_heads, self.head_dim)
        got = (key_states.shape[0], key_states.shape[1], key_states.shape[3])
        if got != expect or key_states.dtype != self.dtype:
            raise ValueError(f"key_states [B, H, *, D] = {got} {key_states.dtype} does not match the cache's "
                             f"{expect} {self.dtype}")
        if not self.cfg.is_passthrough:  # as the high-precision storage keeps them
            key_states, value_states = served_bhtd(key_states, value_states, self.cfg)
        parts_k = [self.sink_keys]
        parts_v = [self.sink_values]
        if self.num_quantized_blocks:
            k_hat, v_hat = self._dequantized()
            parts_k.append(k_hat)
            parts_v.append(v_hat)
        keys = torch.cat(parts_k + [self.tail_keys, key_states], dim=2)
        values = torch.cat(parts_v + [self.tail_values, value_states], dim=2)
        self._store(key_states, value_states)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._reset_storage()
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("KVarNCache cannot be cropped (quantized blocks cannot be partially removed); "
                         "assisted/speculative decoding needs a cache that can roll back")

    def offload(self):
        raise ValueError("KVarNCache does not support offloading")

    def prefetch(self):
        raise ValueError("KVarNCache does not support offloading")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map_batch(beam_idx.to(self.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            idx = torch.as_tensor(indices, device=self.device)
            if idx.dtype == torch.bool:
                idx = idx.nonzero().flatten()
            self._map_batch(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    # ------------------------------------------------------------------ storage
    @property
    def high_precision_tokens(self) -> int:
        """Tokens per sequence currently held in the model dtype (sink + tail)."""
        return 0 if not self.is_initialized else self.sink_keys.shape[2] + self.tail_keys.shape[2]

    def nbytes(self) -> dict:
        """Bytes held now: quantized pages (all buffer capacity), high-precision sink + tail."""
        hp = 0 if not self.is_initialized else sum(
            t.numel() * t.element_size() for t in (self.sink_keys, self.sink_values, self.tail_keys, self.tail_values))
        q = 0 if self.quantized is None else sum(a.nbytes for a in jax.tree_util.tree_leaves(self.quantized))
        return {"quantized_bytes": q, "high_precision_bytes": hp}

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        bs = self.block_size
        n_sink = min(max(bs - self.cumulative_length, 0), k.shape[2])
        if n_sink:
            self.sink_keys = torch.cat([self.sink_keys, k[:, :, :n_sink]], dim=2)
            self.sink_values = torch.cat([self.sink_values, v[:, :, :n_sink]], dim=2)
        self.tail_keys = torch.cat([self.tail_keys, k[:, :, n_sink:]], dim=2)
        self.tail_values = torch.cat([self.tail_values, v[:, :, n_sink:]], dim=2)
        full = self.tail_keys.shape[2] // bs
        for i in range(full):  # one block per call: a single compiled quantize shape per cache
            blk = slice(i * bs, (i + 1) * bs)
            self._append_block(quantize_bhtd(self.tail_keys[:, :, blk], self.tail_values[:, :, blk], self.cfg))
        if full:
            self.tail_keys = self.tail_keys[:, :, full * bs:].clone()
            self.tail_values = self.tail_values[:, :, full * bs:].clone()
        self.cumulative_length += k.shape[2]

    def _tiles_per_block(self) -> int:
        return self.block_size // self.cfg.tile_tokens

    def _append_block(self, q: kj.QuantizedKV) -> None:
        tpb = self._tiles_per_block()
        used = self.num_quantized_blocks
        if used == self.capacity_blocks:
            # Double the buffer (zero fields dequantize to finite values that are never returned).
            cap = max(2 * self.capacity_blocks, 1)

            def grow(old, new):
                keep = [] if old is None else [old]
                filler = jnp.zeros(((cap - used - 1) * tpb,) + new.shape[1:], new.dtype)
                return jnp.concatenate(keep + [new, filler], axis=0)

            if self.quantized is None:
                self.quantized = jax.tree_util.tree_map(lambda new: grow(None, new), q)
            else:
                self.quantized = jax.tree_util.tree_map(grow, self.quantized, q)
            self.capacity_blocks = cap
        else:
            self.quantized = jax.tree_util.tree_map(
                lambda old, new: jax.lax.dynamic_update_slice_in_dim(old, new, used * tpb, axis=0), self.quantized, q)
        self.num_quantized_blocks = used + 1

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        k_hat, v_hat = kj.dequantize(self.quantized)
        n = self.num_quantized_blocks * self.block_size
        k_hat, v_hat = to_torch(k_hat), to_torch(v_hat)
        return tokens_to_bhtd(k_hat[:n], self.batch_size), tokens_to_bhtd(v_hat[:n], self.batch_size)

    def _map_batch(self, idx: torch.Tensor) -> None:
        """Apply a batch index (reorder/select/repeat) to every stored tensor."""
        for name in ("sink_keys", "sink_values", "tail_keys", "tail_values"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        if self.quantized is not None:
            b, h = self.batch_size, self.num_heads
            jidx = jnp.asarray(idx.cpu().numpy())

            def take(a):
                a = a.reshape((a.shape[0], b, h) + a.shape[2:])
                a = jnp.take(a, jidx, axis=1)
                return a.reshape((a.shape[0], a.shape[1] * h) + a.shape[3:])

            self.quantized = jax.tree_util.tree_map(take, self.quantized)
        self.batch_size = int(idx.shape[0])


class KVarNCache(Cache):
    """A transformers `Cache` storing K/V with a kvarn_jax scheme (module docstring for the semantics).

    scheme: one scheme string / KVQuantConfig for every layer (layers are created as the model calls
      them), a per-layer list, or the path of a layer-scheme file written by `kvarn-jax tune`.
    block_size: tokens per block (the sink is the first block); a multiple of every scheme's tile.
    """

    def __init__(self, scheme: Union[Scheme, Sequence[Scheme], str, os.PathLike] = "kvarn_k4v2_g128", *,
                 block_size: int = 128):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(scheme, (os.PathLike,)) or (isinstance(scheme, str) and scheme.endswith(".json")):
            from kvarn_jax.layer_config import load_layer_config
            scheme = load_layer_config(Path(scheme))
        self.block_size = block_size
        if isinstance(scheme, (str, KVQuantConfig)):
            self.scheme = _check_scheme(scheme, block_size)
            super().__init__(layers=[])
            self.layer_schemes = None
        else:
            schemes = list(scheme)
            if not schemes:
                raise ValueError("scheme must be a scheme string, a non-empty per-layer list, or a layer-scheme file")
            cfgs = [_check_scheme(s, block_size, f"scheme[{i}]") for i, s in enumerate(schemes)]
            self.scheme = None
            self.layer_schemes = cfgs
            super().__init__(layers=[KVarNLayer(c, block_size) for c in cfgs])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.layer_schemes is None:
            while len(self.layers) <= layer_idx:
                self.layers.append(KVarNLayer(self.scheme, self.block_size))
        elif layer_idx >= len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} is out of range: the per-layer schemes cover "
                             f"{len(self.layers)} layers")
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def nbytes(self) -> dict:
        """Bytes held now, summed over layers: {'quantized_bytes', 'high_precision_bytes'}."""
        total = {"quantized_bytes": 0, "high_precision_bytes": 0}
        for layer in self.layers:
            for key, val in layer.nbytes().items():
                total[key] += val
        return total

    def __repr__(self):
        what = self.scheme.name if self.scheme is not None else f"{len(self.layer_schemes)} per-layer schemes"
        return f"KVarNCache({what}, block_size={self.block_size}, layers={len(self.layers)})"
