"""Lazy, optional `torch_npu`: imported on first use, never at package import.

Installing `torch_npu` without CANN breaks `import torch` through PyTorch's device-backend autoload
(set `TORCH_DEVICE_BACKEND_AUTOLOAD=0` there), and `import torch_npu` then fails on the missing CANN
libraries (docs/design.md §6). So nothing here imports it eagerly: without it the package imports,
reports the NPU as unavailable (with the reason) and runs its CPU semantics.
"""

from __future__ import annotations

import importlib
import sys

BACKENDS = ("auto", "npu", "cpu")

# Why the last import attempt failed; a failed import is not retried (it costs a path scan), but a
# module that appears in sys.modules later (e.g. a test's fake) is picked up.
_import_error: list[str] = []


def torch_npu_module():
    """The `torch_npu` module, or None when it cannot be imported here."""
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return mod
    if _import_error:
        return None
    try:
        return importlib.import_module("torch_npu")
    except Exception as e:  # ImportError, or OSError/RuntimeError from missing CANN libraries
        _import_error.append(f"{type(e).__name__}: {e}")
        return None


def unavailable_reason() -> str | None:
    """None when an NPU is usable, else a sentence saying why not."""
    mod = torch_npu_module()
    if mod is None:
        why = _import_error[0] if _import_error else "not installed"
        return f"torch_npu cannot be imported ({why})"
    try:
        ok = bool(mod.npu.is_available())
    except Exception as e:  # a broken CANN install raises here rather than returning False
        return f"torch_npu.npu.is_available() failed: {type(e).__name__}: {e}"
    return None if ok else "torch_npu is importable but torch_npu.npu.is_available() is False (no NPU device)"


def npu_available() -> bool:
    return unavailable_reason() is None


def resolve_backend(backend: str) -> str:
    """'auto' -> 'npu' when an NPU is usable, else 'cpu'; 'npu' without one raises naming the reason."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "cpu":
        return "cpu"
    why = unavailable_reason()
    if backend == "npu" and why is not None:
        raise ValueError(f"backend='npu' was requested but no NPU is usable: {why}; use backend='cpu' "
                         "(the CPU semantics of the same ops) or 'auto'")
    return "npu" if why is None else "cpu"
