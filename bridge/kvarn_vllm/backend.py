"""The attention backends the plugin registers.

- `KvarnCpuBackend` replaces vLLM's `CPU_ATTN` (the CPU platform picks it for every model and
  ignores `--attention-backend`). It is vLLM's own CPU backend unless the engine asked for kvarn
  (see `settings`), so installing the plugin changes nothing for other engines.
- `KvarnBackend` is registered as `CUSTOM` for GPUs (`--attention-backend CUSTOM`).

With kvarn, `customize_spec` turns the layer's KV spec into a `spec.KvarnAttentionSpec`: a uint8
page of exactly the bytes the scheme needs per block (one head slot, `block_size` states of C bytes;
C rounded up so the page is a multiple of 64 bytes), and the number of blocks each request holds
for its high-precision sink and tail (`hp_pool`), so that vLLM's own accounting hands out the extra
blocks and charges every live request for its sink and tail out of the same pool.

With per-layer schemes (`kvarn_layer_config`) every layer declares one page size, that of the layer
needing the most (see `layout.shared_page_bytes`): vLLM 0.32 could hold layers of different page
sizes in one KV-cache group, but `customize_spec` is not told which layer it customizes, so a
per-layer size could only be matched to its layer by call order. The cost: a layer of a smaller
scheme leaves the rest of each page unused, i.e. the cache holds as many blocks as if every layer
used the largest scheme (logged once at engine start).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout, replace_as

from . import runtime
from .layout import PageLayout, hp_blocks_per_seq, padding_report, shared_page_bytes
from .spec import KvarnAttentionSpec

logger = init_logger("vllm.kvarn_vllm")


def kvarn_spec(spec: AttentionSpec) -> AttentionSpec:
    """The layer's KV spec for kvarn (called once per layer, after the model is built)."""
    settings = runtime.current()
    if settings is None:
        return spec
    vllm_config = runtime.config()
    made = {cfg: PageLayout(cfg, block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                            dtype=str(vllm_config.model_config.dtype).split(".")[-1],
                            max_seqs=vllm_config.scheduler_config.max_num_seqs)
            for cfg in settings.schemes}
    page = shared_page_bytes(made.values())
    hp_blocks = hp_blocks_per_seq(made.values())
    if settings.layers is not None:
        logger.info_once(
            "kvarn: layer config %s: every layer's page is padded to %d B per block (the largest layer's need); "
            "format bytes per block and unused share of the page by scheme: %s", settings.layer_config, page,
            ", ".join(f"{n} x {name}: {b} B, {unused:.0%} unused"
                      for name, (n, b, unused) in padding_report([made[c] for c in settings.layers], page).items()))
    logger.info_once(
        "kvarn: %s: %d B per block of %d tokens; each request holds %d more blocks for its high-precision sink "
        "and tail while it runs (taken from the KV cache pool with its other blocks)",
        ", ".join(c.name for c in settings.schemes), page, spec.block_size, hp_blocks)
    return replace_as(spec, KvarnAttentionSpec, dtype=torch.uint8, num_head_slots=1,
                      state_content_bytes=page // spec.block_size, tokens_per_state=1, page_size_padded=None,
                      hp_blocks=hp_blocks)


def _impl():
    from .impl import KvarnAttentionImpl

    return KvarnAttentionImpl


def _builder():
    from .metadata import KvarnMetadataBuilder

    return KvarnMetadataBuilder


class KvarnCpuBackend(CPUAttentionBackend):
    """vLLM's CPU_ATTN, or kvarn when the engine asked for it."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return _impl() if runtime.current() is not None else CPUAttentionBackend.get_impl_cls()

    @staticmethod
    def get_builder_cls():
        return _builder() if runtime.current() is not None else CPUAttentionBackend.get_builder_cls()

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return kvarn_spec(spec) if runtime.current() is not None else super().customize_spec(spec)


class KvarnBackend(AttentionBackend):
    """kvarn as vLLM's CUSTOM attention backend (GPU builds of vLLM)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = []  # any: the plugin decides from its own settings

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return _impl()

    @staticmethod
    def get_builder_cls():
        return _builder()

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)  # layer-outer: one layer's pages are one run of bytes

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if runtime.current() is None:
            raise ValueError("kvarn: the CUSTOM attention backend is kvarn's; set --kv-cache-dtype to a kvarn "
                             "scheme (or kvarn_kv_cache_dtype in --additional-config)")
        return kvarn_spec(spec)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
