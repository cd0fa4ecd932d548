"""`timm-ls convert SRC DST --to {native,meta,meta-train,hf,timm}`: a checkpoint into another layout."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from timm_ls.names import CAST_DTYPES, FORMATS, KEEP, WEIGHTS_SETS

from ..checkpoints import get_format
from ..checkpoints.reader import open_checkpoint
from ..convert import convert_checkpoint
from .common import CliError, parse_model_kwargs

EPILOG = """examples:
  timm-ls convert dinov3_vitb16_pretrain.pth vitb16-timm --to timm
  timm-ls convert ckpt/12499 vitl16-hf --to hf --model vit_ls_large_patch16_dinov3
  timm-ls convert hf-folder model.pth --to meta --dtype bf16
  timm-ls convert model.pth fused --to native --fuse-layerscale
  timm-ls convert dinov3_vitl16_pretrain.pth vitl16-train.pth --to meta-train --meta-config train.yaml
  timm-ls convert timm-finetune/model_best.pth.tar vitb16-teacher --to meta-train --distill-teacher --strict"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert",
        help="convert a checkpoint between Meta, transformers, timm eva and native layouts",
        description="Convert a checkpoint into another layout, tensor by tensor, and say what the target cannot hold.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "src",
        metavar="SRC",
        help="a .pth/.bin/.safetensors file, a sharded index, a Hub folder or a torch.distributed.checkpoint folder",
    )
    parser.add_argument(
        "dst",
        metavar="DST",
        help="a folder (native, hf, timm) or a .pth/.safetensors file (meta); meta-train: a .pth file, or a name "
        "without a suffix for a distributed checkpoint folder",
    )
    targets = "; ".join(f"{t.name}: {t.description}" for t in FORMATS)
    parser.add_argument("--to", required=True, metavar="{" + ",".join(t.name for t in FORMATS) + "}", help=targets)
    parser.add_argument("--model", metavar="NAME[.TAG]|VARIANT.yaml", help="the variant (default: from the shapes)")
    parser.add_argument(
        "--model-kwargs", nargs="+", action="extend", default=[], metavar="K=V", help="override its args, e.g. depth=2"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        metavar="{" + ",".join((KEEP, *CAST_DTYPES)) + "}",
        help="cast the weights (RoPE periods keep theirs); default keep, fp32 for meta-train",
    )
    parser.add_argument(
        "--weights", default="auto", metavar="{" + ",".join(WEIGHTS_SETS) + "}", help="EMA/teacher or trained weights"
    )
    parser.add_argument("--fuse-layerscale", action="store_true", help="fold every gamma into the layer before it")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="refuse NaN/Inf gammas, outputs the target changes and (meta-train) what Meta's backbone cannot hold",
    )
    meta = parser.add_argument_group("meta-train (what Meta's DINOv3 trainer resumes, distils and gram-anchors from)")
    meta.add_argument(
        "--meta-config",
        metavar="FILE.yaml",
        help="Meta's training YAML: new heads get its dino:/ibot: head sizes (merged over Meta's defaults); "
        "carried heads must match them",
    )
    meta.add_argument("--seed", type=int, default=0, help="seed of new heads (default 0)")
    meta.add_argument(
        "--distill-teacher",
        action="store_true",
        help="the checkpoint is for distillation.checkpoint_path: a source without heads warns (--strict refuses)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print what was done as JSON, every model argument included"
    )
    parser.set_defaults(func=convert)


def convert(args: argparse.Namespace) -> int:
    if args.weights not in WEIGHTS_SETS:
        raise CliError(f"unknown weights set {args.weights!r}; pass --weights one of {', '.join(WEIGHTS_SETS)}")
    target = get_format(args.to)
    if args.to != "meta-train" and (args.meta_config or args.distill_teacher):
        raise CliError("--meta-config and --distill-teacher are for --to meta-train")
    with open_checkpoint(args.src, args.weights, heads=target.reads_heads) as source:
        result = convert_checkpoint(
            source,
            args.dst,
            to=args.to,
            model=args.model,
            model_kwargs=parse_model_kwargs(args.model_kwargs),
            dtype=args.dtype,
            fuse_layerscale=args.fuse_layerscale,
            overwrite=args.overwrite,
            strict=args.strict,
            meta_config=args.meta_config,
            seed=args.seed,
            distill_teacher=args.distill_teacher,
        )
    for warning in result.warnings:
        print(f"timm-ls: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(dict(asdict(result), destination=str(result.destination), summary=result.summary()), indent=1))
        return 0
    for line in result.report:
        print(f"  {line}")
    print(result.summary())
    if result.meta_yaml:
        print("Meta training YAML for it (continued pretraining, Gram anchoring, distillation):")
        print(result.meta_yaml)
    return 0
