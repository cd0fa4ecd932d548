"""`deploy.quantize`: an int8 copy with its fidelity to the fp32 model; `fidelity`'s measures by hand."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from support import TINY, move_off_init_
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from timm_layerscale import quantize
from timm_layerscale.fidelity import Fidelity, Outputs, compare, model_outputs, rendered_images

IMAGES = rendered_images(4, 48, seed=5)


def tiny(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_ls_small_patch16_dinov3", **{**TINY, "num_classes": 0, **kwargs})
    return move_off_init_(model).eval()


def fidelity(**kwargs) -> Fidelity:
    values = dict(
        images=8,
        pooled_cosine_mean=0.99981,
        pooled_cosine_min=0.9995,
        patch_cosine_mean=0.9997,
        patch_cosine_min=0.9961,
        top1_agreement=1.0,
    )
    return Fidelity(**{**values, **kwargs})


def test_compare_gives_the_cosines_computed_by_hand():
    reference = Outputs(
        pooled=torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
        patches=torch.tensor([[[1.0, 0.0], [1.0, 1.0], [3.0, 4.0]]]),
        logits=torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]]),
    )
    candidate = Outputs(
        pooled=torch.tensor([[1.0, 1.0], [0.0, 5.0]]),  # cosines 1/sqrt(2) and 1
        patches=torch.tensor([[[1.0, 0.0], [1.0, 0.0], [4.0, 3.0]]]),  # 1, 1/sqrt(2), 24/25
        logits=torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 2.5]]),  # the first image agrees, the second not
    )
    result = compare(reference, candidate)
    assert result.images == 2
    assert result.pooled_cosine_mean == pytest.approx((1 / math.sqrt(2) + 1) / 2, abs=1e-12)
    assert result.pooled_cosine_min == pytest.approx(1 / math.sqrt(2), abs=1e-12)
    assert result.patch_cosine_mean == pytest.approx((1 + 1 / math.sqrt(2) + 24 / 25) / 3, abs=1e-12)
    assert result.patch_cosine_min == pytest.approx(1 / math.sqrt(2), abs=1e-12)
    assert result.top1_agreement == 0.5
    assert compare(reference, Outputs(candidate.pooled, candidate.patches)).top1_agreement is None


def test_compare_refuses_outputs_of_different_shapes():
    one = Outputs(pooled=torch.ones(2, 4), patches=torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="different shapes"):
        compare(one, Outputs(pooled=torch.ones(2, 4), patches=torch.ones(2, 5, 4)))


def test_the_line_reads_every_figure():
    assert fidelity().line() == (
        "fidelity vs fp32 on 8 images: pooled cosine mean 0.99981 min 0.99950, "
        "patch cosine mean 0.9997 min 0.9961, top-1 agreement 100.0%"
    )
    assert fidelity(top1_agreement=None).line().endswith("patch cosine mean 0.9997 min 0.9961")
    assert fidelity(top1_agreement=0.875).line().endswith(", top-1 agreement 87.5%")


def test_below_names_what_fell_short_and_by_how_much():
    assert fidelity().below(0.99) is None
    assert fidelity().below(0.9961) is None  # reaching the threshold is enough
    patch = fidelity().below(0.998)
    assert "patch cosine min 0.99610 is 0.00190 below 0.998" in patch and "pooled" not in patch
    pooled = fidelity(pooled_cosine_min=0.95, patch_cosine_min=0.999).below(0.99)
    assert "pooled cosine min 0.95000 is 0.04000 below 0.99" in pooled and "patch" not in pooled
    both = fidelity().below(0.9999)
    assert "pooled" in both and "patch" in both and both.count("\n") == 0
    # the means never decide
    assert fidelity(pooled_cosine_mean=0.5, patch_cosine_mean=0.5).below(0.99) is None


@torch.no_grad()
def test_model_outputs_are_the_models_pooled_patches_and_logits():
    model = tiny(num_classes=3)
    out = model_outputs(model, IMAGES)
    tokens = model.forward_features(IMAGES)
    grid = (48 // 16) ** 2
    assert out.patches.shape == (4, grid, TINY["embed_dim"]) and model.num_prefix_tokens == 5
    assert torch.equal(out.patches, tokens[:, -grid:])
    assert torch.equal(out.pooled, model.forward_head(tokens, pre_logits=True))
    assert torch.equal(out.logits, model(IMAGES))
    assert model_outputs(tiny(), IMAGES).logits is None


def test_rendered_images_repeat_and_are_normalised():
    images = rendered_images(3, 32, seed=1)
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.float32
    assert torch.equal(images, rendered_images(3, 32, seed=1))
    assert not torch.equal(images, rendered_images(3, 32, seed=2))
    assert rendered_images().shape == (8, 3, 224, 224)
    assert abs(images.mean().item()) < 0.5 and 0.5 < images.std().item() < 2.0


def test_quantize_quantizes_a_copy_and_measures_it():
    model = tiny(num_classes=3).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized, result = quantize(model, images=IMAGES)
    assert model.training and all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not quantized.training
    assert sum(isinstance(m, DynamicLinear) for m in quantized.modules()) == 4 * TINY["depth"] + 1
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    assert result.images == 4
    assert result.pooled_cosine_min <= result.pooled_cosine_mean <= 1 + 1e-9
    assert result.patch_cosine_min <= result.patch_cosine_mean <= 1 + 1e-9
    assert result.patch_cosine_min >= 0.99 and result.pooled_cosine_min >= 0.99
    assert result.patch_cosine_min < 1.0  # int8 weights do change something
    assert 0.0 <= result.top1_agreement <= 1.0
    assert result.below(0.99) is None


def test_an_eval_fp32_model_is_left_as_it_was():
    model = tiny(num_classes=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantize(model, images=IMAGES)
    assert not model.training and all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@torch.no_grad()
def test_a_training_model_is_measured_in_eval():
    """Drop path draws anew in training: the fp32 outputs measured against are the eval model's."""
    model = tiny(num_classes=3, drop_path_rate=0.9).train()
    quantized, result = quantize(model, images=IMAGES)
    assert model.training
    expected = compare(model_outputs(model.eval(), IMAGES), model_outputs(quantized, IMAGES))
    assert result == expected and result.below(0.99) is None


def test_quantize_measures_what_model_outputs_measure():
    model = tiny()
    quantized, result = quantize(model, images=IMAGES)
    assert result == compare(model_outputs(model, IMAGES), model_outputs(quantized, IMAGES))
    assert result.top1_agreement is None


def test_quantize_draws_images_at_the_models_input_size_without_any():
    """timm's input size for the model (its pretrained cfg's, as `resolve_data_config` reads it), here 64x48."""
    model = tiny(pretrained_cfg_overlay=dict(input_size=(3, 64, 48)))
    assert timm.data.resolve_data_config({}, model=model)["input_size"] == (3, 64, 48)
    _, result = quantize(model)
    assert result.images == 8
    expected = rendered_images(size=64)[..., :48]
    quantized, _ = quantize(model, images=expected)
    assert result == compare(model_outputs(model, expected), model_outputs(quantized, expected))


def test_an_unknown_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown quantization mode 'static': choose one of dynamic"):
        quantize(tiny(), mode="static")
