"""DistributedDataParallel as timm's train.py uses it (no find_unused_parameters): two CPU processes."""

import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support import free_port
from torch.nn.parallel import DistributedDataParallel

import timm_layerscale  # noqa: F401


def train_two_steps(rank: int, port: int, kwargs: dict, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = timm.create_model("vit_ls_small_patch16_dinov3", embed_dim=64, num_heads=4, depth=2, **kwargs)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for _ in range(2):
        ddp(torch.randn(4, 3, 32, 32)).square().mean().backward()  # raises if a parameter got no gradient
        optimizer.step()
        optimizer.zero_grad()
    results[rank] = model.blocks[0].ls1.gamma.detach().clone()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_classes=3, local_cls_norm=True, cls_norm=True),
        dict(num_classes=3, drop_path_rate=0.5, stochastic_depth="sample_drop"),
    ],
)
def test_ddp_without_find_unused_parameters(kwargs):
    results = mp.Manager().dict()
    mp.spawn(train_two_steps, args=(free_port(), kwargs, results), nprocs=2, join=True)
    assert torch.equal(results[0], results[1])  # gradients were reduced across both ranks
    assert not torch.equal(results[0], torch.full((64,), 1e-5))
