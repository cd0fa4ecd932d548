"""What the probes read: the images of a folder through the model's own data config, and the masks beside them.

Classification takes timm's eval transform (`timm.data.resolve_data_config` then `create_transform`: the
shorter side resized by the crop ratio, centre-cropped to the input size, normalised). Segmentation resizes
the image to the input size without a crop, and its mask to the same size by nearest, so that every pixel of
the mask keeps a class index of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import timm.data
import torch
from PIL import Image
from torch import nn
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as tvf

from ..tools.dense import open_image, read_image

IGNORE = 255  # ADE20K's "no class" in a mask: neither trained on nor scored


@dataclass
class SegmentationTransform:
    """An image resized to `size` (height, width) without a crop and normalised; its mask resized by nearest."""

    size: tuple[int, int]
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, image: Image.Image) -> torch.Tensor:
        resized = tvf.resize(
            image, list(self.size), interpolation=InterpolationMode(self.interpolation), antialias=True
        )
        return tvf.normalize(tvf.to_tensor(resized), self.mean, self.std)

    def mask(self, mask: np.ndarray) -> torch.Tensor:
        resized = Image.fromarray(mask).resize(self.size[::-1], Image.NEAREST)
        return torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())

    def picture(self, image: Image.Image) -> np.ndarray:
        """What the model saw, as `[H, W, 3]` uint8, for the pictures."""
        return np.asarray(image.resize(self.size[::-1], Image.BILINEAR), dtype=np.uint8)

    def __repr__(self) -> str:
        return (
            f"Resize({self.size[0]}x{self.size[1]}, {self.interpolation}, no crop), Normalize(mean={self.mean}, "
            f"std={self.std}); masks: nearest"
        )


def data_config(model: nn.Module) -> dict:
    return timm.data.resolve_data_config({}, model=model)


def classification_transform(model: nn.Module) -> Callable[[Image.Image], torch.Tensor]:
    """timm's eval transform for `model` (resize, centre crop, normalise)."""
    return timm.data.create_transform(**data_config(model), is_training=False)


def segmentation_transform(model: nn.Module) -> SegmentationTransform:
    cfg = data_config(model)
    return SegmentationTransform(tuple(cfg["input_size"][1:]), cfg["interpolation"], cfg["mean"], cfg["std"])


def describe(transform: object) -> str:
    """The transform in one line: what the cache is keyed by, and what results.json records."""
    return " ".join(repr(transform).split())


MASK_FIX = "pass a PNG of class indices"


def header_size(path: Path, kind: str = "image", fix: str = "pass a PNG or JPEG file") -> tuple[int, int]:
    """(width, height) from the file's header, nothing decoded; a file that cannot be opened is one line."""
    with open_image(path, kind, fix) as image:
        return image.size


def read_mask(path: Path) -> np.ndarray:
    """A mask of class indices, `[H, W]` uint8: a one-channel PNG (mode L or P, indices as stored)."""
    with open_image(path, "mask", MASK_FIX) as mask:
        if mask.mode not in ("L", "P"):
            raise ValueError(
                f"mask {path} is a {mask.mode} image; a mask is a one-channel PNG of class indices (mode L or P)"
            )
        return np.asarray(mask, dtype=np.uint8).copy()


def mask_classes(images: list[Path], masks: list[Path]) -> set[int]:
    """The class indices a split's masks hold (255 included where present), each mask read once and refused in
    one line where its size is not its image's (from the image's header) before any forward. An image that
    cannot be read is left to the reading, which skips or refuses it."""
    found: set[int] = set()
    for image, path in zip(images, masks):
        mask = read_mask(path)
        try:
            want = header_size(image)
        except ValueError:
            want = mask.shape[::-1]
        if mask.shape[::-1] != want:
            raise ValueError(
                f"mask {path} is {mask.shape[1]}x{mask.shape[0]} px and its image {image} is {want[0]}x{want[1]} "
                f"px; a mask needs its image's size"
            )
        found.update(np.unique(mask).tolist())
    return found


def load_image(path: Path) -> Image.Image:
    """The image as RGB, or a `ValueError` naming it (`tools.dense.read_image`)."""
    return read_image(path)


def refuse_unreadable(images: list[Path]) -> None:
    """--strict: every image decoded before any forward or write; the first that cannot be is refused."""
    for image in images:
        try:
            load_image(image)
        except ValueError as exc:
            raise ValueError(f"{exc} (--strict refuses it; without --strict it is skipped)") from None
