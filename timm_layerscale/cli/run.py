"""`timm-ls run SCRIPT ARGS...`: run a timm script (train.py, validate.py, ...) with the variants registered."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from .common import CliError


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("run", help="run a timm script (train.py, validate.py) with the variants registered")
    parser.add_argument("script", help="path of the script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    parser.set_defaults(func=run_script)


def run_script(args: argparse.Namespace) -> int:
    """timm's scripts look models up by name only: registering ours first is all they need."""
    script = Path(args.script)
    if not script.is_file():
        raise CliError(f"script {script} does not exist; pass the path of timm's train.py or validate.py")
    sys.argv = [str(script), *args.script_args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0
