"""What the bridge refuses, checked on vLLM's engine configuration before any worker starts.

`check_config(vllm_config)` runs from the plugin's config hook (`plugin.register` wraps the current
platform's `check_and_update_config`, which vLLM calls when it builds the engine configuration in
the process that starts the engine - the API server, or the `LLM` constructor). An unsupported
configuration therefore fails within seconds, with the plugin's message as the last line of the
traceback, instead of minutes later inside a worker. The attention impl runs the per-layer checks
again when vLLM builds each layer (`impl.py`), for what only the layer knows (ALiBi, sinks, ...).

Every message starts with "kvarn:" and names the setting to change.
"""

from __future__ import annotations

from . import runtime


class UnsupportedConfig(RuntimeError):
    """An engine configuration the kvarn bridge cannot serve (raised by the config hook).

    Not a ValueError on purpose: vLLM builds its configuration in a pydantic dataclass, which turns
    a ValueError raised there into a ValidationError whose message ends in pydantic boilerplate; this
    one reaches the caller - and the server's last line - as the plugin wrote it."""

MODEL_DTYPES = ("float16", "bfloat16", "float32")


def refuse(what: str, hint: str = "") -> None:
    raise ValueError(f"kvarn: the kvarn-jax vLLM bridge does not support {what}" + (f"; {hint}" if hint else ""))


def _dtype_name(dtype) -> str:
    return str(dtype).split(".")[-1]


def check_engine(vllm_config) -> None:
    """Engine-wide combinations the bridge refuses (the parts of the config every layer shares)."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    if cache.enable_prefix_caching:
        refuse("prefix caching", "each sequence's sink block and partial tail live in its own high-precision "
               "slot, which a cache hit cannot share; start vLLM with --no-enable-prefix-caching "
               "(LLM(..., enable_prefix_caching=False))")
    if vllm_config.speculative_config is not None:
        refuse("speculative decoding", "not tested with the bridge yet")
    if model is not None and getattr(model, "is_hybrid", False):
        refuse("hybrid (attention + state-space) models", "vLLM zeroes their blocks in its own page layout")
    if model is not None and getattr(model, "is_encoder_decoder", False):
        refuse("encoder-decoder models")
    if model is not None and getattr(model, "use_mla", False):
        refuse("MLA (latent attention) models", "their cache holds one compressed latent per token, not per-head "
               "K and V; unset kvarn_kv_cache_dtype")
    par = vllm_config.parallel_config
    if getattr(par, "decode_context_parallel_size", 1) > 1 or getattr(par, "prefill_context_parallel_size", 1) > 1:
        refuse("context parallelism")
    if vllm_config.kv_transfer_config is not None:
        refuse("KV transfer / connectors", "the page bytes are kvarn's own layout")
    if model is not None and _dtype_name(model.dtype) not in MODEL_DTYPES:
        refuse(f"model dtype {model.dtype}", "use float16, bfloat16 or float32")


def _check_model(vllm_config, settings) -> None:
    """What the model's config says about its attention layers."""
    model = vllm_config.model_config
    if model is None or not hasattr(model, "get_head_size"):
        return
    hf = getattr(model, "hf_text_config", None)
    window = model.get_sliding_window() if hasattr(model, "get_sliding_window") else None
    if window and getattr(hf, "use_sliding_window", True):
        refuse(f"sliding-window attention (the model's sliding_window={window})")
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(hf, key, None):
            refuse(f"logits soft-capping ({key}={getattr(hf, key)})")
    head = model.get_head_size()
    block = vllm_config.cache_config.block_size
    where = f" (kvarn_layer_config {settings.layer_config!r})" if settings.layers is not None else ""
    for cfg in settings.schemes:
        try:
            cfg.check_head_dim(head, "head_size")
            if block is not None:
                cfg.check_block_size(block, "block_size (--block-size)")
        except ValueError as e:
            raise ValueError(f"kvarn: {e}{where}") from None
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    quantized = [cfg.name for cfg in settings.schemes if not cfg.is_passthrough]
    if settings.decode_impl == "native":
        _check_native(settings, device, head, block, where)
    if device == "cpu" and quantized:
        # a quantized cache's prefill on the CPU runs vLLM's CPU attention op (`torch_ops._prefill_rule`)
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head not in sizes:
            refuse(f"head_size={head} with {', '.join(quantized)} on the CPU{where}",
                   f"the CPU prefill runs vLLM's CPU attention, which takes head sizes {sizes}")


def _check_native(settings, device, head: int, block: int | None, where: str) -> None:
    """kvarn_decode_impl=native: the C++ CPU decode kernel must take every layer's scheme and build here."""
    from kvarn_jax.attention import paged_decode_cpu

    if device not in (None, "cpu"):
        refuse(f"kvarn_decode_impl=native on {device}", "it is the CPU decode kernel; use auto")
    for cfg in settings.schemes:
        why = paged_decode_cpu.supports(cfg, block or cfg.tile_tokens, head)
        if why:
            refuse(f"kvarn_decode_impl=native with {cfg.name}{where}", why)
    why = paged_decode_cpu.available()
    if why:
        refuse("kvarn_decode_impl=native on this machine", why)


def _check_compilation(vllm_config) -> None:
    """The kvarn attention runs outside CUDA graphs, between the captured pieces (as vLLM's attention
    backends without graph support do): full graphs that would capture attention are refused."""
    comp = vllm_config.compilation_config
    mode = getattr(comp, "cudagraph_mode", None)
    name = getattr(mode, "name", None)
    if name in ("FULL", "FULL_DECODE_ONLY"):
        refuse(f"cudagraph_mode={name}", "kvarn's attention runs between CUDA graphs, not inside one: use "
               "-O '{\"cudagraph_mode\": \"PIECEWISE\"}' (vLLM's default FULL_AND_PIECEWISE becomes PIECEWISE for "
               "this backend) or --enforce-eager")
    ops = getattr(comp, "splitting_ops", None)
    if name in ("PIECEWISE", "FULL_AND_PIECEWISE") and ops is not None and len(ops) > 0 \
            and "vllm::unified_attention_with_output" not in ops and not getattr(comp, "use_inductor_graph_partition",
                                                                               False):
        refuse("splitting_ops without vllm::unified_attention_with_output",
               "piecewise CUDA graphs must split at attention, which kvarn runs outside the graphs")


def check_config(vllm_config) -> None:
    """Everything the configuration alone decides: raises ValueError("kvarn: ...") for an unsupported
    combination, a bad kvarn setting, a layer config or KV budget that does not fit; does nothing for
    an engine that did not ask for kvarn. (The config hook re-raises it as `UnsupportedConfig`.)"""
    try:
        settings = runtime.settings_for(vllm_config)
    except ValueError as e:  # a bad kvarn setting: said as the plugin says everything
        raise ValueError(str(e) if str(e).startswith("kvarn:") else f"kvarn: {e}") from None
    if settings is None:
        return
    from .plugin import check_version, installed_version

    why = check_version(installed_version())
    if why is not None:
        raise ValueError(f"kvarn: kvarn was asked for but {why}")
    check_engine(vllm_config)
    _check_model(vllm_config, settings)
    _check_compilation(vllm_config)
    if settings.calibration is not None:
        import kvarn_jax

        try:
            kvarn_jax.Calibration.load(settings.calibration)
        except (OSError, ValueError) as e:
            raise ValueError(f"kvarn: kvarn_calibration {settings.calibration!r} cannot be loaded: {e}") from None
    _select_scheduler(vllm_config)


def _select_scheduler(vllm_config) -> None:
    """The scheduler that finishes requests whose K/V the cache stored altered with an error
    (`failures.KvarnScheduler`, vLLM's own with that added); another custom scheduler is refused."""
    from .failures import SCHEDULERS, failing_scheduler

    sched = vllm_config.scheduler_config
    current = sched.scheduler_cls
    if current is None:
        sched.scheduler_cls = SCHEDULERS[bool(sched.async_scheduling)]
        return
    if failing_scheduler(current):
        return
    name = current if isinstance(current, str) else f"{current.__module__}.{current.__qualname__}"
    refuse(f"a custom scheduler_cls ({name})", "kvarn finishes requests whose K/V the cache stored altered "
           f"(NaN/Inf, beyond its range) with an error through its own scheduler, {SCHEDULERS[False]}; "
           "subclass that one")


def layer_index(name: str) -> int:
    """The decoder layer index in a vLLM attention layer name ('model.layers.7.self_attn.attn' -> 7)."""
    for part in reversed(name.split(".")):
        if part.isdigit():
            return int(part)
    raise ValueError(f"kvarn: cannot find a layer index in the layer name {name!r} (needed to pick the "
                     "layer's calibration, or its scheme from a layer config)")


def check_layer_order(vllm_config, layer_names) -> None:
    """With a layer config, each named layer's impl must hold the scheme of that layer's index.

    vLLM does not tell an attention impl which layer it is when it builds it; the i-th kvarn impl
    built is taken as layer i (`impl.py`). Raises ValueError when a layer was built out of order (its
    impl would use another layer's scheme).
    """
    settings = runtime.settings_for(vllm_config)
    if settings is None or settings.layers is None:
        return
    layers = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        built = getattr(getattr(layers.get(name), "impl", None), "kvarn_layer_index", None)
        if built is None:
            continue
        index = layer_index(name)
        if built != index:
            raise ValueError(f"kvarn: layer {name!r} was built as attention layer {built}, so it would "
                             f"use that layer's scheme from kvarn_layer_config {settings.layer_config!r} instead of "
                             f"layer {index}'s; this model does not build its layers in order, which per-layer "
                             "schemes need")
