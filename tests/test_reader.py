"""The lazy reader: which weights set a checkpoint gives, and that it reads tensors one key at a time."""

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from timm_layerscale.conversion import CheckpointError
from timm_layerscale.conversion.reader import open_checkpoint


def backbone(value: float) -> dict[str, torch.Tensor]:
    return {"cls_token": torch.full((1, 1, 8), value), "blocks.0.ls1.gamma": torch.full((8,), value)}


def prefixed(prefix: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in sd.items()}


@pytest.mark.parametrize(
    ("weights", "taken", "value"),
    [("auto", "state_dict_ema", 2.0), ("ema", "state_dict_ema", 2.0), ("raw", "state_dict", 1.0)],
)
def test_timm_training_checkpoint_sets(tmp_path, weights, taken, value):
    path = tmp_path / "last.pth.tar"
    optimizer = {"state": {0: {"exp_avg": torch.zeros(8)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    args = argparse.Namespace(model="vit_ls_small_patch16_dinov3", lr=0.1)
    checkpoint = {"epoch": 3, "args": args, "optimizer": optimizer}
    torch.save({**checkpoint, "state_dict": backbone(1.0), "state_dict_ema": backbone(2.0)}, path)
    with open_checkpoint(path, weights) as ckpt:
        assert (ckpt.kind, ckpt.weights) == ("torch file", taken)
        assert sorted(ckpt) == ["blocks.0.ls1.gamma", "cls_token"]
        assert ckpt.info("cls_token").shape == (1, 1, 8)
        assert torch.equal(ckpt["blocks.0.ls1.gamma"], torch.full((8,), value))


@pytest.mark.parametrize(("weights", "taken", "value"), [("auto", "model_ema", 3.0), ("raw", "student", 1.0)])
def test_meta_training_sets_flat_in_safetensors(tmp_path, weights, taken, value):
    heads = {"dino_head.mlp.0.weight": torch.zeros(4, 8)}
    flat = {
        **prefixed("student.backbone.", {**backbone(1.0), **heads}),
        **prefixed("teacher.backbone.", backbone(2.0)),
        **prefixed("model_ema.backbone.", backbone(3.0)),
        "dino_loss.center": torch.zeros(1, 4),
    }
    save_file(flat, tmp_path / "ckpt.safetensors")
    with open_checkpoint(tmp_path / "ckpt.safetensors", weights) as ckpt:
        assert (ckpt.kind, ckpt.weights) == ("safetensors file", taken)
        assert sorted(ckpt) == ["blocks.0.ls1.gamma", "cls_token"]
        assert torch.equal(ckpt["cls_token"], torch.full((1, 1, 8), value))


def test_plain_state_dict_keeps_keys_that_look_like_set_names(tmp_path):
    """transformers files put blocks under `model.layer.`: that is not a `model` weights set."""
    sd = {"embeddings.cls_token": torch.zeros(1, 1, 8), "model.layer.0.norm1.weight": torch.ones(8)}
    save_file(sd, tmp_path / "hf.safetensors")
    with open_checkpoint(tmp_path / "hf.safetensors") as ckpt:
        assert ckpt.weights == "the only weights set"
        assert sorted(ckpt) == sorted(sd)


def test_ddp_and_compile_prefixes_are_stripped():
    ckpt = open_checkpoint(prefixed("module._orig_mod.", backbone(1.0)))
    assert sorted(ckpt) == ["blocks.0.ls1.gamma", "cls_token"]


def test_ema_requested_but_absent_is_an_error(tmp_path):
    save_file(backbone(1.0), tmp_path / "plain.safetensors")
    with pytest.raises(CheckpointError, match="holds no EMA or teacher weights; pass --weights raw"):
        open_checkpoint(tmp_path / "plain.safetensors", "ema")


def test_torch_files_are_memory_mapped(tmp_path):
    torch.save(backbone(1.0), tmp_path / "plain.pth")
    with open_checkpoint(tmp_path / "plain.pth") as ckpt:
        address = ckpt["cls_token"].data_ptr()
        assert any(
            address in r for r in mapped_ranges(tmp_path / "plain.pth")
        )  # a view of the file's pages, not a copy


def mapped_ranges(path) -> list[range]:
    """Address ranges at which this process maps `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        if name.strip() == str(path):
            start, end = (int(a, 16) for a in span.split("-"))
            ranges.append(range(start, end))
    return ranges
