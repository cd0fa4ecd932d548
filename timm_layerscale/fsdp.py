"""FSDP2 for models too large for one device's memory (the 7B): each block is one unit, then the root."""

from __future__ import annotations

from typing import Any

from torch import nn


def shard_model(model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
    """Shards `model` with FSDP2: `fully_shard` on every block, then on the model itself; returns it.

    A block's parameters are gathered in full only around its own forward and backward, so a rank's memory
    holds its shards plus the blocks in flight; the root unit holds the rest (tokens, patch embedding,
    norms, head).
    `fully_shard_kwargs` (`mesh`, `mp_policy`, `reshard_after_forward`, `offload_policy`) go to every call.

    A 7B never needs to exist whole on one rank: build it on the meta device, shard it, materialise the
    shards with a random init, then broadcast weights in this package's own keys (the `DST/model.safetensors`
    that `timm-ls convert SRC DST --to native` wrote) from rank 0; what the file lacks (a new head) keeps
    its init::

        model = timm.create_model("vit_ls_7b_patch16_dinov3", device="meta", num_classes=100)
        shard_model(model, mesh=init_device_mesh("cuda", (world_size,)))
        model.to_empty(device="cuda")
        model.init_weights()  # every parameter and buffer, RoPE periods and qkv bias masks included
        weights = safetensors.torch.load_file("vit7b/model.safetensors") if rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, weights, options=options)
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model
