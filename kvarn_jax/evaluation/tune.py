"""Per-layer scheme choice under a bit budget (`kvarn-jax tune`).

1. Record real activations (calibration windows taken after the evaluation windows, so the check in
   step 3 is on text the choice never saw) and measure, for every layer and candidate scheme, the
   attention-output error of that layer alone (`errors.layer_errors`): cost[l, c] = mean over kv heads
   of the squared relative error (the noise power the layer adds to the residual stream).
2. Choose one candidate per layer minimizing sum_l cost[l, c_l] subject to
   mean_l bits_per_element(c_l) <= budget_bits: a multiple-choice knapsack, solved exactly by dynamic
   programming over block bytes (bits per element include every scale and zero point, like the tables).
   Layers whose keys have outlier channels have higher costs at low bits, so they get more bits.
3. Check it: teacher-forced perplexity of the per-layer choice and of every uniform candidate that
   fits the same budget, on the same tokens. The per-layer costs are a proxy (each layer's error
   alone, on other text), so the choice can lose to a uniform scheme: whichever configuration has the
   lowest perplexity is written (`pick_winner`), and the command says which won and by how much. With
   `max_ppl_increase`, a winner that misses it is reported as a failure and nothing is written.

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


def pick_winner(check: dict) -> str:
    """The name of the configuration to write: lowest perplexity, then fewest bits.

    check: {name: {"ppl": float, "bits_per_element": float, ...}} measured on the same tokens.
    """
    if not check:
        raise ValueError("check is empty: nothing to choose from")
    return min(check, key=lambda n: (check[n]["ppl"], check[n]["bits_per_element"]))
