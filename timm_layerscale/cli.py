"""`timm-ls`: build a vit_ls variant, run the shipped images through it and show its LayerScale gammas.

`timm-ls [demo]` runs a variant (random, `--checkpoint` or `--pretrained` weights); `timm-ls list` lists
the registered variants with their size, pretrained tags and YAML file; `timm-ls run SCRIPT ARGS...` runs a
timm script (train.py, validate.py, ...) with the variants registered.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import logging
import pickle
import runpy
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import huggingface_hub
import timm
import torch
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from PIL import Image, UnidentifiedImageError
from safetensors import SafetensorError
from timm.data import create_transform, resolve_data_config
from torch import nn

from .conversion import CheckpointError
from .variants import VARIANTS, Variant

ASSETS = Path(__file__).with_name("assets")
HUB_FILE = "model.safetensors"
READ_ERRORS = (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError)


class CliError(Exception):
    """Bad input: printed as one `timm-ls: error:` line."""


def parse_model_kwargs(items: Sequence[str]) -> dict[str, Any]:
    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--model-kwargs: got {item!r}; write each one as key=value, e.g. depth=2")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def resolve_variant(name: str) -> tuple[Variant, str | None]:
    base, _, tag = name.partition(".")
    if base not in VARIANTS:
        close = difflib.get_close_matches(base, VARIANTS, n=3, cutoff=0.5) or sorted(VARIANTS)
        raise CliError(f"unknown variant {base!r}; did you mean {', '.join(close)}? (`timm-ls list` shows all)")
    variant = VARIANTS[base]
    if tag and tag not in variant.tags:
        raise CliError(f"{base} has no pretrained tag {tag!r}; its tags: {', '.join(variant.tags) or 'none'}")
    return variant, tag or None


@contextmanager
def load_report() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(("warning: " if r.levelno >= logging.WARNING else "") + r.getMessage())
    logger = logging.getLogger("timm_layerscale")
    old = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate = old


def hub_unreachable(exc: BaseException | None) -> str | None:
    """A short reason when `exc` says the Hub could not be reached, None when it answered."""
    chain = []
    while exc is not None and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    network = (LocalEntryNotFoundError, ConnectionError, TimeoutError)
    if any(isinstance(e, HfHubHTTPError) for e in chain) or not any(
        isinstance(e, network) or any(c.__name__ == "TransportError" for c in type(e).__mro__) for e in chain
    ):
        return None
    return f"{constants.ENDPOINT}: {type(chain[-1]).__name__}: {chain[-1]}"


def read_error(path: str, exc: BaseException) -> CliError:
    if "weights_only" in str(exc) or "Weights only" in str(exc):
        return CliError(
            f"refused to load {path}: it is a pickle that needs objects other than tensors, which could run "
            f"code (nothing was run); use a file you trust saved as a plain state dict or .safetensors"
        )
    kind = "safetensors" if isinstance(exc, SafetensorError) else "torch checkpoint"
    reason = " ".join(str(exc).split()).split(". ")[0] or type(exc).__name__
    return CliError(
        f"{path} is not a readable {kind} ({reason}); it is truncated or corrupt: save or download it again"
    )


def build(args: argparse.Namespace, variant: Variant, tag: str | None) -> tuple[nn.Module, str]:
    name = f"{variant.name}.{tag}" if tag else variant.name
    kwargs = parse_model_kwargs(args.model_kwargs)
    if args.checkpoint:
        try:
            model = timm.create_model(
                name, pretrained=True, pretrained_cfg_overlay=dict(file=args.checkpoint), **kwargs
            )
        except READ_ERRORS as exc:
            raise read_error(args.checkpoint, exc) from exc
        return model, f"checkpoint {args.checkpoint}"
    if not args.pretrained:
        return timm.create_model(name, **kwargs), "random init (no --checkpoint or --pretrained given)"
    tag = tag or next(iter(variant.tags), None)
    hub_id = (variant.tags.get(tag) or {}).get("hf_hub_id") if tag else None
    if not hub_id:
        raise CliError(f"{variant.name} has no pretrained weights on the Hub; pass --checkpoint PATH instead")
    repo, _, revision = hub_id.partition("@")
    try:
        huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo, HUB_FILE, revision=revision or None))
        return timm.create_model(f"{variant.name}.{tag}", pretrained=True, **kwargs), f"Hub {hub_id}"
    except Exception as exc:
        reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else hub_unreachable(exc)
        if reason is None:
            raise
    cached = huggingface_hub.try_to_load_from_cache(repo, HUB_FILE, revision=revision or None)
    if isinstance(cached, str):
        overlay = dict(file=cached)
        model = timm.create_model(f"{variant.name}.{tag}", pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
        return model, f"Hub {hub_id} from the local cache (the Hub is not reachable: {reason})"
    return timm.create_model(name, **kwargs), f"random init: the Hub is not reachable ({reason})"


def gamma_stats(module: nn.Module) -> list[str]:
    gamma = getattr(module, "gamma", None)
    if gamma is None:
        return ["off", "", ""]
    g = gamma.detach().float()
    return [f"{g.abs().mean():.4g}", f"{g.min():.4g}", f"{g.max():.4g}"]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


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


def list_variants(args: argparse.Namespace) -> int:
    rows = []
    for name, variant in sorted(VARIANTS.items()):
        params = sum(p.numel() for p in timm.create_model(name, device="meta").parameters())
        tags = ", ".join(f"{tag} ({cfg.get('hf_hub_id', 'no hub id')})" for tag, cfg in variant.tags.items())
        rows.append([name, f"{params / 1e6:,.1f}M", variant.source, tags or "-"])
    print(table(["variant", "params", "config", "pretrained tags"], rows))
    return 0


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


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timm-ls",
        description=__doc__.split("\n")[0].split(": ", 1)[1],
        epilog="Without a command it runs `demo`; `timm-ls demo -h` lists the demo's options.",
    )
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("demo", help="run a variant on images and show its LayerScale (the default)")
    run.add_argument("--variant", default="vit_ls_small_patch16_dinov3", help="NAME or NAME.TAG")
    weights = run.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", metavar="PATH", help="a .safetensors or .pth file of weights")
    weights.add_argument("--pretrained", action="store_true", help="download the tag's weights from the Hub")
    run.add_argument(
        "--model-kwargs", nargs="+", action="extend", default=[], metavar="K=V", help="e.g. init_values=off depth=2"
    )
    run.add_argument("--image", action="append", default=[], metavar="PATH", help="instead of the shipped ones")
    run.set_defaults(func=demo)
    commands.add_parser("list", help="list the registered variants").set_defaults(func=list_variants)
    script = commands.add_parser("run", help="run a timm script (train.py, validate.py) with the variants registered")
    script.add_argument("script", help="path of the script")
    script.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    script.set_defaults(func=run_script)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("demo", "list", "run", "-h", "--help"):
        argv.insert(0, "demo")
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, CheckpointError, ValueError, FileNotFoundError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"timm-ls: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
