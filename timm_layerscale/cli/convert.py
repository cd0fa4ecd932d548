"""`timm-ls convert SRC DST --to FORMAT` (`timm-ls convert --help` lists them): a checkpoint into another format."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from timm_ls.names import format_spec

from ..convert import convert_checkpoint
from .common import parse_model_kwargs


def execute(args: argparse.Namespace) -> int:
    """The arguments were checked before this module loaded (timm_ls.checks)."""
    model_kwargs = parse_model_kwargs(args.model_kwargs)
    result = convert_checkpoint(
        args.src,
        args.dst,
        to=args.to,
        model=args.model,
        model_kwargs=model_kwargs,
        dtype=args.dtype,
        weights=args.weights,
        fuse_layerscale=args.fuse_layerscale,
        overwrite=args.overwrite,
        strict=args.strict,
        **{option.dest: getattr(args, option.dest) for option in format_spec(args.to).options},
    )
    for warning in result.warnings:
        print(f"timm-ls: warning: {warning}", file=sys.stderr)
    if args.json:
        shown = dict(asdict(result), layout=result.source_format)  # `layout`: the old name, still written
        print(json.dumps(dict(shown, destination=str(result.destination), summary=result.summary()), indent=1))
        return 0
    for line in result.report:
        print(f"  {line}")
    print(result.summary())
    if result.meta_yaml:
        print("Meta training YAML for it (continued pretraining, Gram anchoring, distillation):")
        print(result.meta_yaml)
    return 0
