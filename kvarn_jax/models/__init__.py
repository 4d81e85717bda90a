"""Real models in JAX and the offline checkpoints they load (see checkpoints.py)."""

from .checkpoints import DEFAULT_MODEL, cache_dir, default_gguf_path, hf_folder_from_gguf

__all__ = ["DEFAULT_MODEL", "cache_dir", "default_gguf_path", "hf_folder_from_gguf"]
