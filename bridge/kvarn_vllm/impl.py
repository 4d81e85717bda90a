"""`KvarnAttentionImpl`: vLLM's attention layer on a kvarn_jax cache.

Every unsupported combination raises at construction, which vLLM does while it builds the model
(engine start), never mid-request. Each forward: `torch_ops.write` stores the step's K/V in place,
then decode rows go through `kvarn_jax.paged_decode_attention` and prefill rows (several query
tokens, e.g. chunks of a long prompt) through the causal prefill path, both reading the cache in
place.

Per-layer schemes (`kvarn_layer_config`): vLLM does not tell an attention impl which layer it
belongs to when it builds it, and the scheme must be known then (it sizes the sink/tail). vLLM
builds a decoder's attention layers in order, so the i-th impl built for an engine is layer i;
`check_layer_order` confirms that against the layer names once they are known (when vLLM builds the
metadata builder, at engine start) and refuses the engine otherwise.
"""

from __future__ import annotations

import torch

from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionImpl, AttentionType

import kvarn_jax

from . import runtime, torch_ops
from .layout import PageLayout, allocate_hp
from .metadata import KvarnMetadata

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
logger = init_logger("vllm.kvarn_vllm")  # under "vllm": printed with vLLM's own log lines


def _refuse(what: str, hint: str = "") -> None:
    raise ValueError(f"kvarn: {what} is not supported by the kvarn-jax vLLM bridge" + (f"; {hint}" if hint else ""))


def _layer_index(name: str) -> int:
    for part in reversed(name.split(".")):
        if part.isdigit():
            return int(part)
    raise ValueError(f"kvarn: cannot find a layer index in the layer name {name!r} (needed to pick the "
                     "layer's calibration, or its scheme from a layer config)")


def check_engine(vllm_config) -> None:
    """Engine-wide combinations the bridge refuses (raised while the first layer is built)."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    if cache.enable_prefix_caching:
        _refuse("prefix caching", "each sequence's sink block and partial tail live in its own high-precision "
                "slot, which a cache hit cannot share; start vLLM with --no-enable-prefix-caching "
                "(LLM(..., enable_prefix_caching=False))")
    if vllm_config.speculative_config is not None:
        _refuse("speculative decoding", "not tested with the bridge yet")
    if model is not None and getattr(model, "is_hybrid", False):
        _refuse("hybrid (attention + state-space) models", "vLLM zeroes their blocks in its own page layout")
    if model is not None and getattr(model, "is_encoder_decoder", False):
        _refuse("encoder-decoder models")
    if model is not None and getattr(model, "use_mla", False):
        _refuse("MLA (latent attention) models")
    par = vllm_config.parallel_config
    if getattr(par, "decode_context_parallel_size", 1) > 1 or getattr(par, "prefill_context_parallel_size", 1) > 1:
        _refuse("context parallelism")
    if vllm_config.kv_transfer_config is not None:
        _refuse("KV transfer / connectors", "the page bytes are kvarn's own layout")
    if model is not None and model.dtype not in MODEL_DTYPES:
        _refuse(f"model dtype {model.dtype}", "use float16, bfloat16 or float32")


def check_layer_order(vllm_config, layer_names) -> None:
    """With a layer config, each named layer's impl must hold the scheme of that layer's index.

    Raises ValueError when a layer was built out of order (its impl would use another layer's scheme).
    """
    settings = runtime.settings_for(vllm_config)
    if settings is None or settings.layers is None:
        return
    layers = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        impl = getattr(layers.get(name), "impl", None)
        if not isinstance(impl, KvarnAttentionImpl):
            continue
        index = _layer_index(name)
        if impl.layer_index != index:
            raise ValueError(f"kvarn: layer {name!r} was built as attention layer {impl.layer_index}, so it would "
                             f"use that layer's scheme from kvarn_layer_config {settings.layer_config!r} instead of "
                             f"layer {index}'s; this model does not build its layers in order, which per-layer "
                             "schemes need")


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
        # the build order is the layer index (module docstring); counted before any refusal below,
        # which aborts the engine anyway
        self.layer_index = runtime.add_layer(vllm_config) - 1
        cfg = settings.scheme(self.layer_index)
        if attn_type != AttentionType.DECODER:
            _refuse(f"attention type {attn_type!r} (encoder, encoder-only or cross attention)",
                    "only decoder self-attention uses the cache")
        if alibi_slopes is not None:
            _refuse("ALiBi")
        if sliding_window is not None:
            _refuse("sliding-window attention")
        if logits_soft_cap:
            _refuse("logits soft-capping")
        if sinks is not None:
            _refuse("learned attention sinks")
        if kv_sharing_target_layer_name is not None:
            _refuse("cross-layer KV sharing")
        unknown = sorted(k for k, v in extra.items() if v is not None)
        if unknown:
            _refuse(f"attention options {unknown}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"kvarn: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        try:
            cfg.check_head_dim(head_size, "head_size")
            cfg.check_block_size(vllm_config.cache_config.block_size, "block_size (--block-size)")
        except ValueError as e:
            where = (f" (layer {self.layer_index} of kvarn_layer_config {settings.layer_config!r})"
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
        # With an explicit KV budget the sink/tail are carved from vLLM's buffer (the page size the
        # backend declares carries their share). Otherwise vLLM measures the memory left after the
        # model is built: allocating them now makes that measurement count them.
        self.hp_buffers = None
        if vllm_config.cache_config.kv_cache_memory_bytes is None:
            self.hp_buffers = allocate_hp(self.layout, vllm_config.device_config.device)
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
            cal = self._calibration.layer(_layer_index(getattr(layer, "layer_name", "")))
            static = cal.params(self.layout.cfg, self.num_kv_heads, self.head_size)
        self.bound = torch_ops.bind(kv_cache, self.layout, hp_buffers=self.hp_buffers, static=static)
        lay = self.layout
        logger.info_once(
            "kvarn: %s cache bound zero-copy: %d blocks of %d tokens per layer, %d B per block for the format "
            "(%.1f B/token/head), high-precision sink/tail %.1f MiB per layer for max_num_seqs=%d (%s)",
            lay.cfg.name, kv_cache.shape[0], lay.block_size, lay.format_page_bytes,
            lay.format_page_bytes / (lay.block_size * lay.num_kv_heads), lay.hp_bytes / 2 ** 20, lay.max_seqs,
            "inside the KV budget" if self.hp_buffers is None else "allocated before vLLM measured memory")
        return self.bound

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KvarnMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("kvarn: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run without a cache
            return output
        md = attn_metadata
        n = md.num_actual_tokens
        bound = self._bind(layer, kv_cache)
        on_host = query.device.type == "cpu"
        # on a GPU the write and the decode rows do not wait for the device (`torch_ops`: the
        # host-side counts come from the metadata, the index checks run on the host only when the
        # tensors live there); prefill rows still do
        torch_ops.write(bound, key[:n], value[:n], md.slot_mapping[:n], md.token_seq_ids[:n], md.positions[:n],
                        check_values=on_host, completing=md.completing_blocks)
        nd, ndt = md.num_decodes, md.num_decode_tokens
        if nd:
            out = torch_ops.decode(bound, query[:ndt], md.block_table[:nd], md.seq_lens[:nd], md.seq_ids[:nd],
                                   scale=self.scale, impl=self.settings.decode_impl,
                                   max_seq_len=md.max_decode_seq_len, check_values=on_host)
            output[:ndt].copy_(out.view(ndt, self.num_heads, self.head_size))
        if md.num_reqs > nd:
            qsl = md.query_start_loc[nd:] - md.query_start_loc[nd]
            out = torch_ops.prefill(bound, query[ndt:n], qsl, md.seq_lens[nd:], md.block_table[nd:],
                                    md.seq_ids[nd:], scale=self.scale)
            output[ndt:n].copy_(out.view(n - ndt, self.num_heads, self.head_size))
        return output
