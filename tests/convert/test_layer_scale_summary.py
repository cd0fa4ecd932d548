"""The LayerScale line of a conversion says what happened to the gammas, true of the variant asked for as of the
model written: a checkpoint without gammas builds its model with LayerScale off, and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file
from support import TINY, move_off_init_
from support.families import FAMILIES

from timm_layerscale import open_checkpoint
from timm_ls.main import main

SAPIENS2 = {k: v for k, v in FAMILIES["sapiens2"][0].items() if k != "init_values"}


def kwargs_args(kwargs: dict) -> list[str]:
    return ["--model-kwargs", *(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in kwargs.items())]


@pytest.mark.parametrize(
    ("name", "kwargs", "branches"),
    [
        ("vit_ls_small_patch16_dinov3", TINY, "attention and MLP"),
        ("vit_ls_base_patch16_sapiens2", SAPIENS2, "attention"),
    ],
)
def test_a_checkpoint_without_gammas_says_its_model_is_built_without(
    tmp_path: Path, capsys, name, kwargs, branches
) -> None:
    trained = move_off_init_(timm.create_model(name, num_classes=0, **kwargs, init_values=0))
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, tmp_path / "nogammas.safetensors")
    args = ["convert", str(tmp_path / "nogammas.safetensors"), str(tmp_path / "out"), "--to", "native"]
    assert main([*args, "--model", name, *kwargs_args(kwargs)]) == 0
    out = capsys.readouterr().out
    assert (
        f"  LayerScale: none in the checkpoint, so the model is built with it off (its variant has it on "
        f"{branches}); its outputs are the checkpoint's\n" in out
    ), out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_args"]["init_values"] == 0
    written = timm.create_model(config["architecture"], **config["model_args"])  # the model the folder says
    with open_checkpoint(tmp_path / "out") as ckpt:
        written.load_state_dict({key: ckpt[key] for key in ckpt})
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(written.eval()(images), trained.eval()(images), rtol=0, atol=0)


def test_a_model_without_layer_scale_in_both_says_off_in_both(tmp_path: Path, capsys) -> None:
    """A YAML variant with LayerScale off: nothing was turned off, and the line says so."""
    variant = tmp_path / "vit_off.yaml"
    variant.write_text("base: vit_ls_small_patch16_dinov3\nmodel:\n  init_values: 0\n")
    trained = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=0, **TINY, init_values=0))
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, tmp_path / "nogammas.safetensors")
    args = ["convert", str(tmp_path / "nogammas.safetensors"), str(tmp_path / "out"), "--to", "native"]
    assert main([*args, "--model", str(variant), *kwargs_args(TINY)]) == 0
    assert "  LayerScale: off in both checkpoint and model\n" in capsys.readouterr().out
