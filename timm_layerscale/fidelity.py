"""How close a changed model (int8, exported, pruned) stays to its fp32 original, on the same images.

`model_outputs` records what a model gives for images (pooled features, patch tokens, logits with a head),
`compare` measures a candidate's outputs against a reference's as cosine similarities, and
`rendered_images` draws images offline when the user gives none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .tools.shapes import ShapesSpec, draw_shapes


@dataclass(frozen=True)
class Outputs:
    """A model's outputs for a batch of images, float tensors on the CPU."""

    pooled: torch.Tensor  # [B, C]
    patches: torch.Tensor  # [B, N, C]
    logits: torch.Tensor | None = None  # [B, K]


@dataclass(frozen=True)
class Fidelity:
    """Cosine similarities of a candidate's outputs to a reference's, and how often their top-1 classes agree."""

    images: int
    pooled_cosine_mean: float
    pooled_cosine_min: float
    patch_cosine_mean: float  # cosine per patch token, mean over tokens and images
    patch_cosine_min: float
    top1_agreement: float | None  # share of images with the same top-1 class; None without a head

    def line(self) -> str:
        text = (
            f"fidelity vs fp32 on {self.images} images: pooled cosine mean {self.pooled_cosine_mean:.5f} "
            f"min {self.pooled_cosine_min:.5f}, patch cosine mean {self.patch_cosine_mean:.4f} "
            f"min {self.patch_cosine_min:.4f}"
        )
        if self.top1_agreement is not None:
            text += f", top-1 agreement {100 * self.top1_agreement:.1f}%"
        return text

    def below(self, min_cosine: float) -> str | None:
        """None when both minimum cosines reach `min_cosine`, else a sentence naming those that fell short."""
        short = [
            f"{name} cosine min {value:.5f} is {min_cosine - value:.5f} below {min_cosine:g}"
            for name, value in (("pooled", self.pooled_cosine_min), ("patch", self.patch_cosine_min))
            if value < min_cosine
        ]
        if not short:
            return None
        return f"fidelity on {self.images} images falls short: " + " and ".join(short) + "."


def _cosines(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    # In float64: cosines of 0.9999x are what is compared, and fp32 rounding would blur the last digits.
    return F.cosine_similarity(reference.double(), candidate.double(), dim=-1)


def compare(reference: Outputs, candidate: Outputs) -> Fidelity:
    """The candidate's outputs against the reference's, image by image and patch token by token."""
    if reference.pooled.shape != candidate.pooled.shape or reference.patches.shape != candidate.patches.shape:
        raise ValueError(
            f"outputs of different shapes: pooled {tuple(reference.pooled.shape)} vs "
            f"{tuple(candidate.pooled.shape)}, patches {tuple(reference.patches.shape)} vs "
            f"{tuple(candidate.patches.shape)}"
        )
    pooled = _cosines(reference.pooled, candidate.pooled)
    patches = _cosines(reference.patches, candidate.patches)
    agreement = None
    if reference.logits is not None and candidate.logits is not None:
        same = reference.logits.argmax(dim=-1) == candidate.logits.argmax(dim=-1)
        agreement = same.double().mean().item()
    return Fidelity(
        images=reference.pooled.shape[0],
        pooled_cosine_mean=pooled.mean().item(),
        pooled_cosine_min=pooled.min().item(),
        patch_cosine_mean=patches.mean().item(),
        patch_cosine_min=patches.min().item(),
        top1_agreement=agreement,
    )


def model_outputs(model: nn.Module, images: torch.Tensor) -> Outputs:
    """The pooled features, patch tokens (prefix tokens dropped) and, with a head, logits for `images`."""
    with torch.inference_mode():
        feats = model.forward_features(images)
        pooled = model.forward_head(feats, pre_logits=True)
        logits = model.forward_head(feats) if model.num_classes > 0 else None
        patches = feats[:, model.num_prefix_tokens :]
    return Outputs(
        pooled=pooled.float().cpu(),
        patches=patches.float().cpu(),
        logits=None if logits is None else logits.float().cpu(),
    )


def rendered_images(count: int = 8, size: int = 224, seed: int = 0) -> torch.Tensor:
    """`count` normalised images `[count, 3, size, size]` (about zero mean, unit spread), one shape on a noisy
    background each, drawn from `seed`: the same every time, nothing read or downloaded."""
    images, _ = draw_shapes(count, ShapesSpec(image_size=size, seed=seed), seed)
    return images
