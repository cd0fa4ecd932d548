"""DINOv3's k-bias masking (`mask_k_bias`) under grouped-query attention: a fresh model never adds a k bias,
whatever the k/v width, and adds its q and v biases in full."""

import timm
import torch
from support import move_off_init_

from timm_layerscale import fold_bias_masks_

IMAGES = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_a_fresh_grouped_model_masks_exactly_its_k_bias_rows():
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_ls_small_patch16_dinov3", embed_dim=64, num_heads=4, depth=1, num_kv_heads=[2], qk_norm=True,
        mask_k_bias=True, num_classes=0,
    )  # fmt: skip
    model = move_off_init_(model).eval()
    qkv = model.blocks[0].attn.qkv
    dim, kv = 64, 2 * 16
    assert qkv.bias.shape == (dim + 2 * kv,)
    assert qkv.bias_mask.tolist() == [1.0] * dim + [0.0] * kv + [1.0] * kv
    # In eval the bias is added as it stands (the mask folded in); a bias written by hand is folded first.
    # Training multiplies by the mask in the forward. Either way a k bias never counts.
    for mode, fold in (("eval", fold_bias_masks_), ("train", lambda m: m)):
        model.train(mode == "train")
        before = model.forward_features(IMAGES)
        for rows, moves in ((slice(dim, dim + kv), False), (slice(0, dim), True), (slice(dim + kv, None), True)):
            kept = qkv.bias.clone()
            qkv.bias[rows] += 1.0
            moved = not torch.equal(fold(model).forward_features(IMAGES), before)
            qkv.bias.copy_(kept)
            assert moved == moves, f"{mode}, bias rows {rows}: {'moved' if moved else 'did not move'} the outputs"
