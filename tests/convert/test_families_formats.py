"""Every family through every format: a small model of each family (weights moved off their inits) is written in
each format its record says can hold it and loaded back by that format's own library where there is one
(transformers' DINOv3ViTModel / Sapiens2Model, timm's eva), else read back by us, giving the source's outputs;
every other format refuses it in one line naming the formats that can, before anything is written.

And a DINOv3 with Meta's own RMSNorm (`norm_layer="rmsnorm"`, in Meta's norm_layer_dict): read from a file
Meta's DinoVisionTransformer wrote (tests/fixtures/README.md), it gives Meta's outputs, and `timm-ls convert
--to meta` writes exactly the keys and shapes Meta's strict load asks for, with Meta's values.
"""

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest
import timm
import torch
from safetensors.torch import load_file
from support import FIXTURES, assert_fp32_close, format_destination, move_off_init_
from support.families import EVA_HAS_FAMILIES
from transformers import DINOv3ViTModel, Sapiens2Model

from timm_layerscale import convert_checkpoint
from timm_layerscale.checkpoints.errors import CheckpointError
from timm_layerscale.checkpoints.formats import FORMATS
from timm_layerscale.cli.listing import registered_variants
from timm_layerscale.config import VitLsConfig
from timm_layerscale.families import FAMILIES, either
from timm_layerscale.publish import save_native
from timm_layerscale.variants import VARIANTS
from timm_ls.main import main

IMAGES = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))
SHAPE = dict(embed_dim=64, num_heads=4, depth=2)
FP32_ROPE = dict(rope_dtype="fp32", rope_periods_bf16=False)  # as transformers and eva compute it
# One small model of each family: (variant, its arguments at test size). A registered family without a row fails
# `test_every_registered_family_and_format_is_in_the_matrix`; the formats are the registry's.
FAMILY_MODELS = {
    "dinov3": ("vit_ls_small_patch16_dinov3", SHAPE),
    "eupe": ("vit_ls_tiny_patch16_dinov3", dict(embed_dim=192, num_heads=3, depth=2)),  # a DINOv3 of its own width
    "lingbot": ("vit_ls_small_patch16_lingbot", SHAPE),
    "sapiens2": ("vit_ls_base_patch16_sapiens2", dict(SHAPE, num_kv_heads=[4, 2])),
}
EVA_NEEDS_NEW_TIMM = ("eupe", "lingbot", "sapiens2")  # eva's architectures of these arrived in timm 1.0.31


def family_model(name: str) -> torch.nn.Module:
    variant, shape = FAMILY_MODELS[name]
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(variant, num_classes=0, **shape, **FP32_ROPE)).eval()


@torch.no_grad()
def loaded_back(to: str, dst, model, tmp_path) -> torch.Tensor:
    """The written model's outputs, by the format's own library where it has one, else read back by us with the
    model's arguments, as Meta's and Sapiens2's code is given its config."""
    if to in ("native", "timm"):
        loaded = timm.create_model(f"local-dir:{dst}", pretrained=True).eval()
        assert to == "native" or type(loaded).__name__ == "Eva"
        return loaded.forward_features(IMAGES)
    if to == "hf":
        model_type = json.loads((dst / "config.json").read_text())["model_type"]
        hf = Sapiens2Model if model_type == "sapiens2" else DINOv3ViTModel
        return hf.from_pretrained(dst).eval()(pixel_values=IMAGES).last_hidden_state
    args = {k: v for k, v in model.config.rebuild_args().items() if k != "init_values"}
    convert_checkpoint(
        dst, tmp_path / "back", to="native", model=model.pretrained_cfg["architecture"], model_kwargs=args
    )
    return timm.create_model(f"local-dir:{tmp_path / 'back'}", pretrained=True).eval().forward_features(IMAGES)


def test_every_registered_family_and_format_is_in_the_matrix():
    # Every registered family has a row (a family added without one fails here), and so has each shipped variant's.
    rows = {VARIANTS[variant].config.family for variant, _ in FAMILY_MODELS.values()}
    shipped = {VARIANTS[v["name"]].config.family for v in registered_variants() if v["shipped"]}
    assert rows == set(FAMILIES) and shipped <= rows, (rows, set(FAMILIES), shipped)
    assert list(FORMATS) == MATRIX_FORMATS  # the matrix's formats are the registry's, each once


MATRIX_FORMATS = list(FORMATS)  # as registered when the tests are collected: the shipped ones


@pytest.mark.parametrize("to", MATRIX_FORMATS)
@pytest.mark.parametrize("family", FAMILY_MODELS)
def test_each_family_is_held_by_each_format_its_record_names_and_refused_by_the_others(family, to, tmp_path):
    model = family_model(family)
    record = FAMILIES[model.config.family]
    save_native(model, tmp_path / "src")
    dst = format_destination(to, tmp_path / to)
    dst.parent.mkdir()
    if to not in record.formats:
        with pytest.raises(CheckpointError) as refused:
            convert_checkpoint(tmp_path / "src", dst, to=to)
        line = str(refused.value)
        assert "\n" not in line and f"cannot hold a {record.name} model" in line, line
        assert line.endswith(f"convert --to {either(record.holders(model.config))} instead"), line
        assert not list(dst.parent.iterdir()), f"a refusal wrote into {dst.parent}"
        return
    if to == "timm" and family in EVA_NEEDS_NEW_TIMM and not EVA_HAS_FAMILIES:
        pytest.skip("this timm's eva has none of these families (1.0.31 has)")
    convert_checkpoint(tmp_path / "src", dst, to=to)
    with torch.no_grad():
        expected = model.forward_features(IMAGES)
    assert_fp32_close(loaded_back(to, dst, model, tmp_path / to), expected, what=f"{family} --to {to}")


# ---------------------------------------------------------------------------------- Meta's RMSNorm DINOv3

META_RMSNORM = FIXTURES / "meta_rmsnorm.safetensors"
RMSNORM_ARGS = dict(SHAPE, norm_layer="rmsnorm", rope_periods_bf16=True)  # Meta's trained periods: bf16-rounded


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@torch.no_grad()
def test_a_dinov3_with_metas_rmsnorm_reads_metas_file_and_converts_to_meta_for_metas_strict_load(tmp_path):
    meta = load_file(META_RMSNORM)
    outputs = load_file(FIXTURES / "meta_rmsnorm_outputs.safetensors")
    result = convert_checkpoint(META_RMSNORM, tmp_path / "native", to="native", model_kwargs=RMSNORM_ARGS)
    assert result.variant.endswith("_dinov3"), result.variant  # read from its keys: a DINOv3, never a Sapiens2
    ours = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    assert ours.config.family == "dinov3" and ours.config.norm_layer == "rmsnorm"
    tokens = ours.forward_features(outputs["input"])
    assert_fp32_close(tokens[:, 0], outputs["x_norm_clstoken"], what="cls")
    assert_fp32_close(tokens[:, 1:5], outputs["x_storage_tokens"], what="storage")
    assert_fp32_close(tokens[:, 5:], outputs["x_norm_patchtokens"], what="patches")

    code, _, err = cli("convert", str(tmp_path / "native"), str(tmp_path / "meta.pth"), "--to", "meta")
    assert code == 0, err
    written = torch.load(tmp_path / "meta.pth", weights_only=True)
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in meta.items()}  # strict=True
    assert all(torch.equal(written[k], meta[k]) for k in meta)

    code, out, err = cli("convert", str(tmp_path / "native"), str(tmp_path / "train.pth"), "--to", "meta-train")
    assert code == 0 and "  norm_layer: rmsnorm" in out and "eps" not in out.split("norm_layer:")[1].split("\n")[0]


RMSNORM_DINOV3 = VitLsConfig(**RMSNORM_ARGS)
# The formats whose record fixes a DINOv3's norm otherwise (transformers' DINOv3ViTModel, eva: LayerNorm only).
WITHOUT_RMSNORM = [name for name, held in FAMILIES["dinov3"].formats.items() if held.differences(RMSNORM_DINOV3)]


def test_the_formats_that_hold_a_dinov3_with_rmsnorm_are_its_records():
    assert FAMILIES["dinov3"].holders(RMSNORM_DINOV3) == ["native", "meta", "meta-train"]
    assert WITHOUT_RMSNORM == ["hf", "timm"]


@pytest.mark.parametrize("to", WITHOUT_RMSNORM)
def test_a_dinov3_with_rmsnorm_is_refused_by_layouts_without_it_naming_those_with_it(to, tmp_path):
    convert_checkpoint(META_RMSNORM, tmp_path / "native", to="native", model_kwargs=RMSNORM_ARGS)
    code, out, err = cli("convert", str(tmp_path / "native"), str(tmp_path / "out"), "--to", to)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    holders = either(FAMILIES["dinov3"].holders(RMSNORM_DINOV3))
    assert "norm_layer='layernorm'" in err and f"convert --to {holders} instead" in err, err
    assert not (tmp_path / "out").exists()
