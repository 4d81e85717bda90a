"""kvarn-jax: KV-cache quantization for LLM serving in JAX.

Public surface:
    KVQuantConfig, parse                    scheme strings -> frozen, hashable configs
    quantize, dequantize, QuantizedKV       whole-tensor (de)quantization, jit/vmap-able
    calibrate, Calibration                  static scales for int*_static / fp8_static
    PagedKVCache, write, stack_layers       the paged cache serving code holds
    paged_decode_attention                  decode attention: Pallas kernel or reference
    paged_decode_attention_reference        pure-jnp decode attention (the kernels' oracle)
    memory_report, bytes_per_token          exact byte accounting
"""

from .attention.paged_decode import paged_decode_attention
from .attention.reference import paged_decode_attention_reference
from .cache import (PagedKVCache, bytes_per_token, format_memory_report, gather_dense, memory_report,
                    stack_layers, write)
from .calibration import Calibration, calibrate
from .config import GRAMMAR, PRESETS, KVQuantConfig, parse
from .hadamard import hadamard_matrix, rotate, unrotate
from .quantize import QuantizedKV, dequantize, quantize

__version__ = "0.1.0"

__all__ = [
    "KVQuantConfig", "parse", "PRESETS", "GRAMMAR",
    "quantize", "dequantize", "QuantizedKV",
    "calibrate", "Calibration",
    "PagedKVCache", "write", "stack_layers", "gather_dense",
    "paged_decode_attention", "paged_decode_attention_reference",
    "memory_report", "format_memory_report", "bytes_per_token",
    "hadamard_matrix", "rotate", "unrotate",
]
