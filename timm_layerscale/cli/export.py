"""`timm-ls export MODEL_OR_CHECKPOINT DST.onnx`: ONNX with one input, checked in ONNX Runtime with --check."""

from __future__ import annotations

import argparse
import sys

from timm_ls.names import EXPORT_DTYPES

from ..export import OnnxCheckError, export_onnx, require_onnx
from ..export.check import TOLERANCE
from .common import parse_model_kwargs

EPILOG = """examples:
  timm-ls export vit_ls_small_patch16_dinov3.lvd1689m vits16.onnx --pretrained --check
  timm-ls export dinov3_vitb16_pretrain_lvd1689m.pth vitb16.onnx --outputs features:2,5,8,11 --check
  timm-ls export vit_ls_base_patch16_dinov3.lvd1689m vitb16-fp16.onnx --pretrained --dtype fp16 --size 224x224
  timm-ls export vit7b16-folder vit7b16.onnx --model vit_ls_7b_patch16_dinov3 --dtype fp16"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export",
        help="export a model or checkpoint to ONNX, checked in ONNX Runtime",
        description=(
            "Export to ONNX with one input, pixel_values [N, 3, H, W], and named outputs; the metadata carries "
            "the variant, preprocessing and licence. Needs the export extra: pip install 'timm-layerscale[export]'."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        metavar="MODEL_OR_CHECKPOINT",
        help="a variant NAME[.TAG] (with --pretrained for its weights), a YAML variant file, or any checkpoint "
        "file or folder",
    )
    parser.add_argument("dst", metavar="DST.onnx", help="the ONNX file (weights over 2 GB go to DST.onnx.data)")
    parser.add_argument(
        "--model", metavar="NAME[.TAG]|VARIANT.yaml", help="a checkpoint's variant (default: from the shapes)"
    )
    parser.add_argument(
        "--model-kwargs", nargs="+", action="extend", default=[], metavar="K=V", help="override its args, e.g. depth=2"
    )
    parser.add_argument("--pretrained", action="store_true", help="a variant name's Hub weights (else random init)")
    parser.add_argument(
        "--dtype", default="fp32", metavar="{" + ",".join(EXPORT_DTYPES) + "}", help="weights and activations"
    )
    parser.add_argument("--batch", default="dynamic", metavar="N|dynamic", help="the batch size (default: dynamic)")
    parser.add_argument("--size", default="dynamic", metavar="HxW|dynamic", help="the input sides (default: dynamic)")
    parser.add_argument(
        "--outputs",
        default="pooled",
        metavar="pooled|tokens|features:I,J,...",
        help="pooled: what forward returns; tokens: the last block's normed tokens; features: those blocks' "
        "patch tokens as [N, C, H/16, W/16]",
    )
    parser.add_argument("--fuse-layerscale", action="store_true", help="fold every gamma into the layer before it")
    parser.add_argument("--opset", type=int, metavar="N", help="the ONNX opset (default: torch's)")
    tolerances = ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"compare ONNX Runtime with PyTorch fp32 at three sizes; fail above a relative error of {tolerances}",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.set_defaults(func=export)


def export(args: argparse.Namespace) -> int:
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
    except OnnxCheckError as exc:
        for row in exc.rows:
            print(row.line())
        print(f"timm-ls: check failed: {exc}", file=sys.stderr)
        return 1
    for row in result.check:
        print(row.line())
    print(result.summary())
    return 0
