"""The timm API on the families' own code paths: a tiny Sapiens2 (grouped k/v heads, qk-norm, RMSNorm, no mask
token, LayerScale on attention only) and a tiny LingBot-Vision, random weights moved off their inits, through
timm's loading from Sapiens2's keys and from a native folder, feature extraction, resizing, folding and ONNX."""

import importlib.util

import pytest
import timm
import torch
from support import assert_fp32_close, move_off_init_
from support.families import EVA_HAS_FAMILIES, SAPIENS2_ARGS

from timm_layerscale import convert_checkpoint, export_onnx, fold_layer_scale, save_native

SAPIENS2 = "vit_ls_base_patch16_sapiens2"
LINGBOT = "vit_ls_small_patch16_lingbot"
# A grouped block between two full ones: the smallest depth that has every Sapiens2 code path.
SAPIENS2_TINY = dict(embed_dim=64, num_heads=4, depth=3, num_kv_heads=[4, 2, 4], rope_dtype="fp32")
LINGBOT_TINY = dict(embed_dim=64, num_heads=4, depth=2)
SHAPES = {SAPIENS2: SAPIENS2_TINY, LINGBOT: LINGBOT_TINY}
needs_eva_families = pytest.mark.skipif(
    not EVA_HAS_FAMILIES, reason="this timm's eva has none of these families (1.0.31 has)"
)
IMAGES = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(1))


def tiny(name: str = SAPIENS2, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(name, num_classes=0, **SHAPES[name], **kwargs)).eval()


def test_the_tiny_sapiens2_has_the_families_code_paths():
    model = tiny()
    config = model.config
    assert config.qk_norm and config.norm_layer == "rmsnorm" and config.mask_token is False
    assert config.num_storage_tokens == SAPIENS2_ARGS["num_storage_tokens"] and config.layer_kv_heads == [4, 2, 4]
    assert "mask_token" not in model.state_dict() and "blocks.1.attn.q_norm.weight" in model.state_dict()
    assert all(b.ls2.__class__ is torch.nn.Identity and b.ls1.gamma.ndim == 1 for b in model.blocks)


@torch.no_grad()
def test_create_model_streams_sapiens2s_own_keys_and_a_native_folder(tmp_path):
    model = tiny()
    expected = model(IMAGES)
    save_native(model, tmp_path / "native")
    convert_checkpoint(tmp_path / "native", tmp_path / "own.safetensors", to="sapiens2")
    own = timm.create_model(
        SAPIENS2,
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(tmp_path / "own.safetensors")),
        num_classes=0,
        **SAPIENS2_TINY,
    ).eval()
    assert_fp32_close(own(IMAGES), expected, what="from sapiens2 keys")
    native = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    assert native.config == model.config
    assert_fp32_close(native(IMAGES), expected, what="from a native folder")


@pytest.mark.parametrize("name", [SAPIENS2, LINGBOT])
@torch.no_grad()
def test_features_only_and_forward_intermediates(name):
    model = tiny(name)
    features = timm.create_model(name, features_only=True, out_indices=(0, -1), **SHAPES[name]).eval()
    wanted = features.state_dict()  # features_only drops the final norm and the head
    features.load_state_dict({f"model.{k}": v for k, v in model.state_dict().items() if f"model.{k}" in wanted})
    depth = SHAPES[name]["depth"]
    assert features.feature_info.channels() == [64, 64] and features.feature_info.reduction() == [16, 16]
    maps = features(IMAGES)
    assert [m.shape for m in maps] == [(2, 64, 4, 3)] * 2
    final, inter = model.forward_intermediates(IMAGES, indices=[0, depth - 1], return_prefix_tokens=True)
    assert_fp32_close(final, model.forward_features(IMAGES))
    for got, (patches, prefix) in zip(maps, inter):
        assert_fp32_close(got, patches)
        assert prefix.shape == (2, model.num_prefix_tokens, 64)
    # the last block's intermediate is the final tokens before the norm: the norm makes it the output
    assert_fp32_close(model.norm(inter[-1][0].flatten(2).transpose(1, 2)), final[:, model.num_prefix_tokens :])


def test_a_wrapper_loading_only_its_other_parts_leaves_the_backbone_alone():
    wrapper = torch.nn.ModuleDict(dict(backbone=tiny(), head=torch.nn.Linear(64, 3)))
    kept = {k: v.clone() for k, v in wrapper.backbone.state_dict().items()}
    head = {"head.weight": torch.ones(3, 64), "head.bias": torch.zeros(3)}
    result = wrapper.load_state_dict(head, strict=False)
    assert len(result.missing_keys) == len(kept) and not result.unexpected_keys
    assert all(torch.equal(v, kept[k]) for k, v in wrapper.backbone.state_dict().items())
    assert torch.equal(wrapper.head.weight, torch.ones(3, 64))


@needs_eva_families
@torch.no_grad()
def test_set_input_size_then_a_forward_at_the_new_size_as_timms_eva(tmp_path):
    """Ours and eva from the same weights (`--to timm`), both resized the same way, give the same outputs."""
    size = dict(img_size=(64, 48), dynamic_img_size=False)
    model = tiny(rope_periods_bf16=False, **size)
    save_native(model, tmp_path / "native")
    convert_checkpoint(tmp_path / "native", tmp_path / "eva", to="timm")
    eva = timm.create_model(f"local-dir:{tmp_path / 'eva'}", pretrained=True, **size).eval()
    assert type(eva).__name__ == "Eva"
    assert_fp32_close(model.forward_features(IMAGES), eva.forward_features(IMAGES), what="before")
    for each in (model, eva):
        each.set_input_size(img_size=(32, 64), patch_size=8)
    assert model.patch_size == 8 and tuple(model.config.img_size) == (32, 64)
    x = torch.randn(2, 3, 32, 64)
    tokens = model.forward_features(x)
    assert tokens.shape == (2, model.num_prefix_tokens + 4 * 8, 64)
    assert_fp32_close(tokens, eva.forward_features(x), what="resized")


@pytest.mark.parametrize("name", [SAPIENS2, LINGBOT])
@torch.no_grad()
def test_fold_layer_scale_keeps_outputs_and_rebuilds_strictly(name):
    model = tiny(name)
    expected = model(IMAGES)
    gammas = {n for n, _ in model.named_parameters() if "gamma" in n}
    assert gammas and all(".ls2." not in n for n in gammas) == (name == SAPIENS2)
    fold_layer_scale(model)
    assert not any("gamma" in n for n, _ in model.named_parameters())
    assert all(isinstance(b.ls1, torch.nn.Identity) and isinstance(b.ls2, torch.nn.Identity) for b in model.blocks)
    assert_fp32_close(model(IMAGES), expected, what="folded")
    assert model.config.init_values == 0  # recorded off
    # the load hook would fill a missing gamma with 1: the rebuilt model must hold none to begin with
    again = timm.create_model(name, **model.config.rebuild_args()).eval()
    assert again.state_dict().keys() == model.state_dict().keys()
    again.load_state_dict(model.state_dict(), strict=True)
    assert again.config == model.config
    assert_fp32_close(again(IMAGES), expected, what="rebuilt")


@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="onnx is not installed")
def test_export_onnx_of_the_tiny_sapiens2_matches_pytorch(tmp_path):
    model = tiny()
    result = export_onnx(model, tmp_path / "m.onnx", check=True, check_sizes=[(32, 32), (32, 64)])
    assert (tmp_path / "m.onnx").is_file() and len(result.check) == 4
    assert max(row.max_rel for row in result.check) <= result.tolerance
