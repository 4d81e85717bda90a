"""matplotlib figures: KL vs bits per element (eval), error by layer (report-errors).

matplotlib is imported lazily with the non-interactive Agg backend, so headless machines work.
Point labels are placed so that no two overlap and none covers a point (`place_labels`); the figure
layout is fixed before placing them, because a later layout pass would move points but not text.
"""

from __future__ import annotations

import math
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


def pareto_front(points: Sequence[Mapping], y: str = "kl_mean", x: str = "bits_per_element") -> list[Mapping]:
    """Points no other point beats on both axes (fewer or equal `x` and lower `y`), sorted by `x`."""
    front = []
    for p in sorted(points, key=lambda p: (p[x], p[y])):
        if not front or p[y] < front[-1][y]:
            front.append(p)
    return front


# Directions tried around a point, in order of preference: right, upper right, lower right, up, down,
# upper left, lower left, left.
_DIRECTIONS = ((1, 0), (1, 1), (1, -1), (0, 1), (0, -1), (-1, 1), (-1, -1), (-1, 0))
_RADII = (6, 14, 26, 40, 58, 80, 106)   # points from the marker's centre


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def place_labels(ax, xy: Sequence[tuple[float, float]], texts: Sequence[str], *, fontsize: float = 8,
                 marker_px: float = 5.0) -> list:
    """Annotate each data point xy[i] with texts[i] where the text overlaps no other label, no point
    and stays inside the axes; labels farther out get a leader line. Returns the annotations, None for
    a label no position fits (the caller lists those elsewhere, e.g. in the legend).

    Call after the axes limits and the figure layout are final.
    """
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    to_px = fig.dpi / 72.0
    disp = ax.transData.transform(list(xy))
    frame = ax.get_window_extent(renderer)
    taken = [Bbox.from_extents(px - marker_px, py - marker_px, px + marker_px, py + marker_px) for px, py in disp]
    out = []
    for (x, y), text in zip(xy, texts):
        ann = ax.annotate(text, (x, y), xytext=(0, 0), textcoords="offset points", fontsize=fontsize)
        placed = False
        for r in _RADII:
            for dx, dy in _DIRECTIONS:
                norm = math.hypot(dx, dy)
                ann.set_position((r * dx / norm, r * dy / norm))
                ann.set_horizontalalignment({1: "left", 0: "center", -1: "right"}[dx])
                ann.set_verticalalignment({1: "bottom", 0: "center", -1: "top"}[dy])
                box = ann.get_window_extent(renderer).padded(1.5 * to_px)
                inside = (box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1)
                if inside and not any(_overlaps(box, t) for t in taken):
                    taken.append(box)
                    placed = True
                    break
            if placed:
                break
        if placed and r > _RADII[1]:   # far from its point: redraw with a leader line
            pos, ha, va = ann.get_position(), ann.get_horizontalalignment(), ann.get_verticalalignment()
            ann.remove()
            ann = ax.annotate(text, (x, y), xytext=pos, textcoords="offset points", fontsize=fontsize, ha=ha, va=va,
                              arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 0, "shrinkB": 3})
        if not placed:
            ann.remove()
            ann = None
        out.append(ann)
    return out


def plot_kl_vs_bits(points: Sequence[Mapping], path: Union[str, os.PathLike], *, title: str = "",
                    floor: float = 1e-6) -> list:
    """Mean KL(unquantized || scheme) per token (nats, log scale) against bits per element, one
    labelled point per scheme ("name, ΔPPL"), the Pareto front (no scheme has fewer bits and lower
    KL) joined by a dashed line. KL below `floor` (an exact cache) is drawn at the floor.

    points: [{"scheme", "bits_per_element", "kl_mean", "ppl_increase"}, ...]. Returns the labels'
    annotations (see `place_labels`).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    fig.subplots_adjust(left=0.09, right=0.72, top=0.90, bottom=0.11)   # fixed: labels are placed in it

    def kl(p):
        return max(p["kl_mean"], floor)

    pts = sorted(points, key=lambda p: (p["bits_per_element"], kl(p)))
    front = pareto_front([{**p, "kl_mean": kl(p)} for p in pts])
    on_front = {p["scheme"] for p in front}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, p in enumerate(pts):
        ax.scatter(p["bits_per_element"], kl(p), s=30, zorder=3, color=colors[i % len(colors)],
                   marker="o" if p["scheme"] in on_front else "s", label=p["scheme"])
    ax.plot([p["bits_per_element"] for p in front], [p["kl_mean"] for p in front], "--", lw=1, color="gray",
            zorder=2)
    ax.set_yscale("log")
    xs = [p["bits_per_element"] for p in pts]
    ys = [kl(p) for p in pts]
    span = max(xs) - min(xs) or 1.0
    ax.set_xlim(min(xs) - 0.08 * span - 0.5, max(xs) + 0.35 * span + 0.5)
    ax.set_ylim(min(ys) / 4, max(ys) * 6)
    ax.set_xlabel("bits per K/V element (scales and zero points included)")
    ax.set_ylabel("KL(unquantized || scheme), nats per token (log)")
    ax.grid(alpha=0.3, which="both")
    if title:
        ax.set_title(title, fontsize=10)
    labels = place_labels(ax, [(p["bits_per_element"], kl(p)) for p in pts],
                          [f"{p['scheme']} ({100 * p['ppl_increase']:+.2f}% PPL)" for p in pts])
    handles, names = ax.get_legend_handles_labels()
    keep = [(h, n + ("" if lab is not None else " (label did not fit)"))
            for h, n, lab in zip(handles, names, labels)]
    from matplotlib.lines import Line2D
    keep.append((Line2D([], [], ls="--", color="gray"), "Pareto front (circles)"))
    keep.append((Line2D([], [], ls=""), f"KL < {floor:g} drawn at {floor:g}"))
    fig.legend([h for h, _ in keep], [n for _, n in keep], loc="upper left", bbox_to_anchor=(0.73, 0.90),
               fontsize=8, frameon=False)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels


def plot_layer_errors(report: Mapping, path: Union[str, os.PathLike], *, title: str = "",
                      bits: Mapping[str, float] | None = None) -> None:
    """Three panels (K, V, attention output): mean relative error over heads by layer, one line per
    scheme (its bits per element in the legend when `bits` is given); layers with flagged key
    outlier channels are shaded."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharex=True)
    flagged = sorted({o["layer"] for o in report["outliers"]})
    for ax, key, label in zip(axes, ("k", "v", "attn"), ("K", "V", "attention output")):
        for name, errs in report["schemes"].items():
            means = [sum(h) / len(h) for h in errs[key]]
            tag = f"{name} ({bits[name]:.2f} bits)" if bits else name
            ax.plot(range(len(means)), means, marker="o", ms=3, label=tag)
        for layer in flagged:
            ax.axvspan(layer - 0.5, layer + 0.5, color="red", alpha=0.08, lw=0)
        ax.set_title(f"{label}: ||x̂ − x|| / ||x||", fontsize=10)
        ax.set_xlabel("layer")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title + ("  (shaded: key outlier channels)" if flagged else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pareto(panels: Mapping[str, Sequence[Mapping]], path: Union[str, os.PathLike], *, title: str = "",
                floor: float = 1e-6) -> None:
    """KL (top row, log) and perplexity increase (bottom row) against bits per element, one column
    per model: {model name: eval rows ({"scheme", "bits_per_element", "kl_mean", "ppl_increase"})}.
    Clipped-range schemes (`_clip`, `_clipv`) are filled, the others hollow; circles are on the KL Pareto
    front, which the KL panel joins."""
    plt = _pyplot()
    n = len(panels)
    fig, axes = plt.subplots(2, n, figsize=(7.5 * n, 9), squeeze=False)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.92 if title else 0.95, bottom=0.06, hspace=0.22, wspace=0.15)
    for col, (model, rows) in enumerate(panels.items()):
        pts = sorted(rows, key=lambda p: (p["bits_per_element"], p["kl_mean"]))
        front = {p["scheme"] for p in pareto_front([{**p, "kl_mean": max(p["kl_mean"], floor)} for p in pts])}
        for row, (key, label, log) in enumerate((("kl_mean", "KL(unquantized || scheme), nats/token", True),
                                                 ("ppl_increase", "perplexity increase (%)", False))):
            ax = axes[row][col]
            val = (lambda p: max(p["kl_mean"], floor)) if log else (lambda p: 100 * p["ppl_increase"])
            for p in pts:
                clipped = p["scheme"].endswith(("_clip", "_clipv"))
                ax.scatter(p["bits_per_element"], val(p), s=36, zorder=3, marker="o" if p["scheme"] in front else "s",
                           facecolors="C3" if clipped else "none", edgecolors="C3" if clipped else "C0")
            if log:   # the front is KL's; the perplexity panel marks its members only
                fr = [p for p in pts if p["scheme"] in front]
                ax.plot([p["bits_per_element"] for p in fr], [val(p) for p in fr], "--", lw=1, color="gray", zorder=2)
            if log:
                ax.set_yscale("log")
            else:
                ax.set_yscale("symlog", linthresh=1.0)
            xs, ys = [p["bits_per_element"] for p in pts], [val(p) for p in pts]
            span = max(xs) - min(xs) or 1.0
            ax.set_xlim(min(xs) - 0.1 * span - 0.3, max(xs) + 0.35 * span + 0.3)
            if log:
                ax.set_ylim(min(ys) / 4, max(ys) * 6)
            else:
                ax.set_ylim(min(min(ys) * 1.5, -0.5), max(ys) * 3 + 1)
            ax.grid(alpha=0.3, which="both")
            ax.set_ylabel(label, fontsize=9)
            ax.set_xlabel("bits per K/V element (scales and zero points included)", fontsize=9)
            if row == 0:
                ax.set_title(model, fontsize=10)
            place_labels(ax, [(p["bits_per_element"], val(p)) for p in pts], [p["scheme"] for p in pts], fontsize=7)
    from matplotlib.lines import Line2D
    fig.legend([Line2D([], [], ls="", marker="o", color="C3"), Line2D([], [], ls="", marker="o", mfc="none", color="C0"),
                Line2D([], [], ls="--", color="gray")],
               ["clipped range (_clip, _clipv)", "min..max range", "Pareto front of KL (circles; squares: off it)"],
               loc="upper right", fontsize=8, ncol=3, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11, x=0.4)
    fig.savefig(path, dpi=110)
    plt.close(fig)
