"""What every plot of the project shares: a grid of small panels (one metric each), integer step ticks,
accuracies drawn with their 95% Wilson score interval, a caption, and an atomic PNG write.

Figures are ``matplotlib.figure.Figure`` objects made without pyplot (no global state, no GUI backend),
so callers can return them for inspection and save them with ``save``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson_interval(k: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``k / n`` (E. B. Wilson, 1927): ``(low, high)`` in [0, 1].

    Unlike the normal approximation p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and is not empty at
    p = 0 or 1. ``k`` may be fractional (a mean accuracy times ``n``)."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def panel_grid(titles: Sequence[str], ncols: int = 3, sharex: bool = True, sharey: bool = False,
               panel_size=(4.0, 2.6)):
    """A figure with one small axes per title (row-major, at most ``ncols`` per row), each titled; returns
    ``(fig, axes)`` with exactly ``len(titles)`` axes (the grid's unused cells are removed)."""
    from matplotlib.figure import Figure

    if not titles:
        raise ValueError("panel_grid needs at least one panel")
    ncols = min(ncols, len(titles))
    nrows = math.ceil(len(titles) / ncols)
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows + 0.6), layout="constrained")
    grid = fig.subplots(nrows, ncols, sharex=sharex, sharey=sharey, squeeze=False).ravel()
    for ax in grid[len(titles):]:
        fig.delaxes(ax)
    axes = list(grid[:len(titles)])
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.xaxis.set_tick_params(labelbottom=True)  # every panel keeps its tick labels, shared or not
        ax.yaxis.set_tick_params(labelleft=True)
    return fig, axes


def integer_steps(ax, label: str = "step") -> None:
    """Ticks on whole steps only (never 1.5), and the x label."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(label, fontsize=8)


def accuracy_with_interval(ax, steps: Sequence[int], accuracy: Sequence[float], prompts: Sequence[int], **kw):
    """``accuracy`` against ``steps`` with its 95% Wilson score interval as error bars, the accuracy at
    each step measured on ``prompts`` items (k = accuracy · n correct). Returns the ErrorbarContainer."""
    lows, highs = [], []
    for p, n in zip(accuracy, prompts, strict=True):
        lo, hi = wilson_interval(p * n, n)
        lows.append(max(0.0, p - lo))  # (at p = 0 or 1 the bound equals p up to rounding, either side)
        highs.append(max(0.0, hi - p))
    kw.setdefault("marker", "o")
    return ax.errorbar(list(steps), list(accuracy), yerr=[lows, highs], capsize=0, markersize=3, elinewidth=1,
                       **kw)


def counts_text(prompts: Sequence[int]) -> str:
    """``n=32``, or ``n=30–32`` when the count differs between steps."""
    lo, hi = min(prompts), max(prompts)
    return f"n={lo}" if lo == hi else f"n={lo}–{hi}"


def caption(fig, lines: Sequence[str]) -> None:
    """A small note under the panels (what the intervals are, which metrics have none)."""
    if lines:
        fig.supxlabel("\n".join(lines), fontsize=7, ha="left", x=0.01)


def save(fig, path: Path, dpi: int = 100) -> Path:
    """Write ``fig`` to ``path`` as PNG, atomically (a temporary file beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    tmp.replace(path)
    return path
