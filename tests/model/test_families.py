"""Every family of DINOv3-style ViT in timm (EUPE, LingBot-Vision, Sapiens2) expressed by our one model: timm's
own eva model of each, moved off its init, loaded into ours, with the same outputs.

eva computes RoPE periods in fp32 without rounding, so ours take `rope_periods_bf16=False` here.
"""

import warnings

import pytest
import timm
import torch
from safetensors.torch import save_file
from support import FP32_RTOL, assert_fp32_close, move_off_init_, relative_diff
from support.families import EVA_HAS_FAMILIES, FAMILIES, eva_family

needs_eva_families = pytest.mark.skipif(
    not EVA_HAS_FAMILIES, reason="this timm's eva has none of these families (1.0.31 has)"
)


def ours_from_eva(name: str, path) -> torch.nn.Module:
    ours, _, _ = FAMILIES[name]
    return timm.create_model(
        "vit_ls_small_patch16_dinov3",
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(path)),
        rope_periods_bf16=False,
        num_classes=0,
        **ours,
    ).eval()


@needs_eva_families
@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_each_family_matches_timm_eva(name, tmp_path):
    ref = eva_family(name)
    save_file(ref.state_dict(), tmp_path / "model.safetensors")
    model = ours_from_eva(name, tmp_path / "model.safetensors")
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in ref.parameters()) == (
        model.embed_dim if model.mask_token is not None else 0
    ) + sum(b.attn.qkv.bias.numel() // 3 for b in model.blocks if b.attn.qkv.bias is not None and name != "sapiens2")
    images = torch.randn(2, 3, 64, 48)
    tokens = model.forward_features(images)
    assert_fp32_close(tokens, ref.forward_features(images))
    assert_fp32_close(model(images), ref(images))


@needs_eva_families
@torch.no_grad()
def test_the_sapiens2_check_fails_a_dropped_bias_or_norm(tmp_path):
    ref = eva_family("sapiens2")
    save_file(ref.state_dict(), tmp_path / "model.safetensors")
    model = ours_from_eva("sapiens2", tmp_path / "model.safetensors")
    images = torch.randn(1, 3, 48, 32)
    expected = ref.forward_features(images)
    assert_fp32_close(model.forward_features(images), expected)
    # A bias or gamma of a grouped block, a qk-norm, a block norm: each moves the outputs far past the tolerance.
    moved = ("blocks.9.attn.qkv.bias", "blocks.8.ls1.gamma", "blocks.9.attn.k_norm.weight", "blocks.0.norm2.weight")
    for name in moved:
        param = model.get_parameter(name)
        kept = param.clone()
        param.mul_(-0.5)
        assert relative_diff(model.forward_features(images), expected) > 100 * FP32_RTOL, name
        param.copy_(kept)


# Sapiens2's code paths at their smallest: a grouped block between full ones, qk-norm, RMSNorm, no mask token.
GROUPED = dict(FAMILIES["sapiens2"][0], depth=3, num_kv_heads=[4, 2, 4])


def grouped(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_ls_small_patch16_dinov3", num_classes=5, **{**GROUPED, **kwargs})
    return move_off_init_(model).eval()


@pytest.mark.parametrize("rope_dtype", ["fp32", "bf16"])
@torch.no_grad()
def test_grouped_attention_traces_scripts_and_exports(rope_dtype):
    model = grouped(rope_dtype=rope_dtype)
    images = torch.randn(2, 3, 48, 32)
    expected = model(images)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated in torch, still supported
        scripted = torch.jit.script(model)
    assert torch.equal(scripted(images), expected)
    traced = torch.fx.symbolic_trace(model)
    assert torch.equal(traced(images), expected)
    other = torch.randn(1, 3, 32, 64)
    assert torch.equal(traced(other), model(other))  # no size fixed at trace time
    exported = torch.export.export(model, (images,))
    assert_fp32_close(exported.module()(images), expected)


@torch.no_grad()
def test_bf16_rope_is_sapiens2s_bf16_tables_and_rotation():
    fp32, bf16 = grouped(), grouped(rope_dtype="bf16")
    bf16.load_state_dict(fp32.state_dict())
    sin, cos = bf16.rope_embed(3, 2)
    assert sin.dtype == cos.dtype == torch.bfloat16
    images = torch.randn(1, 3, 48, 32)
    # bf16 tables and rotation move the outputs by far more than fp32 noise, far less than a broken block.
    assert 1e-4 < relative_diff(bf16(images), fp32(images)) < 1e-1


def test_mask_token_off_refuses_masks_in_one_line():
    model = grouped()
    assert "mask_token" not in model.state_dict()
    with pytest.raises(ValueError, match="no mask token"):
        model.forward_features(torch.randn(1, 3, 32, 32), masks=torch.zeros(1, 4, dtype=torch.bool))
