"""PNG plots of gammas and training curves. matplotlib is the optional `tools` extra, imported on use."""

from __future__ import annotations

import importlib.util
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path

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


def _pyplot():
    if not plotting_available():
        raise PlottingUnavailable(missing_matplotlib())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    write_atomically(path, buffer.getvalue())


def _wrap(title: str, width: int = 90) -> str:
    return "\n".join(textwrap.wrap(title, width))


def plot_gammas(
    blocks: Sequence[BlockGammas], path: Path, title: str, before: Sequence[BlockGammas] | None = None
) -> None:
    """Mean |gamma| per block for each branch, a band from min to max, and `before` as dashed lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    x = list(range(len(blocks)))
    for branch in BRANCHES:
        points = [(i, b.branch(branch)) for i, b in zip(x, blocks) if b.branch(branch) is not None]
        if not points:
            continue
        xs = [i for i, _ in points]
        clip = lambda v: max(v, FLOOR)  # noqa: E731
        ax.fill_between(
            xs, [clip(s.min) for _, s in points], [clip(s.max) for _, s in points], color=COLOURS[branch], alpha=0.18
        )
        ax.plot(
            xs, [clip(s.mean) for _, s in points], "o-", ms=3, color=COLOURS[branch], label=f"{branch} mean |gamma|"
        )
        if before is not None:
            old = [before[i].branch(branch) for i in xs]
            ax.plot(xs, [clip(s.mean) for s in old], "--", color=COLOURS[branch], alpha=0.7, label=f"{branch} before")
    ax.set_yscale("log")
    ax.set_xlabel("block")
    ax.set_ylabel("|gamma| (band: min to max over channels)")
    step = max(1, len(x) // 16)
    ax.set_xticks(x[::step], [b.label for b in blocks][::step])
    ax.set_title(_wrap(title), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_curves(
    runs: dict[str, list[dict[str, float]]],
    path: Path,
    title: str,
    gammas: dict[str, list[float]] | None = None,
) -> None:
    """Training loss and held-out accuracy against step, one line per init value, a band over seeds;
    optionally a third panel with each init value's mean |gamma| per block at the end.

    `runs` maps a label to rows with `step`, `train_loss`, `test_acc` (one row per seed and step).
    """
    plt = _pyplot()
    panels = 3 if gammas else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.8))
    colours = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for label, rows in runs.items():
        steps = sorted({r["step"] for r in rows})
        for ax, metric in zip(axes, ("train_loss", "test_acc")):
            by_step = [[r[metric] for r in rows if r["step"] == s] for s in steps]
            ax.plot(steps, [sum(v) / len(v) for v in by_step], "-", color=colours[label], label=label)
            if any(len(v) > 1 for v in by_step):
                ax.fill_between(
                    steps, [min(v) for v in by_step], [max(v) for v in by_step], color=colours[label], alpha=0.2
                )
    axes[0].set_ylabel("training loss")
    axes[1].set_ylabel("held-out accuracy")
    for ax in axes[:2]:
        ax.set_xlabel("step")
    if gammas:
        ax = axes[2]
        for label, values in gammas.items():
            ax.plot(
                range(len(values)), [max(v, FLOOR) for v in values], "o-", ms=2, color=colours.get(label), label=label
            )
        ax.set_yscale("log")
        ax.set_xlabel("block")
        ax.set_ylabel("mean |gamma| at the end")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[1].legend(title="init_values", fontsize=8)
    fig.suptitle(_wrap(title, 120), fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
