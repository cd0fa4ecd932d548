"""A small method with every kind of state a real one has (random views, a collate draw, an EMA buffer), for
the loop's tests."""

from __future__ import annotations

import numpy as np
import timm
import torch
from torch import Tensor, nn
from torchvision.transforms import v2

from timm_layerscale.pretrain.method import Method, Shard, StepValues, split_decay, with_decay


class Regress(Method):
    """The backbone's pooled features of a random crop, plus a collate-drawn offset, regressed onto a fixed
    projection of the crop; an EMA copy of the head's weight as a buffer."""

    name = "regress"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.student = timm.create_model("vit_ls_tiny_patch16_dinov3", num_classes=0, depth=1, img_size=32)
        self.head = nn.Linear(self.student.num_features, 8)
        self.register_buffer("ema", torch.zeros(8, self.student.num_features))
        self.register_buffer("target", torch.randn(3 * 32 * 32, 8, generator=torch.Generator().manual_seed(7)))
        self.crop = v2.Compose([v2.RandomResizedCrop(32, antialias=True), v2.ToDtype(torch.float32, scale=True)])

    def views(self, image: Tensor) -> Tensor:
        return self.crop(image)

    def collate(self, samples, generator: np.random.Generator, shard: Shard) -> dict[str, Tensor]:
        offsets = torch.from_numpy(generator.standard_normal((len(samples) * shard.world, 8))).float()
        rows = slice(shard.rank * len(samples), (shard.rank + 1) * len(samples))
        return {"images": torch.stack(list(samples)), "offsets": offsets[rows]}

    def forward(self, batch: dict[str, Tensor], step: int) -> tuple[Tensor, dict[str, Tensor]]:
        images = batch["images"]
        predicted = self.head(self.student(images)) + batch["offsets"]
        loss = (predicted - images.flatten(1) @ self.target).square().mean()
        return loss, {"mse": loss.detach()}

    def param_groups(self) -> list[dict]:
        return split_decay(self.student, "student") + split_decay(self.head, "head")

    def step_values(self, step: int) -> dict[str, StepValues]:
        values = StepValues(lr=1e-3 * (1 + step) / 4, weight_decay=0.05)
        return {name: with_decay(values, name) for name in ("student", "student_no_wd", "head", "head_no_wd")}

    def after_step(self, step: int) -> None:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.head.weight, alpha=0.1)

    def backbone(self) -> nn.Module:
        return self.student
