"""What the pretraining loop (`pretrain.loop`) asks of a method: `distill.Distill` and `ssl.DINOv3` are two.

A method is one `nn.Module` holding every tensor a run needs to continue (student, heads, frozen or EMA teacher,
loss centres): its `state_dict` is what a checkpoint saves besides the optimiser's. The loop owns the data, the
seeds, the optimiser, gradient clipping, DDP and checkpoints; the method owns what an image becomes (`views`),
how views make a batch (`collate`), the loss (`forward`) and what happens between steps (`after_step`).

Determinism, so that a resumed run and a run on N ranks give one process's numbers: the loop seeds torch's
global generator before each image's `views` (from the run's seed, the step and the image's place in the global
batch), and hands `collate` a numpy generator seeded from the seed and the step. A method draws its random
numbers only from those two. `collate` gets this rank's samples and the shard (`rank`, `world`): anything drawn
per sample (iBOT's masks) is drawn for the whole global batch, `world` times this rank's, and this rank's rows
taken, so that the draws do not depend on the number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Shard:
    """This process's part of the global batch: ranks take contiguous slices, in rank order."""

    rank: int = 0
    world: int = 1


@dataclass(frozen=True)
class StepValues:
    """A parameter group's learning rate and weight decay at one step."""

    lr: float
    weight_decay: float


class Method(nn.Module):
    """The base of a pretraining method. Subclasses set `name` and implement every method below."""

    name: str = ""

    def views(self, image: Tensor) -> object:
        """One image, uint8 `[3, H, W]` -> what `collate` takes (a `Crops`, a tensor)."""
        raise NotImplementedError

    def collate(self, samples: Sequence[object], generator: np.random.Generator, shard: Shard) -> dict[str, Tensor]:
        """This rank's samples -> the batch `forward` takes."""
        raise NotImplementedError

    def forward(self, batch: dict[str, Tensor], step: int) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss to minimise and its parts (detached scalars, by name, for the progress bar and metrics)."""
        raise NotImplementedError

    def param_groups(self) -> list[dict]:
        """The optimiser's parameter groups, each a dict with `params` and a `name` that `step_values` knows."""
        raise NotImplementedError

    def step_values(self, step: int) -> dict[str, StepValues]:
        """Each group's learning rate and weight decay at `step` (0-based)."""
        raise NotImplementedError

    def after_step(self, step: int) -> None:
        """After the optimiser's step: the EMA teacher's update, for one. Nothing by default."""

    def backbone(self) -> nn.Module:
        """The model a run saves at the end: a timm model, without the method's heads."""
        raise NotImplementedError

    def metrics(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """Health figures for `metrics.jsonl` beyond the loss parts (the teacher's entropy, say). None by default."""
        return {}


def trainable(module: nn.Module) -> list[Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def no_weight_decay(name: str, param: Tensor) -> bool:
    """Biases, norms, gammas and tokens: Meta's trainer decays none of them (1-D tensors and the tokens)."""
    return param.ndim <= 1 or name.endswith(("cls_token", "reg_token", "storage_tokens", "mask_token", "pos_embed"))


def split_decay(module: nn.Module, prefix: str) -> list[dict]:
    """`module`'s trainable parameters as two groups, `PREFIX` (decayed) and `PREFIX_no_wd` (not)."""
    decay, keep = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            (keep if no_weight_decay(name, param) else decay).append(param)
    groups = [dict(params=decay, name=prefix), dict(params=keep, name=f"{prefix}_no_wd")]
    return [g for g in groups if g["params"]]


def with_decay(values: StepValues, name: str) -> StepValues:
    """`values` for the group `name`: no weight decay for a `_no_wd` group."""
    return StepValues(values.lr, 0.0) if name.endswith("_no_wd") else values


@torch.no_grad()
def feature_std(tokens: Tensor) -> float:
    """The standard deviation over a batch of L2-normalised features, averaged over channels: it falls to 0
    when every image maps to one point (collapse)."""
    normed = nn.functional.normalize(tokens.float().flatten(0, -2), dim=-1)
    return normed.std(dim=0).mean().item() if normed.shape[0] > 1 else 0.0
