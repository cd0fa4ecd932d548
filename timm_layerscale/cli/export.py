"""`timm-ls export MODEL_OR_CHECKPOINT DST.onnx`: ONNX with one input, checked in ONNX Runtime with --check;
int8 with --int8, its fidelity to PyTorch fp32 printed (and held to --min-cosine)."""

from __future__ import annotations

import argparse
import sys

from ..export import FidelityError, OnnxCheckError, export_onnx, require_onnx
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
            int8=args.int8,
            calibrate=args.calibrate,
            images=args.images,
            min_cosine=args.min_cosine,
        )
    except HubError as exc:
        raise exc.instead("pass the downloaded file instead: timm-ls export FILE DST.onnx --model NAME") from None
    except OnnxCheckError as exc:
        for row in exc.rows:
            print(row.line())
        print(f"timm-ls: check failed: {exc}", file=sys.stderr)
        return 1
    except FidelityError as exc:
        print(exc.fidelity.line())
        print(f"timm-ls: error: {exc}", file=sys.stderr)
        return 2
    for row in result.check:
        print(row.line())
    for line in result.skipped:
        print(f"timm-ls: skipped {line}", file=sys.stderr)
    if result.fidelity is not None:
        print(result.fidelity.line())
    print(result.summary())
    return 0
