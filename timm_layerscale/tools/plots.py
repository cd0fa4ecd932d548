"""PNG plots of gammas and training curves. matplotlib is the optional `tools` extra, imported on use.

Figures are built with `matplotlib.figure.Figure`, not pyplot: no global state, no GUI backend, nothing
to close.
"""

from __future__ import annotations

import importlib.util
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .files import write_atomically
from .gammas import BRANCHES, BlockGammas

INSTALL_HINT = "pip install 'timm-layerscale[tools]' (or pip install matplotlib)"
COLOURS = {"attn": "tab:blue", "mlp": "tab:orange"}
FLOOR = 1e-8  # a log axis cannot show 0: smaller |gamma| are drawn here


class PlottingUnavailable(Exception):
    """matplotlib is not installed."""


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def missing_matplotlib() -> str:
    return f"plotting needs matplotlib, which the core install leaves out; install it with {INSTALL_HINT}"


def _figure(**kwargs: Any):
    if not plotting_available():
        raise PlottingUnavailable(missing_matplotlib())
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def save_png(fig, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    write_atomically(path, buffer.getvalue())


def _wrap(title: str, width: int = 90) -> str:
    return "\n".join(textwrap.wrap(title, width))


def _floor(values: Sequence[float]) -> list[float]:
    return [max(v, FLOOR) for v in values]


def gamma_figure(blocks: Sequence[BlockGammas], title: str, before: Sequence[BlockGammas] | None = None):
    """Mean |gamma| per block for each branch, a band from min to max, and `before` as dashed lines."""
    fig = _figure(figsize=(7.5, 4), layout="tight")
    ax = fig.subplots()
    x = list(range(len(blocks)))
    for branch in BRANCHES:
        xs = [i for i in x if blocks[i].branch(branch) is not None]
        if not xs:
            continue
        stats = [blocks[i].branch(branch) for i in xs]
        colour = COLOURS[branch]
        ax.fill_between(xs, _floor([s.min for s in stats]), _floor([s.max for s in stats]), color=colour, alpha=0.18)
        ax.plot(xs, _floor([s.mean for s in stats]), "o-", ms=3, color=colour, label=f"{branch} mean |gamma|")
        if before is not None:
            old = _floor([before[i].branch(branch).mean for i in xs])
            ax.plot(xs, old, "--", color=colour, alpha=0.7, label=f"{branch} before")
    ax.set_yscale("log")
    ax.set_xlabel("block")
    ax.set_ylabel("|gamma| (band: min to max over channels)")
    step = max(1, len(x) // 16)
    ax.set_xticks(x[::step], [b.label for b in blocks][::step])
    ax.set_title(_wrap(title), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def plot_gammas(
    blocks: Sequence[BlockGammas], path: Path, title: str, before: Sequence[BlockGammas] | None = None
) -> None:
    save_png(gamma_figure(blocks, title, before), path)


def curves_figure(runs: dict[str, list[dict[str, float]]], title: str, gammas: dict[str, list[float]] | None = None):
    """Training loss and held-out accuracy against step, one line per init value (the mean over seeds)
    with a band from min to max; optionally a third panel with each init value's mean |gamma| per block
    at the end. `runs` maps a label to rows with `step`, `train_loss`, `test_acc` (one per seed and step).
    """
    panels = 3 if gammas else 2
    fig = _figure(figsize=(4.6 * panels, 3.8), layout="tight")
    axes = fig.subplots(1, panels)
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
    colours = {label: palette[i % len(palette)] for i, label in enumerate(runs)}
    for label, rows in runs.items():
        steps = sorted({r["step"] for r in rows})
        for ax, metric in zip(axes, ("train_loss", "test_acc")):
            by_step = [[r[metric] for r in rows if r["step"] == s] for s in steps]
            ax.plot(steps, [sum(v) / len(v) for v in by_step], "-", color=colours[label], label=label)
            if any(len(v) > 1 for v in by_step):
                low, high = [min(v) for v in by_step], [max(v) for v in by_step]
                ax.fill_between(steps, low, high, color=colours[label], alpha=0.2)
    axes[0].set_ylabel("training loss")
    axes[1].set_ylabel("held-out accuracy")
    for ax in axes[:2]:
        ax.set_xlabel("step")
    if gammas:
        for label, values in gammas.items():
            axes[2].plot(range(len(values)), _floor(values), "o-", ms=2, color=colours.get(label), label=label)
        axes[2].set_yscale("log")
        axes[2].set_xlabel("block")
        axes[2].set_ylabel("mean |gamma| at the end")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[1].legend(title="init_values", fontsize=8)
    fig.suptitle(_wrap(title, 120), fontsize=9)
    return fig


def plot_curves(
    runs: dict[str, list[dict[str, float]]], path: Path, title: str, gammas: dict[str, list[float]] | None = None
) -> None:
    save_png(curves_figure(runs, title, gammas), path)
