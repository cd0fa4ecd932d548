"""The training paths on Sapiens2's architecture (grouped k/v heads, qk-norm, RMSNorm, no mask token, attention-only
LayerScale): timm's NaFlex batches, each image equal to its own forward, and train.py's `--torchcompile` graph."""

from __future__ import annotations

import pytest
import timm
import torch
from support import FP32_RTOL, assert_compiled_matches_eager, assert_fp32_close, move_off_init_
from timm.data.naflex_dataset import NaFlexCollator
from timm.data.naflex_transforms import patchify_image

NAME = "vit_ls_base_patch16_sapiens2"
GROUPED = dict(embed_dim=64, num_heads=4, depth=3, num_kv_heads=[4, 2, 4], num_classes=3, dynamic_img_pad=True)
SIZES = [(48, 80), (64, 32), (40, 40)]


def sapiens2(rope_dtype: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model(NAME, rope_dtype=rope_dtype, **GROUPED)).eval()
    assert model.config.qk_norm and model.config.norm_layer == "rmsnorm" and not model.config.mask_token
    assert [b.attn.num_kv_heads for b in model.blocks] == [4, 2, 4]
    return model


def naflex_batch(imgs: list[torch.Tensor]) -> dict:
    items = []
    for img in imgs:
        patches, coord, valid = patchify_image(img, (16, 16), flatten_patches=True, channels_last=True)
        items.append(({"patches": patches, "patch_coord": coord, "patch_valid": valid}, 0))
    seq_len = max(item["patches"].shape[0] for item, _ in items) + 3
    return NaFlexCollator(max_seq_len=seq_len)(items)[0]


@pytest.mark.parametrize("rope_dtype", ["fp32", "bf16"])
@torch.no_grad()
def test_each_image_of_a_naflex_batch_equals_its_own_forward(rope_dtype):
    model = sapiens2(rope_dtype)
    generator = torch.Generator().manual_seed(3)
    imgs = [torch.randn(3, h, w, generator=generator) for h, w in SIZES]
    batch = naflex_batch(imgs)
    assert not batch["patch_valid"].all()
    logits = model(batch)
    features = model.forward_features(batch)["patches"]
    prefix = model.num_prefix_tokens
    # bf16 RoPE's tables are the same either path, but it rounds q and k to bf16, whose fp32 inputs differ in
    # their last bits between the two (patches embedded by a conv or by a linear layer): how many roundings flip
    # depends on the CPU's kernels (1.7e-4 of the scale seen with AVX-512, none with AVX2). NaFlex patch centres
    # computed in fp32 instead of bf16 move the outputs by 2e-3, ten times this tolerance.
    rtol = FP32_RTOL if rope_dtype == "fp32" else 5e-4
    for i, img in enumerate(imgs):
        count = int(batch["patch_valid"][i].sum())
        assert_fp32_close(logits[i : i + 1], model(img[None]), rtol=rtol, what=f"image {i} logits")
        image_features = model.forward_features(img[None])
        assert_fp32_close(features[i : i + 1, : prefix + count], image_features, rtol=rtol, what=f"image {i}")


def test_torch_compile_traces_the_grouped_model_with_gradients():
    """train.py's `--torchcompile`: one graph, no breaks, the same loss and gradients as eager."""
    model = sapiens2("bf16").train()
    images = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(1))
    assert "blocks.1.attn.k_norm.weight" in assert_compiled_matches_eager(model, images)
