"""The bridge's CPU settings for XLA (`kvarn_vllm.runtime.run_xla_on_the_calling_thread`) take effect
in a process whose JAX backend starts after them, and leave the user's own settings alone.

Each case runs in a fresh Python process (the settings only act before JAX's CPU client starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ("XLA_FLAGS", "PJRT_NPROC", "NPROC", "JAX_CPU_ENABLE_ASYNC_DISPATCH")

# Applies the settings, then starts JAX's CPU backend and reports what it runs with: the compiled
# partitions of a fusion large enough for XLA to split across its pool, and the pool's threads.
PROBE = r"""
import json, os, re, sys
from kvarn_vllm import runtime
runtime.keep_compiled_executables()  # the order of the config hook and the worker's impl
runtime.run_xla_on_the_calling_thread()
import jax, jax.numpy as jnp
x = jnp.ones((512, 1024), jnp.float32)
f = jax.jit(lambda a: jnp.exp(a) * 2.0 + 1.0)
text = f.lower(x).compile().as_text()
jax.block_until_ready(f(x))
names = []
for t in os.listdir("/proc/self/task"):
    try:
        names.append(open(f"/proc/self/task/{t}/comm").read().strip())
    except OSError:
        pass
print(json.dumps({
    "env": {k: os.environ.get(k) for k in %r},
    "async_dispatch": bool(jax.config.values["jax_cpu_enable_async_dispatch"]),
    "partitions": sorted(set(re.findall(r'"outer_dimension_partitions":\[([^\]]*)\]', text))),
    "pool_threads": sum(n.endswith("XLAEigen") for n in names),
    "cache_dir": jax.config.values["jax_compilation_cache_dir"],
}))
""" % (SETTINGS,)


def probe(cache, **env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in SETTINGS and not k.startswith("JAX_")}
    full.update(KVARN_JAX_CACHE=str(cache), JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "bridge")]), **env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not os.path.isdir("/proc/self/task"),
                                    reason="XLA's pool is one thread anyway on one CPU (Linux /proc read)")


@needs_two_cpus
def test_xla_runs_on_one_pool_thread_without_split_loops(tmp_path):
    got = probe(tmp_path)
    assert got["env"]["PJRT_NPROC"] == "1"
    assert "--xla_cpu_multi_thread_eigen=false" in got["env"]["XLA_FLAGS"]
    assert got["env"]["JAX_CPU_ENABLE_ASYNC_DISPATCH"] == "false" and got["async_dispatch"] is False
    assert got["pool_threads"] == 1, got
    assert all(p in ("", '"1"') for p in got["partitions"]), got  # no fusion split across threads
    # executables split for another pool size (the cache key lacks it) are not loaded
    assert got["cache_dir"] == str(tmp_path / "xla-cpu-pool-1")
    assert any(f.endswith("-cache") for f in os.listdir(got["cache_dir"]))


@needs_two_cpus
def test_the_users_settings_are_kept(tmp_path):
    n = str(len(os.sched_getaffinity(0)))
    got = probe(tmp_path, NPROC=n, XLA_FLAGS="--xla_cpu_multi_thread_eigen=true", JAX_CPU_ENABLE_ASYNC_DISPATCH="true",
                JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"))
    assert got["env"]["PJRT_NPROC"] is None and got["env"]["NPROC"] == n
    assert got["env"]["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=true"
    assert got["async_dispatch"] is True
    assert got["pool_threads"] == int(n), got
    assert f'"{n}"' in got["partitions"], got  # the control: with the user's pool XLA does split
    assert got["cache_dir"] == str(tmp_path / "mine")
