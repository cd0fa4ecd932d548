"""What the commands print and draw about gammas: the stats table, JSON, and the PNG with its fallbacks."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..tools.gammas import MUTED_BELOW, BlockGammas, stats_rows
from ..tools.plots import PlottingUnavailable, missing_matplotlib, plot_gammas, plotting_available
from .common import CliError, table, warn


def plot_target(args: argparse.Namespace) -> Path | None:
    """Where to draw (its name and folder were checked before this module loaded): a missing matplotlib fails, or
    for the default plot warns, before any work."""
    if getattr(args, "no_plot", False):
        return None
    path = Path(args.plot or args.default_plot) if (args.plot or args.default_plot) else None
    if path is None:
        return None
    if not plotting_available():
        if args.plot:
            raise CliError(f"--plot: {missing_matplotlib()}")
        warn(f"no PNG of the gammas: {missing_matplotlib()} (or pass --no-plot)")
        return None
    return path


def draw(path: Path | None, blocks: list[BlockGammas], title: str, before: list[BlockGammas] | None = None) -> str:
    """Draws if asked; returns the line that says where the PNG went (or nothing)."""
    if path is None:
        return ""
    try:
        plot_gammas(blocks, path, title, before=before)
    except PlottingUnavailable as exc:  # found but not importable
        raise CliError(str(exc)) from None
    return f"plot: {path} (mean |gamma| per block, log scale; bars from min to max over channels)"


def stats_table(blocks: list[BlockGammas]) -> str:
    header, rows = stats_rows(blocks)
    return f"|gamma| per block and branch over its channels; muted: share of channels below {MUTED_BELOW:g}\n" + table(
        header, rows
    )
