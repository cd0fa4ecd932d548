"""The running centre a teacher's logits are softmaxed around (DINO's original centring, Meta's
`softmax_center_teacher`), shared by the class-token and patch losses."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import Group, all_reduce_, world_size


class CentredTeacher(nn.Module):
    """A `center` buffer of shape `center_shape`, updated as an exponential moving average of the teacher's
    mean output over every rank: `center = center * center_momentum + batch_mean * (1 - center_momentum)`.

    The update is split as Meta's: `update_center` starts the sum over the ranks (asynchronously) and
    `apply_center_update` (called by `softmax_center_teacher`) waits for it and moves the centre, so the
    reduction overlaps the student's forward. The centre starts as NaN, as Meta's, until `init_weights`.
    """

    def __init__(self, center_shape: tuple[int, ...], center_momentum: float, process_group: Group = None):
        super().__init__()
        self.center_momentum = center_momentum
        self.process_group = process_group
        self.register_buffer("center", torch.full(center_shape, math.nan))
        self.updated = True
        self.reduce_handle = None
        self.async_batch_center: Tensor | None = None
        self.n_batch_items = 0

    def init_weights(self) -> None:
        """Zeroes the centre (Meta's trainer calls this once, before the first step)."""
        self.center.zero_()

    @torch.no_grad()
    def softmax_center_teacher(
        self, teacher_output: Tensor, teacher_temp: float, update_centers: bool = True
    ) -> Tensor:
        """`softmax((teacher_output - center) / teacher_temp)` over the last dim, after applying a pending update
        of the centre when `update_centers`."""
        if update_centers:
            self.apply_center_update()
        return F.softmax((teacher_output - self.center) / teacher_temp, dim=-1)

    def batch_center_sum(self, teacher_output: Tensor) -> Tensor:
        """This rank's sum of the teacher's outputs, shaped as the centre."""
        raise NotImplementedError

    @torch.no_grad()
    def update_center(self, teacher_output: Tensor) -> None:
        """Starts an update of the centre from this batch (applied by the next `apply_center_update`)."""
        self.reduce_center_update(teacher_output)

    @torch.no_grad()
    def reduce_center_update(self, teacher_output: Tensor) -> None:
        self.updated = False
        self.n_batch_items = len(teacher_output)
        self.async_batch_center = self.batch_center_sum(teacher_output)
        self.reduce_handle = all_reduce_(self.async_batch_center, self.process_group, async_op=True)

    @torch.no_grad()
    def apply_center_update(self) -> None:
        if self.updated:
            return
        if self.reduce_handle is not None:
            self.reduce_handle.wait()
            self.reduce_handle = None
        batch_center = self.async_batch_center / (self.n_batch_items * world_size(self.process_group))
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)
        self.updated = True
