"""Dense distillation: a student (any timm model) learns a frozen teacher's global and patch features.

The loss. Each of the student's two outputs goes through a small projection head to the teacher's width: the
pooled feature through a two-layer MLP, the patch map through a 1x1 linear and then bilinearly resized to the
teacher's patch grid. The loss is the mean cosine distance `1 - cos` of the global features plus that of the
patch features, position by position. Compared with the anchors: timm's `FeatureDistillationTask` matches
pooled features only, by MSE, so a teacher's feature norms (which differ by orders of magnitude between
families and sizes, and a DINOv3 7B's by token) set the loss's scale and dense features are not learned; Meta
distils DINOv3's smaller models with its self-supervised losses through the teacher's DINO and iBOT heads,
which the released checkpoints do not carry; relational losses on similarity distributions need a
temperature and a batch of negatives. Cosine distance has no scale, no temperature and no batch dependence,
and a patch's direction is what kNN, linear probes and PCA pictures read off DINOv3's features.

Each model sees the same crop normalised with its own mean and std (a ConvNeXt student and a DINOv3 teacher
may differ). The teacher is held outside the module's parameters and state: it is frozen, never saved in a
checkpoint (a resumed run loads it again from where it came from) and not broadcast by DDP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torchvision.transforms import v2

from .augment import BICUBIC
from .method import Method, Shard, StepValues, feature_std, split_decay, with_decay
from .schedules import CosineScheduler


@dataclass(frozen=True)
class DistillSettings:
    """A distillation run's schedule and crops; `global_weight` and `dense_weight` weigh the two losses."""

    steps: int
    lr: float = 1e-3
    min_lr: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.05
    size: int = 224
    crop_scale: tuple[float, float] = (0.32, 1.0)  # Meta's global_crops_scale
    global_weight: float = 1.0
    dense_weight: float = 1.0

    def check(self) -> None:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} must be fewer than --steps {self.steps}")
        if self.size < 1 or not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise ValueError("--size must be positive and the crop scale within (0, 1]")


@dataclass(frozen=True)
class Features:
    """A model's pooled features `[B, C]` and patch map `[B, C, h, w]`."""

    pooled: Tensor
    dense: Tensor


def patch_size(model: nn.Module) -> tuple[int, int]:
    """A token model's patch size (timm's `patch_embed.patch_size`); `(1, 1)` for one without patches."""
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "patch_size", (1, 1))
    return (size, size) if isinstance(size, int) else tuple(size)


def features(model: nn.Module, images: Tensor) -> Features:
    """`forward_features` and `forward_head(pre_logits=True)`; tokens past the prefix become the patch map."""
    tokens = model.forward_features(images)
    pooled = model.forward_head(tokens, pre_logits=True)
    if tokens.ndim == 4:
        nhwc = getattr(model, "output_fmt", "NCHW") == "NHWC"
        return Features(pooled, tokens.permute(0, 3, 1, 2) if nhwc else tokens)
    patches = tokens[:, getattr(model, "num_prefix_tokens", 0) :]
    height, width = (side // patch for side, patch in zip(images.shape[-2:], patch_size(model)))
    if height * width != patches.shape[1]:
        raise ValueError(f"{patches.shape[1]} patch tokens do not make a {height}x{width} grid")
    return Features(pooled, patches.transpose(1, 2).reshape(len(patches), -1, height, width))


def normalizer(model: nn.Module) -> v2.Normalize:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return v2.Normalize(cfg.get("mean", (0.485, 0.456, 0.406)), cfg.get("std", (0.229, 0.224, 0.225)))


class DistillHeads(nn.Module):
    """The student's projections to the teacher's widths: an MLP for the pooled feature, a 1x1 for patches."""

    def __init__(self, student: Features, teacher: Features) -> None:
        super().__init__()
        width, target = student.pooled.shape[-1], teacher.pooled.shape[-1]
        self.pooled = nn.Sequential(nn.Linear(width, target), nn.GELU(), nn.Linear(target, target))
        self.dense = nn.Conv2d(student.dense.shape[1], teacher.dense.shape[1], kernel_size=1)

    def forward(self, student: Features, grid: Sequence[int]) -> Features:
        dense = self.dense(student.dense)
        if tuple(dense.shape[-2:]) != tuple(grid):
            dense = F.interpolate(dense, size=tuple(grid), mode="bilinear", align_corners=False)
        return Features(self.pooled(student.pooled), dense)


def cosine_distance(ours: Tensor, target: Tensor, dim: int) -> Tensor:
    return (1 - F.cosine_similarity(ours.float(), target.float(), dim=dim)).mean()


class Distill(Method):
    """`Distill(student, teacher, settings)`: the student learns the frozen `teacher`'s features."""

    name = "distill"

    def __init__(self, student: nn.Module, teacher: nn.Module, settings: DistillSettings) -> None:
        super().__init__()
        settings.check()
        self.settings = settings
        self.student = student
        teacher.requires_grad_(False).eval()
        self._teacher = (teacher,)  # a tuple: not a submodule, so not in the state, the optimiser or DDP
        self.student_norm, self.teacher_norm = normalizer(student), normalizer(teacher)
        probe = torch.zeros(1, 3, settings.size, settings.size)
        with torch.no_grad():
            shapes = shared_input(student, teacher, probe, self.student_norm, self.teacher_norm)
        self.heads = DistillHeads(*shapes)
        self.lr = CosineScheduler(settings.lr, settings.min_lr, settings.steps, settings.warmup_steps)
        self.crop = v2.Compose(
            [
                v2.RandomResizedCrop(settings.size, settings.crop_scale, interpolation=BICUBIC, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
            ]
        )
        self._last: Features | None = None

    @property
    def teacher(self) -> nn.Module:
        return self._teacher[0]

    def views(self, image: Tensor) -> Tensor:
        return self.crop(image)

    def collate(self, samples, generator: np.random.Generator, shard: Shard) -> dict[str, Tensor]:
        return {"images": torch.stack(list(samples))}

    def forward(self, batch: dict[str, Tensor], step: int) -> tuple[Tensor, dict[str, Tensor]]:
        images = batch["images"]
        with torch.no_grad():
            target = features(self.teacher, self.teacher_norm(images).to(teacher_dtype(self.teacher)))
        ours = self.heads(features(self.student, self.student_norm(images)), target.dense.shape[-2:])
        self._last = ours
        pooled = cosine_distance(ours.pooled, target.pooled, dim=-1)
        dense = cosine_distance(ours.dense, target.dense, dim=1)
        loss = self.settings.global_weight * pooled + self.settings.dense_weight * dense
        return loss, {"global": pooled.detach(), "dense": dense.detach()}

    def param_groups(self) -> list[dict]:
        return split_decay(self.student, "student") + split_decay(self.heads, "heads")

    def step_values(self, step: int) -> dict[str, StepValues]:
        values = StepValues(self.lr[step], self.settings.weight_decay)
        return {name: with_decay(values, name) for name in ("student", "student_no_wd", "heads", "heads_no_wd")}

    def backbone(self) -> nn.Module:
        return self.student

    def metrics(self, batch: dict[str, Tensor]) -> dict[str, float]:
        return {} if self._last is None else {"student_feature_std": feature_std(self._last.pooled)}


def teacher_dtype(teacher: nn.Module) -> torch.dtype:
    return next(teacher.parameters()).dtype


def shared_input(
    student: nn.Module, teacher: nn.Module, probe: Tensor, student_norm: nn.Module, teacher_norm: nn.Module
) -> tuple[Features, Features]:
    """Both models' features of one probe image; a `ValueError` where one cannot take the run's input size."""
    found = []
    for role, model, norm in (("student", student, student_norm), ("teacher", teacher, teacher_norm)):
        param = next(model.parameters())
        try:
            found.append(features(model.eval(), norm(probe).to(param.device, param.dtype)))
        except (RuntimeError, ValueError, AssertionError) as error:
            side = probe.shape[-1]
            raise ValueError(
                f"the {role} cannot take {side}x{side} images ({str(error).splitlines()[0]}): "
                "choose a --size both the teacher's and the student's patch sizes divide"
            ) from None
    student.train()
    return found[0], found[1]
