import json

import pytest
import timm
import timm.data
import torch
from packaging.version import Version
from PIL import Image
from safetensors.torch import save_file
from support import TINY, VARIANT, assert_fp32_close, max_diff, move_off_init_
from timm.layers import RotaryEmbeddingDinoV3
from timm.models._manipulate import group_parameters

from timm_layerscale import VisionTransformerLS, convert_checkpoint, save_native
from timm_layerscale.layers import RopeEmbedding, apply_rope

# Meta's published parameter counts (millions), mask token and qkv biases included.
PARAMS_M = {
    "vit_ls_small_patch16_dinov3": 21.60,
    "vit_ls_small_plus_patch16_dinov3": 28.70,
    "vit_ls_base_patch16_dinov3": 85.67,
    "vit_ls_large_patch16_dinov3": 303.15,
    "vit_ls_huge_plus_patch16_dinov3": 840.63,
    "vit_ls_7b_patch16_dinov3": 6716.04,
}
# timm 1.0.31 records model arguments (create_model's, and resizes) and its save_for_hf writes them.
RECORDS_MODEL_ARGS = Version(timm.__version__) >= Version("1.0.31")
TAGS = {
    "vit_ls_tiny_patch16_dinov3": ["eupe_lvd1689m"],
    "vit_ls_small_patch16_dinov3": ["lvd1689m", "lvd1689m_facebook", "eupe_lvd1689m"],
    "vit_ls_small_plus_patch16_dinov3": ["lvd1689m", "lvd1689m_facebook"],
    "vit_ls_base_patch16_dinov3": ["lvd1689m", "lvd1689m_facebook", "eupe_lvd1689m"],
    "vit_ls_large_patch16_dinov3": ["lvd1689m", "sat493m", "lvd1689m_facebook", "sat493m_facebook"],
    "vit_ls_large_plus_patch16_dinov3": [],
    "vit_ls_huge_plus_patch16_dinov3": ["lvd1689m", "lvd1689m_facebook"],
    "vit_ls_7b_patch16_dinov3": ["lvd1689m", "sat493m", "lvd1689m_facebook", "sat493m_facebook"],
    **{f"vit_ls_{s}_patch16_lingbot": ["robbyant"] for s in ("small", "base", "large", "giant")},
    **{f"vit_ls_{s}_patch16_sapiens2": ["fb"] for s in ("base", "large", "huge", "giant", "5b")},
}
# Our tags of the other families -> timm's eva tag of the same weights.
EVA_TAGS = {
    **{
        f"vit_ls_{s}_patch16_dinov3.eupe_lvd1689m": f"vit_{s}_patch16_dinov3_qkvb.eupe_lvd1689m"
        for s in ("tiny", "small", "base")
    },
    **{
        f"vit_ls_{s}_patch16_lingbot.robbyant": f"vit_{s}_patch16_lingbot.robbyant"
        for s in ("small", "base", "large", "giant")
    },
    **{
        f"vit_ls_{s}_patch16_sapiens2.fb": f"vit_{s}_patch16_sapiens2.fb"
        for s in ("base", "large", "huge", "giant", "5b")
    },
}
DATA_FIELDS = (
    "hf_hub_id",
    "license",
    "input_size",
    "min_input_size",
    "interpolation",
    "crop_pct",
    "crop_mode",
    "mean",
    "std",
)


def tiny(name="vit_ls_small_patch16_dinov3", **kwargs):
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(name, **{**TINY, **kwargs})).eval()


def test_registration_and_tags():
    assert sorted(timm.list_models("vit_ls_*")) == sorted(TAGS)
    pretrained = set(timm.list_pretrained("vit_ls_*"))
    assert pretrained == {f"{name}.{tag}" for name, tags in TAGS.items() for tag in tags}
    for name in pretrained:
        cfg = timm.models.get_pretrained_cfg(name)
        if name.endswith("_facebook"):  # Meta's official repos, checked in test_hub_sources.py
            assert cfg.hf_hub_id.startswith("facebook/dinov3-vit")
        elif name in EVA_TAGS:  # checked against timm's own tags below
            continue
        else:
            assert cfg.hf_hub_id.startswith("timm/vit_") and cfg.hf_hub_id.endswith(name.split(".")[1])
    assert timm.models.get_pretrained_cfg("vit_ls_7b_patch16_dinov3.sat493m").mean == (0.430, 0.411, 0.296)


@pytest.mark.skipif(not timm.models.is_model("vit_base_patch16_sapiens2"), reason="this timm has no such tags")
@pytest.mark.parametrize("name", sorted(EVA_TAGS))
def test_each_family_tag_is_timms_repo_licence_and_data_config(name):
    ours, theirs = timm.models.get_pretrained_cfg(name), timm.models.get_pretrained_cfg(EVA_TAGS[name])
    assert {f: getattr(ours, f) for f in DATA_FIELDS} == {f: getattr(theirs, f) for f in DATA_FIELDS}
    assert not ours.fixed_input_size  # ours take any size
    model, eva = (timm.create_model(n, device="meta", num_classes=0) for n in (name, EVA_TAGS[name].split(".")[0]))
    count, eva_count = (sum(p.numel() for p in m.parameters()) for m in (model, eva))
    # ours keep the mask token and the (masked) k bias, which eva's DINOv3-layout ports drop; Sapiens2 has neither
    extra = 0 if name.endswith(".fb") else model.embed_dim * (1 + len(model.blocks) * model.config.qkv_bias)
    assert count - extra == eva_count
    assert abs(count - eva_count) / eva_count < 1e-3


@pytest.mark.parametrize("name", sorted(PARAMS_M))
def test_parameter_counts_match_meta(name):
    model = timm.create_model(name, device="meta")
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == PARAMS_M[name]


def test_tags_set_local_cls_norm():
    assert timm.create_model("vit_ls_large_patch16_dinov3.lvd1689m", device="meta").local_cls_norm is None
    assert timm.create_model("vit_ls_large_patch16_dinov3.sat493m", device="meta").local_cls_norm is not None
    assert timm.create_model("vit_ls_7b_patch16_dinov3.lvd1689m", device="meta").local_cls_norm is not None


def test_7b_on_meta_device_has_meta_shapes():
    model = timm.create_model("vit_ls_7b_patch16_dinov3", device="meta", dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["blocks.39.mlp.w1.weight"].shape == (8192, 4096)  # int(4096 * 3 * 2 / 3) aligned to 64
    assert sd["blocks.0.ls1.gamma"].dtype == torch.bfloat16 and sd["blocks.0.ls1.gamma"].is_meta
    assert sd["rope_embed.periods"].dtype == torch.float32
    assert "blocks.0.attn.qkv.bias" not in sd and "local_cls_norm.weight" in sd
    out = model.forward_features(torch.empty(1, 3, 64, 64, device="meta", dtype=torch.bfloat16))
    assert out.shape == (1, 5 + 16, 4096)


@pytest.mark.parametrize(
    ("pool", "width"), [("token", 64), ("avg", 64), ("avgmax", 64), ("max", 64), ("cls_avg", 128), ("", None)]
)
@torch.no_grad()
def test_global_pools(pool, width, images):
    model = tiny(global_pool=pool, num_classes=7)
    tokens = model.forward_features(images)
    pooled = model.forward_head(tokens, pre_logits=True)
    patches = tokens[:, 5:]
    expected = {
        "token": tokens[:, 0],
        "avg": patches.mean(1),
        "avgmax": 0.5 * (patches.amax(1) + patches.mean(1)),
        "max": patches.amax(1),
        "cls_avg": torch.cat([tokens[:, 0], patches.mean(1)], -1),
        "": tokens,
    }[pool]
    assert torch.equal(pooled, expected)
    assert model(images).shape == (*expected.shape[:-1], 7)
    if width:
        assert model.head_hidden_size == width and model.get_classifier().in_features == width


@pytest.mark.parametrize("training", [True, False])
def test_reset_classifier_keeps_the_model_mode(training):
    model = tiny(num_classes=5).train(training)
    for num_classes, pool in [(3, "avg"), (0, None), (2, None)]:
        model.reset_classifier(num_classes, pool)
        assert all(m.training == training for m in model.modules())


def test_in_chans_is_an_attribute_and_sizes_the_stem():
    model = tiny(in_chans=1)
    assert model.in_chans == 1 and model.patch_embed.proj.in_channels == 1
    assert model(torch.randn(1, 1, 32, 32)).shape == (1, 64)


def test_reset_classifier_and_timm_api():
    model = tiny(num_classes=5)
    model.reset_classifier(3, "cls_avg")
    assert model.head.in_features == 128 and model.head.out_features == 3 and model.num_classes == 3
    model.reset_classifier(0)
    assert isinstance(model.get_classifier(), torch.nn.Identity) and model.global_pool == "cls_avg"
    with pytest.raises(ValueError, match="global_pool: got 'mean'"):
        model.reset_classifier(2, "mean")
    assert model.num_prefix_tokens == 5
    assert model.no_weight_decay() == {"cls_token", "storage_tokens", "mask_token"}
    layers = group_parameters(tiny(), model.group_matcher(), reverse=True)  # layer-wise lr decay's map
    assert layers["cls_token"] == layers["storage_tokens"] == layers["patch_embed.proj.weight"] == 0
    assert layers["blocks.0.ls1.gamma"] == 1 and layers["blocks.1.ls2.gamma"] == 2 and layers["norm.weight"] == 2


@torch.no_grad()
def test_forward_intermediates_contract_and_meta_method(images):
    model = tiny()
    final, inter = model.forward_intermediates(images, indices=2, norm=True, return_prefix_tokens=True)
    assert max_diff(final, model.forward_features(images)) == 0
    assert [t.shape for t, _ in inter] == [(2, 64, 3, 5)] * 2
    gil = model.get_intermediate_layers(images, n=2, reshape=True, return_class_token=True, return_extra_tokens=True)
    assert len(gil) == len(inter) == 2  # stop_early runs every block up to the last one taken
    for (patch, prefix), (g_patch, g_cls, g_extra) in zip(inter, gil):
        assert torch.equal(patch, g_patch) and torch.equal(prefix[:, 0], g_cls) and torch.equal(prefix[:, 1:], g_extra)
    nlc = model.forward_intermediates(images, indices=[0], output_fmt="NLC", intermediates_only=True)
    assert nlc[0].shape == (2, 15, 64)
    assert torch.equal(nlc[0], model.get_intermediate_layers(images, n=[0], norm=False)[0])
    assert max_diff(inter[-1][0].flatten(2).transpose(1, 2), final[:, 5:]) == 0


@torch.no_grad()
def test_features_only_and_pruning(images):
    model = timm.create_model("vit_ls_small_patch16_dinov3", features_only=True, out_indices=(0, 1), **TINY)
    feats = model(images)
    assert [f.shape for f in feats] == [(2, 64, 3, 5)] * 2
    assert model.feature_info.channels() == [64, 64] and model.feature_info.reduction() == [16, 16]
    default = timm.create_model("vit_ls_small_patch16_dinov3", features_only=True, **TINY)
    assert len(default(images)) == 2  # the last four blocks, or all when there are fewer
    six = timm.create_model("vit_ls_small_patch16_dinov3", features_only=True, depth=6, embed_dim=64, num_heads=4)
    assert len(six(images)) == 4
    full = tiny(depth=4)
    taken = full.prune_intermediate_layers([1], prune_head=True)
    assert taken == [1] and len(full.blocks) == 2


@torch.no_grad()
def test_prune_norm_ends_features_at_the_tap(images):
    model = tiny(depth=3, cls_norm=True)
    (patches, prefix), *_ = model.forward_intermediates(
        images, indices=[1], output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True
    )
    assert model.prune_intermediate_layers([1], prune_norm=True) == [1] and len(model.blocks) == 2
    features = model.forward_features(images)
    assert torch.equal(features[:, 5:], patches) and torch.equal(features[:, :5], prefix)


def test_non_multiple_of_patch_size_rule():
    model = tiny()
    with pytest.raises(
        ValueError,
        match=r"input size 50x80 is not a multiple of the patch size 16: resize or crop it to 48x80, .*dynamic_img_pad",
    ):
        model(torch.randn(1, 3, 50, 80))
    padded = tiny(dynamic_img_pad=True)
    assert padded.forward_features(torch.randn(1, 3, 50, 80)).shape == (1, 5 + 4 * 5, 64)


@pytest.mark.parametrize("size", [(8, 8), (8, 64), (64, 15)])
def test_input_smaller_than_a_patch_is_told_the_smallest_size(size):
    message = f"input size {size[0]}x{size[1]} is smaller than the patch size 16: resize it to at least 16x16"
    with pytest.raises(ValueError, match=message):
        tiny()(torch.randn(1, 3, *size))
    with pytest.raises(ValueError, match=message):
        tiny().forward_intermediates(torch.randn(1, 3, *size))
    grid = -(-size[0] // 16) * -(-size[1] // 16)
    assert tiny(dynamic_img_pad=True).forward_features(torch.randn(1, 3, *size)).shape == (1, 5 + grid, 64)


def test_any_image_size_without_interpolation():
    model = tiny()
    for size in [(32, 32), (64, 160), (256, 256)]:
        grid = size[0] // 16 * size[1] // 16
        assert model.forward_features(torch.randn(1, 3, *size)).shape == (1, 5 + grid, 64)


def test_backward_reaches_every_trainable_parameter(images):
    model = tiny(cls_norm=True, local_cls_norm=True, num_classes=3).train()
    model(images).sum().backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert no_grad == []  # DDP without find_unused_parameters needs this
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() == 0
    assert not any(p.requires_grad for p in model.local_cls_norm.parameters())


def test_grad_checkpointing_gives_same_outputs_and_grads(images):
    model = tiny(num_classes=3)
    reference = model(images)
    reference.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    out = model(images)
    out.sum().backward()
    assert max_diff(out, reference) == 0
    for name, param in model.named_parameters():
        if name in grads:
            assert_fp32_close(param.grad, grads[name], what=name)


@pytest.mark.parametrize("grad_checkpointing, runs_per_block", [(False, 1), (True, 2)])
def test_grad_checkpointing_reruns_each_block_in_the_backward(images, grad_checkpointing, runs_per_block):
    model = tiny().train()
    model.set_grad_checkpointing(grad_checkpointing)
    runs = []
    for block in model.blocks:  # a pre-hook: the recomputation stops once it has what the backward needs
        block.register_forward_pre_hook(lambda module, args: runs.append(module))
    model(images).sum().backward()
    assert [runs.count(block) for block in model.blocks] == [runs_per_block] * len(model.blocks)


def test_drop_path_kinds_in_train_mode(images):
    batch = torch.randn(8, 3, 32, 32)
    drop_path = tiny(drop_path_rate=0.5)
    assert [type(b.drop_path).__name__ for b in drop_path.blocks] == [
        "Identity",
        "DropPath",
    ]  # linear schedule
    drop_path.train()
    torch.manual_seed(1)
    a = drop_path.forward_features(batch)
    torch.manual_seed(2)
    assert max_diff(a, drop_path.forward_features(batch)) > 1e-3
    drop_path.eval()
    assert torch.equal(drop_path.forward_features(batch), drop_path.forward_features(batch))

    sample = tiny(drop_path_rate=0.5, stochastic_depth="sample_drop")
    assert [b.sample_drop_rate for b in sample.blocks] == [0.5, 0.5]  # DINOv3: uniform rate
    eval_out = sample.forward_features(batch)
    sample.train()
    calls = []
    handle = sample.blocks[0].attn.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    torch.manual_seed(3)
    train_out = sample.forward_features(batch)
    handle.remove()
    assert calls == [4]  # the branch ran on half the batch only
    assert max_diff(train_out, eval_out) > 1e-3
    train_out.sum().backward()


@pytest.mark.parametrize(("batch", "kept"), [(4, 2), (1, 1)])
@torch.no_grad()
def test_sample_drop_adds_each_branch_to_a_subset_scaled_by_batch_over_kept(batch, kept):
    block = tiny(drop_path_rate=0.5, stochastic_depth="sample_drop").blocks[0].train()
    x = torch.randn(batch, 7, 64)
    torch.manual_seed(9)  # at batch 4: samples {0, 2} for attention, {1, 3} for the MLP
    out = block(x)
    torch.manual_seed(9)
    expected = x.clone()
    index = torch.randperm(batch)[:kept]
    expected[index] += batch / kept * block.ls1(block.attn(block.norm1(x[index])))
    index = torch.randperm(batch)[:kept]
    expected[index] += batch / kept * block.ls2(block.mlp(block.norm2(expected[index])))
    assert_fp32_close(out, expected)


def test_sample_drop_trains_under_autocast():
    """Under autocast the residual stream is bf16 but a LayerScale'd branch is fp32 (fp32 gammas)."""
    model = tiny(depth=1, drop_path_rate=0.5, stochastic_depth="sample_drop").train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.forward_features(torch.randn(4, 3, 32, 32))
    out.float().sum().backward()
    assert model.blocks[0].ls2.gamma.grad is not None


@pytest.mark.parametrize("grad_checkpointing", [False, True])
def test_rope_augmentation_only_in_training_and_per_block(images, grad_checkpointing):
    model = tiny(rope_rescale_coords=2.0)
    plain = tiny()
    with torch.no_grad():
        assert torch.equal(model.forward_features(images), plain.forward_features(images))
    model.train().set_grad_checkpointing(grad_checkpointing)
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args: seen.append(args[1][0].clone()))
    model.forward_features(images)
    assert not torch.equal(seen[0], seen[1])


def test_masks_replace_patch_tokens(images):
    model = tiny()
    masks = torch.zeros(2, 15, dtype=torch.bool)
    masks[:, 3] = True
    tokens = model.prepare_tokens(images, masks)
    assert torch.equal(tokens[:, 5 + 3], model.mask_token.expand(2, -1))


AUGMENT = dict(shift_coords=0.2, jitter_coords=1.5, rescale_coords=2.0)


@pytest.mark.parametrize("normalize_coords", ["separate", "max", "min"])
@pytest.mark.parametrize("augment", [{}, dict(shift_coords=0.2), AUGMENT], ids=["none", "shift", "all"])
def test_rope_matches_timms_dinov3_rope(normalize_coords, augment):
    """timm's RotaryEmbeddingDinoV3 (DINOv3's coordinates, augmentations and draw order) on a 3x5 grid."""
    coords = dict(normalize_coords=normalize_coords, **augment)
    ours = RopeEmbedding(16, num_prefix_tokens=5, round_periods_to_bf16=False, **coords)
    timms = RotaryEmbeddingDinoV3(16, temperature=100.0, **coords)
    for training in (False, True):
        ours.train(training), timms.train(training)
        torch.manual_seed(0)
        signed_sin, cos = ours(3, 5)
        torch.manual_seed(0)
        expected_sin, expected_cos = timms.get_embed(shape=[3, 5]).chunk(2, dim=-1)
        assert not signed_sin[:5].any() and (cos[:5] == 1).all()  # the prefix tokens are not rotated
        assert_fp32_close(signed_sin[5:, 8:], expected_sin[:, 8:])
        assert_fp32_close(signed_sin[5:, :8], -expected_sin[:, :8])
        assert_fp32_close(cos[5:], expected_cos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_meta_rotate_half_computed_in_fp32(dtype):
    sin, cos = RopeEmbedding(8, num_prefix_tokens=1, round_periods_to_bf16=False)(2, 3)
    assert sin.shape == cos.shape == (7, 8) and not sin[0].any() and (cos[0] == 1).all()
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(0)).to(dtype)

    def meta(x, sin, cos):  # Meta's rope_apply on a tensor in the rope's dtype
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin[..., 4:].repeat(1, 2)

    assert torch.equal(apply_rope(x, (sin, cos)), meta(x.float(), sin, cos).to(dtype))
    assert torch.equal(apply_rope(x, (sin, cos))[0], x[0])  # prefix tokens are not rotated
    if dtype == torch.bfloat16:  # rotating in bf16 (as the anchors do) gives other values
        assert not torch.equal(apply_rope(x, (sin, cos)), meta(x, sin.to(dtype), cos.to(dtype)))


def test_bf16_forward_is_close_to_fp32():
    model = tiny(depth=1)
    x = torch.randn(1, 3, 32, 32)
    fp32 = model(x)
    bf16 = model.to(torch.bfloat16)(x.bfloat16())
    assert bf16.dtype == torch.bfloat16 and max_diff(bf16, fp32) < 0.1 * fp32.abs().max()


def test_direct_construction_matches_registered_variant():
    model = VisionTransformerLS(embed_dim=64, num_heads=4, depth=2, num_classes=0)
    assert set(model.state_dict()) == set(timm.create_model("vit_ls_small_patch16_dinov3", **TINY).state_dict())


def test_default_periods_are_the_released_bf16_values():
    periods = timm.create_model("vit_ls_small_patch16_dinov3", device="meta").rope_embed
    model = timm.create_model("vit_ls_small_patch16_dinov3", depth=1)
    assert periods.periods.shape == (16,)
    assert model.rope_embed.periods[:3].tolist() == [1.0, 1.3359375, 1.78125]
    assert model.rope_embed.periods[-1].item() == 75.0  # 100 ** (60 / 64) = 74.99... rounds to 75 in bf16
    exact = timm.create_model("vit_ls_small_patch16_dinov3", depth=1, rope_periods_bf16=False)
    assert exact.rope_embed.periods[1].item() == pytest.approx(100 ** (4 / 64), rel=1e-7)


# ------------------------------------------------------------------------------------------ set_input_size

RESIZES = [dict(img_size=(64, 32)), dict(patch_size=8), dict(img_size=64, patch_size=(8, 8))]


def resized_pair(tmp_path, ffn, dynamic):
    """Ours (random, moved off init, fp32 RoPE periods as eva computes them) and eva from the same weights,
    converted with `convert_checkpoint(..., to="timm")`, both at 48x80."""
    size = dict(img_size=(48, 80), dynamic_img_size=dynamic)
    ours = tiny(VARIANT[ffn], rope_periods_bf16=False, **size)
    save_file(ours.state_dict(), tmp_path / "ours.safetensors")
    convert_checkpoint(
        tmp_path / "ours.safetensors", tmp_path / "eva", to="timm", model=VARIANT[ffn], model_kwargs=TINY
    )
    eva = timm.create_model(f"local-dir:{tmp_path / 'eva'}", pretrained=True, **size).eval()
    assert type(eva).__name__ == "Eva" and eva.patch_embed.strict_img_size is not dynamic
    return ours, eva


def assert_same_outputs(ours, eva, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    tokens, expected = ours.forward_features(x), eva.forward_features(x)
    assert tokens.shape == expected.shape
    assert_fp32_close(tokens, expected)
    pooled = ours.forward_head(tokens, pre_logits=True)
    assert_fp32_close(pooled, eva.forward_head(expected, pre_logits=True))


@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
@pytest.mark.parametrize("resize", RESIZES, ids=["img_size", "patch_size", "both"])
@torch.no_grad()
def test_set_input_size_matches_timm_eva_on_a_fixed_size_model(tmp_path, ffn, resize):
    ours, eva = resized_pair(tmp_path, ffn, dynamic=False)
    assert_same_outputs(ours, eva, (2, 3, 48, 80))
    ours.set_input_size(**resize)
    eva.set_input_size(**resize)
    assert torch.equal(ours.patch_embed.proj.weight, eva.patch_embed.proj.weight)  # resampled as timm does
    height, width = eva.patch_embed.img_size
    assert_same_outputs(ours, eva, (2, 3, height, width))
    for model in (ours, eva):  # the fixed size moved: the old one is refused by both
        with pytest.raises(AssertionError, match="doesn't match model"):
            model.forward_features(torch.randn(1, 3, height + 16, width))
    patch = ours.patch_size
    assert patch == eva.patch_embed.patch_size[0] and ours.feature_info[-1]["reduction"] == patch
    assert ours.config.patch_size == patch and ours.pretrained_cfg["input_size"] == (3, height, width)
    config = timm.data.resolve_data_config(model=ours)
    assert timm.data.create_transform(**config)(Image.new("RGB", (300, 200))).shape == (3, height, width)


@pytest.mark.parametrize("resize", RESIZES[1:], ids=["patch_size", "both"])
@torch.no_grad()
def test_set_input_size_matches_timm_eva_on_a_dynamic_model(tmp_path, resize):
    ours, eva = resized_pair(tmp_path, "mlp", dynamic=True)
    ours.set_input_size(**resize)
    eva.set_input_size(**resize)
    for shape in [(2, 3, 48, 80), (1, 3, 32, 72)]:  # any multiple of the new patch size
        assert_same_outputs(ours, eva, shape)


@torch.no_grad()
def test_a_resized_model_saves_and_rebuilds_resized(tmp_path):
    model = tiny(dynamic_img_size=False, img_size=(48, 80))
    model.set_input_size(img_size=(32, 64), patch_size=8)
    x = torch.randn(2, 3, 32, 64)
    save_native(model, tmp_path / "native")
    again = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    assert again.patch_size == 8 and tuple(again.config.img_size) == (32, 64)
    assert torch.equal(again(x), model(x))
    if RECORDS_MODEL_ARGS:  # timm's own export records the resize
        timm.models.save_for_hf(model, tmp_path / "timm")
        args = json.loads((tmp_path / "timm" / "config.json").read_text())["model_args"]
        assert args["patch_size"] == 8 and tuple(args["img_size"]) == (32, 64)
        again = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
        assert torch.equal(again(x), model(x))


def test_set_input_size_refuses_bad_values_and_keeps_the_model():
    model = tiny(dynamic_img_size=False, img_size=(48, 80))
    before = model.patch_embed.proj.weight.clone()
    with pytest.raises(ValueError, match="img_size"):
        model.set_input_size(img_size=(50, 80))
    with pytest.raises(ValueError, match="img_size"):  # 48x80 is no multiple of 20
        model.set_input_size(patch_size=20)
    with pytest.raises(ValueError, match="square patches"):
        model.set_input_size(patch_size=(8, 16))
    assert model.patch_size == 16 and model.config.img_size == (48, 80)
    assert torch.equal(model.patch_embed.proj.weight, before) and model.patch_embed.img_size == (48, 80)
