"""`timm-ls features IMAGE ... [--model NAME] --out DIR`: the PCA of a block's patch features as RGB, per image.

The model is a vit_ls variant (random, `--pretrained` or `--checkpoint` weights, a checkpoint read by the one
identity rule of every command: `--model` > what it records > its family > its shapes), a YAML variant file,
or any timm ViT with `forward_intermediates` (DINOv2, DeiT-III, eva), built with `dynamic_img_size=True`.
This module parses, builds the model and prints; the run is `tools.feature_run.write_feature_pictures`.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

import timm
import torch
from torch import nn

from timm_ls.model_source import ModelSource
from timm_ls.names import is_variant_file
from timm_ls.paths import image_files

from ..tools.feature_pictures import measure_images
from ..tools.feature_run import FeatureSettings, Loaded, write_feature_pictures
from ..variants import VARIANTS
from .common import (
    CliError,
    build,
    build_from_checkpoint,
    load_report,
    parse_model_kwargs,
    resolve_variant,
    warn_and_keep_the_rest,
)


def _timm_model(source: ModelSource, name: str, kwargs: dict) -> tuple[nn.Module, str]:
    kwargs = {"dynamic_img_size": True, **kwargs}
    if source.checkpoint:
        overlay = dict(file=source.checkpoint)
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs), source.checkpoint
    if source.pretrained:
        return timm.create_model(name, pretrained=True, **kwargs), "timm's pretrained weights (the Hub)"
    return timm.create_model(name, **kwargs), "random init (no --checkpoint or --pretrained given)"


def _check_vit(name: str, model: nn.Module) -> None:
    if not hasattr(model, "forward_intermediates") or not hasattr(model, "blocks"):
        raise CliError(f"{name} has no forward_intermediates and blocks; pass a ViT (vit_ls_*, vit_*, deit3_*, eva)")


def load_model(name: str | None, source: ModelSource) -> Loaded:
    """The model `name` (None: the one `source`'s checkpoint records): ours through the commands' one `build`
    (a checkpoint through the identity rule), timm's own ViTs through `timm.create_model`."""
    if name is None or is_variant_file(name) or name.partition(".")[0] in VARIANTS:
        with load_report() as report:
            if source.checkpoint:
                model, origin, name = build_from_checkpoint(source, name)
            else:
                variant, tag = resolve_variant(name)
                model, origin = build(source, variant, tag)
                name = f"{variant.name}.{tag}" if tag else variant.name
        warn_and_keep_the_rest(report)
    elif timm.is_model(name.partition(".")[0]):
        with torch.device("meta"):  # the architecture alone, checked before any weights are built or fetched
            _check_vit(name, timm.create_model(name))
        model, origin = _timm_model(source, name, parse_model_kwargs(source.model_kwargs))
    else:
        close = difflib.get_close_matches(name.partition(".")[0], [*VARIANTS, *timm.list_models()], n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CliError(f"unknown model {name!r}; {hint}pass a vit_ls name (`timm-ls list`) or a timm ViT")
    patch = model.patch_embed.patch_size
    patch = patch if isinstance(patch, int) else patch[0]
    return Loaded(model.eval(), name, origin, patch, getattr(model, "num_prefix_tokens", 1))


def find_device(name: str) -> torch.device:
    """`--device`, checked before any work: a name torch knows, on a machine that has it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CliError(f"--device: got {name!r}; pass cpu, cuda, cuda:N or mps") from None
    present = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available}.get(device.type, lambda: True)
    if not present() or (device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count()):
        raise CliError(f"--device {name}: this machine has no such device; pass --device cpu")
    return device


def settings(args: argparse.Namespace) -> FeatureSettings:
    """The run's settings from the command's flags."""
    return FeatureSettings(
        layer=args.layer,
        batch=args.batch,
        dtype=args.dtype,
        per_image=args.per_image,
        foreground=args.foreground,
        save=args.save,
        overwrite=args.overwrite,
    )


def execute(args: argparse.Namespace) -> int:
    device = find_device(args.device)
    size = None if args.size == "native" else int(args.size)
    paths = image_files(args.images)
    torch.manual_seed(0)  # a random-init model gives the same picture on every run
    loaded = load_model(args.model, ModelSource.of(args))
    jobs = measure_images(paths, size, loaded.patch)
    print("\n".join(write_feature_pictures(loaded, jobs, Path(args.out), settings(args), device)))
    return 0
