"""`timm-ls features IMAGE ... --model NAME --out DIR`: the PCA of a block's patch features as RGB, per image.

The model is a vit_ls variant (random, `--pretrained` or `--checkpoint` weights), a YAML variant file, or any
timm ViT with `forward_intermediates` (DINOv2, DeiT-III, eva), built with `dynamic_img_size=True`. Each image
is resized and normalised by the model's own data config (`timm.data.resolve_data_config`: its
interpolation, mean and std; the shorter side resized, the longer centre-cropped, as timm's eval transform),
images of one size run as one batch, and the PCA, colours and foreground are `tools.dense`'s.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import timm
import torch
from safetensors.torch import save
from timm.data import resolve_data_config
from torch import nn
from tqdm import tqdm

from timm_ls.names import is_variant_file
from timm_ls.paths import image_files

from ..tools.dense import (
    Foreground,
    ImagingUnavailable,
    available_memory,
    foreground,
    forward_bytes,
    largest_side,
    pca_colours,
    read_image,
    side_by_side,
    target_size,
    write_png,
)
from ..tools.files import write_atomically
from ..variants import VARIANTS
from .common import CliError, build, count, load_report, parse_model_kwargs, resolve_variant, warn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PIL_FILTERS = {"nearest": 0, "bilinear": 2, "bicubic": 3, "lanczos": 1, "box": 4, "hamming": 5}


@dataclass
class Loaded:
    """The model and what the command says of it."""

    model: nn.Module
    name: str
    source: str
    patch: int
    prefix: int


def _timm_model(args: argparse.Namespace, name: str, kwargs: dict) -> tuple[nn.Module, str]:
    kwargs = {"dynamic_img_size": True, **kwargs}
    if args.checkpoint:
        overlay = dict(file=args.checkpoint)
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs), args.checkpoint
    if args.pretrained:
        return timm.create_model(name, pretrained=True, **kwargs), "timm's pretrained weights (the Hub)"
    return timm.create_model(name, **kwargs), "random init (no --checkpoint or --pretrained given)"


def _check_vit(name: str, model: nn.Module) -> None:
    if not hasattr(model, "forward_intermediates") or not hasattr(model, "blocks"):
        raise CliError(f"{name} has no forward_intermediates and blocks; pass a ViT (vit_ls_*, vit_*, deit3_*, eva)")


def load_model(args: argparse.Namespace) -> Loaded:
    """Ours through the commands' one `build`; timm's own ViTs through `timm.create_model`."""
    name = args.model
    if is_variant_file(name) or name.partition(".")[0] in VARIANTS:
        variant, tag = resolve_variant(name)
        with load_report() as report:
            model, source = build(args, variant, tag)
        for line in report:
            if line.startswith("warning: "):
                warn(line.removeprefix("warning: "))
        name = f"{variant.name}.{tag}" if tag else variant.name
    elif timm.is_model(name.partition(".")[0]):
        with torch.device("meta"):  # the architecture alone, checked before any weights are built or fetched
            _check_vit(name, timm.create_model(name))
        model, source = _timm_model(args, name, parse_model_kwargs(args.model_kwargs))
    else:
        close = difflib.get_close_matches(name.partition(".")[0], [*VARIANTS, *timm.list_models()], n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CliError(f"unknown model {name!r}; {hint}pass a vit_ls name (`timm-ls list`) or a timm ViT")
    patch = model.patch_embed.patch_size
    patch = patch if isinstance(patch, int) else patch[0]
    return Loaded(model.eval(), name, source, patch, getattr(model, "num_prefix_tokens", 1))


def block_index(text: str, depth: int) -> int:
    """`--layer`: an index (negative from the end) or `last`, checked against the model's depth."""
    index = depth - 1 if text == "last" else int(text)
    index = index + depth if index < 0 else index
    if not 0 <= index < depth:
        raise CliError(f"--layer {text}: the model has {depth} blocks; pass 0 to {depth - 1}, -1 or last")
    return index


@dataclass
class Picture:
    path: Path
    image: np.ndarray  # [H, W, 3] uint8, what the model saw
    pixels: np.ndarray  # [3, H, W] float32, normalised

    @property
    def pixel_size(self) -> tuple[int, int]:
        """(height, width) in pixels."""
        return self.image.shape[0], self.image.shape[1]


def read_all(paths: list[Path]) -> list:
    """Every image, read before the model is built: an unreadable one is refused before any long step."""
    try:
        return [read_image(path) for path in paths]
    except ImagingUnavailable as exc:
        raise CliError(str(exc)) from None


def prepare(path: Path, picture, size: int | None, patch: int, data_cfg: dict) -> Picture:
    """The image resized (shorter side to `size`), centre-cropped to whole patches and normalised."""
    if size is not None and size < patch:
        raise CliError(f"--size {size} is below one patch ({patch} px) of the model; pass --size {patch} or more")
    (rw, rh), (cw, ch) = target_size(*picture.size, size, patch)
    if cw < patch or ch < patch:
        raise CliError(
            f"{path} is {rw}x{rh} px, smaller than one patch ({patch} px) of the model; pass --size {patch} or more"
        )
    if (rw, rh) != picture.size:
        picture = picture.resize((rw, rh), PIL_FILTERS.get(data_cfg["interpolation"], 3))
    left, top = (rw - cw) // 2, (rh - ch) // 2
    image = np.asarray(picture.crop((left, top, left + cw, top + ch)), dtype=np.uint8)
    mean, std = (np.asarray(data_cfg[k], np.float32)[:, None, None] for k in ("mean", "std"))
    pixels = (image.transpose(2, 0, 1).astype(np.float32) / 255 - mean) / std
    return Picture(path, image, pixels)


def batches(pictures: list[Picture], batch: int) -> Iterator[list[int]]:
    """Indices of the pictures, those of one size together, at most `batch` per forward."""
    by_size: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(pictures):
        by_size.setdefault(p.image.shape[:2], []).append(i)
    for group in by_size.values():
        for start in range(0, len(group), batch):
            yield group[start : start + batch]


def available(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory() if device.type == "cpu" else None


def plan(loaded: Loaded, pictures: list[Picture], args: argparse.Namespace, device: torch.device) -> str:
    """What the forwards will take, in one line; a batch that would not fit is refused with the side that does."""
    dim, element = loaded.model.embed_dim, DTYPES[args.dtype].itemsize
    free = available(device)
    worst, worst_bytes = None, 0
    held = sum(p.image.shape[0] * p.image.shape[1] // loaded.patch**2 * dim * 4 for p in pictures)
    for group in batches(pictures, args.batch):
        height, width = pictures[group[0]].image.shape[:2]
        tokens = (height // loaded.patch) * (width // loaded.patch) + loaded.prefix
        need = forward_bytes(tokens, dim, len(group), element) + held
        if free is not None and need > free:
            aspect = max(height, width) / min(height, width)
            side = largest_side(free - held, dim, loaded.patch, aspect, loaded.prefix, len(group), element)
            fix = f"pass --size {side} or less (the largest shorter side that fits)" if side else "free memory"
            raise CliError(
                f"{pictures[group[0]].path} at {width}x{height} px is {tokens - loaded.prefix} patches; "
                f"{count(len(group), 'image')} of it take about {need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB "
                f"is available; {fix}" + (" or a smaller --batch" if len(group) > 1 else "")
            )
        if need > worst_bytes:
            worst, worst_bytes = (width, height, tokens - loaded.prefix, len(group)), need
    width, height, patches, n = worst
    where = f" of {free / 2**30:.1f} GiB available" if free is not None else ""
    return (
        f"plan: {count(len(pictures), 'image')}; the largest forward: {count(n, 'image')} of {width}x{height} px "
        f"({patches} patches each), about {worst_bytes / 2**30:.2f} GiB{where}"
    )


def run_forwards(loaded: Loaded, pictures: list[Picture], layer: int, args, device) -> list[np.ndarray]:
    """Each picture's patch features `[h * w, C]` (float32) of block `layer`, normed as the last block's."""
    dtype, features = DTYPES[args.dtype], [np.empty(0)] * len(pictures)
    with tqdm(total=len(pictures), desc="features", unit="image", file=sys.stderr, disable=None) as bar:
        for group in batches(pictures, args.batch):
            x = torch.from_numpy(np.stack([pictures[i].pixels for i in group])).to(device, dtype)
            with torch.inference_mode():
                (out,) = loaded.model.forward_intermediates(
                    x, indices=[layer], norm=True, stop_early=True, output_fmt="NCHW", intermediates_only=True
                )
            for i, f in zip(group, out.float().cpu().numpy()):
                features[i] = f.reshape(f.shape[0], -1).T.copy()
            bar.update(len(group))
    return features


def _metadata(loaded: Loaded, picture: Picture, layer: int, depth: int) -> dict[str, str]:
    h, w = (s // loaded.patch for s in picture.pixel_size)
    return dict(
        model=loaded.name,
        source=loaded.source,
        layer=str(layer),
        depth=str(depth),
        grid=f"{h}x{w}",
        patch_size=str(loaded.patch),
        input_size=f"{picture.pixel_size[0]}x{picture.pixel_size[1]}",
        image=str(picture.path),
        tokens="normed patch tokens, [h, w, C]",
    )


def write_results(out: Path, loaded: Loaded, pictures, features, rgb, layer, args) -> list[str]:
    out.mkdir(exist_ok=args.overwrite)
    depth, lines = len(loaded.model.blocks), []
    for picture, f, colours in zip(pictures, features, rgb):
        h, w = (s // loaded.patch for s in picture.pixel_size)
        png = out / f"{picture.path.stem}_pca.png"
        write_png(png, side_by_side(picture.image, colours, (h, w)))
        line = f"{picture.path.name}: {picture.pixel_size[1]}x{picture.pixel_size[0]} px, {w}x{h} patches -> {png}"
        if args.save:
            tensors = {"features": torch.from_numpy(f.reshape(h, w, -1))}
            saved = out / f"{picture.path.stem}_features.safetensors"
            write_atomically(saved, save(tensors, metadata=_metadata(loaded, picture, layer, depth)))
            line += f", {saved.name}"
        lines.append(line)
    return lines


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


def execute(args: argparse.Namespace) -> int:
    device = find_device(args.device)
    size = None if args.size == "native" else int(args.size)
    paths = image_files(args.images)
    raw = read_all(paths)
    torch.manual_seed(0)  # a random-init model gives the same picture on every run
    loaded = load_model(args)
    layer = block_index(args.layer, len(loaded.model.blocks))
    data_cfg = resolve_data_config({}, model=loaded.model)
    pictures = [prepare(path, picture, size, loaded.patch, data_cfg) for path, picture in zip(paths, raw)]
    del raw
    print(f"model: {loaded.name}; weights: {loaded.source}")
    print(plan(loaded, pictures, args, device))
    loaded.model.to(device, DTYPES[args.dtype])
    features = run_forwards(loaded, pictures, layer, args, device)
    grids = [tuple(s // loaded.patch for s in p.pixel_size) for p in pictures]
    masks = None
    if args.foreground:
        groups = [[i] for i in range(len(pictures))] if args.per_image else [list(range(len(pictures)))]
        found = [foreground([features[i] for i in g], [grids[i] for i in g]) for g in groups]
        masks = [m for f in found for m in f.masks]
        print(Foreground(masks, found[0].threshold).line() + (", each image alone" if args.per_image else ""))
    rgb = pca_colours(features, masks, joint=not args.per_image)
    print(
        f"features: block {layer} of {len(loaded.model.blocks)} (0-based), normed patch tokens (the "
        f"{loaded.prefix} prefix tokens left out); PCA "
        + ("per image" if args.per_image or len(pictures) == 1 else f"fitted on all {len(pictures)} images together")
    )
    print("\n".join(write_results(Path(args.out), loaded, pictures, features, rgb, layer, args)))
    return 0
