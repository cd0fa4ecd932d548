"""The PCA pictures of a model's patch features, streamed, so that memory is bounded by a batch, not the images.

Before any pixel is decoded every image is planned from its header (`measure_images`): where it goes (resized,
centre-cropped to whole patches), within the pixel limit and the patches an image may have (`MAX_PATCHES`, the
time bound). `feature_run.run_line` then states what the run holds at its peak and refuses what would not
fit. The run reads, resizes, forwards and spools one batch at a time (`Spool`: a file beside the output, read
back through the page cache), fitting the PCA as the features stream by (`dense.PcaFit`: its memory is
`C x C`); the pictures are then drawn from the spool, one image at a time.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from timm_ls.errors import CliError

from .dense import (
    Foreground,
    Pca,
    PcaFit,
    colours,
    foreground,
    foreground_masks,
    image_size,
    largest_side_where,
    pca_colours,
    read_image,
    side_by_side,
    target_size,
    write_png,
)

# The time bound: a forward's attention grows with the square of the tokens. At 16,384 patches (2048 x 2048 px
# at patch 16) one image takes ViT-S/16 about 75 CPU seconds and ViT-B/16 about 155 (BENCHMARKS.md section 12).
MAX_PATCHES = 16_384
SPOOL_NAME = ".features.spool"  # in the staging folder, removed before it is renamed into place
PIL_FILTERS = {"nearest": 0, "bilinear": 2, "bicubic": 3, "lanczos": 1, "box": 4, "hamming": 5}


@dataclass(frozen=True)
class ImageJob:
    """One image's place in the run, from its header: its size in the file, resized, and the crop the model sees."""

    path: Path
    source: tuple[int, int]  # (width, height)
    resized: tuple[int, int]
    crop: tuple[int, int]
    patch: int

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of patches."""
        return self.crop[1] // self.patch, self.crop[0] // self.patch

    @property
    def patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def pixels(self) -> int:
        """Of the crop, what the model sees."""
        return self.crop[0] * self.crop[1]

    def at(self, size: int | None) -> ImageJob:
        """The same image planned at another `--size`."""
        resized, crop = target_size(*self.source, size, self.patch)
        return ImageJob(self.path, self.source, resized, crop, self.patch)


def measure_images(paths: Sequence[Path], size: int | None, patch: int) -> list[ImageJob]:
    """Each image planned from its header (nothing decoded): a problem with any is one error before any forward."""
    if size is not None and size < patch:
        raise CliError(f"--size {size} is below one patch ({patch} px) of the model; pass --size {patch} or more")
    jobs = []
    for path in paths:
        try:
            source = image_size(path)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        job = ImageJob(path, source, source, source, patch).at(size)
        if min(job.crop) < patch:
            raise CliError(
                f"{path} is {job.resized[0]}x{job.resized[1]} px, smaller than one patch ({patch} px) of the model; "
                f"pass --size {patch} or more"
            )
        if job.patches > MAX_PATCHES:
            raise CliError(_too_many_patches(job, size))
        jobs.append(job)
    return jobs


def _too_many_patches(job: ImageJob, size: int | None) -> str:
    aspect = max(job.source) / min(job.source)
    side = largest_side_where(lambda patches: patches <= MAX_PATCHES, job.patch, aspect)
    at = f"--size {size}" if size is not None else "its own size"
    return (
        f"{job.path} ({job.source[0]}x{job.source[1]} px) at {at} is {job.crop[0]}x{job.crop[1]} px, "
        f"{job.patches:,} patches; an image may have at most {MAX_PATCHES:,} (the time a forward takes grows with "
        f"their square); pass --size {side} or less"
    )


def batches(jobs: Sequence[ImageJob], batch: int) -> Iterator[list[int]]:
    """Indices of the jobs, those of one crop together, at most `batch` per forward."""
    by_crop: dict[tuple[int, int], list[int]] = {}
    for i, job in enumerate(jobs):
        by_crop.setdefault(job.crop, []).append(i)
    for group in by_crop.values():
        for start in range(0, len(group), batch):
            yield group[start : start + batch]


def decode(job: ImageJob, data_cfg: dict, into: np.ndarray) -> np.ndarray:
    """The image resized and centre-cropped as planned, `[H, W, 3]` uint8 (what the model sees); its normalised
    pixels are written `into` a `[3, H, W]` float32 slot of the batch."""
    try:
        picture = read_image(job.path)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if picture.size != job.source:  # changed since it was planned: the plan no longer holds
        raise CliError(f"{job.path} changed while the command ran ({picture.size} px, was {job.source}); run it again")
    if job.resized != job.source:
        picture = picture.resize(job.resized, PIL_FILTERS.get(data_cfg["interpolation"], 3))
    left, top = (job.resized[0] - job.crop[0]) // 2, (job.resized[1] - job.crop[1]) // 2
    image = np.asarray(picture.crop((left, top, left + job.crop[0], top + job.crop[1])), dtype=np.uint8)
    del picture
    np.divide(image.transpose(2, 0, 1), 255, out=into, dtype=np.float32)
    into -= np.asarray(data_cfg["mean"], np.float32)[:, None, None]
    into /= np.asarray(data_cfg["std"], np.float32)[:, None, None]
    return image


@dataclass
class Spool:
    """Arrays appended to a file and read back as memory maps: the page cache holds them, not the process."""

    path: Path
    _file: BinaryIO = field(init=False)
    _entries: list[tuple[int, np.dtype, tuple[int, ...]]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._file = open(self.path, "w+b")  # noqa: SIM115 (closed by `close`, which the caller's finally runs)

    def add(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        self._entries.append((self._file.tell(), array.dtype, array.shape))
        array.tofile(self._file)
        return len(self._entries) - 1

    def get(self, index: int) -> np.ndarray:
        self._file.flush()
        offset, dtype, shape = self._entries[index]
        if not int(np.prod(shape)):
            return np.empty(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)

    def close(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


@dataclass
class Streamed:
    """What the forwards left: per job its picture and features in the spool, and the joint PCA's fit."""

    spool: Spool
    pictures: list[int]
    features: list[int]
    fit: PcaFit | None


def run_forwards(
    model: nn.Module,
    jobs: Sequence[ImageJob],
    layer: int,
    data_cfg: dict,
    *,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    spool: Spool,
    joint: bool,
) -> Streamed:
    """Each job read, forwarded with those of its crop and spooled; block `layer`'s normed patch tokens
    `[h * w, C]` as float32, fitted into one PCA as they come where `joint`."""
    pictures, features = [0] * len(jobs), [0] * len(jobs)
    fit = PcaFit(model.embed_dim) if joint else None
    with tqdm(total=len(jobs), desc="features", unit="image", file=sys.stderr, disable=None) as bar:
        for group in batches(jobs, batch):
            width, height = jobs[group[0]].crop
            pixels = np.empty((len(group), 3, height, width), np.float32)
            for slot, i in enumerate(group):
                pictures[i] = spool.add(decode(jobs[i], data_cfg, pixels[slot]))
            x = torch.from_numpy(pixels).to(device, dtype)
            del pixels
            with torch.inference_mode():
                (out,) = model.forward_intermediates(
                    x, indices=[layer], norm=True, stop_early=True, output_fmt="NCHW", intermediates_only=True
                )
            del x
            for i, tokens in zip(group, out):
                tokens = tokens.float().cpu().numpy().reshape(tokens.shape[0], -1).T
                features[i] = spool.add(tokens)
                if fit is not None:
                    fit.add(tokens)
            bar.update(len(group))
    return Streamed(spool, pictures, features, fit)


def masks_and_colours(
    streamed: Streamed, jobs: Sequence[ImageJob], masked: bool
) -> tuple[Pca | None, Foreground | None, list]:
    """The joint fit's colour PCA and, where `masked`, DINOv2's foreground (a first PCA over every patch, its
    sign from the border patches of every image, the colours fitted on the foreground alone): two more passes
    over the spool, one image at a time."""
    if streamed.fit is None:
        return None, None, [None] * len(jobs)
    if not masked:
        return streamed.fit.pca(), None, [None] * len(jobs)
    first = streamed.fit.pca(components=1)
    features = [streamed.spool.get(i) for i in streamed.features]
    masks = foreground_masks(first, features, [job.grid for job in jobs])
    kept = PcaFit(first.mean.shape[0])
    for f, mask in zip(features, masks):
        kept.add(np.asarray(f)[mask])
    if kept.count < 2:
        raise CliError("the foreground holds fewer than 2 patches: nothing to fit; drop --foreground")
    return kept.pca(), Foreground(sum(int(m.sum()) for m in masks), sum(m.size for m in masks)), masks


def image_colours(features: np.ndarray, job: ImageJob, pca: Pca | None, mask, alone_masked: bool) -> tuple:
    """One image's patch colours `[h * w, 3]`: by the joint `pca` (and its mask), or fitted on the image alone
    (with its own foreground where `alone_masked`); with the foreground's counts of this image."""
    if pca is not None:
        rgb = colours(pca.project(features))
        return (rgb if mask is None else rgb * mask[:, None]), mask
    features = np.asarray(features)
    masks = foreground([features], [job.grid]) if alone_masked else None
    try:
        (rgb,) = pca_colours([features], masks)
    except ValueError as exc:
        raise CliError(f"{job.path}: {exc}") from None
    return rgb, masks[0] if masks else None


def free_disk(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def draw_all(
    out: Path, jobs: Sequence[ImageJob], streamed: Streamed, *, masked: bool, save: bool, about: dict[str, str]
) -> list[str]:
    """Every picture (and with `save` its features, with `about` and the image's own metadata) into `out`, one
    image at a time from the spool; a line for each, after the foreground's where `masked`."""
    pca, found, masks = masks_and_colours(streamed, jobs, masked)
    lines, kept, total = [], 0, 0
    for i, job in enumerate(jobs):
        features = streamed.spool.get(streamed.features[i])
        rgb, mask = image_colours(features, job, pca, masks[i], masked)
        if mask is not None and found is None:
            kept, total = kept + int(mask.sum()), total + mask.size
        png = out / f"{job.path.stem}_pca.png"
        write_png(png, side_by_side(np.asarray(streamed.spool.get(streamed.pictures[i])), rgb, job.grid))
        line = f"{job.path.name}: {job.crop[0]}x{job.crop[1]} px, {job.grid[1]}x{job.grid[0]} patches -> {png.name}"
        if save:
            tensors = {"features": torch.from_numpy(np.array(features).reshape(*job.grid, -1))}
            saved = out / f"{job.path.stem}_features.safetensors"
            save_file(tensors, saved, metadata={**about, **_image_metadata(job)})
            line += f", {saved.name}"
        lines.append(line)
    if masked:
        lines.insert(0, (found or Foreground(kept, total)).line() + (", each image alone" if pca is None else ""))
    return lines


def _image_metadata(job: ImageJob) -> dict[str, str]:
    h, w = job.grid
    return dict(
        grid=f"{h}x{w}",
        patch_size=str(job.patch),
        input_size=f"{job.crop[1]}x{job.crop[0]}",
        image=str(job.path),
        tokens="normed patch tokens, [h, w, C]",
    )
