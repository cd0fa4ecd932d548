"""Every format holds a model in full or refuses it in one line before anything is written: each family's small
shape with each architecture switch flipped, converted to every format and loaded back (by transformers'
DINOv3ViTModel/Sapiens2Model or timm's eva where the format is theirs; otherwise by our loader, told the
model's arguments as Meta's and Sapiens2's own code is told its config), gives the source's outputs."""

import json

import pytest
import timm
import torch
from support import assert_fp32_close, format_destination, move_off_init_
from transformers import DINOv3ViTModel, Sapiens2Model

from timm_layerscale import convert_checkpoint
from timm_layerscale.checkpoints.errors import CheckpointError
from timm_layerscale.checkpoints.formats import FORMATS
from timm_layerscale.families import FAMILIES as FAMILY_RECORDS
from timm_layerscale.layer_options import OPTIONS
from timm_layerscale.publish import save_native

IMAGES = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))
SHAPE = dict(embed_dim=64, num_heads=4, depth=2)
# RoPE in fp32 from exact periods throughout, as transformers and eva compute it (bf16 RoPE is its own rule).
FP32_ROPE = dict(rope_dtype="fp32", rope_periods_bf16=False)
FAMILIES = {
    "dinov3_mlp": ("vit_ls_small_patch16_dinov3", SHAPE),
    "dinov3_swiglu": ("vit_ls_small_plus_patch16_dinov3", SHAPE),
    "eupe_tiny": ("vit_ls_tiny_patch16_dinov3", dict(embed_dim=192, num_heads=3, depth=2)),
    "lingbot": ("vit_ls_small_patch16_lingbot", SHAPE),
    "sapiens2": ("vit_ls_base_patch16_sapiens2", dict(SHAPE, num_kv_heads=[4, 2])),
}
# Each registered layer option (norm, FFN, the attention's switches) as a switch of its own, from the registry: an
# option added there is in the matrix, and one no row's model takes fails `test_every_registered_family_and_...`.
OPTION_SWITCHES = {
    f"{name}={value}": (lambda c, name=name, value=value: {name: value})
    for name, values in OPTIONS.items()
    for value in values
}
SWITCHES = {
    "as_shipped": lambda c: {},
    **OPTION_SWITCHES,
    "kv_heads": lambda c: {"num_kv_heads": None if c.grouped_attention else [c.num_heads, 1]},
    "mask_token": lambda c: {"mask_token": not c.mask_token},
    "layer_scale_attn_only": lambda c: {"init_values": {"attn": 1e-4, "mlp": None}},
    "layer_scale_mlp_only": lambda c: {"init_values": {"attn": None, "mlp": 1e-4}},
    "layer_scale_off": lambda c: {"init_values": None},
    "storage_tokens": lambda c: {"num_storage_tokens": 0 if c.num_storage_tokens else 4},
    "qkv_bias": lambda c: {"qkv_bias": not c.qkv_bias},
    "mask_k_bias": lambda c: {"mask_k_bias": not c.mask_k_bias},
    "proj_bias": lambda c: {"proj_bias": False},
    "cls_norm": lambda c: {"cls_norm": True},
    "norm_eps": lambda c: {"norm_eps": 1e-3},
    "rope_normalize_coords": lambda c: {"rope_normalize_coords": "max"},
}


def meta_model(variant: str, **args) -> torch.nn.Module:
    with torch.device("meta"):
        return timm.create_model(variant, num_classes=0, **args)


def shipped_config(family: str):
    variant, shape = FAMILIES[family]
    return meta_model(variant, **shape).config


def source_args(family: str, switch: str) -> dict:
    return {**FAMILIES[family][1], **FP32_ROPE, **SWITCHES[switch](shipped_config(family))}


def source_model(family: str, switch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(FAMILIES[family][0], num_classes=0, **source_args(family, switch))
    return move_off_init_(model).eval()


def shipped_args(family: str) -> set:
    config = shipped_config(family)
    return {(name, getattr(config, name)) for name in OPTIONS}


def test_every_registered_family_and_option_is_in_the_matrix():
    """A family registered without a row, or an option no row's model takes, fails here (the matrix would skip it)."""
    rows = {shipped_config(family).family for family in FAMILIES}
    assert rows == set(FAMILY_RECORDS), (rows, set(FAMILY_RECORDS))
    for switch in OPTION_SWITCHES:
        taken = []
        for family, (variant, _) in FAMILIES.items():
            try:
                meta_model(variant, **source_args(family, switch))
            except ValueError:
                continue
            taken.append(family)
        assert taken, f"no family's model takes {switch}: the matrix never converts it"


@torch.no_grad()
def loaded_back(to: str, dst, model, tmp_path) -> torch.Tensor:
    if to in ("native", "timm"):
        return timm.create_model(f"local-dir:{dst}", pretrained=True).eval().forward_features(IMAGES)
    if to == "hf":
        hf = Sapiens2Model if json.loads((dst / "config.json").read_text())["model_type"] == "sapiens2" else None
        return (hf or DINOv3ViTModel).from_pretrained(dst).eval()(pixel_values=IMAGES).last_hidden_state
    args = {k: v for k, v in model.config.rebuild_args().items() if k != "init_values"}
    variant = model.pretrained_cfg["architecture"]
    convert_checkpoint(dst, tmp_path / "back", to="native", model=variant, model_kwargs=args)
    return timm.create_model(f"local-dir:{tmp_path / 'back'}", pretrained=True).eval().forward_features(IMAGES)


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_format_holds_the_model_in_full_or_refuses_in_one_line(family, switch, tmp_path):
    if switch in OPTION_SWITCHES and not SWITCHES[switch](shipped_config(family)).items() - shipped_args(family):
        pytest.skip("the family's own value: as_shipped converts it")
    try:
        model = source_model(family, switch)
    except ValueError:
        pytest.skip("the family's variant does not take this switch")  # e.g. bf16-only rules
    save_native(model, tmp_path / "src")
    with torch.no_grad():
        expected = model.forward_features(IMAGES)
    for to in FORMATS:
        dst = format_destination(to, tmp_path / to)
        dst.parent.mkdir()
        try:
            convert_checkpoint(tmp_path / "src", dst, to=to)
        except CheckpointError as refused:
            assert "\n" not in str(refused) and "convert --to" in str(refused), f"{to}: {refused}"
            assert not dst.exists() and not list(dst.parent.iterdir()), f"{to}: a refusal wrote {dst}"
            continue
        assert_fp32_close(loaded_back(to, dst, model, tmp_path / to), expected, what=f"--to {to}")


def test_sapiens2_refuses_a_dinov3_model_with_qk_norm_and_attention_layer_scale(tmp_path):
    """A DINOv3 with qk-norm and LayerScale on attention only has switches a Sapiens2 has too, but its config
    records its family: Sapiens2's keys refuse it by that, naming the one format that holds it."""
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_ls_small_patch16_dinov3", num_classes=0, qk_norm=True, init_values={"attn": 1e-4, "mlp": None}, **SHAPE
    )
    save_native(model, tmp_path / "src")
    with pytest.raises(CheckpointError, match=r"^Sapiens2 keys cannot hold a dinov3 model .*; convert --to native "):
        convert_checkpoint(tmp_path / "src", tmp_path / "s.pth", to="sapiens2")
    assert not (tmp_path / "s.pth").exists()
