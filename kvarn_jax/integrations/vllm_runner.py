"""What the vLLM plugins (`bridge/kvarn_vllm`, `ascend/kvarn_ascend`) share about vLLM's internals."""

from __future__ import annotations

import inspect


def find_model_runner():
    """The vLLM model runner on the call stack (the first caller whose `self` holds the batch and the
    requests: `input_batch`, `requests`), or None. vLLM builds attention metadata and calls the
    attention backends from its runner without passing it; the plugins need its batch rows."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            obj = frame.f_locals.get("self")
            if obj is not None and hasattr(obj, "input_batch") and hasattr(obj, "requests"):
                return obj
            frame = frame.f_back
    finally:
        del frame
    return None
