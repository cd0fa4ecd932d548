"""The Kozachenko-Leonenko regulariser (Sablayrolles et al., 2018, "Spreading vectors for similarity search"):
pushes each feature away from its nearest neighbour, spreading the batch over the sphere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import Group, all_gather_with_grad, rank, world_size

PDIST_EPS = 1e-8  # Meta's PairwiseDistance eps: ||a - b + eps||


def _autocast_off(x: Tensor) -> torch.autocast:
    return torch.autocast(x.device.type, enabled=False)


class KoLeoLoss(nn.Module):
    """`-mean(log(||x_i - x_nn(i)|| + eps))` over the L2-normalised rows of a `[batch, dim]` tensor, each row's
    nearest neighbour taken among the other rows of this rank's batch. Meta's arguments and methods."""

    def __init__(self):
        super().__init__()
        self.pdist = nn.PairwiseDistance(2, eps=PDIST_EPS)

    @torch.no_grad()
    def pairwise_NNs_inner(self, x: Tensor) -> Tensor:  # Meta's name
        """Each unit row's nearest other row: the index of its largest inner product, itself excluded."""
        dots = torch.mm(x, x.t())
        dots.fill_diagonal_(-1)
        return torch.max(dots, dim=1).indices

    def forward(self, student_output: Tensor, eps: float = 1e-8) -> Tensor:
        """`student_output` `[batch, dim]` (the student's class tokens before the head) -> the loss, a scalar."""
        with _autocast_off(student_output):
            x = F.normalize(student_output, eps=eps, p=2, dim=-1)
            distances = self.pdist(x, x[self.pairwise_NNs_inner(x)])
            return -torch.log(distances + eps).mean()


class KoLeoLossDistributed(nn.Module):
    """KoLeo with neighbours drawn from the batch of every rank (or of `loss_group_size` samples: the group of
    adjacent ranks this rank falls into), over the `topk` nearest. Meta's arguments and methods;
    `process_group` (not Meta's) names the ranks gathered over."""

    def __init__(self, topk: int = 1, loss_group_size: int | None = None, *, process_group: Group = None):
        super().__init__()
        self.pdist = nn.PairwiseDistance(2, eps=PDIST_EPS)
        self.topk = topk
        self.loss_group_size = loss_group_size
        self.process_group = process_group

    @torch.no_grad()
    def pairwise_NNs_inner(self, x: Tensor, all_x: Tensor, rank: int) -> Tensor:  # Meta's name
        """The `topk` nearest rows of `all_x` to each row of `x`, where `x` is `all_x`'s `rank`-th block of
        rows (each row itself excluded)."""
        dots = torch.mm(x, all_x.t())
        local_batch = dots.shape[0]
        own = torch.arange(local_batch, device=dots.device)
        dots[own, own + rank * local_batch] = -1
        return torch.topk(dots, dim=1, k=self.topk).indices

    def neighbour_set(self, x: Tensor) -> tuple[Tensor, int]:
        """Every rank's normalised rows in this rank's loss group, and this rank's place in the group."""
        all_x = all_gather_with_grad(x, self.process_group)
        ranks = world_size(self.process_group)
        local_batch, global_batch = len(x), len(all_x)
        group_size = self.loss_group_size if self.loss_group_size is not None else global_batch
        if group_size % local_batch != 0:
            raise ValueError(f"Loss group size {group_size} must be a multiple of local batch size {local_batch}.")
        if global_batch % group_size != 0:
            raise ValueError(f"Global batch size {global_batch} must be divisible by loss group size {group_size}.")
        n_groups = global_batch // group_size
        ranks_per_group = ranks // n_groups
        this_rank = rank(self.process_group)
        grouped = all_x.view(n_groups, group_size, x.shape[1])[this_rank // ranks_per_group]
        return grouped, this_rank % ranks_per_group

    def forward(self, student_output: Tensor, eps: float = 1e-8) -> Tensor:
        """`student_output` `[local batch, dim]` -> the loss over this rank's rows, a scalar."""
        with _autocast_off(student_output):
            x = F.normalize(student_output, eps=eps, p=2, dim=-1)
            neighbours, rank_in_group = self.neighbour_set(x)
            indices = self.pairwise_NNs_inner(x, neighbours, rank_in_group)
            expanded = x.unsqueeze(1).repeat(1, self.topk, 1).flatten(0, 1)
            distances = self.pdist(expanded, neighbours[indices].flatten(0, 1))
            return -torch.log(distances.float() + eps).mean()
