"""NaFlex input (timm's `--naflex-loader`): each image of a padded, mixed batch as if it ran alone.

Batches are made by timm's own `patchify_image` and `NaFlexCollator` (what `create_naflex_loader` strings
together), and checked against the image path (`dynamic_img_pad=True`: `patchify_image` pads the bottom and
right the same way) and against timm's `NaFlexVit` on the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from support import EVA, TINY, assert_fp32_close, move_off_init_
from timm.data import NaFlexMixup, create_dataset, create_naflex_loader
from timm.data.naflex_dataset import NaFlexCollator
from timm.data.naflex_transforms import patchify_image
from timm.models.naflexvit import checkpoint_filter_fn as naflex_filter

NAME = "vit_ls_small_patch16_dinov3"
POOLS = ["token", "avg", "max", "avgmax", "cls_avg"]
# (height, width) in pixels: wide, tall, square, and sides that are not multiples of 16 (padded up).
SIZES = [(48, 80), (64, 32), (40, 40), (16, 112)]
CPU = torch.device("cpu")


def tiny(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = {**TINY, "num_classes": 5, "dynamic_img_pad": True, **kwargs}
    return move_off_init_(timm.create_model(NAME, **kwargs)).eval()


def images(sizes=SIZES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(3, h, w, generator=generator) for h, w in sizes]


def naflex_batch(imgs, patch=16, channels_last=True, flatten=True, seq_len=None) -> dict:
    """timm's patchify_image per image, then timm's NaFlexCollator pads them to `seq_len` (default: longest + 3)."""
    items = []
    for img in imgs:
        patches, coord, valid = patchify_image(
            img, (patch, patch), flatten_patches=flatten, channels_last=channels_last
        )
        items.append(({"patches": patches, "patch_coord": coord, "patch_valid": valid}, 0))
    seq_len = seq_len or max(item["patches"].shape[0] for item, _ in items) + 3
    batch, _ = NaFlexCollator(max_seq_len=seq_len)(items)
    return batch


def valid_rows(tokens: torch.Tensor, batch: dict, i: int, prefix: int = 0) -> torch.Tensor:
    """Image i's tokens: its prefix tokens, then its valid patches in order (the collator keeps them first)."""
    count = int(batch["patch_valid"][i].sum())
    return tokens[i : i + 1, : prefix + count]


# ------------------------------------------------------------------------------ exact to the image path


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("normalize_coords", ["separate", "max"])
@torch.no_grad()
def test_each_image_of_a_mixed_padded_batch_equals_its_own_forward(channels_last, normalize_coords):
    model = tiny(patchify_channels_last=channels_last, rope_normalize_coords=normalize_coords)
    imgs = images()
    batch = naflex_batch(imgs, channels_last=channels_last)
    assert not batch["patch_valid"].all()  # every image padded
    features = model.forward_features(batch)
    assert set(features) == {"patches", "patch_valid"} and features["patches"].shape[:2] == (4, 5 + 15 + 3)
    logits = model(batch)
    final, blocks = model.forward_intermediates(batch, output_fmt="NLC", norm=True, return_prefix_tokens=True)
    for i, img in enumerate(imgs):
        alone = img[None]
        what = f"image {i} {tuple(img.shape[1:])}"
        assert_fp32_close(logits[i : i + 1], model(alone), what=f"{what} logits")
        assert_fp32_close(valid_rows(features["patches"], batch, i, 5), model.forward_features(alone), what=what)
        expected_final, expected_blocks = model.forward_intermediates(
            alone, output_fmt="NLC", norm=True, return_prefix_tokens=True
        )
        assert_fp32_close(valid_rows(final, batch, i, 5), expected_final, what=f"{what} final")
        for (patches, prefix), (want_patches, want_prefix) in zip(blocks, expected_blocks):
            assert_fp32_close(valid_rows(patches, batch, i), want_patches, what=f"{what} block patches")
            assert_fp32_close(prefix[i : i + 1], want_prefix, what=f"{what} block prefix")


@pytest.mark.parametrize("global_pool", POOLS)
@torch.no_grad()
def test_every_pool_leaves_padding_out(global_pool):
    model = tiny(global_pool=global_pool)
    imgs = images()
    batch = naflex_batch(imgs)
    pooled = model.forward_head(model.forward_features(batch), pre_logits=True)
    for i, img in enumerate(imgs):
        assert_fp32_close(pooled[i : i + 1], model.forward_head(model.forward_features(img[None]), pre_logits=True))


@torch.no_grad()
def test_padding_never_reaches_a_real_token():
    model = tiny(global_pool="avgmax")
    batch = naflex_batch(images())
    padding = ~batch["patch_valid"]
    noisy = dict(batch, patches=batch["patches"].clone(), patch_coord=batch["patch_coord"].clone())
    noisy["patches"][padding] = 1e4 * torch.randn(int(padding.sum()), noisy["patches"].shape[-1])
    noisy["patch_coord"][padding] = 3  # inside every grid: padding coordinates must not change a grid either
    assert_fp32_close(model(noisy), model(batch), rtol=1e-6)
    features, clean = model.forward_features(noisy)["patches"], model.forward_features(batch)["patches"]
    for i in range(len(SIZES)):
        assert_fp32_close(valid_rows(features, batch, i, 5), valid_rows(clean, batch, i, 5), rtol=1e-6)


def test_a_full_batch_builds_no_attention_mask(monkeypatch):
    masks = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = tiny()
    with torch.no_grad():
        model(naflex_batch(images([(48, 80), (80, 48)]), seq_len=15))  # 15 patches each: no padding
        assert masks == [None, None]
        model(naflex_batch(images([(48, 80), (64, 32)])))
    assert masks[2].shape == (2, 1, 1, 5 + 18) and masks[2].dtype == torch.bool
    assert masks[2][:, 0, 0, :5].all() and masks[2][1, 0, 0, 5 + 8 :].logical_not().all()


# ------------------------------------------------------------------------------ against timm's NaFlexVit


def timm_naflexvit_and_ours(channels_last=True, **ours_kwargs):
    """timm's eva, its NaFlexVit (`use_naflex=True`) and ours, with the same weights: ours reads eva's file."""
    torch.manual_seed(0)
    eva = timm.create_model(EVA["mlp"], num_classes=5, global_pool="token", dynamic_img_pad=True, **TINY)
    eva = move_off_init_(eva).eval()
    flex = timm.create_model(
        EVA["mlp"],
        use_naflex=True,
        enable_patch_interpolator=True,
        patchify_channels_last=channels_last,
        num_classes=5,
        global_pool="token",
        **TINY,
    ).eval()
    flex.load_state_dict(naflex_filter(eva.state_dict(), flex))
    if not channels_last:  # timm's filter lays the kernel out as (P, P, C) whatever the model's layout
        with torch.no_grad():
            flex.embeds.proj.weight.copy_(eva.patch_embed.proj.weight.flatten(1))
    ours = timm.create_model(
        NAME, num_classes=5, rope_periods_bf16=False, patchify_channels_last=channels_last, **TINY, **ours_kwargs
    ).eval()
    ours.load_state_dict(eva.state_dict())  # our load hook converts eva's layout
    return eva, flex, ours


@pytest.mark.parametrize(
    "patch, flatten, channels_last", [(16, True, True), (16, False, False), (8, False, True), (8, False, False)]
)
@torch.no_grad()
def test_equals_timm_naflexvit_on_the_same_weights(patch, flatten, channels_last):
    """Patches of 8 pixels resample the 16-pixel kernel as timm's NaFlexVit does with its patch interpolator."""
    eva, flex, ours = timm_naflexvit_and_ours(channels_last)
    imgs = images()
    batch = naflex_batch(imgs, patch=patch, channels_last=channels_last, flatten=flatten)
    assert batch["patches"].dim() == (3 if flatten else 5)
    assert_fp32_close(ours(batch), flex(batch))
    if patch == 16:
        assert_fp32_close(ours(batch), torch.cat([eva(img[None]) for img in imgs]))
    ours_out = ours.forward_intermediates(batch, indices=2, output_fmt="NLC", output_dict=True)
    flex_out = flex.forward_intermediates(batch, indices=2, output_fmt="NLC", output_dict=True)
    assert torch.equal(ours_out["patch_valid"], flex_out["patch_valid"])
    for mine, theirs in zip(ours_out["image_intermediates"], flex_out["image_intermediates"], strict=True):
        assert mine.shape == (*batch["patch_valid"].shape, 64)  # padded [B, N, C]
        valid = batch["patch_valid"]
        assert_fp32_close(mine[valid], theirs[valid])
    real = F.pad(batch["patch_valid"], (5, 0), value=True)  # prefix and valid patches: padding holds no result
    assert_fp32_close(ours_out["image_features"][real], flex_out["image_features"][real])


@torch.no_grad()
def test_patch_embedding_is_resampled_as_flexivit():
    """One image at patch 8 through NaFlex equals the image path after `set_input_size(patch_size=8)`, which
    resamples the kernel with timm's `resample_patch_embed`; the model's own patch size is unchanged."""
    model = tiny()
    img = images([(48, 80)])
    by_patch_8 = model(naflex_batch(img, patch=8, flatten=False))
    assert model.get_patch_size() == (16, 16)
    model.set_input_size(patch_size=8)
    assert_fp32_close(by_patch_8, model(img[0][None]))


# ------------------------------------------------------------------------------ training


@torch.no_grad()
def test_rope_augmentation_draws_once_per_block_for_the_whole_batch():
    """In training, each block draws one shift, jitter and rescale for the batch (as Meta's rope_embed does for
    its batch) and applies it to each image's own coordinates: image i of the batch sees what it would see
    alone with the same random stream."""
    model = tiny(rope_shift_coords=0.5, rope_jitter_coords=1.5, rope_rescale_coords=2.0).train()
    imgs = images()
    torch.manual_seed(7)
    batched = model(naflex_batch(imgs))
    for i, img in enumerate(imgs):
        torch.manual_seed(7)
        assert_fp32_close(batched[i : i + 1], model(img[None]), what=f"image {i}")
    torch.manual_seed(8)
    assert (model(naflex_batch(imgs)) - batched).abs().max() > 1e-3  # the draws do move the outputs


@pytest.mark.parametrize("depth_mode", ["drop_path", "sample_drop"])
def test_trains_with_stochastic_depth_and_checkpointing(depth_mode):
    model = tiny(drop_path_rate=0.5, stochastic_depth=depth_mode, rope_rescale_coords=2.0).train()
    model.set_grad_checkpointing()
    model(naflex_batch(images())).logsumexp(-1).sum().backward()
    no_grad = [name for name, p in model.named_parameters() if p.grad is None and name != "local_cls_norm.weight"]
    assert no_grad == []  # mask_token too: DDP without find_unused_parameters takes NaFlex batches


@pytest.fixture(scope="module")
def mixed_aspect_folder(tmp_path_factory: pytest.TempPathFactory):
    """Two classes by dominant colour, six aspect ratios from 1:3 to 3:1."""
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    sizes = [(32, 48), (48, 32), (40, 40), (24, 72), (72, 24), (36, 52)]
    for name, channel in (("red", 0), ("blue", 2)):
        (root / "train" / name).mkdir(parents=True)
        for i in range(6):
            pixels = rng.integers(0, 160, (*sizes[i], 3))
            pixels[..., channel] += 64
            Image.fromarray(pixels.astype(np.uint8)).save(root / "train" / name / f"{i}.png")
    return root


def loader(folder, training: bool, model, **kwargs):
    dataset = create_dataset("", root=str(folder), split="train", is_training=training)
    return create_naflex_loader(
        dataset, batch_size=4, is_training=training, num_workers=0, device=CPU, pin_memory=False, **kwargs
    )


@pytest.mark.parametrize("channels_last", [True, False])
def test_train_py_naflex_steps(mixed_aspect_folder, channels_last):
    """What train.py's `--naflex-loader` does, step by step: the model's patch size, create_naflex_loader with
    seq lens, NaFlexMixup and random erasing, the linear loss scale, then the eval loader at max_seq_len."""
    model = tiny(num_classes=2, patchify_channels_last=channels_last).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = model.patch_embed.proj.weight.detach().clone()
    train = loader(
        mixed_aspect_folder,
        True,
        model,
        patch_size=model.get_patch_size(),
        train_seq_lens=(8, 12),
        mixup_fn=NaFlexMixup(num_classes=2),
        re_prob=0.5,
        patchify_channels_last=channels_last,
    )
    seen = 0
    for batch, target in train:
        assert batch["patches"].shape[-1] == 16 * 16 * 3 and target.shape == (len(target), 2)  # soft targets
        loss = torch.sum(-target * model(batch).log_softmax(-1), dim=-1).mean()
        (loss * len(target) / 4).backward()  # --naflex-loss-scale linear, batch size 4
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(loss)
        seen += len(target)
    assert seen == 12 and not torch.equal(before, model.patch_embed.proj.weight)
    model.eval()
    with torch.no_grad():
        for batch, target in loader(mixed_aspect_folder, False, model, max_seq_len=20, patch_size=(16, 16)):
            assert model(batch).shape == (len(target), 2)


def test_train_py_naflex_patch_sizes(mixed_aspect_folder):
    """`--naflex-patch-sizes 8 16`: a patch size drawn per batch, unflattened patches, the model's defaults."""
    model = tiny(num_classes=2).train()
    sizes = set()
    train = loader(mixed_aspect_folder, True, model, patch_size_choices=[8, 16], train_seq_lens=(16, 24), seed=1)
    for batch, target in train:
        sizes.add(tuple(batch["patches"].shape[2:4]))
        F.cross_entropy(model(batch), target).backward()
    assert sizes == {(8, 8), (16, 16)}
    assert model.patch_embed.proj.weight.grad is not None


# ------------------------------------------------------------------------------ API and bad input


def test_timm_options_and_patch_size():
    model = timm.create_model(NAME, use_naflex=True, enable_patch_interpolator=True, patch_size=14, device="meta")
    assert model.get_patch_size() == (14, 14) and model.embeds.patch_size == (14, 14)  # validate.py reads this
    assert timm.create_model(NAME, use_naflex=False, device="meta").config.use_naflex is False
    for key in ("use_naflex", "enable_patch_interpolator", "patchify_channels_last"):
        with pytest.raises(ValueError, match=rf"^{key}: got 'yes'; allowed: true or false$"):
            timm.create_model(NAME, device="meta", **{key: "yes"})


def bad_batches():
    batch = naflex_batch(images()[:2])
    return {
        "misspelt": (
            {"patches": batch["patches"], "patch_coords": batch["patch_coord"], "patch_valid": batch["patch_valid"]},
            {},
            r"missing key\(s\) \['patch_coord'\], unknown key\(s\) \['patch_coords'\]",
        ),
        "no valid": ({k: v for k, v in batch.items() if k != "patch_valid"}, {}, r"missing key\(s\) \['patch_valid'\]"),
        "lengths": (dict(batch, patch_valid=batch["patch_valid"][:, :-1]), {}, "disagree on"),
        "not tensors": (dict(batch, patch_valid=batch["patch_valid"].tolist()), {}, "must be tensors"),
        "coord": (dict(batch, patch_coord=batch["patch_coord"].float()), {}, "integer patch indices"),
        "flat": (dict(batch, patches=batch["patches"][..., :-1]), {}, "not P\\*P\\*3"),
        "layout": (naflex_batch(images()[:1], flatten=False), dict(patchify_channels_last=False), "=True to match"),
        "no resample": (naflex_batch(images()[:1], 8, flatten=False), dict(enable_patch_interpolator=False), "8x8"),
        "images only": (batch, dict(use_naflex=False), "use_naflex=False"),
    }


@pytest.mark.parametrize("case", list(bad_batches()))
def test_bad_batches_get_one_line_naming_the_fix(case):
    batch, kwargs, message = bad_batches()[case]
    with pytest.raises(ValueError, match=message) as caught:
        tiny(**kwargs)(batch)
    assert "\n" not in str(caught.value)


def test_nchw_intermediates_of_a_naflex_batch_are_refused():
    with pytest.raises(ValueError, match="allowed: 'NLC'"):
        tiny().forward_intermediates(naflex_batch(images()[:1]))
