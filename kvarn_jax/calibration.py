"""Static calibration: per-layer, per-head statistics of K and V from sample batches.

`calibrate(samples, cfg)` reduces samples to ranges (per channel min/max for int, per head |max| for
fp8); the static schemes (`int*_static`, `fp8_static`) turn them into fixed scales. A `Calibration`
is a pytree (vmap over layers works), saves to / loads from one `.npz` file, and
`compare(samples, cfg)` reports static vs dynamic quantization error on given samples.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Union

import jax
import jax.numpy as jnp
import numpy as np

from .config import KVQuantConfig
from .schemes import per_token
from .schemes.arith import meta_dtype
from .validation import check_array, check_finite

_ARRAYS = ("k_min", "k_max", "v_min", "v_max")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Calibration:
    """k_min/k_max/v_min/v_max: [num_layers, Hk, D] (or [Hk, D] for one layer, e.g. under vmap).

    `tokens` is how many token rows the statistics were reduced over (static metadata).
    """

    k_min: jnp.ndarray
    k_max: jnp.ndarray
    v_min: jnp.ndarray
    v_max: jnp.ndarray
    tokens: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def num_layers(self) -> int:
        return 1 if self.k_min.ndim == 2 else self.k_min.shape[0]

    def layer(self, i: int) -> "Calibration":
        """The statistics of layer i (as a one-layer calibration)."""
        if self.k_min.ndim == 2:
            if i != 0:
                raise ValueError(f"layer index {i} is out of range: this calibration has 1 layer")
            return self
        if not 0 <= i < self.k_min.shape[0]:
            raise ValueError(f"layer index {i} is out of range: this calibration has {self.k_min.shape[0]} layers")
        return Calibration(*(getattr(self, a)[i] for a in _ARRAYS), tokens=self.tokens)

    def params(self, cfg: KVQuantConfig, num_kv_heads: int, head_dim: int, dtype="float16") -> dict:
        """Canonical static parameters of `cfg` ({"k": {...}, "v": {...}}, see schemes.static_param_shapes)
        for a cache of model dtype `dtype`, in which they are stored (`schemes.arith.meta_dtype`)."""
        if self.k_min.ndim == 3 and self.k_min.shape[0] == 1:
            return self.layer(0).params(cfg, num_kv_heads, head_dim, dtype)
        meta = meta_dtype(dtype)
        if self.k_min.ndim != 2:
            raise ValueError(f"calibration has {self.k_min.shape[0]} layers; pass one layer's, e.g. "
                             "calibration.layer(i)")
        if self.k_min.shape != (num_kv_heads, head_dim):
            raise ValueError(f"calibration is for [kv_heads, head_dim] = {list(self.k_min.shape)}, but the "
                             f"data has {[num_kv_heads, head_dim]}")
        out = {}
        for side in ("k", "v"):
            lo, hi = getattr(self, f"{side}_min"), getattr(self, f"{side}_max")
            if cfg.method == "int":
                scale, zero = per_token.int_static_params(lo, hi, cfg.bits(side), meta)
                out[side] = {"scale": scale, "zero": zero}
            elif cfg.method == "fp8":
                amax = jnp.maximum(jnp.max(jnp.abs(lo), -1), jnp.max(jnp.abs(hi), -1))
                out[side] = {"scale": per_token.fp8_scale_from_amax(amax, meta=meta)}
            else:
                raise ValueError(f"{cfg.name} does not use a calibration")
        return out

    # ------------------------------------------------------------ files
    def save(self, path: Union[str, os.PathLike]) -> None:
        meta = json.dumps({"format": "kvarn_jax.Calibration", "version": 1, "tokens": self.tokens})
        with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz"
            np.savez(f, meta=np.frombuffer(meta.encode(), np.uint8),
                     **{a: np.asarray(getattr(self, a), np.float32) for a in _ARRAYS})

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Calibration":
        """Read a file written by `save`; ValueError naming the file if it is not one (or is damaged)."""
        name = os.fspath(path)
        try:
            with np.load(path) as z:
                if "meta" not in z.files:
                    raise ValueError("it holds no calibration metadata")
                meta = json.loads(bytes(z["meta"]).decode())
                if not isinstance(meta, dict) or meta.get("format") != "kvarn_jax.Calibration":
                    raise ValueError("its metadata does not name a kvarn_jax calibration")
                missing = [a for a in _ARRAYS if a not in z.files]
                if missing:
                    raise ValueError(f"it lacks {missing}")
                arrays = [np.asarray(z[a], np.float32) for a in _ARRAYS]
                tokens = int(meta["tokens"])
        except FileNotFoundError:
            raise ValueError(f"calibration file {name!r} does not exist") from None
        except (ValueError, KeyError, TypeError, OSError, EOFError, UnicodeDecodeError) as e:
            raise ValueError(f"calibration file {name!r} is not a readable kvarn_jax calibration: {e}") from None
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1 or arrays[0].ndim not in (2, 3) or not all(np.isfinite(a).all() for a in arrays):
            raise ValueError(f"calibration file {name!r} is damaged: its four arrays must be finite and of one "
                             f"shape [layers, kv_heads, head_dim], got {[a.shape for a in arrays]}")
        return cls(*(jnp.asarray(a) for a in arrays), tokens=tokens)

    # ------------------------------------------------------------ report
    def compare(self, samples, cfg: Union[str, KVQuantConfig]) -> dict:
        """Relative L2 error of the static scheme vs its dynamic counterpart on `samples`.

        Returns {"static": name, "dynamic": name, "k": {"static": e, "dynamic": e}, "v": {...}}.
        """
        from .quantize import dequantize, quantize
        cfg = KVQuantConfig.parse(cfg)
        static_cfg = dataclasses.replace(cfg, static=True, group=0)
        dynamic_cfg = dataclasses.replace(cfg, static=False)
        errs = {s: {"static": [0.0, 0.0], "dynamic": [0.0, 0.0]} for s in ("k", "v")}
        for k, v in _iter_samples(samples, self.num_layers):
            for layer in range(k.shape[0]):
                kv = (k[layer], v[layer])
                for kind, c, cal in (("static", static_cfg, self.layer(layer)), ("dynamic", dynamic_cfg, None)):
                    kh, vh = dequantize(quantize(kv, c, calibration=cal))
                    for side, x, xh in (("k", kv[0], kh), ("v", kv[1], vh)):
                        x = x.astype(jnp.float32)
                        errs[side][kind][0] += float(jnp.sum((xh.astype(jnp.float32) - x) ** 2))
                        errs[side][kind][1] += float(jnp.sum(x * x))
        out = {"static": static_cfg.name, "dynamic": dynamic_cfg.name}
        for side in ("k", "v"):
            out[side] = {kind: float(np.sqrt(n / max(d, 1e-30))) for kind, (n, d) in errs[side].items()}
        return out


def _iter_samples(samples, num_layers: int | None = None):
    """Normalize samples to an iterator of (k, v) with a layer axis: [L, T, Hk, D]."""
    if isinstance(samples, tuple) and len(samples) == 2 and hasattr(samples[0], "shape"):
        samples = [samples]
    for i, item in enumerate(samples):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"samples[{i}] must be a pair (k, v)")
        k, v = (jnp.asarray(a) for a in item)
        for name, a in (("k", k), ("v", v)):
            if a.ndim not in (3, 4):
                raise ValueError(f"samples[{i}] {name} must be [tokens, kv_heads, head_dim] or "
                                 f"[layers, tokens, kv_heads, head_dim], got shape {tuple(a.shape)}")
            check_array(a, f"samples[{i}] {name}", floating=True)
            check_finite(a, f"samples[{i}] {name}")
        if k.shape != v.shape:
            raise ValueError(f"samples[{i}]: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
        if k.ndim == 3:
            k, v = k[None], v[None]
        if num_layers is not None and k.shape[0] != num_layers:
            raise ValueError(f"samples[{i}] has {k.shape[0]} layers, the calibration {num_layers}")
        yield k, v


def calibrate(samples: Iterable, cfg: Union[str, KVQuantConfig, None] = None) -> Calibration:
    """Reduce sample batches to a `Calibration`.

    samples: a pair (k, v) or an iterable of pairs; each array [tokens, Hk, D] (one layer) or
      [layers, tokens, Hk, D]. All samples must agree in layers, heads and head_dim.
    cfg: the scheme the calibration is for (checked: int or fp8); the statistics themselves are
      scheme-independent, so one calibration serves int8_static, int4_static and fp8_static.
    """
    if cfg is not None:
        cfg = KVQuantConfig.parse(cfg)
        if cfg.method not in ("int", "fp8"):
            raise ValueError(f"cfg {cfg.name} does not use a calibration (only int*_static and fp8_static do)")
    acc = None
    tokens = 0
    for k, v in _iter_samples(samples):
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        cur = (k.min(1), k.max(1), v.min(1), v.max(1))
        if acc is not None and acc[0].shape != cur[0].shape:
            raise ValueError(f"samples disagree in [layers, kv_heads, head_dim]: {list(acc[0].shape)} vs "
                             f"{list(cur[0].shape)}")
        acc = cur if acc is None else (jnp.minimum(acc[0], cur[0]), jnp.maximum(acc[1], cur[1]),
                                       jnp.minimum(acc[2], cur[2]), jnp.maximum(acc[3], cur[3]))
        tokens += k.shape[1]
    if acc is None:
        raise ValueError("samples is empty: calibration needs at least one (k, v) batch")
    if cfg is not None:
        cfg.check_head_dim(acc[0].shape[-1], "samples head_dim")
    return Calibration(*acc, tokens=tokens)


__all__ = ["Calibration", "calibrate"]
