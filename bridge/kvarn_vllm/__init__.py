"""kvarn-jax as a vLLM plugin: KV-cache quantization for stock vLLM over DLPack."""
