"""`timm-ls export MODEL_OR_CHECKPOINT DST.onnx`: ONNX with one input, checked in ONNX Runtime with --check."""

from __future__ import annotations

import argparse
import sys

from ..export import OnnxCheckError, export_onnx, require_onnx
from ..hub import HubError
from .common import parse_model_kwargs


def execute(args: argparse.Namespace) -> int:
    require_onnx()
    try:
        result = export_onnx(
            args.source,
            args.dst,
            model=args.model,
            model_kwargs=parse_model_kwargs(args.model_kwargs),
            pretrained=args.pretrained,
            dtype=args.dtype,
            batch=args.batch,
            size=args.size,
            outputs=args.outputs,
            fuse_layerscale=args.fuse_layerscale,
            opset=args.opset,
            check=args.check,
            overwrite=args.overwrite,
        )
    except HubError as exc:
        raise exc.instead("pass the downloaded file instead: timm-ls export FILE DST.onnx --model NAME") from None
    except OnnxCheckError as exc:
        for row in exc.rows:
            print(row.line())
        print(f"timm-ls: check failed: {exc}", file=sys.stderr)
        return 1
    for row in result.check:
        print(row.line())
    print(result.summary())
    return 0
