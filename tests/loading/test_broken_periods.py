"""RoPE periods that are NaN, infinite, zero or negative make every output NaN: a checkpoint holding them is
refused in one line naming the tensor, by the commands and by every way a model loads weights, in DINOv3's keys
and in Sapiens2's (whose bf16 RoPE must not be blamed instead)."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from timm_layerscale.checkpoints import CheckpointError
from timm_layerscale.convert import convert_checkpoint
from timm_ls.main import main

TINY = dict(embed_dim=64, num_heads=4, depth=2)
FAMILIES = {
    "dinov3": ("vit_ls_small_patch16_dinov3", TINY, "native"),
    "sapiens2": ("vit_ls_base_patch16_sapiens2", {**TINY, "num_kv_heads": [4, 2]}, "sapiens2"),
}
BROKEN = {
    "nan": (float("nan"), "holds NaN (1 of 4)"),
    "inf": (float("inf"), "holds Inf (1 of 4)"),
    "zero": (0.0, "holds zero or negative (1 of 4)"),
    "negative": (-3.0, "holds zero or negative (1 of 4)"),
}


def broken_file(tmp_path, family: str, value: float):
    name, kwargs, to = FAMILIES[family]
    model = timm.create_model(name, **kwargs, num_classes=0)
    good = tmp_path / "good.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, good)
    path = tmp_path / f"{family}.safetensors"
    if to == "native":
        state = load_file(good)
    else:
        state = load_file(
            convert_checkpoint(good, tmp_path / "keys.safetensors", to=to, model=name, model_kwargs=kwargs).destination
        )
    state["rope_embed.periods"] = state["rope_embed.periods"].clone()
    state["rope_embed.periods"][2] = value
    save_file(state, path)
    return path, name, kwargs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", BROKEN)
def test_the_commands_refuse_broken_periods_in_one_line(family, case, tmp_path, capsys):
    value, words = BROKEN[case]
    path, _, kwargs = broken_file(tmp_path, family, value)
    size = [f"{k}={v}" for k, v in kwargs.items() if k != "num_kv_heads"]
    convert = ["convert", str(path), str(tmp_path / "out"), "--to", "native", "--model-kwargs", *size]
    for argv in (convert, ["export", str(path), str(tmp_path / "out.onnx"), *convert[-4:]]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith("timm-ls: error: ") and "Traceback" not in err, err
        assert f"rope_embed.periods {words}" in err and "rope_dtype" not in err, err
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_never_loads_broken_periods(family, tmp_path):
    path, name, kwargs = broken_file(tmp_path, family, float("nan"))
    with pytest.raises(CheckpointError, match=r"rope_embed.periods holds NaN"):
        timm.create_model(name, **kwargs, num_classes=0, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    model = timm.create_model(name, **kwargs, num_classes=0)
    with pytest.raises(CheckpointError, match=r"rope_embed.periods holds NaN"):
        model.load_state_dict(load_file(path))
    assert bool(torch.isfinite(model.rope_embed.periods).all())


def test_sound_periods_still_load(tmp_path):
    """The check refuses only what is broken: the same file with its periods untouched loads and runs."""
    path, name, kwargs = broken_file(tmp_path, "sapiens2", 1.0)
    model = timm.create_model(
        name, **kwargs, num_classes=0, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))
    )
    assert model.rope_embed.periods[2] == 1.0
    assert bool(torch.isfinite(model(torch.randn(1, 3, 32, 32))).all())
