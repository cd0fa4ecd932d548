"""Every command that builds a model from a checkpoint reads it one way (the identity rule): one checkpoint of each
layout, written by `convert` from one model, goes through convert, export, inspect, features and demo with the same
arguments, and features draws the same picture from each (the model each command built is the same model)."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from support import move_off_init_

from timm_ls.main import main

SHAPE = ["embed_dim=64", "num_heads=4", "depth=2"]
# (the variant, its arguments at test size, the layouts convert writes it to and every command reads back)
FAMILIES = {
    "dinov3": ("vit_ls_small_patch16_dinov3", {}, ["native", "meta", "meta-train", "hf", "timm"]),
    "sapiens2": ("vit_ls_base_patch16_sapiens2", {"num_kv_heads": [4, 2]}, ["native", "hf", "timm", "sapiens2"]),
}
SUFFIX = {"meta": ".pth", "sapiens2": ".safetensors"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def written(request, tmp_path_factory):
    """One model moved off its init, saved as a bare state dict, then converted to each layout."""
    name, extra, layouts = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    shape = dict(item.split("=") for item in SHAPE)
    model = timm.create_model(name, **{k: int(v) for k, v in shape.items()}, **extra)
    move_off_init_(model).eval()
    save_file(model.state_dict(), root / "bare.safetensors")
    kwargs = [*SHAPE, *(f"{k}={v}".replace(" ", "") for k, v in extra.items())]
    files = {}
    for layout in layouts:
        dst = root / f"as-{layout}{SUFFIX.get(layout, '')}"
        args = ["convert", str(root / "bare.safetensors"), str(dst), "--to", layout, "--model", name]
        assert main([*args, "--model-kwargs", *kwargs]) == 0, layout
        files[layout] = dst
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 80, 3), dtype=np.uint8)).save(root / "a.png")
    return root, name, kwargs, files


def test_every_command_reads_each_layout_and_features_draws_one_picture(written, tmp_path, capsys):
    root, name, _, files = written
    pictures = {}
    for layout, checkpoint in files.items():
        out = tmp_path / layout
        # The layouts that record the model (config.json) need nothing; the others its widths and depth alone (the
        # rest, Sapiens2's k/v heads per block included, the weights' keys and shapes tell).
        given = [] if layout in ("native", "hf", "timm") else ["--model-kwargs", *SHAPE]
        assert main(["features", str(root / "a.png"), "--checkpoint", str(checkpoint), "--out", str(out), *given]) == 0
        assert (
            main(
                [
                    "demo",
                    "--checkpoint",
                    str(checkpoint),
                    "--image",
                    str(root / "a.png"),
                    "--out",
                    str(out / "demo"),
                    *given,
                ]
            )
            == 0
        )
        assert main(["inspect", str(checkpoint)]) == 0
        assert main(["export", str(checkpoint), str(out / "model.onnx"), *given]) == 0
        assert main(["convert", str(checkpoint), str(out / "back"), "--to", "native", *given]) == 0
        printed = capsys.readouterr().out
        if layout == "native":  # it records the variant; the others are the registered variant nearest their shapes
            assert f"model: {name}" in printed, (layout, printed)
        pictures[layout] = np.asarray(Image.open(out / "a_pca.png"))
    first = pictures["native"]
    for layout, picture in pictures.items():
        assert picture.shape == first.shape and np.abs(picture.astype(int) - first).max() <= 1, layout
    assert first[:, 80:].std() > 10  # the colours vary: a constant picture would pass the comparison


def test_a_checkpoint_without_a_record_and_no_shape_is_one_line_naming_the_arguments(written, tmp_path, capsys):
    root, _, _, files = written
    for layout in ("meta", "sapiens2"):
        if layout not in files:
            continue
        args = ["features", str(root / "a.png"), "--checkpoint", str(files[layout]), "--out", str(tmp_path / "out")]
        assert main(args) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert "--model-kwargs" in err or "--model" in err, err
        assert not (tmp_path / "out").exists()
