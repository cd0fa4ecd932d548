"""fold_layer_scale on timm's own LayerScale families and ours: same outputs, gammas gone or 1, and recorded
arguments that rebuild a model the folded state dict loads into strictly."""

import copy

import pytest
import timm
import torch
from support import assert_fp32_close, move_off_init_
from torch import nn

from timm_layerscale import fold_layer_scale

SMALL = dict(img_size=32, depth=2, pretrained=False)
# (model, its arguments, init_values recorded after folding, gammas left as parameters)
FAMILIES = [
    ("vit_small_patch16_224", dict(init_values=1e-5), 0, 0),
    ("deit3_small_patch16_224", {}, 0, 0),
    ("vit_small_patch14_reg4_dinov2", dict(img_size=28), 0, 0),
    ("cait_xxs24_224", {}, 1.0, 8),  # 2 blocks and 2 class-attention blocks, 2 gammas each
    ("vit_small_patch16_dinov3", {}, 1.0, 4),  # eva
    ("vit_small_plus_patch16_dinov3", {}, 1.0, 4),  # eva with SwiGLU (mlp.fc2)
    ("vit_ls_small_patch16_dinov3", {}, 0, 0),
    ("vit_ls_small_patch16_dinov3", dict(ffn_layer="swiglu"), 0, 0),  # ours with SwiGLU (mlp.w3)
]


def build(name: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(name, **{**SMALL, **kwargs})).eval()


def inputs(model: nn.Module) -> torch.Tensor:
    return torch.randn(2, 3, *model.patch_embed.img_size, generator=torch.Generator().manual_seed(1))


def gammas(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "gamma" in k}


@pytest.mark.parametrize(("name", "kwargs", "recorded", "left"), FAMILIES)
@torch.no_grad()
def test_fold_keeps_outputs_and_rebuilds_strictly(name, kwargs, recorded, left):
    model = build(name, **kwargs)
    x = inputs(model)
    assert gammas(model) and not any(torch.allclose(g, torch.ones_like(g)) for g in gammas(model).values())
    before = model(x)
    assert fold_layer_scale(model) is model
    assert_fp32_close(model(x), before, what="folded")
    left_over = gammas(model)
    assert len(left_over) == left and all(torch.equal(g, torch.ones_like(g)) for g in left_over.values())
    assert model._model_args["init_values"] == recorded
    again = timm.create_model(name, **model._model_args).eval()
    again.load_state_dict(model.state_dict(), strict=True)
    assert_fp32_close(again(x), before, what="rebuilt")


@torch.no_grad()
def test_our_config_records_layer_scale_off():
    model = fold_layer_scale(build("vit_ls_small_patch16_dinov3"))
    assert model.config.init_values == 0 and model.config.layer_init_values == [(None, None)] * 2


def test_a_gamma_of_the_wrong_size_is_refused_before_anything_changes():
    model = build("deit3_small_patch16_224")
    model.blocks[-1].ls2.gamma = nn.Parameter(torch.ones(2 * model.embed_dim))  # the last fold planned
    state, args = copy.deepcopy(model.state_dict()), dict(model._model_args)
    with pytest.raises(ValueError, match=r"cannot fold blocks\.1\.ls2: gamma of shape \(768,\) after a projection"):
        fold_layer_scale(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and model._model_args == args
    assert len(gammas(model)) == 4


def test_a_gamma_with_no_projection_is_refused():
    model = build("vit_small_patch16_dinov3")
    model.blocks[-1].attn.proj = nn.Identity()
    with pytest.raises(ValueError, match=r"cannot fold blocks\.1\.gamma_1: no nn\.Linear at attn\.proj"):
        fold_layer_scale(model)


def test_timms_parallel_blocks_are_refused():
    """ViT with parallel branches keeps each branch's LayerScale where no family of the table does."""
    model = build("vit_small_patch16_18x2_224")
    with pytest.raises(ValueError, match=r"cannot fold blocks\.0\.attns\.0\.ls: no known projection"):
        fold_layer_scale(model)


def test_a_layer_scale_no_family_keeps_is_refused_before_anything_changes():
    model = build("vit_small_patch16_224", init_values=1e-5)
    model.blocks[-1].attn.extra = nn.Sequential(timm.layers.LayerScale(model.embed_dim))
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"cannot fold blocks\.1\.attn\.extra\.0: no known projection"):
        fold_layer_scale(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model._model_args["init_values"] == 1e-5


WITHOUT = [("vit_small_patch16_224", {}), ("vit_ls_small_patch16_dinov3", {"init_values": 0})]


@pytest.mark.parametrize(("name", "kwargs"), WITHOUT)
def test_a_model_without_layer_scale_is_left_unchanged(name, kwargs):
    """Nothing to fold is no error: the model comes back as it was, and nothing is recorded."""
    model = build(name, **kwargs)
    state, args, config = copy.deepcopy(model.state_dict()), dict(model._model_args), getattr(model, "config", None)
    assert fold_layer_scale(model) is model
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model._model_args == args and getattr(model, "config", None) is config
