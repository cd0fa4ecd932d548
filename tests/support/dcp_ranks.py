"""One rank of a sharded save, as Meta's DINOv3 training writes its checkpoints with FSDP2.

`python dcp_ranks.py STATE.pt OUT_DIR ...` (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) loads each
state (a nested dict of tensors and plain values), shards every tensor on dim 0 across the ranks as a DTensor
(what `fully_shard` does to parameters) and saves it with `torch.distributed.checkpoint` to OUT_DIR.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(tree):
        if isinstance(tree, dict):
            return {k: shard(v) for k, v in tree.items()}
        if isinstance(tree, torch.Tensor):
            return distribute_tensor(tree, mesh, [Shard(0) if tree.ndim else Replicate()])
        return tree

    args = sys.argv[1:]
    for state_file, out in zip(args[::2], args[1::2]):
        dcp.save(shard(torch.load(state_file, weights_only=True)), storage_writer=dcp.FileSystemWriter(out))
    dist.barrier()  # both ranks' files are complete


if __name__ == "__main__":
    main()
    # Leave without tearing gloo down: its teardown at exit sometimes aborts ("terminate called without an
    # active exception") after the work is done, which would fail a save that succeeded.
    os._exit(0)
