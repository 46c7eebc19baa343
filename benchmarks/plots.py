"""Small PNG plotting helpers shared by the benchmarks: lines, grouped bars, labelled points, annotated heatmaps.

Each function draws one figure with matplotlib's non-interactive ``Agg`` backend, writes it
to ``path`` (creating the folder) and returns the path; nothing is shown on screen, so they
run headless in CI and over SSH.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NotRequired, TypedDict, Unpack

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, also headless

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

DPI = 120


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


class Labels(TypedDict):
    """What a plot's axes say: its title, each axis's label, and optionally the y range and the
    legend's title."""

    title: str
    xlabel: str
    ylabel: str
    ylim: NotRequired[tuple[float, float] | None]
    legend_title: NotRequired[str | None]


def _label(ax: Axes, labels: Labels, *, legend: bool, grid_axis: str = "both") -> None:
    ax.set_title(labels["title"])
    ax.set_xlabel(labels["xlabel"])
    ax.set_ylabel(labels["ylabel"])
    if labels.get("ylim") is not None:
        ax.set_ylim(*labels["ylim"])
    ax.grid(True, axis=grid_axis, alpha=0.3)
    if legend:
        ax.legend(title=labels.get("legend_title"), loc="best", fontsize="small")


def line_plot(
    path: str | Path, series: Mapping[str, tuple[Sequence[float], Sequence[float]]], **labels: Unpack[Labels]
) -> Path:
    """One line per entry of ``series`` (label -> (xs, ys)) on shared axes."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), label=label, linewidth=1.6)
    _label(ax, labels, legend=bool(series))
    return _save(fig, path)


def scatter_plot(
    path: str | Path, points: Mapping[str, tuple[float, float]], *, log_y: bool = False, **labels: Unpack[Labels]
) -> Path:
    """One point per entry of ``points`` (label -> (x, y)), named in the legend."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (x, y) in points.items():
        ax.scatter([x], [y], s=40, label=label)
    if log_y:
        ax.set_yscale("log")
    _label(ax, labels, legend=bool(points))
    return _save(fig, path)


def bar_plot(
    path: str | Path, groups: Sequence[str], series: Mapping[str, Sequence[float]], **labels: Unpack[Labels]
) -> Path:
    """Grouped bars: one group per entry of ``groups``, one bar per series (label -> a value per group)."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(groups) * max(1, len(series))), 4.5))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        offsets = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(offsets, list(values), width=width, label=label)
    ax.set_xticks(range(len(groups)), list(groups))
    _label(ax, labels, legend=bool(series), grid_axis="y")
    return _save(fig, path)


def heatmaps(
    path: str | Path,
    panels: Mapping[str, Sequence[Sequence[float]]],
    *,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    row_title: str,
    col_title: str,
    vmin: float,
    vmax: float,
    fmt: str = "{:.2f}",
    colorbar_label: str = "",
) -> Path:
    """Side-by-side annotated heatmaps on one colour scale: panel title -> matrix[row][col]."""
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(0.6 + 2.9 * n, 3.4), squeeze=False, sharey=True, constrained_layout=True)
    image = None
    for ax, (name, matrix) in zip(axes[0], panels.items(), strict=False):
        image = ax.imshow(matrix, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_title(name)
        ax.set_xticks(range(len(col_labels)), list(col_labels))
        ax.set_yticks(range(len(row_labels)), list(row_labels))
        ax.set_xlabel(col_title)
        midpoint = (vmin + vmax) / 2
        for r, row in enumerate(matrix):
            for c, value in enumerate(row):
                color = "black" if value > midpoint else "white"
                ax.text(c, r, fmt.format(value), ha="center", va="center", fontsize=8, color=color)
    axes[0][0].set_ylabel(row_title)
    fig.suptitle(title)
    if image is not None:
        fig.colorbar(image, ax=list(axes[0]), label=colorbar_label, shrink=0.9)
    return _save(fig, path)
