"""Per-layer, per-head error of K, V and of the attention output on a real model's activations.

One exact forward records every layer's post-RoPE query, key and value (the tensors a serving cache
would store). Then, for each scheme and layer, measured on those same activations:

    K / V relative error   ||X_hat - X||_F / ||X||_F per kv head over the tokens that get quantized
                           (full blocks after the sink), X_hat = dequantize(quantize(X))
    attention error        ||O_scheme - O_exact||_F / ||O_exact||_F per kv head (its query heads),
                           serving semantics, over the queries that see quantized blocks (block >= 2)

and per layer and kv head the outlier ratio of every key channel: max_t |K[t, c]| divided by the
median over channels of that maximum. Channels at or above `outlier_ratio` are flagged: those are the
keys per-token schemes cannot represent (Qwen2.5-Coder-1.5B reaches ~90x).
Layers are independent here (each sees exact inputs), so an error belongs to that layer alone.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch

import kvarn_jax as kj
from kvarn_jax.integrations.dlpack import roundtrip_bhtd

from .serving_attention import attention_modules, serving_attention, serving_semantics


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """Post-RoPE q [B, Hq, T, D], k and v [B, Hk, T, D] of one layer, and its softmax scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float


def capture_activations(model, windows: torch.Tensor, *, block_size: int = 128) -> list[LayerActivations]:
    """Run `windows` [B, T] through the model with exact attention and record every layer's q/k/v."""
    store = {}

    def record(layer_idx, q, k, v):
        store[layer_idx] = (q.detach().clone(), k.detach().clone(), v.detach().clone())

    mods = attention_modules(model)
    with torch.no_grad(), serving_semantics(model, None, block_size=block_size, recorder=record):
        model(windows, use_cache=False)
    return [LayerActivations(*store[i], scaling=float(mods[i].scaling)) for i in range(len(mods))]


def _rel(err: torch.Tensor, ref: torch.Tensor, dims) -> torch.Tensor:
    return err.double().pow(2).sum(dims).sqrt() / ref.double().pow(2).sum(dims).sqrt().clamp_min(1e-30)


def channel_outlier_ratio(k: torch.Tensor) -> torch.Tensor:
    """[Hk, D]: per channel, max |k| over batch and tokens / median over channels of that max."""
    amax = k.abs().amax(dim=(0, 2))                     # [Hk, D]
    return amax / amax.median(dim=-1, keepdim=True).values.clamp_min(1e-30)


def layer_errors(acts: LayerActivations, scheme, *, block_size: int = 128) -> dict:
    """{'k', 'v', 'attn'}: lists over kv heads of relative errors of this layer under `scheme`."""
    cfg = kj.parse(scheme)
    b, hk, t, d = acts.k.shape
    n_full = t // block_size
    if n_full < 3:
        raise ValueError(f"windows of {t} tokens hold {n_full} full blocks of {block_size}; the error report needs "
                         f"at least 3 (sink, a quantized block, a query block): use >= {3 * block_size} tokens")
    region = slice(block_size, n_full * block_size)
    k, v = acts.k[:, :, region], acts.v[:, :, region]
    k_hat, v_hat = roundtrip_bhtd(k, v, cfg)
    out = serving_attention(acts.q, acts.k, acts.v, cfg, block_size=block_size, scaling=acts.scaling)
    ref = serving_attention(acts.q, acts.k, acts.v, None, block_size=block_size, scaling=acts.scaling)
    group = acts.q.shape[1] // hk
    qsl = slice(2 * block_size, t)
    o = out[:, :, qsl].reshape(b, hk, group, -1, d)
    r = ref[:, :, qsl].reshape(b, hk, group, -1, d)
    return {"k": _rel(k_hat - k, k, (0, 2, 3)).tolist(), "v": _rel(v_hat - v, v, (0, 2, 3)).tolist(),
            "attn": _rel(o - r, r, (0, 2, 3, 4)).tolist()}


def error_report(activations: Sequence[LayerActivations], schemes: Sequence[str], *, block_size: int = 128,
                 outlier_ratio: float = 8.0, progress: bool = True) -> dict:
    """The full report (JSON-ready).

    {"schemes": {name: {"k": [L][Hk], "v": [L][Hk], "attn": [L][Hk]}},
     "key_channel_ratio_max": [L][Hk], "value_channel_ratio_max": [L][Hk],
     "outliers": [{"layer", "kv_head", "channel", "ratio"} for every key channel >= outlier_ratio],
     "outlier_ratio": threshold, "block_size": ..., "tokens": ...}
    """
    if not activations:
        raise ValueError("activations is empty (capture_activations first)")
    if not isinstance(outlier_ratio, (int, float)) or outlier_ratio <= 1:
        raise ValueError(f"outlier_ratio must be a number > 1, got {outlier_ratio!r}")
    names = [kj.parse(s).name for s in schemes]
    from tqdm.auto import tqdm

    per = {n: {"k": [], "v": [], "attn": []} for n in names}
    bar = tqdm(total=len(names) * len(activations), desc="errors", unit="layer", disable=not progress)
    for name in names:
        bar.set_postfix_str(name)
        for acts in activations:
            e = layer_errors(acts, name, block_size=block_size)
            for key in e:
                per[name][key].append(e[key])
            bar.update(1)
    bar.close()
    k_ratio, v_ratio, outliers = [], [], []
    for li, acts in enumerate(activations):
        kr = channel_outlier_ratio(acts.k)
        k_ratio.append(kr.amax(-1).tolist())
        v_ratio.append(channel_outlier_ratio(acts.v).amax(-1).tolist())
        for h, c in (kr >= outlier_ratio).nonzero().tolist():
            outliers.append({"layer": li, "kv_head": h, "channel": c, "ratio": float(kr[h, c])})
    outliers.sort(key=lambda o: -o["ratio"])
    return {"schemes": per, "key_channel_ratio_max": k_ratio, "value_channel_ratio_max": v_ratio,
            "outliers": outliers, "outlier_ratio": outlier_ratio, "block_size": block_size,
            "tokens": int(activations[0].k.shape[0] * activations[0].k.shape[2])}


def layer_summary(report: Mapping) -> list[dict]:
    """Rows per (scheme, layer): mean and worst head of each error, the max key-channel ratio, flags."""
    flagged = {}
    for o in report["outliers"]:
        flagged[o["layer"]] = flagged.get(o["layer"], 0) + 1
    rows = []
    for name, errs in report["schemes"].items():
        for li in range(len(errs["k"])):
            row = {"scheme": name, "layer": li}
            for key in ("k", "v", "attn"):
                vals = errs[key][li]
                row[f"{key}_mean"] = sum(vals) / len(vals)
                row[f"{key}_max"] = max(vals)
            row["key_channel_ratio_max"] = max(report["key_channel_ratio_max"][li])
            row["outlier_channels"] = flagged.get(li, 0)
            rows.append(row)
    return rows
