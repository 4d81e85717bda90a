"""kvarn-jax on Ascend NPUs: CANN-backed ops with CPU functions of identical semantics.

Public surface:
    AscendPagedKVCache          the paged quantized KV cache (write / decode / dense_kv) on torch tensors
    scheme_kind                 which path a kv_cache_dtype takes on the NPU (native op, torch ops), or why none
    ops.OPS, ops.call           the op table: NPU call, CPU semantics, validator, doc per torch_npu op
    npu_available, unavailable_reason, resolve_backend
                                lazy torch_npu: importing this package never imports it
    KVarNAscendAttention, token_positions
                                one attention layer's store + attend per serving step (decodes and prefills)
    vllm_ascend                 the vllm-ascend route: KVarNAttentionScheme for its scheme registry,
                                register(), quant_description() (vLLM is imported only when used)
"""

from . import cpu_semantics, ops, validators, vllm_ascend
from .cache import AscendPagedKVCache, scheme_kind
from .npu import npu_available, resolve_backend, unavailable_reason
from .vllm_ascend import KVarNAscendAttention, token_positions

__all__ = [
    "AscendPagedKVCache", "scheme_kind", "ops", "cpu_semantics", "validators",
    "npu_available", "unavailable_reason", "resolve_backend",
    "KVarNAscendAttention", "token_positions", "vllm_ascend",
]
