"""The per-layer scheme file written by `kvarn-jax tune` and read by the cache, generate and the vLLM bridge.

Format (JSON, UTF-8):

    {
      "format": "kvarn-jax/layer-schemes",
      "version": 1,
      "layers": ["kvarn_k4v2_g128", "kvarn_k4v4_g128", ...],   # one scheme string per decoder layer
      "block_size": 128,                                        # every scheme's tile divides it
      "model": {"name": "...", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
      ...                                                       # free-form provenance (budget, measurements)
    }

Only "format", "version" and "layers" are required. Scheme strings use the `--kv-cache-dtype` grammar
(`kvarn_jax.KVQuantConfig.parse`) and are stored in canonical form.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Union

from .config import KVQuantConfig

FORMAT = "kvarn-jax/layer-schemes"
VERSION = 1


def _validate(layers, block_size, head_dim, source: str) -> list[str]:
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"{source}: 'layers' must be a non-empty list of scheme strings")
    out = []
    for i, s in enumerate(layers):
        if not isinstance(s, str):
            raise ValueError(f"{source}: layers[{i}] must be a scheme string, got {type(s).__name__}")
        try:
            cfg = KVQuantConfig.parse(s)
            if block_size is not None:
                cfg.check_block_size(block_size, "block_size")
            if head_dim is not None:
                cfg.check_head_dim(head_dim, "model.head_dim")
        except ValueError as e:
            raise ValueError(f"{source}: layers[{i}] = {s!r}: {e}") from None
        if cfg.static:
            raise ValueError(f"{source}: layers[{i}] = {s!r} needs a calibration; per-layer files take dynamic "
                             "schemes only")
        out.append(cfg.name)
    return out


def load_layer_config(path: Union[str, os.PathLike], num_layers: Optional[int] = None) -> list[str]:
    """Per-layer scheme strings (canonical) from a layer-scheme file; ValueError naming what is wrong.

    num_layers: if given, the file must have exactly that many layers (the model's).
    """
    source = f"layer config {os.fspath(path)!r}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{source}: 'format' must be {FORMAT!r} (a file written by kvarn-jax tune)")
    if data.get("version") != VERSION:
        raise ValueError(f"{source}: version {data.get('version')!r} is not supported (expected {VERSION})")
    model = data.get("model") or {}
    layers = _validate(data.get("layers"), data.get("block_size"), model.get("head_dim"), source)
    declared = model.get("num_layers")
    if declared is not None and declared != len(layers):
        raise ValueError(f"{source}: model.num_layers is {declared} but 'layers' has {len(layers)} entries")
    if num_layers is not None and num_layers != len(layers):
        raise ValueError(f"{source} has {len(layers)} layers but the model has num_layers={num_layers}")
    return layers


def write_layer_config(path: Union[str, os.PathLike], layers: Sequence[str], *, block_size: int = 128,
                       model: Optional[dict] = None, **provenance) -> dict:
    """Validate and write a layer-scheme file; returns the written document."""
    head_dim = (model or {}).get("head_dim")
    doc = {"format": FORMAT, "version": VERSION,
           "layers": _validate(list(layers), block_size, head_dim, "layers"),
           "block_size": block_size, "model": dict(model or {}), **provenance}
    doc["model"].setdefault("num_layers", len(doc["layers"]))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return doc
