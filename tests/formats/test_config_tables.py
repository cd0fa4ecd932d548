"""The config tables, pinned: each format's config.json written from a config whose every field it holds differs
from its default, and read back equal (a dropped or swapped row fails); and the rows and rules a mutation of the
code once changed unnoticed, checked against timm's and transformers' own code where they decide."""

from __future__ import annotations

import dataclasses

import pytest
import timm
import torch
from transformers import DINOv3ViTConfig

from timm_layerscale.checkpoints import open_checkpoint
from timm_layerscale.checkpoints.formats import HF, NATIVE, TIMM
from timm_layerscale.checkpoints.formats.base import SourceConfig, hidden_features, pretrained_cfg_fields
from timm_layerscale.checkpoints.formats.hf import CONFIG_FIELDS as HF_FIELDS
from timm_layerscale.checkpoints.formats.hf import transformers_config
from timm_layerscale.checkpoints.formats.meta_train import student_lines
from timm_layerscale.checkpoints.formats.native import native_config
from timm_layerscale.checkpoints.formats.timm import CONFIG_FIELDS as TIMM_FIELDS
from timm_layerscale.checkpoints.formats.timm import eva_config, qv_bias
from timm_layerscale.config import VitLsConfig
from timm_layerscale.identity import identify, key_args

SMALL = "vit_ls_small_patch16_dinov3"
# Every field transformers' table holds, away from its default (and from each other: no two equal values a
# swap could hide).
HF_VALUES = dict(
    embed_dim=96,
    depth=3,
    num_heads=6,
    ffn_ratio=3.0,
    norm_eps=1e-6,
    rope_base=50.0,
    img_size=112,
    patch_size=8,
    in_chans=4,
    num_storage_tokens=2,
    qkv_bias=False,
    proj_bias=False,
    ffn_bias=False,
    drop_path_rate=0.125,
    rope_shift_coords=0.5,
    rope_jitter_coords=1.5,
    rope_rescale_coords=2.5,
)
# eva fixes norm_eps, the projection and FFN biases and the RoPE normalisation: those stay at eva's values.
TIMM_VALUES = dict(
    img_size=112,
    patch_size=8,
    in_chans=4,
    num_classes=7,
    global_pool="avg",
    embed_dim=96,
    depth=3,
    num_heads=6,
    ffn_layer="swiglu",
    ffn_ratio=3.0,
    swiglu_align_to=64,
    num_storage_tokens=2,
    rope_base=50.0,
    dynamic_img_size=False,
    dynamic_img_pad=True,
)


def held(fields) -> set[str]:
    return {f.ours for f in fields if f.ours}


def assert_away_from_defaults(values: dict, names: set[str]) -> None:
    """The test's own premise: every field the table holds is set, to a value that is not its default."""
    assert names <= set(values), names - set(values)
    assert all(values[n] != VitLsConfig.default(n) for n in values)


def test_transformers_config_round_trip_keeps_every_field():
    assert_away_from_defaults(HF_VALUES, held(HF_FIELDS))
    config = VitLsConfig(**HF_VALUES)
    back = HF.read_config(transformers_config(config, k_bias=False, dtype=torch.float32)).args
    assert {k: back[k] for k in HF_VALUES} == HF_VALUES


def test_transformers_config_round_trip_of_a_swiglu():
    config = VitLsConfig(**{**HF_VALUES, "ffn_layer": "swiglu", "swiglu_align_to": 64})
    back = VitLsConfig(**HF.read_config(transformers_config(config, False, torch.float32)).args)
    assert back.ffn_layer == "swiglu" and hidden_features(back) == hidden_features(config)


def test_transformers_config_without_a_width_is_transformers_default():
    """A field transformers' config leaves out means its default: read from transformers, not from us."""
    cfg = {k: v for k, v in DINOv3ViTConfig().to_dict().items() if k not in ("hidden_size", "intermediate_size")}
    args = HF.read_config(cfg).args
    assert args["embed_dim"] == DINOv3ViTConfig().hidden_size
    assert args["ffn_ratio"] * args["embed_dim"] == DINOv3ViTConfig().hidden_size * 4


def test_timm_config_round_trip_keeps_every_field():
    assert_away_from_defaults(TIMM_VALUES, held(TIMM_FIELDS))
    config = VitLsConfig(**TIMM_VALUES)
    cfg = eva_config(config, SMALL.replace("small", "small_plus"), False, {})
    back = VitLsConfig(**TIMM.read_config(cfg).args)
    assert {k: getattr(back, k) for k in TIMM_VALUES if k != "ffn_ratio"} == {
        k: v for k, v in TIMM_VALUES.items() if k != "ffn_ratio"
    }
    assert hidden_features(back) == hidden_features(config)


@pytest.mark.parametrize(("dim", "ratio", "align"), [(64, 2.7, 8), (64, 8 / 3, 64), (64, 3.0, 1), (32, 5.3, 8)])
def test_eva_swiglu_hidden_size_is_timms(dim, ratio, align):
    """The SwiGLU width our args give from eva's model args is the width timm's eva builds from them (32 wide,
    5.3: eva's 169 rounds up to 176; unaligned, our ratio would round to 168)."""
    model_args = dict(embed_dim=dim, num_heads=4, depth=1, mlp_ratio=ratio, swiglu_mlp=True, swiglu_align_to=align)
    eva = timm.create_model("vit_small_plus_patch16_dinov3_qkvb", **model_args, device="meta")
    cfg = {"architecture": "vit_small_plus_patch16_dinov3_qkvb", "model_args": model_args}
    ours = VitLsConfig(**TIMM.read_config(cfg).args)
    assert hidden_features(ours) == eva.blocks[0].mlp.fc1_g.out_features


def test_native_config_round_trip_keeps_every_field():
    values = {**HF_VALUES, "num_classes": 7, "global_pool": "avg", "cls_norm": True, "local_cls_norm": True}
    values.update(mask_k_bias=False, rope_periods_bf16=False, rope_normalize_coords="max", init_values=0.25)
    values.update(use_naflex=False, patchify_channels_last=False, enable_patch_interpolator=False)
    values.update(dynamic_img_size=False, dynamic_img_pad=True, drop_rate=0.25, proj_drop_rate=0.375)
    values.update(attn_drop_rate=0.0625, stochastic_depth="sample_drop", strict_layer_scale=True)
    values.update(mask_token=False, norm_layer="rmsnorm", num_kv_heads=[6, 3, 2], qk_norm=True, family="lingbot")
    config = VitLsConfig(**values)
    back = NATIVE.read_config(native_config(config, SMALL, {})).args
    assert back == config.rebuild_args()
    # bf16 RoPE needs bf16-rounded periods (their default): it is read back from a config of its own.
    assert_away_from_defaults(values, set(config.rebuild_args()) - {"swiglu_align_to", "ffn_layer", "rope_dtype"})
    bf16 = config.replace(rope_dtype="bf16", rope_periods_bf16=True)
    assert NATIVE.read_config(native_config(bf16, SMALL, {})).args == bf16.rebuild_args()


def test_written_pretrained_cfg_names_the_classes_and_not_the_source():
    source = {"hf_hub_id": "someone/weights", "url": "https://x", "mean": (0.5, 0.5, 0.5), "num_classes": 1000}
    written = pretrained_cfg_fields(source, num_classes=7)
    assert written == {"mean": (0.5, 0.5, 0.5), "num_classes": 7}


@pytest.mark.parametrize(("q", "v", "expected"), [(1, 0, True), (0, 1, True), (0, 0, False), (1, 1, True)])
def test_eva_qkvb_for_any_non_zero_q_or_v_bias(q, v, expected):
    bias = torch.cat([torch.full((4,), float(q)), torch.full((4,), 3.0), torch.full((4,), float(v))])
    config = VitLsConfig(embed_dim=4, num_heads=1, depth=1)
    assert qv_bias({"blocks.0.attn.qkv.bias": bias}, config) is expected


@pytest.mark.parametrize(("rope_dtype", "periods_bf16"), [("fp32", True), ("fp32", False), ("bf16", True)])
def test_meta_training_yaml_names_the_rope_dtype(rope_dtype, periods_bf16):
    """What RoPE computes in, whatever the stored periods' rounding."""
    config = VitLsConfig(rope_dtype=rope_dtype, rope_periods_bf16=periods_bf16)
    lines = student_lines(config, "ckpt.pth", True, False)
    assert any(line.startswith(f"  pos_embed_rope_dtype: {rope_dtype}  # ") for line in lines), lines


def small_native(**kwargs) -> dict[str, torch.Tensor]:
    model = timm.create_model(SMALL, embed_dim=64, num_heads=4, depth=2, num_classes=0, **kwargs)
    return model.state_dict()


def test_model_kwargs_win_over_config_json():
    """What the caller passes completes the variant over what the checkpoint records, never the other way."""
    with open_checkpoint(small_native()) as ckpt:
        recorded = SourceConfig({"embed_dim": 64, "num_heads": 4, "depth": 2, "rope_base": 100.0})
        found = identify(ckpt, SMALL, {"rope_base": 7.0}, recorded)
    assert found.config.rope_base == 7.0 and found.config.depth == 2


def test_layer_scale_per_branch_is_read_back_on_its_branch():
    """Block 0 has its attention gamma only, block 1 its MLP gamma only: the args keep each on its branch."""
    tensors = small_native(init_values=0.5)
    del tensors["blocks.0.ls2.gamma"], tensors["blocks.1.ls1.gamma"]
    with open_checkpoint(tensors) as ckpt:
        args = key_args(ckpt, {"init_values": 0.5, "depth": 2})
    config = VitLsConfig(**{**dict(embed_dim=64, num_heads=4, depth=2), "init_values": args["init_values"]})
    assert config.layer_init_values == [(0.5, None), (None, 0.5)]


def test_every_config_field_has_its_rule():
    """A field without a rule would take any value a file gives it."""
    unruled = [f.name for f in dataclasses.fields(VitLsConfig) if f.init and "rule" not in f.metadata]
    assert unruled == []


def test_transformers_config_names_each_value_by_transformers_field():
    """A swap of two rows round-trips; the written file, read by its own field names, does not."""
    # The biases apart (the model's three and transformers' four bias fields are otherwise all the same value).
    config = VitLsConfig(**{**HF_VALUES, "proj_bias": True, "ffn_bias": True})
    cfg = transformers_config(config, k_bias=False, dtype=torch.float32)
    expected = dict(
        hidden_size=96,
        intermediate_size=288,
        num_hidden_layers=3,
        num_attention_heads=6,
        layer_norm_eps=1e-6,
        rope_theta=50.0,
        image_size=112,
        patch_size=8,
        num_channels=4,
        num_register_tokens=2,
        query_bias=False,
        value_bias=False,
        proj_bias=True,
        mlp_bias=True,
        key_bias=False,
        drop_path_rate=0.125,
        pos_embed_shift=0.5,
        pos_embed_jitter=1.5,
        pos_embed_rescale=2.5,
    )
    assert {k: cfg[k] for k in expected} == expected
    built = DINOv3ViTConfig(**cfg)  # transformers' own reading of the file
    assert (built.hidden_size, built.num_hidden_layers, built.pos_embed_rescale) == (96, 3, 2.5)
    assert transformers_config(config, k_bias=True, dtype=torch.float32)["key_bias"] is True


def test_timm_config_names_each_value_by_evas_argument():
    config = VitLsConfig(**TIMM_VALUES)
    cfg = eva_config(config, SMALL.replace("small", "small_plus"), False, {})
    args = cfg["model_args"]
    assert cfg["num_classes"] == cfg["pretrained_cfg"]["num_classes"] == 7 and cfg["global_pool"] == "avg"
    expected = dict(
        img_size=112,
        patch_size=8,
        in_chans=4,
        num_classes=7,
        global_pool="avg",
        embed_dim=96,
        depth=3,
        num_heads=6,
        swiglu_mlp=True,
        swiglu_align_to=64,
        num_reg_tokens=2,
        rope_temperature=50.0,
        dynamic_img_size=False,
        dynamic_img_pad=True,
    )
    assert {k: args[k] for k in expected} == expected
    eva = timm.create_model("vit_small_plus_patch16_dinov3", **args, device="meta")  # timm's own reading
    assert eva.blocks[0].mlp.fc1_g.out_features == hidden_features(config) and eva.num_prefix_tokens == 3
