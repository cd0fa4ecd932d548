"""The collectives the pretraining losses share: a no-op on one process, the default group or a given one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | None


def is_distributed() -> bool:
    """Whether a process group is initialised (torchrun, or `init_process_group` by hand)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: Group = None) -> int:
    """The number of ranks of `group` (the default group when None); 1 on one process."""
    return dist.get_world_size(group=group) if is_distributed() else 1


def rank(group: Group = None) -> int:
    """This process's rank in `group`; 0 on one process."""
    return dist.get_rank(group=group) if is_distributed() else 0


def all_reduce_(tensor: Tensor, group: Group = None, async_op: bool = False) -> dist.Work | None:
    """Sums `tensor` in place over the ranks of `group`; on one process leaves it as it is.

    Returns the pending work when `async_op` (wait on it before reading the tensor), else None."""
    if not is_distributed():
        return None
    return dist.all_reduce(tensor, group=group, async_op=async_op)


class _AllGather(torch.autograd.Function):
    """Every rank's tensor, concatenated; backward sums the gradient over the ranks and keeps this rank's rows
    (the gradient of every rank's loss with respect to this rank's input)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: Group) -> Tensor:
        ctx.group = group
        ctx.rank, ctx.world_size = rank(group), world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.world_size, dim=0)[ctx.rank], None


def all_gather_with_grad(tensor: Tensor, group: Group = None) -> Tensor:
    """Every rank's `tensor` (the same shape on each) concatenated on dim 0 in rank order; gradients flow back
    to each rank's own rows. On one process, `tensor` itself."""
    if not is_distributed():
        return tensor
    return _AllGather.apply(tensor, group)


def launched_by_torchrun() -> bool:
    """Whether this process was started by `torchrun` (or another launcher that sets its environment)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@contextmanager
def process_group_from_environment(device: torch.device) -> Iterator[None]:
    """Under `torchrun`: the default process group for the block (NCCL on CUDA, gloo otherwise), this rank on
    its local GPU; otherwise nothing."""
    if not launched_by_torchrun() or is_distributed():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
