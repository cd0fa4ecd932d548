"""Gram anchoring (DINOv3): the student's patch-to-patch similarities held to a Gram teacher's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _similarities(feats: Tensor, apply_norm: bool, img_level: bool) -> Tensor:
    feats = feats.float()
    if apply_norm:
        feats = F.normalize(feats, dim=-1)
    if not img_level and feats.dim() == 3:
        feats = feats.flatten(0, 1)
    return torch.matmul(feats, feats.transpose(-1, -2))


class GramLoss(nn.Module):
    """Mean squared error between the Gram matrices of the student's and the teacher's patch features.

    `apply_norm` L2-normalises each feature first (cosine similarities). `remove_neg` clips both matrices'
    negative entries to 0; `remove_only_teacher_neg` clips the teacher's, and the student's where the
    teacher's was negative too, which, as in Meta's (the teacher is clipped first), never happens: the
    student's negative entries are kept. At most one of the two may be set. `img_level` is accepted as Meta's
    constructor takes it; `forward`'s argument decides, as in Meta's. Meta's arguments and methods.
    """

    def __init__(
        self,
        apply_norm: bool = True,
        img_level: bool = True,
        remove_neg: bool = True,
        remove_only_teacher_neg: bool = False,
    ):
        super().__init__()
        if remove_neg and remove_only_teacher_neg:
            raise ValueError("GramLoss: remove_neg and remove_only_teacher_neg cannot both be set")
        self.mse_loss = nn.MSELoss()
        self.apply_norm = apply_norm
        self.remove_neg = remove_neg
        self.remove_only_teacher_neg = remove_only_teacher_neg

    def forward(self, output_feats: Tensor, target_feats: Tensor, img_level: bool = True) -> Tensor:
        """Student `output_feats` and teacher `target_feats`, `[batch, patches, dim]` (or `[tokens, dim]` when
        not `img_level`) -> the loss, a scalar. `img_level` compares each image's `[patches, patches]` Gram
        matrix; otherwise one `[tokens, tokens]` matrix over the whole (flattened) batch."""
        if img_level and (output_feats.dim() != 3 or target_feats.dim() != 3):
            raise ValueError("GramLoss: img_level needs [batch, patches, dim] features")
        target_sim = _similarities(target_feats, self.apply_norm, img_level)
        student_sim = _similarities(output_feats, self.apply_norm, img_level)
        if self.remove_neg:
            target_sim = target_sim.clamp(min=0.0)
            student_sim = student_sim.clamp(min=0.0)
        elif self.remove_only_teacher_neg:
            target_sim = target_sim.clamp(min=0.0)
        return self.mse_loss(student_sim, target_sim)
