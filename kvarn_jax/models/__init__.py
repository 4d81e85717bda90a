"""Real models in JAX and the offline checkpoints they load.

    LlamaConfig, Decoder        the Flax NNX Llama/Qwen2-family decoder (llama.py)
    ARCHITECTURES               published architectures by name, for random-weight benchmarks
    load_model                  checkpoint (default SmolLM2, HF folder or GGUF) -> Decoder (weights.py)
    checkpoints                 offline GGUF -> Hugging Face folder (checkpoints.py)
"""

from .checkpoints import DEFAULT_MODEL, cache_dir, default_gguf_path, hf_folder_from_gguf
from .llama import ARCHITECTURES, SMOLLM2_135M, Decoder, DecodeBatch, LlamaConfig, PrefillBatch, from_params
from .weights import load_model, resolve_checkpoint

__all__ = ["DEFAULT_MODEL", "cache_dir", "default_gguf_path", "hf_folder_from_gguf", "LlamaConfig", "Decoder",
           "PrefillBatch", "DecodeBatch", "ARCHITECTURES", "SMOLLM2_135M", "from_params", "load_model",
           "resolve_checkpoint"]
