"""Sinkhorn-Knopp centring of a teacher's logits, as DINOv3 (and SwAV before it) computes it."""

from __future__ import annotations

import torch
from torch import Tensor

from ..distributed import Group, all_reduce_


@torch.no_grad()
def sinkhorn_knopp(
    teacher_output: Tensor,
    teacher_temp: float,
    n_samples: int | Tensor,
    n_iterations: int = 3,
    group: Group = None,
) -> Tensor:
    """Soft assignments of samples to prototypes, balanced over the prototypes across every rank.

    `teacher_output` is this rank's `[samples, prototypes]` logits; `n_samples` is the number of samples on all
    ranks together. `exp(logits / teacher_temp)` is scaled to a total of 1, then `n_iterations` times each
    prototype's total (a sum over every rank) is set to `1 / prototypes` and each sample's to `1 / n_samples`.
    The result is fp32, `[samples, prototypes]`, each row summing to 1; each column sums to
    `n_samples / prototypes` over the ranks, up to the last row step's residue.
    """
    q = torch.exp(teacher_output.float() / teacher_temp).t()  # prototypes x samples
    n_prototypes = q.shape[0]
    total = torch.sum(q)
    all_reduce_(total, group)
    q /= total
    for _ in range(n_iterations):
        per_prototype = torch.sum(q, dim=1, keepdim=True)
        all_reduce_(per_prototype, group)
        q /= per_prototype
        q /= n_prototypes
        q /= torch.sum(q, dim=0, keepdim=True)
        q /= n_samples
    q *= n_samples
    return q.t()
