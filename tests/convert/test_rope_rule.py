"""One rule for targets whose code computes RoPE in fp32 (transformers, timm's eva, Meta's hub builders) given a
model computing it in bf16 (Sapiens2 as released): the target is written with one line on stderr saying so and
how far the outputs move, measured on the model; --strict refuses each in one line; the targets that keep bf16
RoPE say nothing. The figure is checked against what transformers and timm's eva compute from the files."""

from __future__ import annotations

import re

import pytest
import timm
import torch
from safetensors.torch import save_file
from support import move_off_init_, relative_diff
from support.families import EVA_HAS_FAMILIES
from transformers import Sapiens2Model

from timm_layerscale.checkpoints.formats import FORMATS
from timm_layerscale.convert import rope_measure_images
from timm_layerscale.families import FAMILIES, ROPE_FP32
from timm_ls.main import main

SAPIENS2 = "vit_ls_base_patch16_sapiens2"
DINOV3 = "vit_ls_small_patch16_dinov3"
SHAPE = ["embed_dim=64", "num_heads=4", "depth=4"]
# Each registered format: whether its target computes RoPE in fp32 whatever the model computes it in, and the
# family of bf16-RoPE model it is tried with (Meta's formats hold DINOv3's layout only).
TARGETS = {
    "native": (False, "sapiens2"),
    "sapiens2": (False, "sapiens2"),
    "hf": (True, "sapiens2"),
    "timm": (True, "sapiens2"),
    "meta": (True, "dinov3"),
    "meta-train": (False, "dinov3"),  # Meta's build_model computes RoPE in bf16 whatever its YAML says
}
DESTINATIONS = {"meta": "out.pth", "meta-train": "out.pth", "sapiens2": "out.safetensors"}
IMAGE = torch.randn(1, 3, 96, 64, generator=torch.Generator().manual_seed(3))
MOVED = re.compile(r"outputs move there by (\d\.\de-\d\d) relative \(measured on this model, 4 images at 128x128\)")


def bf16_rope_model(family: str) -> torch.nn.Module:
    """A small bf16-RoPE model of `family`, every weight moved off its init."""
    torch.manual_seed(0)
    if family == "sapiens2":  # the variant's own rope_dtype: bf16, as Sapiens2's released code
        model = timm.create_model(SAPIENS2, embed_dim=64, num_heads=4, depth=4, num_kv_heads=[4, 2, 2, 4])
    else:
        model = timm.create_model(DINOV3, embed_dim=64, num_heads=4, depth=4, rope_dtype="bf16")
    assert model.config.rope_dtype == "bf16"
    return move_off_init_(model.eval())


def source_file(tmp_path, family: str) -> tuple[str, list[str], torch.nn.Module]:
    model = bf16_rope_model(family)
    path = tmp_path / f"{family}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return str(path), ["--model", SAPIENS2 if family == "sapiens2" else DINOV3, "--model-kwargs", *SHAPE], model


def convert(tmp_path, capsys, to: str, *extra: str, family: str | None = None):
    family = family or TARGETS[to][1]
    src, args, model = source_file(tmp_path, family)
    if family == "dinov3":  # the variant computes RoPE in fp32 unless told
        args = [*args, "rope_dtype=bf16"]
    dst = tmp_path / DESTINATIONS.get(to, "out")
    code = main(["convert", src, str(dst), "--to", to, *args, *extra])
    return code, capsys.readouterr().err, dst, model


def test_every_format_is_classified():
    assert set(TARGETS) == set(FORMATS), "classify a new format's RoPE in TARGETS"
    in_fp32 = {name for record in FAMILIES.values() for name, held in record.formats.items() if held.rope == ROPE_FP32}
    assert {name for name, (fp32, _) in TARGETS.items() if fp32} == in_fp32


@pytest.mark.parametrize("to", [name for name, (fp32, _) in TARGETS.items() if fp32])
def test_a_target_computing_rope_in_fp32_is_written_with_one_line_saying_how_far_outputs_move(to, tmp_path, capsys):
    if to == "timm" and not EVA_HAS_FAMILIES:
        pytest.skip("this timm's eva has no Sapiens2 (1.0.31 has)")
    code, err, dst, _ = convert(tmp_path, capsys, to)
    assert code == 0 and dst.exists(), err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("timm-ls: warning: RoPE is computed in fp32 by "), err
    assert f"--to {to} writes it" in err and "rope_dtype=bf16" in err and "--to native" in err, err
    assert 1e-5 < float(MOVED.search(err).group(1)) < 1e-1, err


@pytest.mark.parametrize("to", [name for name, (fp32, _) in TARGETS.items() if fp32])
def test_strict_refuses_every_target_computing_rope_in_fp32_in_one_line(to, tmp_path, capsys):
    code, err, dst, _ = convert(tmp_path, capsys, to, "--strict")
    assert code == 2 and err.count("\n") == 1 and err.startswith("timm-ls: error: RoPE is computed in fp32"), err
    assert "--strict refuses" in err and "Traceback" not in err and MOVED.search(err), err
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == [f"{TARGETS[to][1]}.safetensors"]


@pytest.mark.parametrize("to", [name for name, (fp32, _) in TARGETS.items() if not fp32])
def test_a_target_keeping_bf16_rope_says_nothing_of_it(to, tmp_path, capsys):
    code, err, dst, _ = convert(tmp_path, capsys, to, "--strict")
    assert code == 0 and dst.exists() and "RoPE" not in err, err


def assert_the_figure_is_theirs(err: str, model: torch.nn.Module, theirs) -> None:
    """The stated figure is what their model moves on the very images it was measured on (to its two digits),
    and, within 3x, on other images of another size."""
    stated = float(MOVED.search(err).group(1))
    measured = rope_measure_images(model.config)
    actual = relative_diff(theirs(measured), model.forward_features(measured))
    assert abs(actual - stated) <= 0.06 * stated, (stated, actual)  # two digits: within 5% of 1.0e-N
    other = torch.randn(4, 3, 96, 64, generator=torch.Generator().manual_seed(3))
    assert stated / 3 < relative_diff(theirs(other), model.forward_features(other)) < stated * 3, stated


@torch.no_grad()
def test_the_figure_is_what_transformers_computes_from_the_file(tmp_path, capsys):
    code, err, dst, model = convert(tmp_path, capsys, "hf")
    assert code == 0, err
    sapiens2 = Sapiens2Model.from_pretrained(dst).eval()
    assert_the_figure_is_theirs(err, model, lambda x: sapiens2(pixel_values=x).last_hidden_state)
    assert main(["convert", str(dst), str(tmp_path / "back"), "--to", "native"]) == 0  # read back: RoPE in fp32
    in_fp32 = timm.create_model(f"local-dir:{tmp_path / 'back'}", pretrained=True).eval()
    assert in_fp32.config.rope_dtype == "fp32"
    assert relative_diff(sapiens2(pixel_values=IMAGE).last_hidden_state, in_fp32.forward_features(IMAGE)) < 1e-5


@pytest.mark.skipif(not EVA_HAS_FAMILIES, reason="this timm's eva has no Sapiens2 (1.0.31 has)")
@torch.no_grad()
def test_the_figure_is_what_timms_eva_computes_from_the_file(tmp_path, capsys):
    code, err, dst, model = convert(tmp_path, capsys, "timm")
    assert code == 0, err
    eva = timm.create_model(f"local-dir:{dst}", pretrained=True).eval()
    assert type(eva).__name__ == "Eva"
    assert_the_figure_is_theirs(err, model, eva.forward_features)


def test_metas_refusal_names_only_targets_that_take_the_model(tmp_path, capsys):
    code, err, dst, _ = convert(tmp_path, capsys, "meta", family="sapiens2")
    assert code == 2 and err.count("\n") == 1 and not dst.exists(), err
    named = re.search(r"convert --to (.+) instead", err).group(1).replace(" or ", ", ").split(", ")
    assert "timm" in named and "sapiens2" in named, err
    for to in named:
        if to == "timm" and not EVA_HAS_FAMILIES:
            continue
        code, err, dst, _ = convert(tmp_path, capsys, to, "--overwrite", family="sapiens2")
        assert code == 0 and dst.exists(), f"--to {to}: {err}"
