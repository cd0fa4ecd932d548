"""PNG plots of gammas and training curves. matplotlib is the optional `tools` extra, imported on use.

Figures are built with `matplotlib.figure.Figure`, not pyplot: no global state, no GUI backend, nothing
to close.
"""

from __future__ import annotations

import importlib.util
import io
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from timm_ls.paths import install_hint

from .files import write_atomically
from .gammas import BRANCHES, BlockGammas

COLOURS = {"attn": "tab:blue", "mlp": "tab:orange"}
FLOOR = 1e-8  # a log axis cannot show 0: smaller |gamma| are drawn here


class PlottingUnavailable(Exception):
    """matplotlib is not installed."""


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def missing_matplotlib() -> str:
    return f"plotting needs matplotlib, which the core install leaves out; install it with {install_hint('tools')}"


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


# Each branch keeps its own marker, line style and horizontal offset, so that two equal series (every gamma
# still at its init, say) lie side by side instead of one hiding the other, and their bars never blend.
STYLE = {
    "attn": dict(marker="o", linestyle="-", offset=-0.14),
    "mlp": dict(marker="s", linestyle="--", offset=0.14),
}
BEFORE_LINESTYLE = {"attn": ":", "mlp": "-."}
MIN_DECADES = 2  # a log axis spanning fewer shows only minor ticks, whose labels can all read the same


def log_limits(values: Sequence[float]) -> tuple[float, float]:
    """y limits around `values` spanning at least MIN_DECADES decades: a flat series gets labelled powers of ten."""
    low, high = min(values), max(values)
    centre = math.sqrt(low * high)
    half = max(math.sqrt(high / low), 10 ** (MIN_DECADES / 2)) * 1.25
    return centre / half, centre * half


def _block_ticks(ax, labels: list[str]) -> None:
    """Tick labels that never overlap: block names (CaiT's `blocks_token_only.1`) run vertically, all up to 40."""
    names = any(not label.isdigit() for label in labels)
    step = math.ceil(len(labels) / (40 if names else 20))
    positions = list(range(len(labels)))[::step]
    ax.set_xticks(positions, labels[::step], rotation=90 if names else 0, fontsize=8 if names else None)
    ax.set_xlim(-0.6, len(labels) - 0.4)


def gamma_figure(blocks: Sequence[BlockGammas], title: str, before: Sequence[BlockGammas] | None = None):
    """Mean |gamma| per block for each branch with a bar from min to max over its channels, and `before`
    as hollow markers on dotted lines; the legend sits beside the axes, off the data."""
    fig = _figure(figsize=(8.5, 4.2), layout="constrained")
    ax = fig.subplots()
    drawn: list[float] = []
    for branch in BRANCHES:
        at = [i for i, block in enumerate(blocks) if block.branch(branch) is not None]
        if not at:
            continue
        stats = [blocks[i].branch(branch) for i in at]
        style, colour = STYLE[branch], COLOURS[branch]
        xs = [i + style["offset"] for i in at]
        low, mean, high = (_floor([getattr(s, field) for s in stats]) for field in ("min", "mean", "max"))
        ax.vlines(xs, low, high, colors=colour, linewidth=3, alpha=0.35)
        ax.plot(
            xs, mean, marker=style["marker"], ls=style["linestyle"], ms=4, color=colour, label=f"{branch} mean |gamma|"
        )
        drawn += low + mean + high
        if before is not None:
            old = _floor([before[i].branch(branch).mean for i in at])
            ax.plot(
                xs,
                old,
                marker=style["marker"],
                mfc="none",
                ms=6,
                ls=BEFORE_LINESTYLE[branch],
                color=colour,
                label=f"{branch} before",
            )
            drawn += old
    ax.set_yscale("log")
    ax.set_ylim(*log_limits(drawn))
    ax.set_xlabel("block")
    ax.set_ylabel("|gamma| (bar: min to max over channels)")
    _block_ticks(ax, [b.label for b in blocks])
    ax.set_title(_wrap(title, 75), fontsize=9)  # the legend takes the figure's right edge
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=8)
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
    fig = _figure(figsize=(4.6 * panels + 1, 3.8), layout="constrained")
    axes = fig.subplots(1, panels)
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
    colours = {label: palette[i % len(palette)] for i, label in enumerate(runs)}
    for label, rows in runs.items():
        steps = sorted({r["step"] for r in rows})
        for ax, metric, scale in zip(axes, ("train_loss", "test_acc"), (1, 100)):
            by_step = [[r[metric] * scale for r in rows if r["step"] == s] for s in steps]
            ax.plot(steps, [sum(v) / len(v) for v in by_step], "-", color=colours[label], label=label)
            if any(len(v) > 1 for v in by_step):
                low, high = [min(v) for v in by_step], [max(v) for v in by_step]
                ax.fill_between(steps, low, high, color=colours[label], alpha=0.2)
    axes[0].set_ylabel("training loss")
    axes[1].set_ylabel("held-out accuracy (%)")
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
    fig.legend(*axes[0].get_legend_handles_labels(), title="init_values", fontsize=8, loc="outside right upper")
    fig.suptitle(_wrap(title, 120), fontsize=9)
    return fig


def plot_curves(
    runs: dict[str, list[dict[str, float]]], path: Path, title: str, gammas: dict[str, list[float]] | None = None
) -> None:
    save_png(curves_figure(runs, title, gammas), path)
