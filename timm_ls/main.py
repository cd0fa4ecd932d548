"""`timm-ls`: the entry point. It parses and checks the arguments first, then loads the command's own module.

`timm-ls [demo]` trains a small variant on generated shapes and shows its gammas learn (or, with
`--checkpoint`/`--pretrained`, a model's real gammas); `timm-ls inspect` reads the gammas of any checkpoint,
variant or timm model; `timm-ls ablate` compares init values on a deep, narrow ViT; `timm-ls list` lists the
registered variants; `timm-ls run SCRIPT ARGS...` runs a timm script (train.py, validate.py, ...) with the
variants registered; `timm-ls convert SRC DST --to ...` converts a checkpoint between formats; `timm-ls export
SRC DST.onnx` exports to ONNX. `timm-ls --debug ...` shows tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType

from .checks import CHECKS
from .errors import CliError
from .interrupts import arrived, interruptible
from .parsers import COMMANDS, DEFAULT_COMMAND, make_parser
from .pretrain_request import RECORD as PRETRAIN_RECORD


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def version_line() -> str:
    """Read from the installed metadata: nothing is imported to say it."""
    return f"timm-ls {_version('timm-layerscale')} (timm {_version('timm')}, torch {_version('torch')})"


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The arguments, the default command put in where none is named."""
    argv = list(argv)
    first = int(argv[:1] == ["--debug"])  # a global option goes before the command
    if len(argv) == first or argv[first] not in (*COMMANDS, "-h", "--help", "--version"):
        argv.insert(first, DEFAULT_COMMAND)
    return make_parser(version_line()).parse_args(argv)


def command_module(command: str) -> ModuleType:
    """The module that runs `command`, loaded now: the one place a module of the package is imported inside a
    function, so that `--help` and bad arguments never wait for torch and timm."""
    return importlib.import_module(f"timm_layerscale.cli.{COMMANDS[command][1]}")


def interrupted_line(args: argparse.Namespace, written: object = None) -> str:
    """What an interrupted command says: its writers leave their destination as it was, unless the signal
    came once the new one was in place (`written`)."""
    if written is not None:
        return f"timm-ls: interrupted; {written} had been written"
    dst = {"convert": "dst", "export": "dst", "features": "out"}.get(args.command)
    if args.command == "pretrain":  # a run's folder keeps its last whole checkpoint, to go on from
        run = args.resume or args.out
        if run and (Path(run) / PRETRAIN_RECORD).is_file():
            return f"timm-ls: interrupted; {run} keeps its last checkpoint: --resume {run} goes on from it"
        return "timm-ls: interrupted" + (f"; no checkpoint was written to {run}" if run else "")
    dst = getattr(args, dst, None) if dst else None
    return "timm-ls: interrupted" + (f"; nothing was written to {dst}" if dst else "")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        with interruptible() if args.command != "run" else nullcontext():  # a script run keeps its own signals
            request = CHECKS[args.command](args)  # a command's request, where it has one: parsed once, here
            return command_module(args.command).execute(args if request is None else request)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the writers' clean-up has run on the way here
        if args.debug:
            raise
        print(interrupted_line(args, getattr(exc, "written", None)), file=sys.stderr)
        return getattr(exc, "exit_status", 130)
    except BrokenPipeError:  # `timm-ls inspect ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 1
    except (CliError, ValueError, OSError) as exc:
        if args.debug:
            raise
        if (signum := arrived()) is not None:  # the signal, turned into this error where it landed: it is the cause
            print(interrupted_line(args), file=sys.stderr)
            return 128 + signum
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"timm-ls: error: {message}", file=sys.stderr)
        return 2
