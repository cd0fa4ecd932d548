"""FSDP2 through `shard_model`: two gloo processes on CPU train exactly like one process on their joint batch."""

import socket

import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support import TINY, assert_fp32_close, move_off_init_
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from timm_layerscale import shard_model

NAME = "vit_ls_small_patch16_dinov3"
KWARGS = dict(TINY, num_classes=3)
STEPS = 3


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 3, (4,), generator=generator))] * STEPS


def train(model, optimizer, rank: int | None = None) -> None:
    for images, labels in batches():
        if rank is not None:  # each rank its half of the batch
            images, labels = images[2 * rank : 2 * rank + 2], labels[2 * rank : 2 * rank + 2]
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()


def full(model) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def worker(rank: int, port: int, backbone_file: str, results) -> None:
    """The documented 7B recipe at tiny size: meta device, shard, materialise, init, broadcast weights."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = timm.create_model(NAME, device="meta", **KWARGS)
    shard_model(model, mesh=init_device_mesh("cpu", (2,)))
    model.to_empty(device="cpu")
    model.init_weights()
    weights = load_file(backbone_file) if rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    initial = full(model)
    gamma = model.blocks[0].ls1.gamma
    sharded = isinstance(gamma, DTensor) and gamma.placements == (Shard(0),) and gamma.to_local().shape == (32,)
    layout = [isinstance(m, FSDPModule) for m in (model, *model.blocks, model.patch_embed, model.head)]
    train(model.train(), torch.optim.SGD(model.parameters(), lr=0.5), rank)
    final = full(model)  # collective: every rank gathers
    results[rank] = dict(
        layout=layout,
        gamma_sharded=sharded,
        gamma=gamma.full_tensor().detach().clone(),
        **(dict(initial=initial, final=final) if rank == 0 else {}),
    )
    dist.destroy_process_group()


def run_two_ranks(tmp_path) -> tuple[dict, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    source = move_off_init_(timm.create_model(NAME, **TINY))  # a backbone file: no head
    save_file(source.state_dict(), tmp_path / "backbone.safetensors")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(worker, args=(port, str(tmp_path / "backbone.safetensors"), results), nprocs=2, join=True)
    return dict(results), source.state_dict()


def test_shard_model_trains_like_one_process_on_the_joint_batch(tmp_path):
    results, backbone = run_two_ranks(tmp_path)
    first, second = results[0], results[1]
    assert first["layout"] == [True, True, True, False, False]  # each block a unit, then the root
    assert first["gamma_sharded"] and second["gamma_sharded"]
    initial = first["initial"]
    assert all(torch.equal(initial[k], v) for k, v in backbone.items())  # the broadcast weights, on every shard
    assert initial["head.weight"].abs().sum() > 0  # a key the file lacks keeps its init

    reference = timm.create_model(NAME, **KWARGS)
    reference.load_state_dict(initial)
    train(reference.train(), torch.optim.SGD(reference.parameters(), lr=0.5))
    final = first["final"]
    for key, value in reference.state_dict().items():
        assert_fp32_close(final[key], value, what=key)
    assert torch.equal(first["gamma"], second["gamma"])  # the ranks agree
    assert not torch.allclose(first["gamma"], backbone["blocks.0.ls1.gamma"])  # and the gammas trained
