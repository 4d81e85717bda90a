import gc
import os
import pathlib
import sys
import zlib

# On the CPU, most test modules compile without XLA's optimization passes: their time is mostly
# compiling (every interpreted kernel and shape anew) and their arrays are small, so the interpreted
# decode and quantize tests ran 21-28% faster on 2 cores. Modules marked `xla_optimized` run a model
# for many steps instead, which unoptimized code made ~2.5x slower (`_xla_optimization`). XLA's CPU
# backend uses no fast-math, so the results are the same floats either way. A level the user set
# (XLA_FLAGS, JAX_DISABLE_MOST_OPTIMIZATIONS) is left alone.
_SWITCH_OPTIMIZATIONS = (os.environ.get("KVARN_TEST_PLATFORM", "cpu") == "cpu"
                         and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
                         and "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ)

# Four CPU devices (the default device is the first): the tensor-parallel tests shard over 2 and 4.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

# No persistent XLA cache in tests: the vLLM bridge turns JAX's on for its process when an attention
# impl is built (`kvarn_vllm.runtime.keep_compiled_executables`), after which every later test in the
# worker would write each compile into the user's cache folder. An empty directory keeps it off.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")

import jax  # noqa: E402
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# CI and the development machine are CPU-only (Pallas kernels interpreted). KVARN_TEST_PLATFORM=cuda
# runs tests on the GPU instead, with the kernels compiled (how the decode kernel tests were run on
# the H200: benchmarks/results/2026-12-01_decode_maxnreg_h200.md).
# The CPU backend stays available beside it: some tests run the reference writer there on purpose.
_PLATFORM = os.environ.get("KVARN_TEST_PLATFORM", "cpu")
jax.config.update("jax_platforms", _PLATFORM if _PLATFORM == "cpu" else f"{_PLATFORM},cpu")

# Hypothesis: few, deterministic examples in CI (each new shape costs a compile).
settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _golden_path():
    env = os.environ.get("KVARN_GOLDEN")
    cands = [pathlib.Path(env)] if env else []
    cands += [ROOT / "tests" / "data" / "kvarn_tiles_public.npz", ROOT.parent / "shared" / "golden" / "kvarn_tiles_public.npz"]
    for c in cands:
        if c.exists():
            return c
    raise FileNotFoundError(f"golden tiles not found in {cands}")


@pytest.fixture(autouse=True, scope="module")
def _xla_optimization(request):
    """XLA's optimization passes for this module's compiles (on for `xla_optimized` modules, see the
    top of this file; subprocesses inherit the choice), and its compiled executables dropped after
    it. Dropping them keeps one module's unoptimized executables from serving another that runs
    them many times, and memory bounded: interpret-mode kernels compile many programs per shape;
    kept for the whole session they grew each xdist worker to ~9 GB here, and two such workers fill
    a 24 GB CI machine."""
    if _SWITCH_OPTIMIZATIONS:
        fast_compile = request.node.get_closest_marker("xla_optimized") is None
        jax.config.update("jax_disable_most_optimizations", fast_compile)
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = str(int(fast_compile))
    yield
    jax.clear_caches()
    runner = sys.modules.get("kvarn_jax.serving.runner")
    if runner is not None:
        runner._COMPILED.clear()  # the engine's executables, cached process-wide
    gc.collect()
    if _SWITCH_OPTIMIZATIONS:
        os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)


@pytest.fixture(scope="session")
def golden():
    with np.load(_golden_path()) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture
def rng(request):
    # Fresh data per test, reproducible from the test's name.
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def pytest_collection_modifyitems(config, items):
    """Tests of an xdist group (the vLLM engine tests: ~8 minutes, all on one worker) run first.
    Collected in file order they came last, and the other worker idled while they finished."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("xdist_group") else 1)
