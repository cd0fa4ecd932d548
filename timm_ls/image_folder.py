"""The data folders `timm-ls probe` reads, listed and checked without torch (the command's front and the package
share them).

Classification is timm's ImageFolder layout: `DATA/train/<class>/*` and, optionally, `DATA/val/<class>/*`
(the val classes a subset of train's). Segmentation is ADE20K's: `DATA/{train,val}/images/*` beside
`DATA/{train,val}/masks/<stem>.png`, a PNG of class indices per image (255 ignored). Files are sorted by
name, classes by folder name (timm's order), so every run sees the same list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import CliError
from .paths import IMAGE_SUFFIXES

CLASSIFICATION, SEGMENTATION = "classification", "segmentation"
TASKS = (CLASSIFICATION, SEGMENTATION)
CLASSIFICATION_LAYOUT = "DATA/train/<class>/*.jpg (and DATA/val/<class>/*.jpg, or --val-split)"
SEGMENTATION_LAYOUT = "DATA/train/images/*.jpg with DATA/train/masks/<same name>.png (and the same under DATA/val)"


@dataclass
class Split:
    """One split's files and, for classification, their class indices (segmentation: their masks)."""

    images: list[Path]
    labels: list[int]  # classification: class index per image; segmentation: empty
    masks: list[Path]  # segmentation: one per image; classification: empty


@dataclass
class ImageFolder:
    task: str
    classes: list[str]  # classification: the class folders of train, in order; segmentation: empty
    train: Split
    val: Split | None  # None: no val folder, the val set is split off train


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _class_folders(folder: Path) -> dict[str, list[Path]]:
    found = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        images = _images(sub)
        if not images:
            raise CliError(f"{sub} holds no images ({', '.join(IMAGE_SUFFIXES)}); add some or remove the folder")
        found[sub.name] = images
    return found


def _train_folder(data: Path, expected: str) -> Path:
    if not data.is_dir():
        raise CliError(f"DATA {data} is not a folder; pass a folder laid out as {expected}")
    train = data / "train"
    if not train.is_dir():
        raise CliError(f"{data} has no train/ folder; lay it out as {expected}")
    return train


def classification_folder(data: Path) -> ImageFolder:
    """The ImageFolder layout of `data`, or one line naming what is missing."""
    train = _train_folder(data, CLASSIFICATION_LAYOUT)
    classes = _class_folders(train)
    if not classes:
        raise CliError(f"{train} has no class folders; lay it out as {CLASSIFICATION_LAYOUT}")
    if len(classes) < 2:
        raise CliError(f"{train} holds one class ({next(iter(classes))}); a probe needs 2 or more class folders")
    names = list(classes)
    split = Split([p for c in names for p in classes[c]], [i for i, c in enumerate(names) for _ in classes[c]], [])
    val = None
    if (data / "val").is_dir():
        found = _class_folders(data / "val")
        unknown = [c for c in found if c not in classes]
        if unknown:
            raise CliError(
                f"{data / 'val'} has the class {unknown[0]!r}, which train/ does not have; every val class needs "
                f"train images (add train/{unknown[0]}/ or remove val/{unknown[0]}/)"
            )
        if not found:
            raise CliError(f"{data / 'val'} has no class folders; lay it out as {CLASSIFICATION_LAYOUT}")
        val = Split([p for c in found for p in found[c]], [names.index(c) for c in found for _ in found[c]], [])
    return ImageFolder(CLASSIFICATION, names, split, val)


def _segmentation_split(folder: Path) -> Split:
    images_dir, masks_dir = folder / "images", folder / "masks"
    for needed in (images_dir, masks_dir):
        if not needed.is_dir():
            raise CliError(f"{folder} has no {needed.name}/ folder; lay it out as {SEGMENTATION_LAYOUT}")
    images = _images(images_dir)
    if not images:
        raise CliError(f"{images_dir} holds no images ({', '.join(IMAGE_SUFFIXES)}); add some")
    masks = []
    for image in images:
        mask = masks_dir / f"{image.stem}.png"
        if not mask.is_file():
            raise CliError(f"{image} has no mask {mask}; each image needs a PNG of class indices of the same name")
        masks.append(mask)
    return Split(images, [], masks)


def segmentation_folder(data: Path) -> ImageFolder:
    """The images-and-masks layout of `data`, or one line naming what is missing."""
    train = _segmentation_split(_train_folder(data, SEGMENTATION_LAYOUT))
    val = _segmentation_split(data / "val") if (data / "val").is_dir() else None
    return ImageFolder(SEGMENTATION, [], train, val)


def read_image_folder(data: str | Path, task: str) -> ImageFolder:
    return (segmentation_folder if task == SEGMENTATION else classification_folder)(Path(data))
