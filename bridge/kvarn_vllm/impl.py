"""`KvarnAttentionImpl`: vLLM's attention layer on a kvarn_jax cache.

Unsupported setups are refused before workers start (`checks.check_config`, from the plugin's
config hook); what only a layer knows (ALiBi, learned sinks, ...) is refused when vLLM builds the
layer, still at engine start, never mid-request. Each forward is `hp_pool.HpPool.forward` (the
sink and tail rows in the pool's blocks) around `torch_ops.forward`: the step's K/V stored in place,
then every row (decode and prefill) attended, both reading the cache in place, with the step's
`plan.StepPlan` that the metadata builder made once for all layers.

Per-layer schemes (`kvarn_layer_config`): vLLM does not tell an attention impl which layer it
belongs to when it builds it, and the scheme must be known then (it sizes the sink/tail). vLLM
builds a decoder's attention layers in order, so the i-th impl built for an engine is layer i;
`checks.check_layer_order` confirms that against the layer names once they are known (when vLLM
builds the metadata builder, at engine start) and refuses the engine otherwise.
"""

from __future__ import annotations

import torch

from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionImpl, AttentionType

import kvarn_jax

from . import runtime, torch_ops
from .checks import check_engine, layer_index, refuse
from .hp_pool import HpPool, staging
from .layout import PageLayout
from .plan import KvarnMetadata

logger = init_logger("vllm.kvarn_vllm")  # under "vllm": printed with vLLM's own log lines


class KvarnAttentionImpl(AttentionImpl[KvarnMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **extra) -> None:
        vllm_config = get_current_vllm_config()
        settings = runtime.settings_for(vllm_config)
        if settings is None:
            raise ValueError("kvarn: KvarnAttentionImpl was built for an engine that did not ask for kvarn")
        self.settings = settings
        check_engine(vllm_config)
        runtime.keep_compiled_executables()  # a worker started without the config hook's env
        if vllm_config.device_config.device_type == "cpu":  # a worker started without the config hook's env
            runtime.run_xla_on_the_calling_thread()
        # the build order is the layer index (module docstring); counted before any refusal below,
        # which aborts the engine anyway
        self.kvarn_layer_index = runtime.add_layer(vllm_config) - 1
        cfg = settings.scheme(self.kvarn_layer_index)
        if attn_type != AttentionType.DECODER:
            refuse(f"attention type {attn_type!r} (encoder, encoder-only or cross attention)",
                   "only decoder self-attention uses the cache")
        if alibi_slopes is not None:
            refuse("ALiBi")
        if sliding_window is not None:
            refuse("sliding-window attention")
        if logits_soft_cap:
            refuse("logits soft-capping")
        if sinks is not None:
            refuse("learned attention sinks")
        if kv_sharing_target_layer_name is not None:
            refuse("cross-layer KV sharing")
        unknown = sorted(k for k, v in extra.items() if v is not None)
        if unknown:
            refuse(f"attention options {unknown}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"kvarn: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        try:
            cfg.check_head_dim(head_size, "head_size")
            cfg.check_block_size(vllm_config.cache_config.block_size, "block_size (--block-size)")
        except ValueError as e:
            where = (f" (layer {self.kvarn_layer_index} of kvarn_layer_config {settings.layer_config!r})"
                     if settings.layers is not None else "")
            raise ValueError(f"kvarn: {e}{where}") from None
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sliding_window = None
        self.layout = PageLayout(cfg, block_size=vllm_config.cache_config.block_size, num_kv_heads=num_kv_heads,
                                 head_dim=head_size, dtype=str(vllm_config.model_config.dtype).split(".")[-1],
                                 max_seqs=vllm_config.scheduler_config.max_num_seqs)
        # the sink/tail live in each request's own blocks; layers share one staging area (hp_pool)
        self.hp_pool = HpPool(self.layout, staging(self.layout, id(vllm_config), vllm_config.device_config.device))
        self._calibration = kvarn_jax.Calibration.load(settings.calibration) if cfg.static else None
        self.bound: torch_ops.BoundCache | None = None

    # vLLM calls this before forward() when the backend keeps the update separate; the write needs
    # the sequences' slots and positions, so it happens in forward().
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        return None

    def _bind(self, layer, kv_cache: torch.Tensor) -> torch_ops.BoundCache:
        b = self.bound
        if b is not None and b.buffer.data_ptr() == kv_cache.data_ptr() and b.num_blocks == kv_cache.shape[0]:
            return b
        static = None
        if self._calibration is not None:
            cal = self._calibration.layer(layer_index(getattr(layer, "layer_name", "")))
            static = cal.params(self.layout.cfg, self.num_kv_heads, self.head_size)
        self.bound = torch_ops.bind(kv_cache, self.layout, hp_buffers=self.hp_pool.staging, static=static)
        lay = self.layout
        logger.info_once(
            "kvarn: %s cache bound zero-copy: %d blocks of %d tokens per layer, %d B per block for the format "
            "(%.1f B/token/head); a request's sink and tail take %d of its blocks, staged per step in %.1f MiB "
            "shared by the layers (max_num_seqs=%d)",
            lay.cfg.name, kv_cache.shape[0], lay.block_size, lay.format_page_bytes,
            lay.format_page_bytes / (lay.block_size * lay.num_kv_heads), lay.hp_blocks_per_seq,
            lay.hp_bytes / 2 ** 20, lay.max_seqs)
        return self.bound

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KvarnMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("kvarn: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run without a cache
            return output
        plan = attn_metadata.plan
        n = plan.num_tokens
        self.hp_pool.forward(self._bind(layer, kv_cache), query[:n].view(n, self.num_heads, self.head_size), key[:n],
                             value[:n], plan, scale=self.scale, impl=self.settings.decode_impl,
                             out=output[:n].view(n, self.num_heads, self.head_size))
        return output
