"""`timm-ls pretrain`'s flags. Every setting's default is None here, so that `--resume` can tell what was
given; a new run's values where none is given are `pretrain_request.DEFAULTS`."""

from __future__ import annotations

import argparse

from .pretrain_request import METHODS

PRETRAIN_EXAMPLES = """examples:
  timm-ls pretrain scans/ --out run --model vit_ls_small_patch16_dinov3.lvd1689m --pretrained --gram
  timm-ls pretrain scans/ --out run --method distill --teacher vit_ls_base_patch16_dinov3.lvd1689m \\
      --teacher-pretrained --model convnext_tiny --steps 5000
  timm-ls pretrain --resume run --steps 8000
  torchrun --nproc-per-node 4 -m timm_ls pretrain scans/ --out run --model vit_ls_base_patch16_dinov3 \\
      --checkpoint dinov3_vitb16_pretrain.pth --device cuda"""


def _int(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    parser.add_argument(flag, type=int, metavar="N", help=help)


def _float(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    parser.add_argument(flag, type=float, metavar="X", help=help)


def _models(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", metavar="{" + ",".join(METHODS) + "}", help="(default dinov3)")
    parser.add_argument(
        "--model",
        metavar="NAME[.TAG]|VARIANT.yaml",
        help="the model trained: a vit_ls variant for dinov3; for distill any timm model (a vit_ls, a timm ViT, "
        "convnext_tiny, ...); with --checkpoint, by default the model the checkpoint is",
    )
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--pretrained", action="store_true", default=None, help="start from the tag's Hub weights")
    weights.add_argument("--checkpoint", metavar="PATH", help="start from this weights file or folder")
    parser.add_argument("--model-kwargs", nargs="+", action="extend", metavar="K=V", help="model args, e.g. depth=2")
    parser.add_argument("--teacher", metavar="NAME[.TAG]", help="distill: the frozen teacher (a vit_ls or timm ViT)")
    teacher = parser.add_mutually_exclusive_group()
    teacher.add_argument("--teacher-pretrained", action="store_true", default=None, help="its Hub weights")
    teacher.add_argument("--teacher-checkpoint", metavar="PATH", help="its weights from this file or folder")


def _schedule(parser: argparse.ArgumentParser) -> None:
    _int(parser, "--steps", "optimiser steps in all (default 1000); with --resume, a new end")
    _int(parser, "--batch-size", "images per step, all ranks together (default 32)")
    _int(parser, "--size", "the input (dinov3: global crop) side in pixels (default: the model's own)")
    _float(parser, "--lr", "the peak learning rate, no batch-size rule applied (default 1e-4)")
    _float(parser, "--min-lr", "the learning rate at the end of the cosine (default 1e-6)")
    _float(parser, "--weight-decay", "AdamW's, on weights only (default 0.04)")
    _int(parser, "--warmup-steps", "linear learning-rate warm-up (default a tenth of --steps)")
    _int(parser, "--seed", "of the data order, the crops and the masks (default 0)")
    _int(parser, "--save-every", "a checkpoint every N steps besides the last (default 0: the last only)")
    parser.add_argument("--bf16", action="store_true", default=None, help="autocast the forward to bfloat16")


def _dinov3(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gram", action="store_true", default=None, help="dinov3: Gram anchoring to the starting weights"
    )
    _int(parser, "--head-warmup-steps", "dinov3: steps that train the new heads alone (default a tenth of --steps)")
    _int(parser, "--local-crops", "dinov3: local crops per image (default 8, Meta's)")
    _int(parser, "--prototypes", "dinov3: the DINO and iBOT heads' prototypes (default 65536, Meta's)")


def add_pretrain(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "pretrain",
        help="adapt a model to a folder of unlabeled images: continued DINOv3 training or dense distillation",
        description="Trains on every image under DATA (any layout, no labels) and writes DIR/model (the backbone, "
        "a folder timm.create_model, convert and probe read), DIR/checkpoint (to --resume from) and "
        "DIR/metrics.jsonl. dinov3: Meta's DINO, iBOT and KoLeo losses with an EMA teacher and multi-crop, "
        "optionally Gram anchoring; distill: a frozen teacher's pooled and patch features, learnt through "
        "projection heads by cosine distance. Under torchrun each rank takes its part of every batch (DDP). "
        "docs/pretrain.md has the recipe and how the options map to Meta's config.",
        epilog=PRETRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("data", nargs="?", metavar="DATA", help="a folder of images, read at any depth")
    parser.add_argument("--out", metavar="DIR", help="the run's folder (must not hold another run)")
    parser.add_argument("--resume", metavar="DIR", help="go on with the run in DIR, with its settings")
    parser.add_argument("--overwrite", action="store_true", help="start a new run in a DIR that holds one")
    _models(parser)
    _schedule(parser)
    _dinov3(parser)
    parser.add_argument("--device", metavar="DEVICE", help="cpu, cuda, cuda:1, mps (default cpu; torchrun: its own)")
    _int(parser, "--threads", "torch's CPU threads (default: torch's own choice)")
