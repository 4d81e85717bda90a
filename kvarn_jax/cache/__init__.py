"""The paged KV cache: storage layout, write path, byte accounting."""

from .layers import LayerCaches
from .memory import bytes_per_token, format_memory_report, memory_report
from .paged import PagedKVCache, gather_dense, stack_layers, write

__all__ = ["PagedKVCache", "LayerCaches", "write", "gather_dense", "stack_layers", "memory_report", "bytes_per_token",
           "format_memory_report"]
