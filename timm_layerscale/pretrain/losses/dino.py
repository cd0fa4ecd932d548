"""DINO's loss on the class token: the student's softmax against the teacher's centred assignments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..distributed import Group, world_size
from .centring import CentredTeacher
from .sinkhorn import sinkhorn_knopp


class DINOLoss(CentredTeacher):
    """Cross-entropy between the teacher's probabilities and the student's softmax at `student_temp`, over
    `out_dim` prototypes, averaged over every (student crop, teacher crop) pair of a sample.

    The teacher's probabilities come from `sinkhorn_knopp_teacher` (DINOv3's centring) or from
    `softmax_center_teacher` (a running centre with `center_momentum`, DINO's original centring).
    Meta's arguments and methods; `process_group` (not Meta's) names the ranks the centring reduces over
    (the default group when None).
    """

    def __init__(
        self,
        out_dim: int,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        *,
        process_group: Group = None,
    ):
        super().__init__((1, out_dim), center_momentum, process_group)
        self.student_temp = student_temp

    @torch.no_grad()
    def sinkhorn_knopp_teacher(self, teacher_output: Tensor, teacher_temp: float, n_iterations: int = 3) -> Tensor:
        """`[samples, out_dim]` teacher logits -> assignments (rows sum to 1), balanced over every rank's samples
        (this rank's count times the world size)."""
        n_samples = teacher_output.shape[0] * world_size(self.process_group)
        return sinkhorn_knopp(teacher_output, teacher_temp, n_samples, n_iterations, self.process_group)

    def batch_center_sum(self, teacher_output: Tensor) -> Tensor:
        return torch.sum(teacher_output, dim=0, keepdim=True)

    def forward(self, student_logits: Tensor, teacher_probs: Tensor, ignore_diagonal: bool = False) -> Tensor:
        """`student_logits` `[student crops, batch, out_dim]`, `teacher_probs` `[teacher crops, batch, out_dim]`
        (each row summing to 1) -> the mean of `-sum(teacher * log_softmax(student / student_temp))` over every
        sample and crop pair; with `ignore_diagonal`, the pairs of a crop with itself (crop i of both, for i
        below the smaller crop count) are left out of the sum and the count."""
        student_crops, batch, _ = student_logits.shape
        teacher_crops = teacher_probs.shape[0]
        log_probs = F.log_softmax(student_logits.float() / self.student_temp, dim=-1)
        if not ignore_diagonal:
            loss = -torch.einsum("sbk,tbk->", log_probs, teacher_probs)
            return loss / (batch * student_crops * teacher_crops)
        per_pair = -torch.einsum("sbk,tbk->st", log_probs, teacher_probs)
        diagonal = min(student_crops, teacher_crops)
        per_pair = torch.diagonal_scatter(per_pair, per_pair.new_zeros(diagonal))
        return per_pair.sum() / (batch * student_crops * teacher_crops - batch * diagonal)
