"""`timm-ls run SCRIPT ARGS...`: run a timm script (train.py, validate.py, ...) with the variants registered."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from timm_ls.names import is_variant_file

from .common import CliError, register_variant_file

MODEL_FLAGS = ("--model", "-m")


def execute(args: argparse.Namespace) -> int:
    """timm's scripts look models up by name only: registering ours first is all they need."""
    script = Path(args.script)
    if not script.is_file():
        raise CliError(f"script {script} does not exist; pass the path of timm's train.py or validate.py")
    sys.argv = [str(script), *name_variant_files(args.script_args)]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0


def name_variant_files(script_args: list[str]) -> list[str]:
    """`--model my_variant.yaml`: the scripts take names, so the file is registered and its name passed on."""
    out = list(script_args)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if eq and flag in MODEL_FLAGS and is_variant_file(value):
            out[i] = f"{flag}={register_variant_file(value).name}"
        elif arg in MODEL_FLAGS and i + 1 < len(out) and is_variant_file(out[i + 1]):
            out[i + 1] = register_variant_file(out[i + 1]).name
    return out
