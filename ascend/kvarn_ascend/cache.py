"""`AscendPagedKVCache`: kvarn_jax's paged quantized KV cache on an Ascend NPU (torch tensors,
updated in place), written and read through the op table (`ops.call`).

Semantics are kvarn_jax's (README "The paged cache"): token i goes to slot
`slot_mapping[i] = block_id * block_size + offset` (-1 = padding); the first block of every sequence
(the attention sink) and its partial last block stay in high precision (the model dtype); a block is
quantized into its page when its last slot is written; reads take a block from its page only when
it is full, not the sink and not the block of the query (position seq_len - 1). What runs natively and what does not:

- int8, int4 (per token and head, asymmetric): store npu_dynamic_quant_asymmetric +
  npu_scatter_pa_kv_cache; decode by the fused attention with per-token antiquant (int8 paged,
  mode 5; int4 cannot be paged by the op, so its blocks are gathered first, mode 3).
- int8_static, int4_static (per channel, calibrated): store npu_quantize (float32 input, float32
  scales: exact) + npu_scatter_pa_kv_cache; decode by the fused attention with per-channel antiquant
  (mode 0; int4 gathered).
- int4 codes (8 per int32, as the quantize ops return them and the fused attention reads them) are
  written by npu_scatter_pa_kv_cache as their bytes, an int8 view [..., D/2]: the scatter takes
  float16, bfloat16 and int8 only on Atlas A2/A3.
- fp16, bf16: npu_scatter_pa_kv_cache; fused paged attention.
- kvarn_*, kivi_*: no CANN op does 2-bit codes or Sinkhorn: store in torch ops (Hadamard matmul,
  Sinkhorn, RTN, pack); decode dequantizes the needed blocks in torch, then fused attention.

The high-precision blocks live in one paged ND tensor per side, `hp[side]`
[max_seqs * (1 + tail_blocks), block_size, Hk, D]: block `s * (1 + tail_blocks)` is sequence s's
sink, the next `tail_blocks` its ring (position p at ring block (p % ring_len) // block_size). A
native decode attends over the quantized pages and over the high-precision blocks with two fused
calls and merges them with their softmax log-sum-exp (the documented ring-attention merge).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

import jax.numpy as jnp
import numpy as np
import torch

from kvarn_jax import schemes
from kvarn_jax.cache.paged import fields_from_pages
from kvarn_jax.config import KVQuantConfig
from kvarn_jax.storage import QUANT_MAX

from . import cpu_semantics, kvarn_torch, npu, ops

SIDES = ("k", "v")
FIA = "npu_fused_infer_attention_score"
SCATTER = "npu_scatter_pa_kv_cache"
SUPPORTED = ("int8", "int4", "int8_static", "int4_static", "fp16", "bf16",
             "kvarn_k{2,4,8}v{2,4,8}_g{32,64,128}", "kivi_k{2,4}v{2,4}_g{32,64,128}")
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_JAX_DTYPES = {t: n for n, t in _TORCH_DTYPES.items()}


def scheme_kind(cfg: KVQuantConfig, head_dim: int | None = None) -> str:
    """'int_dynamic', 'int_static', 'passthrough' or 'tiled'; ValueError for schemes the NPU cannot hold."""
    if cfg.clip:
        raise ValueError(f"kv_cache_dtype {cfg.name!r} cannot be held by the Ascend cache: its torch quantizer has no "
                         f"clipped-range search; use {cfg.name.rsplit('_clip', 1)[0]!r}")
    if cfg.method == "passthrough" and cfg.dtype in _TORCH_DTYPES:
        return "passthrough"
    if cfg.method in ("kvarn", "kivi"):
        return "tiled"
    if cfg.method == "int" and cfg.k_bits == cfg.v_bits and cfg.k_bits in (4, 8) and (
            cfg.group == 0 or cfg.group == head_dim):
        return "int_static" if cfg.static else "int_dynamic"
    why = {"fp8": "the fused attention has no fp8 KV input on Atlas A2/A3",
           "passthrough": "the fused attention takes float16/bfloat16 KV only"}.get(
        cfg.method, "the fused attention dequantizes int8/int4 only, K and V of one dtype, per token or per "
                    "channel (no channel groups)")
    raise ValueError(f"kv_cache_dtype {cfg.name!r} cannot be held by the Ascend cache: {why}. Supported: "
                     f"{', '.join(SUPPORTED)}")


_ALIGN = 64  # bytes: the start of each field carved from a caller's buffer (over_buffers)


def page_fields(scheme: Union[str, KVQuantConfig], block_size: int, num_kv_heads: int, head_dim: int,
                dtype=torch.bfloat16) -> dict:
    """{side: {field: (shape of one block, torch dtype)}} of the quantized pages (see AscendPagedKVCache)."""
    cfg = KVQuantConfig.parse(scheme)
    kind = scheme_kind(cfg, head_dim)
    bs, hk, d = block_size, num_kv_heads, head_dim
    out = {}
    for s in SIDES:
        if kind == "passthrough":
            out[s] = {"values": ((bs, hk, d), dtype)}
        elif kind == "tiled":  # kvarn_jax's fields; scales and zero points in the model dtype, as it keeps them
            tpb = bs // cfg.tile_tokens
            out[s] = {name: ((hk, tpb) + shape, torch.uint8 if np.dtype(dt) == np.uint8 else dtype)
                      for name, (shape, dt) in schemes.side_fields(cfg, s, d, _JAX_DTYPES[dtype]).items()}
        else:
            out[s] = {"codes": ((bs, hk, d), torch.int8) if cfg.k_bits == 8 else ((bs, hk, d // 8), torch.int32)}
            if kind == "int_dynamic":
                out[s]["scale"] = ((hk, bs), torch.float32)
                out[s]["offset"] = ((hk, bs), torch.float32)
    return out


def page_bytes(scheme: Union[str, KVQuantConfig], block_size: int, num_kv_heads: int, head_dim: int,
               dtype=torch.bfloat16) -> dict:
    """{side: bytes of one block's page} (without the high-precision sink/tail)."""
    return {s: sum(math.prod(shape) * dt.itemsize for shape, dt in f.values())
            for s, f in page_fields(scheme, block_size, num_kv_heads, head_dim, dtype).items()}


def _int_dtype(bits: int):
    return torch.int8 if bits == 8 else torch.quint4x2


@dataclasses.dataclass(frozen=True, eq=False)
class AscendPagedKVCache:
    """One layer's paged cache. Tensors are updated in place by `write`.

    pages[side]: int schemes {"codes": int8 [blocks, bs, Hk, D] or int32 [blocks, bs, Hk, D/8] (8 int4
      each), dynamic ones also "scale", "offset": float32 [blocks, Hk, bs] with `x = (code + offset) * scale`};
      fp16/bf16 {"values": [blocks, bs, Hk, D]}; kvarn/kivi: kvarn_jax's fields [blocks, Hk, tiles, ...].
    hp[side]: high-precision sink and ring blocks (see the module docstring), None for fp16/bf16.
    static[side]: calibrated {"scale", "zero"} [Hk, D] in the model dtype (kvarn_jax's), for the static schemes.
    """

    cfg: KVQuantConfig
    kind: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    max_seqs: int
    tail_blocks: int
    dtype: torch.dtype
    backend: str
    pages: dict
    hp: Union[dict, None]
    static: Union[dict, None]

    # ------------------------------------------------------------------------------------ create
    @classmethod
    def create(cls, scheme: Union[str, KVQuantConfig], *, num_blocks: int, block_size: int, num_kv_heads: int,
               head_dim: int, max_seqs: int | None = None, dtype=torch.bfloat16, tail_blocks: int = 1,
               calibration=None, backend: str = "auto", device=None) -> "AscendPagedKVCache":
        """An empty cache. dtype: the model dtype (float16 or bfloat16; the fused attention's query
        dtype); backend: "npu", "cpu" (the CPU semantics) or "auto"; device: default "npu" when the
        backend is the NPU, else "cpu". calibration: one layer's kvarn_jax.Calibration (static schemes)."""
        backend = npu.resolve_backend(backend)
        device = torch.device(device if device is not None else ("npu" if backend == "npu" else "cpu"))

        def zeros(side, shape, dt):
            return torch.zeros(shape, dtype=dt, device=device)

        return cls._build(scheme, num_blocks, block_size, num_kv_heads, head_dim, max_seqs, dtype, tail_blocks,
                          calibration, backend, device, zeros, None)

    @classmethod
    def over_buffers(cls, scheme: Union[str, KVQuantConfig], buffers: dict, *, hp: Union[dict, None],
                     block_size: int, num_kv_heads: int, head_dim: int, max_seqs: int | None = None,
                     dtype=torch.bfloat16, tail_blocks: int = 1, calibration=None,
                     backend: str = "auto") -> "AscendPagedKVCache":
        """The cache with its pages in memory the caller owns: buffers {"k", "v"} are contiguous tensors of
        any dtype whose first axis is the block (vLLM's per-layer KV cache, [num_blocks, block_size, Hk, D]),
        each holding one side's fields field after field (64-byte aligned); hp {"k", "v"}: the sink/tail
        blocks [max_seqs * (1 + tail_blocks), block_size, Hk, D] in `dtype` (None for fp16/bf16).
        ValueError when a side's fields do not fit its buffer (`page_bytes` per block)."""
        backend = npu.resolve_backend(backend)
        if not isinstance(buffers, dict) or set(buffers) != set(SIDES) or not isinstance(buffers["k"], torch.Tensor):
            raise ValueError("buffers must be {'k': tensor, 'v': tensor}")
        nb = buffers["k"].shape[0]
        device = buffers["k"].device
        flat, used = {}, {}
        for s in SIDES:
            b = buffers[s]
            if not isinstance(b, torch.Tensor) or not b.is_contiguous() or b.shape[0] != nb or b.device != device:
                raise ValueError(f"buffers[{s!r}] must be a contiguous tensor on {device} with {nb} blocks "
                                 "(its first axis), as buffers['k']")
            flat[s], used[s] = b.view(torch.uint8).reshape(-1), 0

        def take(side, shape, dt):
            n = math.prod(shape) * dt.itemsize
            start = -(-used[side] // _ALIGN) * _ALIGN
            if start + n > flat[side].numel():
                need = page_bytes(scheme, block_size, num_kv_heads, head_dim, dtype)[side]
                raise ValueError(f"the {side} buffer has {flat[side].numel() // nb} bytes per block, fewer than "
                                 f"{scheme} needs ({need})")
            used[side] = start + n
            return flat[side][start:start + n].view(dt).view(shape)

        return cls._build(scheme, nb, block_size, num_kv_heads, head_dim, max_seqs, dtype, tail_blocks, calibration,
                          backend, device, take, hp)

    @classmethod
    def _build(cls, scheme, num_blocks, block_size, num_kv_heads, head_dim, max_seqs, dtype, tail_blocks,
               calibration, backend, device, alloc, hp):
        cfg = KVQuantConfig.parse(scheme)
        for name, val in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                          ("block_size", block_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        kind = scheme_kind(cfg, head_dim)
        cfg.check_head_dim(head_dim)
        cfg.check_block_size(block_size)
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16 (the fused attention's query dtypes), "
                             f"got {dtype}")
        if kind == "passthrough" and _TORCH_DTYPES[cfg.dtype] != dtype:
            raise ValueError(f"dtype {dtype} must match the passthrough scheme {cfg.name}")
        _check_alignment(cfg, kind, block_size, head_dim)
        if num_kv_heads > 256:
            raise ValueError(f"num_kv_heads={num_kv_heads} exceeds the fused attention's 256")
        nb, bs, hk, d = num_blocks, block_size, num_kv_heads, head_dim
        if kind == "passthrough":
            max_seqs, tail_blocks = 0, 0
        else:
            if not isinstance(max_seqs, int) or isinstance(max_seqs, bool) or max_seqs <= 0:
                raise ValueError(f"max_seqs must be a positive int for {cfg.name} (it sizes the high-precision "
                                 f"sink/tail storage), got {max_seqs!r}")
            if tail_blocks not in (1, 2):
                raise ValueError(f"tail_blocks must be 1 or 2, got {tail_blocks!r}")
        static = None
        if cfg.static:
            if calibration is None:
                raise ValueError(f"calibration is required by {cfg.name}: pass one layer's kvarn_jax.Calibration")
            static = {s: {n: torch.as_tensor(np.array(a.astype(jnp.float32)), device=device).to(dtype)
                          for n, a in p.items()}
                      for s, p in calibration.params(cfg, hk, d, _JAX_DTYPES[dtype]).items()}
        elif calibration is not None:
            raise ValueError(f"calibration was given but {cfg.name} computes its scales dynamically")
        pages = {s: {name: alloc(s, (nb,) + shape, dt) for name, (shape, dt) in fields.items()}
                 for s, fields in page_fields(cfg, bs, hk, d, dtype).items()}
        hp_shape = (max_seqs * (1 + tail_blocks), bs, hk, d)
        if kind == "passthrough":
            if hp is not None:
                raise ValueError(f"{cfg.name} keeps no high-precision blocks: pass hp=None")
        elif hp is None:
            hp = {s: torch.zeros(hp_shape, dtype=dtype, device=device) for s in SIDES}
        else:
            for s in SIDES:
                t = hp.get(s) if isinstance(hp, dict) else None
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != hp_shape or t.dtype != dtype \
                        or t.device != device or not t.is_contiguous():
                    raise ValueError(f"hp[{s!r}] must be a contiguous {dtype} tensor {hp_shape} on {device}")
        return cls(cfg=cfg, kind=kind, num_blocks=nb, block_size=bs, num_kv_heads=hk, head_dim=d,
                   max_seqs=max_seqs, tail_blocks=tail_blocks, dtype=dtype, backend=backend, pages=pages, hp=hp,
                   static=static)

    @classmethod
    def from_kvarn_jax(cls, cache, *, backend: str = "auto", device=None) -> "AscendPagedKVCache":
        """The same content as a kvarn_jax.PagedKVCache, in this layout (codes c in [0, 2^b) become
        c - 2^(b-1); a dynamic scale/zero becomes scale and offset = 2^(b-1) + zero / scale)."""
        dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(cache.dtype)
        if dt is None:
            raise ValueError(f"cache.dtype must be float16 or bfloat16 for the Ascend cache, got {cache.dtype}")
        cal = None
        if cache.cfg.static:
            cal = _CalibrationParams({s: {n: np.array(a) for n, a in p.items()} for s, p in cache.static.items()})
        out = cls.create(cache.cfg, num_blocks=cache.num_blocks, block_size=cache.block_size,
                         num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim,
                         max_seqs=cache.max_seqs or None, dtype=dt, tail_blocks=cache.tail_blocks or 1,
                         calibration=cal, backend=backend, device=device)
        dev = out._device
        t = lambda a, dtype=None: torch.as_tensor(np.array(a), device=dev, dtype=dtype)  # noqa: E731
        bits = cache.cfg.k_bits
        for s in SIDES:
            src = cache.pages[s]
            if out.kind == "tiled":  # bf16 fields pass through fp32 (torch takes no NumPy bf16), exactly
                for name, dst in out.pages[s].items():
                    a = src[name]
                    dst.copy_(t(a) if a.dtype == jnp.uint8 else t(a.astype(jnp.float32)).to(dst.dtype))
            elif out.kind == "passthrough":
                out.pages[s]["values"].copy_(t(src["values"].astype(np.float32)).permute(0, 2, 1, 3).to(dt))
            else:
                codes = fields_from_pages(cache.cfg, s, {"codes": src["codes"]})["codes"]  # V: tokens last
                c = kvarn_torch.unpack(t(codes), bits).to(torch.int16) - 2 ** (bits - 1)  # [nb, Hk, bs, D]
                c = c.permute(0, 2, 1, 3)
                out.pages[s]["codes"].copy_(c.to(torch.int8) if bits == 8 else cpu_semantics.pack_int4(c))
                if out.kind == "int_dynamic":
                    sc = t(src["scale"][..., 0].astype(np.float32))
                    out.pages[s]["scale"].copy_(sc)
                    z = t(src["zero"][..., 0].astype(np.float32))
                    safe = torch.where(sc > 0, sc, torch.ones_like(sc))
                    out.pages[s]["offset"].copy_(torch.where(sc > 0, 2 ** (bits - 1) + z / safe, torch.zeros_like(sc)))
            if out.hp is not None:
                stride = 1 + out.tail_blocks
                sink = t(cache.sink[s].astype(np.float32)).to(dt)  # [S, Hk, bs, D]
                ring = t(cache.tail[s].astype(np.float32)).to(dt)  # [S, Hk, R, D]
                hp = out.hp[s].view(out.max_seqs, stride, out.block_size, out.num_kv_heads, out.head_dim)
                hp[:, 0] = sink.permute(0, 2, 1, 3)
                for r in range(out.tail_blocks):
                    hp[:, 1 + r] = ring[:, :, r * out.block_size:(r + 1) * out.block_size].permute(0, 2, 1, 3)
        return out

    # ------------------------------------------------------------------------------------ helpers
    @property
    def _device(self) -> torch.device:
        return next(iter(self.pages["k"].values())).device

    @property
    def ring_len(self) -> int:
        return self.tail_blocks * self.block_size

    def _call(self, name, *args, **kwargs):
        return ops.call(name, *args, backend=self.backend, **kwargs)

    def _sink_block(self, seq: torch.Tensor) -> torch.Tensor:
        return seq * (1 + self.tail_blocks)

    def _storage(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Values as stored: Hadamard-rotated (in fp32) for KVarN, in the model dtype. A value that
        cannot be stored as given is an error, as an eager kvarn_jax.write raises
        (kvarn_jax.storage): beyond ±QUANT_MAX before quantization, or beyond the dtype's range."""
        if bool((x.abs() > QUANT_MAX).any()):
            raise ValueError(f"{name} holds values beyond ±{QUANT_MAX:.3g}, which {self.cfg.name} cannot store")
        y = kvarn_torch.rotate(x, torch.float32) if self.cfg.rotated else x.float()
        big = torch.finfo(self.dtype).max
        if bool((y.abs() > big).any()):
            raise ValueError(
                f"{name} holds values beyond {self.dtype}'s range"
                + (" after the Hadamard rotation (a KVarN cache stores rotated values: a token whose L2 norm "
                   f"exceeds {big:,.0f})" if self.cfg.rotated else "") + "; a bfloat16 cache holds them")
        return y.to(self.dtype)

    def _static_params(self, side: str):
        """(fused-attention scale in the model dtype [1, Hk, 1, D], fold constant 2^(b-1)*scale + zero f32 [Hk, D])."""
        st = self.static[side]
        s16, z16 = st["scale"].float(), st["zero"].float()
        half = 2 ** (self.cfg.bits(side) - 1)
        return st["scale"].to(self.dtype).reshape(1, self.num_kv_heads, 1, self.head_dim), half * s16 + z16

    def memory_bytes(self) -> dict:
        """Exact bytes: quantized pages, high-precision sink/ring blocks, static parameters."""
        size = lambda ts: sum(x.numel() * x.element_size() for x in ts)  # noqa: E731
        return {"pages": size(a for p in self.pages.values() for a in p.values()),
                "high_precision": size(self.hp.values()) if self.hp else 0,
                "static": size(a for p in self.static.values() for a in p.values()) if self.static else 0}

    # ------------------------------------------------------------------------------------ write
    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *,
              seq_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
        """Store tokens, in place. k, v: [tokens, Hk, D] float; slot_mapping: [tokens] (-1 = padding);
        seq_ids ([tokens], the sequence's slot in [0, max_seqs)) and positions ([tokens], position % block_size
        = the slot's offset) are required by quantized schemes. Semantics as kvarn_jax.write; repeated live
        slots in one call are an error (the scatter op does not define them)."""
        self._check_write(k, v, slot_mapping, seq_ids, positions)
        dev, bs = self._device, self.block_size
        slot = slot_mapping.to(dev).long()
        live = slot >= 0
        xs = {"k": self._storage(k, "k"), "v": self._storage(v, "v")}
        if self.kind == "passthrough":
            idx = live.nonzero().squeeze(1)
            if idx.numel():
                self._call(SCATTER, xs["k"][idx].contiguous(), xs["v"][idx].contiguous(),
                           self.pages["k"]["values"], self.pages["v"]["values"], slot[idx].to(torch.int32),
                           cache_mode="Norm")
            return
        seq, pos = seq_ids.to(dev).long(), positions.to(dev).long()
        ring = self.ring_len
        rest = live & (pos >= bs)

        # Blocks this write completes: their tokens come from the ring (earlier writes) overlaid with
        # this write's tokens of the same block; read them before the ring is overwritten.
        comp = (rest & (slot % bs == bs - 1)).nonzero().squeeze(1)
        bufs = None
        if comp.numel():
            s_m, start = seq[comp], pos[comp] - (bs - 1)
            ring_blk = self._sink_block(s_m) + 1 + (start % ring) // bs
            bufs = {s: self.hp[s][ring_blk].clone() for s in SIDES}  # [M, bs, Hk, D]
            t = rest.nonzero().squeeze(1)
            key_t = seq[t] * 2 ** 32 + pos[t] // bs
            key_m = s_m * 2 ** 32 + start // bs
            tt, mm = (key_t[:, None] == key_m[None, :]).nonzero(as_tuple=True)
            for s in SIDES:
                bufs[s][mm, pos[t[tt]] % bs] = xs[s][t[tt]]

        # High precision: the sink block, and the ring for the last ring_len positions each sequence
        # writes (earlier ones of a long write are only needed by blocks completed above).
        maxpos = torch.full((self.max_seqs,), -1, dtype=torch.long, device=dev).scatter_reduce(
            0, seq[rest], pos[rest], reduce="amax")
        in_ring = rest & (pos > maxpos[seq.clamp(0, self.max_seqs - 1)] - ring)
        hp_tok = ((live & (pos < bs)) | in_ring).nonzero().squeeze(1)
        if hp_tok.numel():
            s_t, p_t = seq[hp_tok], pos[hp_tok]
            blk = torch.where(p_t < bs, self._sink_block(s_t), self._sink_block(s_t) + 1 + (p_t % ring) // bs)
            self._call(SCATTER, xs["k"][hp_tok].contiguous(), xs["v"][hp_tok].contiguous(), self.hp["k"],
                       self.hp["v"], (blk * bs + p_t % bs).to(torch.int32), cache_mode="Norm")
        if bufs is not None:
            self._store_blocks(bufs, slot[comp] // bs)

    def _store_blocks(self, bufs: dict, blocks: torch.Tensor) -> None:
        """Quantize full blocks [M, bs, Hk, D] (storage frame, model dtype) into pages `blocks`."""
        m, bs, hk, d = bufs["k"].shape
        if self.kind == "tiled":
            g = self.cfg.tile_tokens
            for s in SIDES:
                tiles = bufs[s].float().reshape(m, bs // g, g, hk, d).permute(0, 3, 1, 2, 4)
                for name, f in kvarn_torch.quantize_tiles(tiles, self.cfg, s, self.dtype).items():
                    self.pages[s][name][blocks] = f
            return
        bits = self.cfg.k_bits
        codes = {}
        for s in SIDES:
            x = bufs[s].reshape(m * bs * hk, d)
            if self.kind == "int_dynamic":
                y, sc, off = self._call("npu_dynamic_quant_asymmetric", x, dst_type=_int_dtype(bits))
                # the op dequantizes as (y - offset) * scale; the fused attention as (y + offset) * scale
                off = -off
                # A constant row gets the kernel's scale floor (1e-12) and an offset near -value / 1e-12,
                # which the fused attention's antiquant need not hold exactly: store it as code 0, scale 1
                # and offset = its value, so that every antiquant reproduces it exactly.
                flat = x.amax(-1) == x.amin(-1)
                y = torch.where(flat[:, None], torch.zeros_like(y), y)
                sc = torch.where(flat, torch.ones_like(sc), sc)
                off = torch.where(flat, x[:, 0].float(), off)
                self.pages[s]["scale"][blocks] = sc.reshape(m, bs, hk).transpose(1, 2)
                self.pages[s]["offset"][blocks] = off.reshape(m, bs, hk).transpose(1, 2)
            else:
                st = self.static[s]
                inv = (1.0 / st["scale"].float()).reshape(-1)
                zp = (-st["zero"].float() / st["scale"].float() - 2 ** (bits - 1)).reshape(-1)
                # aclnnAscendQuantV3 takes scales of the input's dtype only: the input goes in as float32
                # (exact), so that the float32 scales and zero points are used as they are
                y = self._call("npu_quantize", x.reshape(m * bs, hk * d).float(), inv, zp,
                               torch.qint8 if bits == 8 else torch.quint4x2, axis=-1, div_mode=False)
            codes[s] = y.reshape(m * bs, hk, -1)
        slots = (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).reshape(-1).to(torch.int32)
        # int4 codes (8 per int32) go through the scatter as their bytes: int8 [..., D/2]
        k_c, v_c, k_p, v_p = (_as_bytes(t) for t in (codes["k"], codes["v"], self.pages["k"]["codes"],
                                                    self.pages["v"]["codes"]))
        self._call(SCATTER, k_c, v_c, k_p, v_p, slots, cache_mode="Norm")

    # ------------------------------------------------------------------------------------ read
    def dense_kv(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_ids: torch.Tensor | None = None):
        """Dense fp32 K and V each sequence's attention sees: ([B, Hk, L, D], [B, Hk, L, D]), L =
        block_tables.shape[1] * block_size, in the storage frame (rotated for KVarN); positions >=
        seq_lens are garbage. As kvarn_jax.gather_dense."""
        lens = self._check_read(block_tables, seq_lens, seq_ids, None)
        return self._dense(block_tables, lens, seq_ids)

    def _dense(self, block_tables, lens, seq_ids):
        dev, bs, hk, d = self._device, self.block_size, self.num_kv_heads, self.head_dim
        bt = block_tables.to(dev).long().clamp(0, self.num_blocks - 1)
        b, mb = bt.shape
        bits = self.cfg.k_bits
        out = []
        for s in SIDES:
            p = self.pages[s]
            if self.kind == "tiled":
                x = kvarn_torch.dequantize_tiles({n: a[bt] for n, a in p.items()}, self.cfg, s)
                x = x.reshape(b, mb, hk, bs, d)
            elif self.kind == "passthrough":
                x = p["values"][bt].float().permute(0, 1, 3, 2, 4)
            elif self.kind == "int_dynamic":
                c = p["codes"][bt]
                c = (cpu_semantics.unpack_int4(c) if bits == 4 else c).float()  # [B, mb, bs, Hk, D]
                x = (c.permute(0, 1, 3, 2, 4) + p["offset"][bt][..., None]) * p["scale"][bt][..., None]
            else:
                st = self.static[s]
                sc = st["scale"].float().reshape(-1)
                off = (2 ** (bits - 1) + st["zero"].float() / st["scale"].float()).reshape(-1)
                c = p["codes"][bt].reshape(b * mb * bs, -1)
                x = self._call("npu_anti_quant", c, sc, offset=off, dst_dtype=self.dtype,
                               src_dtype=_int_dtype(bits)).float()
                x = x.reshape(b, mb, bs, hk, d).permute(0, 1, 3, 2, 4)
            x = x.permute(0, 2, 1, 3, 4).reshape(b, hk, mb * bs, d)
            if self.hp is not None:
                sid = (torch.arange(b, device=dev) if seq_ids is None else seq_ids.to(dev).long())
                base = self._sink_block(sid)
                pos = torch.arange(mb * bs, device=dev)
                ring = self.hp[s][base[:, None] + 1 + (pos % self.ring_len)[None, :] // bs, pos % bs]
                # full, not the sink, and not the block of the query (position len - 1)
                full = (pos[None, :] // bs + 1) * bs <= lens.to(dev)[:, None] - 1
                from_page = (pos[None, :] >= bs) & full
                x = torch.where(from_page[:, None, :, None], x, ring.float().permute(0, 2, 1, 3))
                x[:, :, :bs] = self.hp[s][base].float().permute(0, 2, 1, 3)
            out.append(x)
        return tuple(out)

    def decode(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
               seq_ids: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Decode attention of one query token per sequence: q [B, Hq, D] (the cache's dtype; Hq a multiple of
        Hk) -> [B, Hq, D]. block_tables [B, max_blocks] int, seq_lens [B] (0 gives a zero row), seq_ids [B]
        high-precision slots (default: the row index), scale default 1/sqrt(D). As
        kvarn_jax.paged_decode_attention_reference."""
        lens = self._check_read(block_tables, seq_lens, seq_ids, q)
        b, hq, d = q.shape
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        q4 = q.reshape(b, hq, 1, d).contiguous()
        common = dict(num_heads=hq, num_key_value_heads=self.num_kv_heads, input_layout="BNSD", scale=scale)
        bs, dev = self.block_size, self._device
        if self.kind == "passthrough":
            o, _ = self._call(FIA, q4, self._bnbsh(self.pages["k"]["values"]), self._bnbsh(self.pages["v"]["values"]),
                              block_table=block_tables.to(dev).to(torch.int32).contiguous(),
                              actual_seq_lengths_kv=lens.tolist(), block_size=bs, **common)
            return o.reshape(b, hq, d)
        if self.kind == "tiled":  # dequantize only the table columns some sequence uses
            used = max(1, -(-int(lens.max()) // bs))
            k, v = self._dense(block_tables[:, :used], lens, seq_ids)
            qs = kvarn_torch.rotate(q.float(), torch.float32) if self.cfg.rotated else q.float()
            o, _ = self._call(FIA, qs.to(self.dtype).reshape(b, hq, 1, d).contiguous(), k.to(self.dtype).contiguous(),
                              v.to(self.dtype).contiguous(), actual_seq_lengths_kv=lens.tolist(), **common)
            o = o.reshape(b, hq, d)
            return kvarn_torch.unrotate(o.float(), q.dtype) if self.cfg.rotated else o
        return self._decode_native(q4, block_tables, lens, seq_ids, common)

    def prefill(self, q: torch.Tensor, block_table: torch.Tensor, seq_len: int, *, seq_id: int | None = None,
                scale: float | None = None) -> torch.Tensor:
        """Causal attention of one sequence's last n = q.shape[0] positions over its tokens, which `write`
        has stored already: q [n, Hq, D] (the cache's dtype), block_table [max_blocks] (the sequence's row),
        seq_len its length including the n tokens, seq_id its high-precision slot (default 0). Every query
        sees the values a decode at position seq_len - 1 sees (`dense_kv`), up to its own position: the
        semantics of kvarn_jax's serving prefill. Torch ops in float32 (no fused op covers a quantized
        prefill). Returns [n, Hq, D] in q's dtype."""
        self._check_q(q)
        if not isinstance(block_table, torch.Tensor) or block_table.ndim != 1:
            raise ValueError("block_table must be a 1-D integer tensor (one sequence's row)")
        n, hq, d = q.shape
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 1 <= n <= seq_len:
            raise ValueError(f"seq_len must be an int >= the {n} query tokens, got {seq_len!r}")
        sid = None if seq_id is None else torch.tensor([int(seq_id)])
        lens = self._check_read(block_table[None], torch.tensor([seq_len]), sid, None)
        used = -(-seq_len // self.block_size)
        k, v = self._dense(block_table[None, :used], lens, sid)  # [1, Hk, L, D] float32, storage frame
        k, v = k[0, :, :seq_len], v[0, :, :seq_len]  # later positions hold whatever the pages hold
        hk = self.num_kv_heads
        sm = 1.0 / math.sqrt(d) if scale is None else float(scale)
        qf = kvarn_torch.rotate(q.float(), torch.float32) if self.cfg.rotated else q.float()
        s = torch.einsum("nhgd,hld->hgnl", qf.reshape(n, hk, hq // hk, d), k) * sm
        dev = s.device
        qpos = seq_len - n + torch.arange(n, device=dev)
        kpos = torch.arange(seq_len, device=dev)
        s = s.masked_fill(~(kpos[None, :] <= qpos[:, None]), -math.inf)  # position 0 is always visible
        o = torch.einsum("hgnl,hld->nhgd", torch.softmax(s, -1), v).reshape(n, hq, d)
        return (kvarn_torch.unrotate(o, q.dtype) if self.cfg.rotated else o).to(q.dtype)

    @staticmethod
    def _bnbsh(pages: torch.Tensor) -> torch.Tensor:
        """[blocks, bs, Hk, d] -> [blocks, bs, Hk * d], the fused attention's BnBsH paged layout."""
        return pages.reshape(pages.shape[0], pages.shape[1], -1)

    def _decode_native(self, q4, block_tables, lens, seq_ids, common):
        b, hq, _, d = q4.shape
        bs, hk, dev, tb = self.block_size, self.num_kv_heads, self._device, self.tail_blocks
        lens_d = lens.to(dev)
        # blocks before the query's own (position len - 1); the query's block is read from the ring
        # even when it is full, so a token never sees a quantized version of its own block
        nfull = (lens_d - 1).clamp(min=0) // bs
        # high-precision part: the sink block, then the ring block holding the last block
        sid = torch.arange(b, device=dev) if seq_ids is None else seq_ids.to(dev).long()
        hp_len = torch.where(lens_d <= bs, lens_d, bs + lens_d - nfull * bs)
        hp_tab = torch.stack([self._sink_block(sid), self._sink_block(sid) + 1 + nfull % tb], 1).to(torch.int32)
        o_hp, lse_hp = self._call(FIA, q4, self._bnbsh(self.hp["k"]), self._bnbsh(self.hp["v"]),
                                  block_table=hp_tab.contiguous(), actual_seq_lengths_kv=hp_len.cpu().tolist(),
                                  block_size=bs, softmax_lse_flag=True, **common)
        n_q = (nfull - 1).clamp(min=0)  # full, non-sink blocks: block_tables[:, 1:1 + n_q]
        if int(n_q.max()) == 0:
            return o_hp.reshape(b, hq, d)
        bits = self.cfg.k_bits
        pk, pv = self.pages["k"], self.pages["v"]
        tab = block_tables.to(dev)[:, 1:].to(torch.int32).contiguous()
        kw = {}
        if bits == 8:
            kq, vq = self._bnbsh(pk["codes"]), self._bnbsh(pv["codes"])
            kw.update(block_table=tab, block_size=bs)
            if self.kind == "int_dynamic":  # per token per head, scales paged like the codes
                kw.update(key_antiquant_scale=pk["scale"], key_antiquant_offset=pk["offset"],
                          value_antiquant_scale=pv["scale"], value_antiquant_offset=pv["offset"],
                          key_antiquant_mode=5, value_antiquant_mode=5)
        else:  # int4 cannot be paged in the fused op: gather the blocks into BNSD [B, Hk, S, D/8]
            mq = int(n_q.max())
            t = tab[:, :mq].long().clamp(0, self.num_blocks - 1)
            gather = lambda a: a[t].permute(0, 3, 1, 2, 4).reshape(b, hk, mq * bs, -1).contiguous()  # noqa: E731
            kq, vq = gather(pk["codes"]), gather(pv["codes"])
            if self.kind == "int_dynamic":  # per token per head (B, Hk, S)
                tok = lambda a: a[t].permute(0, 2, 1, 3).reshape(b, hk, mq * bs).contiguous()  # noqa: E731
                kw.update(key_antiquant_scale=tok(pk["scale"]), key_antiquant_offset=tok(pk["offset"]),
                          value_antiquant_scale=tok(pv["scale"]), value_antiquant_offset=tok(pv["offset"]),
                          key_antiquant_mode=3, value_antiquant_mode=3)
        if self.kind == "int_static":
            # Per-channel antiquant parameters must be in the query dtype; a bfloat16 offset near 2^(b-1)
            # would lose the zero point, so the offsets are folded out exactly instead: keys' constant
            # q.(2^(b-1) s + z) shifts every score of a row alike (only the lse moves), values' adds
            # 2^(b-1) s + z to the output (the weights sum to 1).
            (ks, kc), (vs, vc) = self._static_params("k"), self._static_params("v")
            kw.update(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=0, value_antiquant_mode=0)
        o_q, lse_q = self._call(FIA, q4, kq, vq, actual_seq_lengths_kv=(n_q * bs).cpu().tolist(),
                                softmax_lse_flag=True, **kw, **common)
        o_q, lse_q = o_q.reshape(b, hq, d).float(), lse_q.reshape(b, hq)
        if self.kind == "int_static":
            g = hq // hk
            qf = q4.reshape(b, hk, g, d).float()
            lse_q = lse_q + common["scale"] * torch.einsum("bhgd,hd->bhg", qf, kc).reshape(b, hq)
            o_q = o_q + vc.repeat_interleave(g, 0)[None]
        return merge_partials(o_hp.reshape(b, hq, d).float(), lse_hp.reshape(b, hq), hp_len > 0,
                      o_q, lse_q, n_q > 0).to(q4.dtype)

    # ------------------------------------------------------------------------------------ checks
    def _check_write(self, k, v, slot_mapping, seq_ids, positions):
        dev = self._device
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
            if x.ndim != 3 or tuple(x.shape[1:]) != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"{name} must be [tokens, {self.num_kv_heads}, {self.head_dim}], got {tuple(x.shape)}")
            if x.device != dev:
                raise ValueError(f"{name} is on {x.device} but the cache is on {dev}")
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"k ({tuple(k.shape)} {k.dtype}) and v ({tuple(v.shape)} {v.dtype}) must have the same "
                             "shape and dtype")
        n = k.shape[0]
        sm = _host_int(slot_mapping, "slot_mapping", n)
        total = self.num_blocks * self.block_size
        bad = (sm != -1) & ((sm < 0) | (sm >= total))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"slot_mapping[{i}] = {int(sm[i])} is out of range: slots are block_id * block_size + "
                             f"offset < {total} (num_blocks={self.num_blocks}, block_size={self.block_size}), "
                             "-1 marks padding")
        live = sm != -1
        if len(np.unique(sm[live])) != int(live.sum()):
            raise ValueError("slot_mapping repeats a slot within one write; write each slot once per call")
        if self.kind != "passthrough":
            ids = {}
            for name, x in (("seq_ids", seq_ids), ("positions", positions)):
                if x is None:
                    raise ValueError(f"{name} is required by {self.cfg.name}: the sink block and the partial tail "
                                     "block of each sequence are kept in high precision, indexed by sequence id "
                                     "and position")
                ids[name] = _host_int(x, name, n)
            sid, pos = ids["seq_ids"], ids["positions"]
            if ((sid < 0) | (sid >= self.max_seqs))[live].any():
                raise ValueError(f"seq_ids must be in [0, max_seqs={self.max_seqs}) for live tokens")
            if (pos < 0)[live].any():
                raise ValueError("positions must be >= 0 for live tokens")
            mism = live & (pos % self.block_size != sm % self.block_size)
            if mism.any():
                i = int(np.argmax(mism))
                raise ValueError(f"positions[{i}] = {int(pos[i])} and slot_mapping[{i}] = {int(sm[i])} disagree: a "
                                 f"token's offset in its block (slot % block_size) must equal position % block_size "
                                 f"(block_size={self.block_size})")
            pairs = sid[live].astype(np.int64) * 2 ** 32 + pos[live]
            if len(np.unique(pairs)) != len(pairs):
                raise ValueError("the same (seq_ids, positions) pair appears twice in one write")
        for name, x in (("k", k), ("v", v)):
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"{name} contains non-finite values (NaN or Inf); refusing to quantize them")

    def _check_q(self, q):
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.ndim != 3 or q.shape[2] != self.head_dim:
            raise ValueError(f"q must be [tokens, q_heads, {self.head_dim}], got {tuple(q.shape)}")
        if q.dtype != self.dtype:
            raise ValueError(f"q must have the cache's dtype {self.dtype} (the fused attention's query dtype), "
                             f"got {q.dtype}")
        if q.shape[1] % self.num_kv_heads or q.shape[1] // self.num_kv_heads > 64 or q.shape[1] > 256:
            raise ValueError(f"q has {q.shape[1]} heads: it must be a multiple of num_kv_heads="
                             f"{self.num_kv_heads}, at most 64 per kv head and 256 in all")
        if q.device != self._device:
            raise ValueError(f"q is on {q.device} but the cache is on {self._device}")
        if not bool(torch.isfinite(q).all()):
            raise ValueError("q contains non-finite values (NaN or Inf)")

    def _check_read(self, block_tables, seq_lens, seq_ids, q):
        if q is not None:
            self._check_q(q)
        if not isinstance(block_tables, torch.Tensor) or block_tables.ndim != 2 or block_tables.is_floating_point():
            raise ValueError("block_tables must be an integer tensor [batch, max_blocks]")
        b, mb = block_tables.shape
        if mb < 1:
            raise ValueError("block_tables needs at least one column")
        if q is not None and b != q.shape[0]:
            raise ValueError(f"block_tables has {b} rows for a batch of {q.shape[0]}")
        lens = torch.as_tensor(_host_int(seq_lens, "seq_lens", b))
        if bool(((lens < 0) | (lens > mb * self.block_size)).any()):
            raise ValueError(f"seq_lens must be in [0, block_tables.shape[1] * block_size = {mb * self.block_size}]")
        bt = block_tables.cpu().long()
        used = torch.arange(mb)[None, :] * self.block_size < lens[:, None]
        if bool((used & ((bt < 0) | (bt >= self.num_blocks))).any()):
            raise ValueError(f"block_tables must hold block ids in [0, num_blocks={self.num_blocks}) for the blocks "
                             "a sequence uses")
        if seq_ids is not None:
            sid = _host_int(seq_ids, "seq_ids", b)
            if self.hp is not None and ((sid < 0) | (sid >= self.max_seqs)).any():
                raise ValueError(f"seq_ids must be in [0, max_seqs={self.max_seqs})")
        elif self.hp is not None and b > self.max_seqs:
            raise ValueError(f"block_tables has {b} rows but max_seqs={self.max_seqs}: pass seq_ids")
        return lens


class _CalibrationParams:
    """Static parameters already in kvarn_jax's canonical form, with Calibration.params' interface."""

    def __init__(self, params: dict):
        self._params = params

    def params(self, cfg, num_kv_heads, head_dim, dtype="float16"):
        return self._params


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """int32 int4 codes [..., D/8] as the int8 view [..., D/2] of the same bytes (npu_scatter_pa_kv_cache
    takes float16, bfloat16 and int8 on Atlas A2/A3); other tensors unchanged."""
    return t.view(torch.int8) if t.dtype == torch.int32 else t


def _host_int(x, name: str, n: int) -> np.ndarray:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 1 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if x.shape[0] != n:
        raise ValueError(f"{name} has {x.shape[0]} entries, expected {n}")
    return x.cpu().numpy().astype(np.int64)


def _check_alignment(cfg, kind, block_size, head_dim):
    """The fused attention's documented alignments (decode branch, page attention)."""
    int8 = kind in ("int_dynamic", "int_static") and cfg.k_bits == 8
    int4 = kind in ("int_dynamic", "int_static") and cfg.k_bits == 4
    bmul = 32 if int8 else 16
    paged = kind != "tiled"
    if paged and (block_size % bmul or block_size > 512):
        raise ValueError(f"block_size={block_size} cannot be used with {cfg.name} on the NPU: page attention needs a "
                         f"multiple of {bmul} up to 512 (e.g. 128)")
    dmul = 64 if int4 else 32 if int8 else 8
    if head_dim % dmul or head_dim > 512:
        raise ValueError(f"head_dim={head_dim} cannot be used with {cfg.name} on the NPU: the fused attention needs "
                         f"a multiple of {dmul} up to 512")


def merge_partials(o1, lse1, has1, o2, lse2, has2):
    """Combine two attention outputs over disjoint key sets with their log-sum-exps (the documented
    ring-attention merge); a side with no keys gets weight 0, a row with none is 0."""
    inf = torch.tensor(-math.inf, device=o1.device)
    l1 = torch.where(has1[:, None], lse1.float(), inf)
    l2 = torch.where(has2[:, None], lse2.float(), inf)
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    den = w1 + w2
    out = (w1[..., None] * o1 + w2[..., None] * o2) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return out
