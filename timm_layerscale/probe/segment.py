"""Linear semantic segmentation on frozen patch features, as Meta's `dinov3/eval/segmentation` linear head.

The head takes the chosen blocks' patch maps concatenated along channels (each resized to the first's grid),
drops whole channels (Dropout2d, 0.1) in training, applies BatchNorm over the channels and a 1x1 convolution
(weights normal with std 0.01, bias 0), and its logits are upsampled bilinearly to the mask. It is trained on
the cached features with AdamW (lr 1e-3, betas 0.9/0.999, weight decay 1e-2, gradients clipped at 35: Meta's
OptimizerConfig), a linear warm-up then a cosine decay, and cross-entropy that ignores 255. Scores are mIoU
over the classes present in val's truth or predictions, and pixel accuracy, both over the pixels not ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn.functional import cross_entropy, interpolate

from .data import IGNORE

LR, BETAS, WEIGHT_DECAY, CLIP, DROPOUT = 1e-3, (0.9, 0.999), 1e-2, 35.0, 0.1  # Meta's segmentation defaults
WARMUP = 0.1  # of the steps


class LinearSegmentationHead(nn.Module):
    """Meta's LinearHead: Dropout2d -> BatchNorm2d -> 1x1 conv over the concatenated patch maps."""

    def __init__(self, channels: int, num_classes: int, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.dropout = nn.Dropout2d(dropout)
        self.batchnorm = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, num_classes, kernel_size=1)
        nn.init.normal_(self.conv.weight, mean=0.0, std=0.01)
        nn.init.zeros_(self.conv.bias)

    def forward(self, maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """Logits `[N, classes, *size]` from patch maps `[N, C, h, w]`."""
        logits = self.conv(self.batchnorm(self.dropout(maps)))
        return interpolate(logits, size=size, mode="bilinear", align_corners=False)


def concatenated(maps: list[torch.Tensor]) -> torch.Tensor:
    """The blocks' maps along channels, each resized to the first's grid (Meta's `_transform_inputs`)."""
    size = maps[0].shape[2:]
    return torch.cat([interpolate(m, size=size, mode="bilinear", align_corners=False) for m in maps], dim=1)


def _schedule(steps: int):
    """Linear warm-up, then cosine to 0 (the shape of Meta's WarmupOneCycleLR)."""
    warmup = max(1, int(WARMUP * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


@dataclass
class SegmentationResult:
    miou: float  # percent
    pixel_accuracy: float  # percent
    iou: list[float]  # percent per class (NaN: absent from val's truth and predictions)
    predictions: torch.Tensor  # [N_val, H, W] int64
    losses: list[float] = field(default_factory=list)  # training loss every 10 steps


def train_head(
    maps: torch.Tensor, masks: torch.Tensor, num_classes: int, *, steps: int, batch: int = 8, seed: int = 0
) -> tuple[LinearSegmentationHead, list[float]]:
    """The head trained on `maps` `[N, C, h, w]` against `masks` `[N, H, W]` (255 ignored), and its training
    loss every 10 steps."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the head's init and its dropout
    head = LinearSegmentationHead(maps.shape[1], num_classes)
    optimizer = torch.optim.AdamW(head.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(steps))
    head.train()
    targets, losses = masks.long(), []
    for step in range(steps):
        rows = torch.randint(len(maps), (min(batch, len(maps)),), generator=generator)
        loss = cross_entropy(head(maps[rows], targets.shape[1:]), targets[rows], ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(head.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        if step % 10 == 0 or step == steps - 1:
            losses.append(loss.item())
    return head.eval(), losses


@torch.no_grad()
def predict(head: LinearSegmentationHead, maps: torch.Tensor, size: tuple[int, int], batch: int = 16) -> torch.Tensor:
    return torch.cat([head(maps[i : i + batch], size).argmax(dim=1) for i in range(0, len(maps), batch)])


def scores(predictions: torch.Tensor, masks: torch.Tensor, num_classes: int) -> tuple[float, float, list[float]]:
    """mIoU (mean over classes seen in truth or prediction), pixel accuracy and IoU per class, in percent."""
    truth, guess = masks.long().reshape(-1), predictions.reshape(-1)
    valid = truth != IGNORE
    truth, guess = truth[valid], guess[valid]
    confusion = torch.bincount(truth * num_classes + guess, minlength=num_classes**2).reshape(num_classes, num_classes)
    confusion = confusion.double()
    union = confusion.sum(0) + confusion.sum(1) - confusion.diag()
    iou = torch.where(union > 0, confusion.diag() / union.clamp(min=1), torch.full_like(union, float("nan")))
    pixel = float(confusion.diag().sum() / confusion.sum().clamp(min=1))
    return 100 * float(np.nanmean(iou.numpy())), 100 * pixel, (100 * iou).tolist()


def linear_segmentation(
    train_maps: torch.Tensor,
    train_masks: torch.Tensor,
    val_maps: torch.Tensor,
    val_masks: torch.Tensor,
    num_classes: int,
    *,
    steps: int = 500,
    seed: int = 0,
) -> SegmentationResult:
    """Meta's linear protocol on frozen patch maps `[N, C, h, w]` and masks `[N, H, W]` of class indices."""
    head, losses = train_head(train_maps, train_masks, num_classes, steps=steps, seed=seed)
    predictions = predict(head, val_maps, tuple(val_masks.shape[1:]))
    miou, pixel, iou = scores(predictions, val_masks, num_classes)
    return SegmentationResult(miou, pixel, iou, predictions, losses)
