"""Per-process state of the bridge: the settings of the engine being built and its layer count.

vLLM builds one engine at a time in a process. The attention layers are constructed while vLLM's
current config is set, so the settings are resolved there and remembered; hooks that vLLM calls
outside that context (`customize_spec`, `get_builder_cls`) read the remembered settings of the
same config. A new config (another engine in the same process) starts afresh.
"""

from __future__ import annotations

import threading

from .settings import BridgeSettings, resolve

_LOCK = threading.Lock()
_STATE: dict = {"config_id": None, "config": None, "settings": None, "layers": 0}


def _current_config():
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - vLLM without the helper is outside the supported range
        return None
    return get_current_vllm_config_or_none()


def settings_for(vllm_config) -> BridgeSettings | None:
    """Resolve (once per config object) whether and how this engine uses kvarn."""
    with _LOCK:
        if _STATE["config_id"] == id(vllm_config):
            return _STATE["settings"]
    settings = resolve(vllm_config)
    with _LOCK:
        _STATE.update(config_id=id(vllm_config), config=vllm_config, settings=settings, layers=0)
    return settings


def current() -> BridgeSettings | None:
    """The settings of the current vLLM config, or of the last one seen when none is current."""
    cfg = _current_config()
    if cfg is not None:
        return settings_for(cfg)
    with _LOCK:
        return _STATE["settings"]


def config():
    """The current vLLM config, or the last one seen when none is current."""
    cfg = _current_config()
    if cfg is not None:
        return cfg
    with _LOCK:
        return _STATE["config"]


def add_layer(vllm_config) -> int:
    """Count an attention layer built for `vllm_config` (they share the KV budget); returns the count."""
    settings_for(vllm_config)
    with _LOCK:
        _STATE["layers"] += 1
        return _STATE["layers"]


def num_layers() -> int:
    with _LOCK:
        return _STATE["layers"]
