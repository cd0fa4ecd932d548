"""`timm-ls`: DINOv3-style ViTs with LayerScale for timm, and LayerScale made visible.

`timm-ls [demo]` trains a small variant on generated shapes and shows its gammas learn (or, with
`--checkpoint`/`--pretrained`, a model's real gammas); `timm-ls inspect` reads the gammas of any checkpoint,
variant or timm model; `timm-ls ablate` compares init values on a deep, narrow ViT; `timm-ls list` lists
the registered variants; `timm-ls run SCRIPT ARGS...` runs a timm script (train.py, validate.py, ...) with
the variants registered; `timm-ls convert SRC DST --to ...` converts a checkpoint between layouts; `timm-ls
export SRC DST.onnx` exports to ONNX. Each command is one module here; `timm-ls --debug ...` shows tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import version

import timm
import torch

from ..checkpoints import CheckpointError
from . import ablate, convert, demo, export, inspection, listing, run
from .common import CliError

COMMANDS = {
    "demo": demo,
    "inspect": inspection,
    "ablate": ablate,
    "list": listing,
    "run": run,
    "convert": convert,
    "export": export,
}
DEFAULT_COMMAND = "demo"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timm-ls",
        description=__doc__.split("\n")[0].split(": ", 1)[1],
        epilog=f"Without a command it runs `{DEFAULT_COMMAND}`; `timm-ls {DEFAULT_COMMAND} -h` lists its options.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"timm-ls {version('timm-layerscale')} (timm {timm.__version__}, torch {torch.__version__})",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command")
    for module in COMMANDS.values():
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = int(argv[:1] == ["--debug"])  # a global option goes before the command
    if len(argv) == first or argv[first] not in (*COMMANDS, "-h", "--help", "--version"):
        argv.insert(first, DEFAULT_COMMAND)
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `timm-ls inspect ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 1
    except (CliError, CheckpointError, ValueError, OSError) as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"timm-ls: error: {message}", file=sys.stderr)
        return 2
