"""DINOv3's multi-crop: two global and several local views of one image, each distorted in colour and blur
as Meta's trainer distorts them, drawn from torch's global generator in Meta's order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BICUBIC = v2.InterpolationMode.BICUBIC


@dataclass(frozen=True)
class CropConfig:
    """The `crops.*` keys of Meta's training config, with `ssl_default_config.yaml`'s values."""

    global_crops_scale: tuple[float, float] = (0.32, 1.0)
    local_crops_scale: tuple[float, float] = (0.05, 0.32)
    local_crops_number: int = 8
    global_crops_size: int = 224
    local_crops_size: int = 96
    gram_teacher_crops_size: int | None = None
    gram_teacher_no_distortions: bool = False
    share_color_jitter: bool = False
    horizontal_flips: bool = True
    rgb_mean: Sequence[float] = IMAGENET_MEAN
    rgb_std: Sequence[float] = IMAGENET_STD


@dataclass
class Crops:
    """One image's views, normalised `[3, size, size]` float tensors: the teacher sees `global_crops` too."""

    global_crops: list[torch.Tensor]
    local_crops: list[torch.Tensor]
    gram_teacher_crops: list[torch.Tensor] | None = None


def blur(probability: float) -> v2.RandomApply:
    """A 9-tap Gaussian blur of sigma 0.1 to 2, applied with `probability`."""
    return v2.RandomApply([v2.GaussianBlur(kernel_size=9, sigma=(0.1, 2.0))], p=probability)


# Meta's trainer asks for blur probabilities 1.0, 0.1 and 0.5, but its blur class hands torchvision `1 - p`
# (v2.RandomApply applies with p): what it trains with, and so what is done here, is 0.0, 0.9 and 0.5.
FIRST_GLOBAL_BLUR, SECOND_GLOBAL_BLUR, LOCAL_BLUR = 0.0, 0.9, 0.5


class MultiCrop:
    """Meta's `DataAugmentationDINO` for a PIL image or a uint8 `[3, H, W]` tensor: each global view a random
    resized crop (bicubic, `global_crops_scale`) with a flip, colour jitter (brightness 0.4, contrast 0.4,
    saturation 0.2, hue 0.1, with p 0.8), grayscale (p 0.2) and blur; the second also solarised (threshold
    128, p 0.2); each local view a crop of `local_crops_scale` with a flip, colour jitter and blur."""

    def __init__(self, cfg: CropConfig = CropConfig()) -> None:
        self.cfg = cfg
        widest = max(cfg.global_crops_size, cfg.gram_teacher_crops_size or 0)
        flip = 0.5 if cfg.horizontal_flips else 0.0
        self.global_geometry = v2.Compose(
            [v2.RandomResizedCrop(widest, cfg.global_crops_scale, interpolation=BICUBIC), v2.RandomHorizontalFlip(flip)]
        )
        self.local_geometry = v2.Compose(
            [
                v2.RandomResizedCrop(cfg.local_crops_size, cfg.local_crops_scale, interpolation=BICUBIC),
                v2.RandomHorizontalFlip(flip),
            ]
        )
        self.normalize = v2.Compose(
            [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(cfg.rgb_mean, cfg.rgb_std)]
        )
        jitter = v2.Compose([v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2)])
        self.shared_jitter = jitter if cfg.share_color_jitter else None
        per_view: list[Callable] = [] if cfg.share_color_jitter else [jitter]
        gram = cfg.gram_teacher_crops_size
        # Without distortions of its own, the gram teacher's view is resized before the student's are distorted
        # (so the blur sees the global size); otherwise the distorted view is resized for both.
        before = (
            v2.Resize(cfg.global_crops_size, interpolation=BICUBIC)
            if gram and cfg.gram_teacher_no_distortions
            else nn.Identity()
        )
        self.after = (
            v2.Resize(cfg.global_crops_size, interpolation=BICUBIC)
            if gram and not cfg.gram_teacher_no_distortions
            else nn.Identity()
        )
        self.gram_resize = v2.Resize(gram, interpolation=BICUBIC) if gram else None
        solarize = v2.RandomSolarize(threshold=128, p=0.2)
        self.first_global = v2.Compose([before, *per_view, blur(FIRST_GLOBAL_BLUR), self.normalize])
        self.second_global = v2.Compose([before, *per_view, blur(SECOND_GLOBAL_BLUR), solarize, self.normalize])
        self.local = v2.Compose([*per_view, blur(LOCAL_BLUR), self.normalize])

    def __call__(self, image) -> Crops:
        if self.shared_jitter is not None:
            image = self.shared_jitter(image)
        # one view after the other, as Meta's: the random draws come in its order
        first_base = self.global_geometry(image)
        first = self.first_global(first_base)
        second_base = self.global_geometry(image)
        second = self.second_global(second_base)
        crops = Crops(global_crops=[self.after(first), self.after(second)], local_crops=[])
        if self.gram_resize is not None and self.cfg.gram_teacher_no_distortions:
            crops.gram_teacher_crops = [self.normalize(self.gram_resize(v)) for v in (first_base, second_base)]
        elif self.gram_resize is not None:
            crops.gram_teacher_crops = [self.gram_resize(first), self.gram_resize(second)]
        crops.local_crops = [self.local(self.local_geometry(image)) for _ in range(self.cfg.local_crops_number)]
        return crops
