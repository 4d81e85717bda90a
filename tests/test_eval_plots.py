"""Figures: labels never overlap each other or a point and stay in the axes (random clusters,
duplicates), the KL plot marks the Pareto front and names unplaced labels in its legend."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn_jax.evaluation.plots import pareto_front, place_labels, plot_kl_vs_bits

plt = pytest.importorskip("matplotlib.pyplot")


def _text_boxes(ax, labels):
    from matplotlib.text import Text
    renderer = ax.figure.canvas.get_renderer()
    boxes = []
    for a in labels:
        if a is not None:
            a.update_positions(renderer)
            boxes.append(Text.get_window_extent(a, renderer))   # the text, not its leader line
    return boxes


def _overlap(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 16), n=st.integers(1, 14), spread=st.sampled_from([0.02, 0.3, 3.0]))
def test_labels_do_not_overlap(seed, n, spread):
    rng = np.random.default_rng(seed)
    centre = rng.uniform(3, 9, size=2)
    xy = [(float(x), float(10 ** y)) for x, y in centre + rng.normal(0, spread, size=(n, 2))]
    xy += xy[:2]   # exact duplicates too
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.set_yscale("log")
    xs, ys = [p[0] for p in xy], [p[1] for p in xy]
    ax.set_xlim(min(xs) - 2, max(xs) + 4)
    ax.set_ylim(min(ys) / 10, max(ys) * 10)
    ax.scatter(xs, ys)
    labels = place_labels(ax, xy, [f"scheme_{i}_k4v2_g128 (+{i}.00%)" for i in range(len(xy))])
    boxes = _text_boxes(ax, labels)
    frame = ax.get_window_extent(fig.canvas.get_renderer())
    points = ax.transData.transform(xy)
    for i, a in enumerate(boxes):
        assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1
        for b in boxes[i + 1:]:
            assert not _overlap(a, b)
        for px, py in points:
            assert not (a.x0 < px < a.x1 and a.y0 < py < a.y1)   # no label covers a point
    if spread >= 0.3 and n <= 8:
        assert all(lab is not None for lab in labels)   # with room, every label is placed
    plt.close(fig)


def test_kl_plot_front_and_unplaced_labels(tmp_path):
    pts = [{"scheme": "a", "bits_per_element": 3.0, "kl_mean": 0.05, "ppl_increase": 0.05},
           {"scheme": "b", "bits_per_element": 3.5, "kl_mean": 0.004, "ppl_increase": 0.004},
           {"scheme": "c", "bits_per_element": 4.5, "kl_mean": 0.009, "ppl_increase": 0.013},   # dominated by b
           {"scheme": "fp16", "bits_per_element": 16.0, "kl_mean": -1e-12, "ppl_increase": 0.0}]
    assert [p["scheme"] for p in pareto_front(pts)] == ["a", "b", "fp16"]
    out = tmp_path / "kl.png"
    labels = plot_kl_vs_bits(pts, out, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and all(lab is not None for lab in labels)
    # 60 schemes at one point cannot all be labelled there: the rest are named in the legend
    crowd = [{"scheme": f"s{i}", "bits_per_element": 4.0, "kl_mean": 0.01, "ppl_increase": 0.01} for i in range(60)]
    labels = plot_kl_vs_bits(crowd, tmp_path / "crowd.png")
    assert 0 < sum(lab is None for lab in labels) < 60
