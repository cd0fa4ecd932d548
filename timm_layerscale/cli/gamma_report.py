"""What the commands print and draw about gammas: the stats table, JSON, and the PNG with its fallbacks."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..tools.gammas import MUTED_BELOW, BlockGammas, stats_rows
from ..tools.plots import PlottingUnavailable, missing_matplotlib, plot_gammas, plotting_available
from .common import CliError, table, warn

DEFAULT_PLOT = "layerscale_gammas.png"


def add_plot_arguments(parser: argparse.ArgumentParser, default: str | None) -> None:
    where = f" (default {default})" if default else ""
    parser.add_argument("--plot", metavar="FILE.png", default=None, help=f"write a PNG of the gammas{where}")
    if default:
        parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.set_defaults(default_plot=default)


def plot_target(args: argparse.Namespace) -> Path | None:
    """Where to draw, checked before any work: a missing matplotlib or folder fails (or warns) up front."""
    if getattr(args, "no_plot", False):
        return None
    path = Path(args.plot or args.default_plot) if (args.plot or args.default_plot) else None
    if path is None:
        return None
    if path.suffix.lower() != ".png":
        raise CliError(f"--plot {path}: the plot is a PNG; give a file name ending in .png")
    if not path.parent.is_dir():
        raise CliError(f"--plot {path}: folder {path.parent} does not exist; create it or pick another path")
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
