"""Exactness against Meta's own DinoVisionTransformer, through outputs recorded once (tests/fixtures)."""

import pytest
import torch
from safetensors.torch import load_file
from support import (
    FIXTURES,
    META_CONFIGS,
    assert_catches_swapped_gammas_and_dropped_biases,
    assert_fp32_close,
    build_from_meta_file,
    max_diff,
)

CONFIGS = META_CONFIGS


@pytest.fixture(params=sorted(CONFIGS))
def meta_case(request):
    name = request.param
    return build_from_meta_file(name), load_file(FIXTURES / f"{name}_outputs.safetensors"), name


@torch.no_grad()
def test_forward_matches_meta(meta_case):
    model, out, _ = meta_case
    x = out["input"]
    tokens = model.forward_features(x)
    assert_fp32_close(model(x), out["forward"])
    assert_fp32_close(tokens[:, 0], out["x_norm_clstoken"])
    assert_fp32_close(tokens[:, 1:5], out["x_storage_tokens"])
    assert_fp32_close(tokens[:, 5:], out["x_norm_patchtokens"])


@torch.no_grad()
def test_masked_tokens_match_meta(meta_case):
    model, out, _ = meta_case
    tokens = model.forward_features(out["input"], masks=out["masks"].bool())
    assert_fp32_close(tokens[:, 0], out["masked_x_norm_clstoken"])
    assert_fp32_close(tokens[:, 5:], out["masked_x_norm_patchtokens"])


@torch.no_grad()
def test_get_intermediate_layers_matches_meta(meta_case):
    model, out, _ = meta_case
    normed = model.get_intermediate_layers(
        out["input"], n=2, reshape=True, return_class_token=True, return_extra_tokens=True
    )
    for i, (patch, cls, extra) in enumerate(normed):
        assert_fp32_close(patch, out[f"gil_norm_{i}_patch"])
        assert_fp32_close(cls, out[f"gil_norm_{i}_cls"])
        assert_fp32_close(extra, out[f"gil_norm_{i}_extra"])
    raw = model.get_intermediate_layers(out["input"], n=[0, 1], norm=False)
    for i, patch in enumerate(raw):
        assert_fp32_close(patch, out[f"gil_raw_{i}"])


@torch.no_grad()
def test_the_parity_tolerance_still_fails_a_swapped_gamma_or_a_dropped_bias(meta_case):
    model, out, _ = meta_case
    x = out["input"]
    patches = out["x_norm_patchtokens"]
    assert_catches_swapped_gammas_and_dropped_biases(model, lambda m: m.forward_features(x)[:, 5:], patches)


def test_meta_layout_is_native_and_round_trips(meta_case):
    """Meta's keys and values, but the qkv bias: loading folds the mask into it (the file's k rows are not
    zero), so the plain linear adds what Meta's LinearKMaskedBias adds."""
    model, _, name = meta_case
    meta_sd = load_file(FIXTURES / f"{name}.safetensors")
    ours = model.state_dict()
    assert set(ours) == set(meta_sd)
    folded = 0
    for key, value in meta_sd.items():
        if key.endswith("attn.qkv.bias") and f"{key}_mask" in meta_sd:
            value, folded = value * meta_sd[f"{key}_mask"], folded + 1
        assert torch.equal(ours[key], value), key
    meta = META_CONFIGS[name]
    assert folded == (len(model.blocks) if meta["qkv_bias"] and meta["mask_k_bias"] else 0)


@torch.no_grad()
def test_loaded_bias_mask_is_kept_not_regenerated():
    model = build_from_meta_file("meta_mlp")
    masks = [b.attn.qkv.bias_mask for b in model.blocks]
    stored = load_file(FIXTURES / "meta_mlp.safetensors")
    for i, mask in enumerate(masks):
        assert torch.equal(mask, stored[f"blocks.{i}.attn.qkv.bias_mask"])
    # Released checkpoints carry an all-zero mask: loading it must switch every qkv bias off.
    stored = {k: (torch.zeros_like(v) if k.endswith("bias_mask") else v) for k, v in stored.items()}
    model.load_state_dict(stored)
    assert all(not b.attn.qkv.bias_mask.any() for b in model.blocks)
    x = torch.randn(1, 3, 32, 32)
    with_mask = model(x)
    for block in model.blocks:
        block.attn.qkv.bias.zero_()
    assert max_diff(with_mask, model(x)) == 0.0


def test_checkpoint_periods_replace_defaults():
    model = build_from_meta_file("meta_mlp")
    stored = load_file(FIXTURES / "meta_mlp.safetensors")["rope_embed.periods"]
    assert torch.equal(model.rope_embed.periods, stored)
    assert model.rope_embed.periods.dtype == torch.float32
    model.to(torch.bfloat16)
    assert model.rope_embed.periods.dtype == torch.float32
