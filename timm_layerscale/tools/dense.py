"""Dense features made visible: the PCA of patch features as RGB, the foreground, and the images read.

numpy only (no torch): the command hands over each image's patch features as `[h * w, C]` float arrays.

The colours follow Meta's `notebooks/pca.ipynb` (DINOv3): three components of a PCA (centred, whitened: unit
variance over the patches it was fitted on), each through `sigmoid(2 x)`. A component's sign is arbitrary in
any SVD; here it is fixed so that its largest-magnitude loading is positive (scikit-learn's `svd_flip` rule
on the components), so the same features always give the same colours.

The foreground is DINOv2's rule (its paper, section 7.2 / Fig. 1): a first PCA over every patch, thresholded on
its first component; the second PCA, whose components are the colours, is fitted on the foreground alone and the
background is drawn black. The first component's sign says which side is which: here the side of the
threshold (`FOREGROUND_THRESHOLD`, on the whitened component) that holds fewer of the image's border patches
is the foreground.
"""

from __future__ import annotations

import importlib.util
import io
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from timm_ls.paths import install_hint

from .files import write_atomically

COMPONENTS = 3
FOREGROUND_THRESHOLD = 0.0  # on the first whitened component: above it (sign fixed as said) is foreground


class ImagingUnavailable(Exception):
    """PIL (which comes with matplotlib, the `tools` extra) is not installed."""


def missing_pil() -> str:
    hint = install_hint("tools")
    return f"reading and writing images needs PIL, which the core install leaves out; install it with {hint}"


# The largest image read, by its header before decoding (100 megapixels, below PIL's own bomb limit; the
# pictures are resized to --size anyway). Modes of more than 8 bits a channel, which PIL's "RGB" would clip.
MAX_IMAGE_PIXELS = 100_000_000
WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def _pil():
    if importlib.util.find_spec("PIL") is None:
        raise ImagingUnavailable(missing_pil())
    from PIL import Image  # an optional dependency: imported on use, so the package imports without it

    return Image


@dataclass(frozen=True)
class Pca:
    """A whitened PCA: `project(x) = (x - mean) @ components.T / scales`."""

    mean: np.ndarray  # [C]
    components: np.ndarray  # [k, C], rows of unit length, signs fixed
    scales: np.ndarray  # [k], the standard deviation of each component over the fitted patches

    def project(self, features: np.ndarray) -> np.ndarray:
        return (np.asarray(features, np.float64) - self.mean) @ self.components.T / self.scales


class PcaFit:
    """A PCA fitted as patches stream by: their count, mean and scatter matrix in float64, merged chunk by chunk
    (Chan, Golub and LeVeque's pairwise update), so it holds `C x C` numbers however many patches it sees."""

    def __init__(self, dim: int) -> None:
        self.count = 0
        self.mean = np.zeros(dim)
        self.scatter = np.zeros((dim, dim))

    def add(self, features: np.ndarray) -> None:
        """Adds the patches `[N, C]`."""
        x = np.asarray(features, np.float64)
        if len(x) == 0:
            return
        mean = x.mean(0)
        centred = x - mean
        delta, total = mean - self.mean, self.count + len(x)
        self.scatter += centred.T @ centred + np.outer(delta, delta) * (self.count * len(x) / total)
        self.mean += delta * (len(x) / total)
        self.count = total

    def pca(self, components: int = COMPONENTS) -> Pca:
        """The whitened PCA of every patch added (at least 2); each component's largest loading positive."""
        if self.count < 2:
            raise ValueError(f"a PCA needs at least 2 patches of features; got {self.count}")
        values, vectors = np.linalg.eigh(self.scatter)  # ascending
        k = min(components, self.count, len(values))
        values, vt = values[::-1][:k], vectors[:, ::-1][:, :k].T
        signs = np.sign(vt[np.arange(k), np.abs(vt).argmax(1)])
        scales = np.sqrt(np.clip(values, 0, None) / (self.count - 1))
        return Pca(self.mean.copy(), vt * signs[:, None], np.where(scales > 0, scales, 1.0))


def fit_pca(features: np.ndarray, components: int = COMPONENTS) -> Pca:
    """The whitened PCA of `features` `[N, C]` (N >= 2); each component's largest loading positive."""
    x = np.asarray(features)
    if x.ndim != 2 or len(x) < 2:
        raise ValueError(f"a PCA needs at least 2 patches of features [N, C]; got shape {x.shape}")
    fit = PcaFit(x.shape[1])
    fit.add(x)
    return fit.pca(components)


def colours(projected: np.ndarray) -> np.ndarray:
    """Meta's colouring: `sigmoid(2 x)` of each whitened component, in [0, 1]; fewer than 3 padded with 0.5."""
    rgb = 1.0 / (1.0 + np.exp(-2.0 * projected))
    if rgb.shape[-1] < COMPONENTS:
        rgb = np.concatenate([rgb, np.full((*rgb.shape[:-1], COMPONENTS - rgb.shape[-1]), 0.5)], -1)
    return rgb


def border(grid: tuple[int, int]) -> np.ndarray:
    """The patches on the edge of a `(h, w)` grid, as a flat boolean mask."""
    edge = np.zeros(grid, bool)
    edge[[0, -1], :] = edge[:, [0, -1]] = True
    return edge.reshape(-1)


@dataclass(frozen=True)
class Foreground:
    kept: int  # foreground patches, over all images
    total: int
    threshold: float = FOREGROUND_THRESHOLD

    def line(self) -> str:
        return (
            f"foreground: DINOv2's rule, the first PCA component > {self.threshold:g} (whitened; its sign makes the "
            f"image borders background): {self.kept} of {self.total} patches ({self.kept / max(self.total, 1):.0%})"
        )


def border_votes(first: Pca, features: np.ndarray, grid: tuple[int, int]) -> tuple[int, int]:
    """Of an image's border patches: how many score above the threshold on `first`, and how many there are."""
    edge = first.project(features[border(grid)])[:, 0]
    return int((edge > FOREGROUND_THRESHOLD).sum()), len(edge)


def foreground_mask(first: Pca, features: np.ndarray, flip: bool) -> np.ndarray:
    """The foreground patches of an image, flat boolean: above the threshold on `first`, its sign flipped when
    most border patches score above it."""
    scores = first.project(features)[:, 0]
    return (-scores if flip else scores) > FOREGROUND_THRESHOLD


def foreground_masks(first: Pca, features: Sequence[np.ndarray], grids: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """Each image's foreground by `first` (the first component of a PCA over all of them): above the
    threshold, on the side that holds fewer of all the images' border patches (one sign vote over them all)."""
    votes = [border_votes(first, f, g) for f, g in zip(features, grids)]
    flip = sum(v[0] for v in votes) / sum(v[1] for v in votes) > 0.5
    return [foreground_mask(first, f, flip) for f in features]


def foreground(features: Sequence[np.ndarray], grids: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """DINOv2's foreground over these images together: the first component of their PCA above the threshold,
    on the side that holds fewer border patches."""
    return foreground_masks(fit_pca(np.concatenate(features), components=1), features, grids)


def pca_colours(
    features: Sequence[np.ndarray], masks: Sequence[np.ndarray] | None = None, joint: bool = True
) -> list[np.ndarray]:
    """Each image's patch colours `[h * w, 3]`: the PCA fitted on every image's (masked) patches together, or,
    without `joint`, on each image's own; a masked-out patch is black."""
    masks = list(masks) if masks is not None else [np.ones(len(f), bool) for f in features]
    groups = [list(range(len(features)))] if joint else [[i] for i in range(len(features))]
    result: list[np.ndarray] = [np.empty(0)] * len(features)
    for group in groups:
        kept = np.concatenate([features[i][masks[i]] for i in group])
        if len(kept) < 2:
            raise ValueError("the foreground holds fewer than 2 patches: nothing to fit; drop --foreground")
        pca = fit_pca(kept)
        for i in group:
            result[i] = colours(pca.project(features[i])) * masks[i][:, None]
    return result


def side_by_side(image: np.ndarray, rgb: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """`image` `[H, W, 3]` uint8 and the patch colours `[h * w, 3]` in [0, 1] at the image's resolution
    (each patch a block of its pixels), side by side: `[H, 2 W, 3]` uint8."""
    height, width = image.shape[:2]
    h, w = grid
    patches = np.rint(rgb.reshape(h, w, 3) * 255).astype(np.uint8)
    up = patches.repeat(height // h, 0).repeat(width // w, 1)
    return np.concatenate([image, up], 1)


def target_size(width: int, height: int, size: int | None, patch: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Where an image of `width` x `height` goes, as timm's eval transform takes it (resize the shorter side,
    centre crop): `((resized_w, resized_h), (crop_w, crop_h))`, the crop a multiple of `patch` per side.
    `size` is the shorter side; None keeps the image's own size (only the crop)."""
    if size is None:
        resized = (width, height)
    else:
        scale = size / min(width, height)
        resized = (max(size, round(width * scale)), max(size, round(height * scale)))
    return resized, (resized[0] // patch * patch, resized[1] // patch * patch)


def image_size(path: Path) -> tuple[int, int]:
    """The `(width, height)` an image file's header states, its data checked whole (PIL's `verify`, which
    decodes nothing), before any pixel is held; any problem is a `ValueError` naming the file and the fix."""
    with open_image(path) as img:
        size = img.size
        img.verify()
    return size


def read_image(path: Path):
    """The image at `path` as RGB (PIL), its size checked from the header before it is decoded; 16-bit, 32-bit
    integer and float images scaled to 8 bits by their own range, as image viewers show them. Anything else is
    a `ValueError` naming the file and the fix."""
    with open_image(path) as img:
        return _by_range(img, _pil()) if img.mode in WIDE_MODES else img.convert("RGB")


@contextmanager
def open_image(path: Path, kind: str = "image", fix: str = "pass a PNG or JPEG file") -> Iterator:
    """The one way the package opens an image file: open (its header read, nothing decoded), within the pixel
    limit; PIL's errors and its size warning become one `ValueError` naming the file (as a `kind`) and `fix`."""
    image_cls = _pil()
    try:
        with warnings.catch_warnings():  # the size is ours to judge, in one line (PIL's warning, then its error)
            warnings.simplefilter("ignore", image_cls.DecompressionBombWarning)
            with image_cls.open(path) as img:
                if img.width * img.height > MAX_IMAGE_PIXELS:
                    raise image_cls.DecompressionBombError(f"{img.width}x{img.height} px")
                yield img
    except image_cls.DecompressionBombError as exc:
        raise ValueError(
            f"{kind} {path} is too large ({_bomb_size(str(exc))}); at most {MAX_IMAGE_PIXELS:,} pixels "
            f"are read: downscale it first"
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:  # UnidentifiedImageError is an OSError; verify's SyntaxError
        if str(exc).startswith(f"{kind} {path} "):
            raise
        raise ValueError(f"cannot read {kind} {path} ({' '.join(str(exc).split())}); {fix}") from None


def _bomb_size(words: str) -> str:
    """The size in our check's words ("W x H px"), or in PIL's ("Image size (N pixels) exceeds ...")."""
    found = re.search(r"\((\d+) pixels\)", words)
    return f"{int(found.group(1)):,} pixels" if found else words


def _by_range(img, image_cls):
    """A 16-bit, 32-bit or float image as 8-bit RGB, its lowest value black and its highest white."""
    values = np.asarray(img, dtype=np.float64)
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    scaled = np.nan_to_num((values - low) / (high - low) if high > low else values * 0, nan=0.0, posinf=1, neginf=0)
    return image_cls.fromarray(np.clip(scaled * 255 + 0.5, 0, 255).astype(np.uint8), mode="L").convert("RGB")


def write_png(path: Path, pixels: np.ndarray) -> None:
    """`pixels` `[H, W, 3]` uint8 as a PNG, written whole or not at all."""
    buffer = io.BytesIO()
    _pil().fromarray(pixels).save(buffer, format="PNG", optimize=True)
    write_atomically(path, buffer.getvalue())


def largest_side_where(fits: Callable[[int], bool], patch: int, aspect: float) -> int:
    """The largest shorter side (a multiple of `patch`) at which `fits(patches of the image)`, 0 if none."""
    side = 0
    while fits((side + patch) // patch * int((side + patch) * aspect // patch)):
        side += patch
    return side
