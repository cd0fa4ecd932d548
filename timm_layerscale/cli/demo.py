"""`timm-ls [demo]`: build a variant, run images through it and show its LayerScale gammas per block."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from timm.data import create_transform, resolve_data_config
from torch import nn

from .common import CliError, build, load_report, resolve_variant, table

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="run a variant on images and show its LayerScale (the default)")
    parser.add_argument("--variant", default="vit_ls_small_patch16_dinov3", help="NAME or NAME.TAG")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument(
        "--checkpoint", metavar="PATH", help="a weights file (.safetensors, .pth) or checkpoint folder"
    )
    weights.add_argument("--pretrained", action="store_true", help="download the tag's weights from the Hub")
    parser.add_argument(
        "--model-kwargs", nargs="+", action="extend", default=[], metavar="K=V", help="e.g. init_values=off depth=2"
    )
    parser.add_argument("--image", action="append", default=[], metavar="PATH", help="instead of the shipped ones")
    parser.set_defaults(func=demo)


def gamma_stats(module: nn.Module) -> list[str]:
    gamma = getattr(module, "gamma", None)
    if gamma is None:
        return ["off", "", ""]
    g = gamma.detach().float()
    return [f"{g.abs().mean():.4g}", f"{g.min():.4g}", f"{g.max():.4g}"]


def load_image(path: Path) -> Image.Image:
    if not path.is_file():
        raise CliError(f"image {path} does not exist; pass the path of an image file with --image")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise CliError(f"cannot read image {path} ({exc}); pass a PNG or JPEG file") from exc


def demo(args: argparse.Namespace) -> int:
    variant, tag = resolve_variant(args.variant)
    images = [Path(p) for p in args.image] if args.image else sorted(ASSETS.glob("*.png"))
    pictures = [load_image(p) for p in images]
    with load_report() as report:
        model, source = build(args, variant, tag)
    model.eval()
    overrides = " ".join(args.model_kwargs)
    print(f"variant: {variant.name}{f'.{tag}' if tag else ''}{f' ({overrides})' if overrides else ''}")
    print(f"config: {variant.source}")
    print(f"weights: {source}")
    print("".join(f"  {line}\n" for line in report), end="")
    data_cfg = resolve_data_config({}, model=model)
    if not model.dynamic_img_size:
        data_cfg["input_size"] = (3, *model.patch_embed.img_size)
    transform = create_transform(**data_cfg)
    prefix = model.num_prefix_tokens
    for path, picture in zip(images, pictures):
        x = transform(picture).unsqueeze(0)
        try:
            with torch.inference_mode():
                tokens = model.forward_features(x)
                pooled = model.forward_head(tokens, pre_logits=True)
        except (RuntimeError, AssertionError) as exc:
            raise CliError(
                f"the model cannot run on {path.name} as {list(x.shape)} ({exc}); check --model-kwargs"
            ) from exc
        print(
            f"{path.name}: {picture.width}x{picture.height} -> input {list(x.shape)}, "
            f"pooled {list(pooled.shape)}, patch tokens {list(tokens[:, prefix:].shape)}"
        )
    rows = [[str(i), *gamma_stats(block.ls1), *gamma_stats(block.ls2)] for i, block in enumerate(model.blocks)]
    print("LayerScale gammas:")
    print(table(["block", "attn mean|g|", "min", "max", "mlp mean|g|", "min", "max"], rows))
    return 0
