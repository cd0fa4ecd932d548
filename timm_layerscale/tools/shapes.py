"""Shapes: a labelled image set drawn from a seed, so experiments run offline and repeat exactly.

Each image holds one shape (the label) of random size, position and colour on a random background with
Gaussian noise. Nothing is downloaded or read from disk; the same seed always gives the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CLASSES = ("disk", "ring", "square", "frame", "triangle", "plus")


@dataclass(frozen=True)
class ShapesSpec:
    image_size: int = 32
    train_size: int = 4096
    test_size: int = 1024
    noise: float = 0.1
    min_radius: float = 0.3  # a shape's radius, as a fraction of the image size
    max_radius: float = 0.45
    seed: int = 0

    def describe(self) -> str:
        return (
            f"{len(CLASSES)} kinds of shape ({', '.join(CLASSES)}) drawn here from seed {self.seed}, not "
            f"downloaded: {self.image_size}x{self.image_size} px, random size, position and colours, noise "
            f"{self.noise:g}; {self.train_size} images to train on, {self.test_size} others held out to test"
        )


@dataclass(frozen=True)
class Shapes:
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int = len(CLASSES)


def _masks(u: torch.Tensor, v: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One boolean mask per image, from pixel coordinates relative to the shape (radius 1)."""
    radius2, box = u**2 + v**2, torch.maximum(u.abs(), v.abs())
    per_class = torch.stack(
        [
            radius2 <= 1,
            (radius2 <= 1) & (radius2 >= 0.3),
            box <= 0.8,
            (box <= 0.8) & (box >= 0.45),
            (v >= -0.9) & (v <= 0.8) & (u.abs() <= (v + 0.9) / 1.7),
            ((u.abs() <= 0.3) & (v.abs() <= 1)) | ((v.abs() <= 0.3) & (u.abs() <= 1)),
        ]
    )
    return per_class[labels, torch.arange(len(labels))]


def draw_shapes(count: int, spec: ShapesSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` images `[count, 3, size, size]` (about zero mean, unit spread) and their labels, balanced."""
    g = torch.Generator().manual_seed(seed)
    size = spec.image_size
    labels = (torch.arange(count) % len(CLASSES))[torch.randperm(count, generator=g)]
    radius = (spec.min_radius + (spec.max_radius - spec.min_radius) * torch.rand(count, generator=g)) * size
    centre = radius[:, None] + torch.rand(count, 2, generator=g) * (size - 2 * radius[:, None])
    pixels = torch.arange(size) + 0.5
    v = (pixels[None, :, None] - centre[:, 1, None, None]) / radius[:, None, None]
    u = (pixels[None, None, :] - centre[:, 0, None, None]) / radius[:, None, None]
    mask = _masks(u, v, labels).unsqueeze(1).float()
    background = torch.rand(count, 3, 1, 1, generator=g)
    # The shape's colour differs from the background by at least 0.3 in every channel.
    offset = (0.3 + 0.7 * torch.rand(count, 3, 1, 1, generator=g)) * torch.where(background > 0.5, -1.0, 1.0)
    foreground = (background + offset).clamp(0, 1)
    images = background + (foreground - background) * mask
    images = images + spec.noise * torch.randn(images.shape, generator=g)
    return (images - 0.5) / 0.3, labels


def make_shapes(spec: ShapesSpec) -> Shapes:
    """Training and held-out images from different draws of the same seed."""
    train = draw_shapes(spec.train_size, spec, spec.seed)
    test = draw_shapes(spec.test_size, spec, spec.seed + 1_000_003)
    return Shapes(*train, *test)
