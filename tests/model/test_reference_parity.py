"""Parity through the load path with the two public references: transformers' DINOv3ViTModel and timm's
eva DINOv3, both with random weights moved off their inits, on a non-square input.

The references compute RoPE periods in fp32 without Meta's bf16 rounding, so our models take
`rope_periods_bf16=False` here; both files lack periods, so ours come from that setting.
"""

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from support import (
    TINY,
    VARIANT,
    assert_catches_swapped_gammas_and_dropped_biases,
    assert_fp32_close,
    eva_reference,
    max_diff,
    move_off_init_,
    transformers_reference,
)
from timm.models import load_checkpoint


def ours_from_file(ffn: str, path, **kwargs) -> torch.nn.Module:
    return timm.create_model(
        VARIANT[ffn],
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(path)),
        rope_periods_bf16=False,
        **TINY,
        **kwargs,
    ).eval()


@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
@torch.no_grad()
def test_transformers_hub_file_matches(ffn, tmp_path, images):
    ref = transformers_reference(ffn)
    ref.save_pretrained(tmp_path)  # the layout of the files on the Hub
    model = ours_from_file(ffn, tmp_path / "model.safetensors")
    expected = ref(pixel_values=images).last_hidden_state
    assert_fp32_close(model.forward_features(images), expected)
    assert_fp32_close(model(images), ref(pixel_values=images).pooler_output)


@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
@torch.no_grad()
def test_the_parity_tolerance_still_fails_a_swapped_gamma_or_a_dropped_bias(ffn, tmp_path, images):
    ref = transformers_reference(ffn)
    ref.save_pretrained(tmp_path)
    model = ours_from_file(ffn, tmp_path / "model.safetensors")
    expected = ref(pixel_values=images).last_hidden_state
    assert_catches_swapped_gammas_and_dropped_biases(model, lambda m: m.forward_features(images), expected)


@pytest.mark.parametrize("prefix", ["layer.", "model.layer."])
@torch.no_grad()
def test_transformers_both_block_spellings_load(prefix, tmp_path, images):
    ref = transformers_reference("mlp")
    state = {k.replace("model.layer.", prefix): v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.startswith(prefix) for k in state)
    save_file(state, tmp_path / "weights.safetensors")
    model = ours_from_file("mlp", tmp_path / "weights.safetensors")
    assert_fp32_close(model.forward_features(images), ref(pixel_values=images).last_hidden_state)


@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
@torch.no_grad()
def test_timm_eva_file_matches(ffn, tmp_path, images):
    ref = eva_reference(ffn)
    save_file(ref.state_dict(), tmp_path / "model.safetensors")
    model = ours_from_file(ffn, tmp_path / "model.safetensors")
    tokens = model.forward_features(images)
    assert_fp32_close(tokens, ref.forward_features(images))
    pooled = ref.forward_head(ref.forward_features(images), pre_logits=True)
    assert_fp32_close(model.forward_head(tokens, pre_logits=True), pooled)


@torch.no_grad()
def test_timm_eva_file_without_qkv_bias_fills_zero_bias(tmp_path, images, ls_log):
    torch.manual_seed(0)
    ref = move_off_init_(timm.create_model("vit_small_plus_patch16_dinov3", global_pool="token", **TINY)).eval()
    save_file(ref.state_dict(), tmp_path / "model.safetensors")
    model = ours_from_file("swiglu", tmp_path / "model.safetensors")
    assert model.config.qkv_bias
    assert_fp32_close(model.forward_features(images), ref.forward_features(images))
    assert "zero qkv biases" in ls_log.text


@torch.no_grad()
def test_load_checkpoint_converts_without_a_filter(tmp_path, images):
    """`timm.models.load_checkpoint` (train.py --initial-checkpoint) applies no filter: the hook converts."""
    ref = eva_reference("mlp")
    torch.save(ref.state_dict(), tmp_path / "eva.pth")
    model = timm.create_model(VARIANT["mlp"], rope_periods_bf16=False, **TINY).eval()
    load_checkpoint(model, str(tmp_path / "eva.pth"), strict=True)
    assert_fp32_close(model.forward_features(images), ref.forward_features(images))


@torch.no_grad()
def test_converted_file_saves_in_meta_layout(tmp_path, images):
    ref = transformers_reference("swiglu")
    ref.save_pretrained(tmp_path)
    model = ours_from_file("swiglu", tmp_path / "model.safetensors")
    save_file(model.state_dict(), tmp_path / "ours.safetensors")
    saved = load_file(tmp_path / "ours.safetensors")
    assert "blocks.0.ls1.gamma" in saved and "blocks.0.mlp.w3.weight" in saved and "storage_tokens" in saved
    again = ours_from_file("swiglu", tmp_path / "ours.safetensors")
    assert max_diff(again.forward_features(images), model.forward_features(images)) == 0.0
