"""matplotlib figures: perplexity vs bits per element (eval), error by layer (report-errors).

matplotlib is imported lazily with the non-interactive Agg backend, so headless machines work.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence, Union


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or pip install 'kvarn-jax[eval]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_front(points: Sequence[Mapping]) -> list[Mapping]:
    """Points no other point beats on both bits and perplexity (fewer or equal bits and lower ppl), by bits."""
    front = []
    for p in sorted(points, key=lambda p: (p["bits_per_element"], p["ppl"])):
        if not front or p["ppl"] < front[-1]["ppl"]:
            front.append(p)
    return front


def plot_pareto(points: Sequence[Mapping], reference_ppl: float, path: Union[str, os.PathLike], *,
                title: str = "", floor: float = 0.01) -> None:
    """Perplexity increase over the unquantized cache (%, log scale) vs bits per element, one labelled
    point per scheme, the Pareto front dashed. Increases below `floor` % (or negative) sit on the floor.

    points: [{"scheme", "bits_per_element", "ppl"}, ...].
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))

    def inc(p):
        return max(100 * (p["ppl"] / reference_ppl - 1), floor)

    for n, p in enumerate(sorted(points, key=lambda p: (p["bits_per_element"], p["ppl"]))):
        ax.scatter(p["bits_per_element"], inc(p), s=36, zorder=3)
        ax.annotate(f"{p['scheme']} ({p['ppl']:.2f})", (p["bits_per_element"], inc(p)), textcoords="offset points",
                    xytext=(6, 6 if n % 2 == 0 else -12), fontsize=8)
    front = pareto_front(points)
    ax.plot([p["bits_per_element"] for p in front], [inc(p) for p in front], "--", lw=1, color="gray",
            label="Pareto front", zorder=2)
    ax.set_yscale("log")
    ax.set_xlabel("bits per K/V element (scales included)")
    ax.set_ylabel("perplexity increase over unquantized KV (%)")
    ax.plot([], [], " ", label=f"unquantized KV: PPL {reference_ppl:.2f}")
    ax.plot([], [], " ", label=f"increases < {floor}% drawn at {floor}%")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_layer_errors(report: Mapping, path: Union[str, os.PathLike], *, title: str = "") -> None:
    """Three panels (K, V, attention output): mean relative error over heads by layer, one line per
    scheme; layers with flagged key outlier channels are shaded."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharex=True)
    flagged = sorted({o["layer"] for o in report["outliers"]})
    for ax, key, label in zip(axes, ("k", "v", "attn"), ("K", "V", "attention output")):
        for name, errs in report["schemes"].items():
            means = [sum(h) / len(h) for h in errs[key]]
            ax.plot(range(len(means)), means, marker="o", ms=3, label=name)
        for layer in flagged:
            ax.axvspan(layer - 0.5, layer + 0.5, color="red", alpha=0.08, lw=0)
        ax.set_title(f"{label} relative error", fontsize=10)
        ax.set_xlabel("layer")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title + ("  (shaded: key outlier channels)" if flagged else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
