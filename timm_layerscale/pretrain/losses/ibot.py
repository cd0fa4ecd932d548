"""iBOT's loss on masked patch tokens: the student's softmax against the teacher's centred assignments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..distributed import Group, all_reduce_
from .centring import CentredTeacher
from .sinkhorn import sinkhorn_knopp


def patch_cross_entropy(teacher: Tensor, student: Tensor, student_temp: float) -> Tensor:
    """`sum(teacher * log_softmax(student / student_temp))` over the last dim, in fp32 (the negative loss)."""
    return torch.sum(teacher.float() * F.log_softmax(student.float() / student_temp, dim=-1), dim=-1)


class iBOTPatchLoss(CentredTeacher):  # Meta's name
    """Cross-entropy between the teacher's probabilities and the student's softmax at `student_temp` over
    `patch_out_dim` prototypes, on the patches masked in the student's input; each image's masked patches
    weigh `1 / (its masked count)`, so every masked image counts the same.

    Meta's arguments and methods; `process_group` (not Meta's) names the ranks the centring reduces over.
    """

    def __init__(
        self,
        patch_out_dim: int,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        *,
        process_group: Group = None,
    ):
        super().__init__((1, 1, patch_out_dim), center_momentum, process_group)
        self.student_temp = student_temp

    @torch.no_grad()
    def sinkhorn_knopp_teacher(
        self,
        teacher_output: Tensor,
        teacher_temp: float,
        n_masked_patches_tensor: Tensor,
        n_iterations: int = 3,
    ) -> Tensor:
        """`[masked patches, patch_out_dim]` teacher logits -> assignments (rows sum to 1), balanced over the
        masked patches of every rank: `n_masked_patches_tensor` (this rank's count, a one-element tensor) is
        summed over the ranks; the caller's tensor is left as it is."""
        n_samples = n_masked_patches_tensor.clone()
        all_reduce_(n_samples, self.process_group)
        return sinkhorn_knopp(teacher_output, teacher_temp, n_samples, n_iterations, self.process_group)

    def batch_center_sum(self, teacher_output: Tensor) -> Tensor:
        return torch.sum(teacher_output.mean(1), dim=0, keepdim=True)

    def forward(self, student_patch_tokens: Tensor, teacher_patch_tokens: Tensor, student_masks_flat: Tensor) -> Tensor:
        """Dense form: `[batch, patches, patch_out_dim]` student logits and teacher probabilities, `[batch,
        patches]` masks -> the mean over images of each image's mean loss over its masked patches (an image with
        none adds 0)."""
        per_patch = patch_cross_entropy(teacher_patch_tokens, student_patch_tokens, self.student_temp)
        masks = student_masks_flat.float()
        per_image = torch.sum(per_patch * masks, dim=-1) / student_masks_flat.sum(dim=-1).clamp(min=1.0)
        return -per_image.mean()

    def forward_masked(
        self,
        student_patch_tokens_masked: Tensor,
        teacher_patch_tokens_masked: Tensor,
        student_masks_flat: Tensor,
        n_masked_patches: int | None = None,
        masks_weight: Tensor | None = None,
    ) -> Tensor:
        """Gathered form: `[masked patches, patch_out_dim]` rows, in the order of `student_masks_flat`'s True
        entries (`[batch, patches]` bool) -> the same value as `forward`. `masks_weight` (one weight a row, as
        the collate makes it) defaults to `1 / (the row's image's masked count)`; `n_masked_patches` keeps the
        first rows only (the rest padding)."""
        per_patch = patch_cross_entropy(teacher_patch_tokens_masked, student_patch_tokens_masked, self.student_temp)
        if masks_weight is None:
            counts = student_masks_flat.sum(-1).clamp(min=1.0)
            masks_weight = (1 / counts).unsqueeze(-1).expand_as(student_masks_flat)[student_masks_flat]
        if n_masked_patches is not None:
            per_patch = per_patch[:n_masked_patches]
        return -(per_patch * masks_weight).sum() / student_masks_flat.shape[0]
