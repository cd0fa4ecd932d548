"""The EMA teacher of DINOv3's training: each teacher parameter moves toward its student's by `1 - momentum`."""

from __future__ import annotations

import torch
from torch import nn


class EmaTeacher:
    """Pairs a teacher's parameters with a student's of the same names, once, and updates them as Meta's
    `SSLMetaArch.update_ema` does: `teacher = teacher * m + student * (1 - m)`, all tensors in one foreach call.

    The teacher's buffers are not averaged (Meta's are not either): the BatchNorm statistics of a head with
    `use_bn`, say, stay the teacher's own.
    """

    def __init__(self, teacher: nn.Module, student: nn.Module) -> None:
        teacher_params = dict(teacher.named_parameters())
        student_params = dict(student.named_parameters())
        if teacher_params.keys() != student_params.keys():
            only = sorted(teacher_params.keys() ^ student_params.keys())
            raise ValueError(f"the teacher and the student differ in their parameters ({', '.join(only[:3])}, ...)")
        for name, param in teacher_params.items():
            if param.shape != student_params[name].shape:
                raise ValueError(f"{name}: the teacher's {tuple(param.shape)} against the student's shape")
        self.teacher = [teacher_params[name] for name in teacher_params]
        self.student = [student_params[name] for name in teacher_params]

    @torch.no_grad()
    def update(self, momentum: float) -> None:
        torch._foreach_mul_(self.teacher, momentum)
        torch._foreach_add_(self.teacher, self.student, alpha=1 - momentum)
