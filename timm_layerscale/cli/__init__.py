"""`timm-ls`: build a vit_ls variant, run the shipped images through it and show its LayerScale gammas.

`timm-ls [demo]` runs a variant (random, `--checkpoint` or `--pretrained` weights); `timm-ls list` lists
the registered variants with their size, pretrained tags and YAML file; `timm-ls run SCRIPT ARGS...` runs a
timm script (train.py, validate.py, ...) with the variants registered; `timm-ls convert SRC DST --to ...`
converts a checkpoint between layouts. Each command is one module here; `timm-ls --debug ...` shows tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..conversion import CheckpointError
from . import convert, demo, listing, run
from .common import CliError

COMMANDS = {"demo": demo, "list": listing, "run": run, "convert": convert}
DEFAULT_COMMAND = "demo"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timm-ls",
        description=__doc__.split("\n")[0].split(": ", 1)[1],
        epilog=f"Without a command it runs `{DEFAULT_COMMAND}`; `timm-ls {DEFAULT_COMMAND} -h` lists its options.",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command")
    for module in COMMANDS.values():
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = int(argv[:1] == ["--debug"])  # a global option goes before the command
    if len(argv) == first or argv[first] not in (*COMMANDS, "-h", "--help"):
        argv.insert(first, DEFAULT_COMMAND)
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, CheckpointError, ValueError, OSError) as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"timm-ls: error: {message}", file=sys.stderr)
        return 2
