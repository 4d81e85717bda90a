"""Per-layer scheme choice under a bit budget (`kvarn-jax tune`).

1. Record real activations (calibration windows taken after the evaluation windows, so the check in
   step 3 is on text the choice never saw) and measure, for every layer and candidate scheme, the
   attention-output error of that layer alone (`errors.layer_errors`): cost[l, c] = mean over kv heads
   of the squared relative error (the noise power the layer adds to the residual stream).
2. Choose one candidate per layer minimizing sum_l cost[l, c_l] subject to
   mean_l bits_per_element(c_l) <= budget_bits: a multiple-choice knapsack, solved exactly by dynamic
   programming over block bytes (bits per element include every scale and zero point, like the tables).
   Layers whose keys have outlier channels have higher costs at low bits, so they get more bits.
   With costs "kl" the attention errors are first put on the scale of the model's output: one
   teacher-forced run per layer with only that layer quantized (by the cheapest candidate, the probe)
   gives its KL to the unquantized model, and cost[l, c] = attn[l, c] * KL_l / attn[l, probe]
   (`kl_scaled_costs`). Equal attention errors cost more KL in some layers than in others; the attention
   error alone cannot see that. Then each candidate's column is scaled so that its sum is the KL measured
   with that candidate in every layer (`candidate_scaled_costs`; one more run per candidate): per unit of
   attention error, schemes differ in KL (on SmolLM2 a KVarN 4-bit-key layer costs about half the KL
   that its attention error, scaled by a KIVI 2-bit probe, predicts).
3. Check it: teacher-forced perplexity of the per-layer choice and of every uniform candidate that
   fits the same budget, on the same tokens. The per-layer costs are a proxy (each layer's error
   alone, on other text), so the choice can lose to a uniform scheme: whichever configuration has the
   lowest perplexity (or KL, `select="kl"`) is written (`pick_winner`), and the command says which won
   and by how much. Comparison schemes of any size (e.g. the scheme the budget is meant to beat) are
   measured on the same tokens and reported, never written. With `max_ppl_increase`, a winner that
   misses it is reported as a failure and nothing is written.

The result is a layer-scheme file (`kvarn_jax/layer_config.py`), read back by `load_layer_config`.
"""

from __future__ import annotations

from functools import reduce
from math import gcd
from typing import Sequence

import numpy as np

import kvarn_jax as kj

DEFAULT_CANDIDATES = ("kvarn_k2v2_g128", "kvarn_k2v4_g128", "kvarn_k4v2_g128", "kvarn_k4v4_g128",
                      "kvarn_k8v4_g128", "kvarn_k8v8_g128")


def bits_per_element(scheme, head_dim: int) -> float:
    """Stored bits per K or V element, metadata included."""
    return 8 * kj.bytes_per_token(scheme, head_dim) / (2 * head_dim)


def parse_fraction(text, arg: str = "max_ppl_increase") -> float:
    """'1%' -> 0.01, '0.01' -> 0.01 (a relative increase)."""
    try:
        value = float(text[:-1]) / 100 if isinstance(text, str) and text.strip().endswith("%") else float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{arg} must be a fraction like 0.01 or a percentage like 1%, got {text!r}") from None
    if not 0 <= value < 10:
        raise ValueError(f"{arg} must be in [0, 10) as a fraction, got {text!r}")
    return value


def layer_costs(activations: Sequence, candidates: Sequence[str], *, block_size: int = 128,
                progress: bool = True) -> np.ndarray:
    """cost[l, c]: mean over kv heads of the squared relative attention-output error of layer l
    (activations: `errors.LayerActivations`, one per layer)."""
    from tqdm.auto import tqdm

    from .errors import layer_errors  # torch: imported when used, so the CLI's --help stays light

    costs = np.zeros((len(activations), len(candidates)))
    bar = tqdm(total=costs.size, desc="layer costs", unit="layer", disable=not progress)
    for ci, cand in enumerate(candidates):
        bar.set_postfix_str(cand)
        for li, acts in enumerate(activations):
            attn = np.asarray(layer_errors(acts, cand, block_size=block_size)["attn"])
            costs[li, ci] = float(np.mean(attn ** 2))
            bar.update(1)
    bar.close()
    return costs


def choose_schemes(costs: np.ndarray, candidates: Sequence[str], head_dim: int, budget_bits: float, *,
                   block_size: int = 128) -> list[str]:
    """The per-layer choice minimizing total cost with mean bits per element <= budget_bits (exact)."""
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 2 or costs.shape[1] != len(candidates) or costs.shape[0] == 0:
        raise ValueError(f"costs must be [layers, {len(candidates)}], got {costs.shape}")
    if not np.all(np.isfinite(costs)):
        raise ValueError("costs must be finite")
    cfgs = [kj.parse(c) for c in candidates]
    for c in cfgs:
        c.check_block_size(block_size)
    # Bytes per block per kv head: an integer, so the knapsack is exact in units of their gcd.
    block_bytes = [int(round(kj.bytes_per_token(c, head_dim) * block_size)) for c in cfgs]
    unit = reduce(gcd, block_bytes)
    weight = [b // unit for b in block_bytes]
    layers = costs.shape[0]
    # bits/elem = 8 * block_bytes / (2 * head_dim * block_size); budget in the same units, rounded down.
    capacity = int(np.floor(layers * budget_bits * 2 * head_dim * block_size / 8 / unit + 1e-9))
    lightest = min(range(len(cfgs)), key=lambda i: weight[i])
    if weight[lightest] * layers > capacity:
        raise ValueError(f"budget_bits={budget_bits} is below the cheapest candidate "
                         f"{cfgs[lightest].name} ({bits_per_element(cfgs[lightest], head_dim):.4f} bits per element "
                         f"at head_dim {head_dim}); raise the budget or add a cheaper candidate")
    inf = np.inf
    best = np.zeros(capacity + 1)          # best[u]: minimal cost of the layers so far using <= u units
    choice = np.zeros((layers, capacity + 1), dtype=np.int64)
    for li in range(layers):
        new = np.full(capacity + 1, inf)
        for ci, w in enumerate(weight):
            if w > capacity:
                continue
            cand = np.full(capacity + 1, inf)
            cand[w:] = best[:capacity + 1 - w] + costs[li, ci]
            better = cand < new
            new[better] = cand[better]
            choice[li][better] = ci
        best = new
    u = int(np.argmin(best))
    picks = []
    for li in range(layers - 1, -1, -1):
        ci = int(choice[li][u])
        picks.append(cfgs[ci].name)
        u -= weight[ci]
    return picks[::-1]


def mean_bits(layers: Sequence[str], head_dim: int) -> float:
    return float(np.mean([bits_per_element(s, head_dim) for s in layers]))


SELECT_KEYS = {"ppl": "ppl", "kl": "kl_mean"}


def pick_winner(check: dict, select: str = "ppl") -> str:
    """The name of the configuration to write: lowest perplexity (select="ppl") or mean KL to the
    unquantized model (select="kl"), then fewest bits.

    check: {name: {"ppl": float, "kl_mean": float, "bits_per_element": float, ...}} measured on the same tokens.
    """
    if select not in SELECT_KEYS:
        raise ValueError(f"select must be one of {sorted(SELECT_KEYS)}, got {select!r}")
    if not check:
        raise ValueError("check is empty: nothing to choose from")
    key = SELECT_KEYS[select]
    return min(check, key=lambda n: (check[n][key], check[n]["bits_per_element"]))


def one_layer_configs(scheme: str, num_layers: int) -> dict:
    """{"layer i": per-layer list with only layer i quantized by `scheme`, the others exact (None)}."""
    return {f"layer {i}": [scheme if j == i else None for j in range(num_layers)] for i in range(num_layers)}


def kl_scaled_costs(attn_costs: np.ndarray, probe: int, probe_kl: Sequence[float]) -> np.ndarray:
    """cost[l, c] = attn_costs[l, c] * probe_kl[l] / attn_costs[l, probe]: each layer's attention errors
    in units of the KL that layer alone adds under the probe candidate (a small perturbation's KL is
    quadratic in it, as the squared attention error is, so the ratio carries over to the other
    candidates of the layer)."""
    attn_costs = np.asarray(attn_costs, dtype=np.float64)
    probe_kl = np.asarray(probe_kl, dtype=np.float64)
    if attn_costs.ndim != 2 or not 0 <= probe < attn_costs.shape[1]:
        raise ValueError(f"probe {probe} is not a column of costs {attn_costs.shape}")
    if probe_kl.shape != (attn_costs.shape[0],):
        raise ValueError(f"probe_kl must have one value per layer ({attn_costs.shape[0]}), got {probe_kl.shape}")
    if not (np.all(np.isfinite(probe_kl)) and np.all(np.isfinite(attn_costs))):
        raise ValueError("costs and probe_kl must be finite")
    base = attn_costs[:, probe]
    if np.any(base <= 0):
        raise ValueError(f"the probe candidate has no attention error in layers {np.flatnonzero(base <= 0).tolist()}: "
                         "probe with a quantizing candidate")
    # KL of a nearly exact layer can come out a hair below 0 (float rounding): no layer costs less than nothing.
    return attn_costs * (np.maximum(probe_kl, 0.0) / base)[:, None]


def candidate_scaled_costs(costs: np.ndarray, uniform_kl: Sequence[float]) -> np.ndarray:
    """costs with column c scaled so that it sums to uniform_kl[c] (the KL measured with candidate c in
    every layer): the layer-to-layer shape of each column is kept, its level is measured."""
    costs = np.asarray(costs, dtype=np.float64)
    uniform_kl = np.maximum(np.asarray(uniform_kl, dtype=np.float64), 0.0)
    if costs.ndim != 2 or uniform_kl.shape != (costs.shape[1],):
        raise ValueError(f"uniform_kl must have one value per candidate ({costs.shape[1:]}), got {uniform_kl.shape}")
    if not (np.all(np.isfinite(costs)) and np.all(np.isfinite(uniform_kl))):
        raise ValueError("costs and uniform_kl must be finite")
    total = costs.sum(axis=0)
    # A column without cost (an exact passthrough candidate) stays without cost.
    scale = np.divide(uniform_kl, total, out=np.zeros_like(total), where=total > 0)
    return costs * scale[None, :]


def costs_from_file(path, candidates: Sequence[str], num_layers: int) -> tuple[np.ndarray, str]:
    """(layer costs, their kind "attn" or "kl") a previous `tune` wrote, for the same candidates and layer
    count."""
    import json

    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--costs-from {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or "layer_costs" not in doc or "candidates" not in doc:
        raise ValueError(f"--costs-from {str(path)!r} has no layer_costs and candidates (a file written by tune)")
    names = [kj.parse(c).name for c in candidates]
    if [kj.parse(c).name for c in doc["candidates"]] != names:
        raise ValueError(f"--costs-from {str(path)!r} was measured for candidates {doc['candidates']}, not {names}: "
                         "give the same --candidates in the same order")
    costs = np.asarray(doc["layer_costs"], dtype=np.float64)
    if costs.shape != (num_layers, len(names)):
        raise ValueError(f"--costs-from {str(path)!r} has costs of shape {costs.shape}, the model and candidates "
                         f"need {(num_layers, len(names))}")
    if not np.all(np.isfinite(costs)):
        raise ValueError(f"--costs-from {str(path)!r} has non-finite costs")
    return costs, doc.get("costs", "attn")
