"""The KV-cache spec and block manager that make each request pay for its own sink and tail.

`KvarnAttentionSpec` is vLLM's full-attention spec plus `hp_blocks`: the blocks a request holds, at
the front of its block table, for its high-precision sink and tail rows (`hp_pool`). vLLM's
`KVCacheSpecRegistry` maps it to `KvarnAttentionManager`, which allocates `hp_blocks` more blocks
than the request's tokens need when the request first gets blocks, from the same pool and with the
same admission check (a request the pool cannot hold waits; a running one that cannot grow is
preempted, releasing them), and frees them with the request. Everything else is full attention:
its group is grouped, sized and laid out as one (`uniform_type_base_spec=FullAttentionSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclass(frozen=True, kw_only=True)
class KvarnAttentionSpec(FullAttentionSpec):
    hp_blocks: int = 0
    """Blocks per request for its sink and tail rows, at the front of its block table."""

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return self.hp_blocks + super().max_num_blocks_per_req(vllm_config, max_len)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        return super().max_memory_usage_bytes(vllm_config) + self.hp_blocks * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list) -> "KvarnAttentionSpec":
        hp = {getattr(s, "hp_blocks", 0) for s in specs}
        if len(hp) != 1:
            raise AssertionError(f"kvarn: the layers of one KV cache group hold different hp_blocks {sorted(hp)}")
        merged = super().merge(specs)
        object.__setattr__(merged, "hp_blocks", hp.pop())
        return merged


class KvarnAttentionManager(FullAttentionManager):
    """Full attention whose every request also holds `hp_blocks` blocks, first in its table."""

    def __init__(self, kv_cache_spec: KvarnAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.hp_tokens = kv_cache_spec.hp_blocks * self.block_size

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, num_tokens + self.hp_tokens, *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return super().allocate_new_blocks(request_id, num_tokens + self.hp_tokens,
                                           num_tokens_main_model + self.hp_tokens)


def register() -> None:
    """Register the spec with vLLM's registry (idempotent; vLLM's own specs first, which it only
    registers itself while the registry is empty)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KvarnAttentionSpec, KvarnAttentionManager, uniform_type_base_spec=FullAttentionSpec)
