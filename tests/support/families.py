"""The DINOv3 families at test size: our arguments and timm's eva architecture of the same shape, each shrunk
where the full model would be slow (widths only: depth and the k/v-head pattern stay the family's)."""

from __future__ import annotations

import timm
import torch
from packaging.version import Version

from . import move_off_init_

# timm's eva has the LingBot, EUPE and Sapiens2 architectures and num_kv_heads from 1.0.31 (CI's lowest, 1.0.26,
# has none): older timms skip the comparisons with eva
EVA_FAMILIES_TIMM = "1.0.31"
EVA_HAS_FAMILIES = Version(timm.__version__) >= Version(EVA_FAMILIES_TIMM) and timm.models.is_model(
    "vit_base_patch16_sapiens2"
)

SAPIENS2_TINY_DEPTH = 18  # the first and last 8 blocks keep every head, blocks 8 and 9 are grouped
SAPIENS2_KV = [4] * 8 + [2] * 2 + [4] * 8

SAPIENS2_ARGS = dict(
    num_storage_tokens=8,
    mask_token=False,
    norm_layer="rmsnorm",
    norm_eps=1e-6,
    qk_norm=True,
    ffn_layer="swiglu",
    ffn_ratio=6,
    mask_k_bias=False,
    init_values={"attn": 1.0, "mlp": "off"},
    rope_rescale_coords=2,
)
# name -> (our variant's arguments at test size, eva architecture, eva's arguments at test size)
FAMILIES = {
    "eupe_tiny": (dict(embed_dim=192, num_heads=3, depth=2), "vit_tiny_patch16_dinov3_qkvb", {}),
    "lingbot_small": (dict(embed_dim=64, num_heads=4, depth=2), "vit_small_patch16_lingbot", {}),
    "lingbot_giant": (
        dict(embed_dim=64, num_heads=4, depth=3, ffn_layer="swiglu", ffn_ratio=4, qkv_bias=False),
        "vit_giant_patch16_lingbot",
        {},
    ),
    "sapiens2": (
        dict(embed_dim=64, num_heads=4, depth=SAPIENS2_TINY_DEPTH, num_kv_heads=SAPIENS2_KV, **SAPIENS2_ARGS),
        "vit_base_patch16_sapiens2",
        dict(num_kv_heads=SAPIENS2_KV),
    ),
}


def eva_family(name: str, seed: int = 0) -> torch.nn.Module:
    """timm's own eva model of a family at test size, moved off its init, pooling the class token."""
    ours, arch, extra = FAMILIES[name]
    torch.manual_seed(seed)
    shape = {k: ours[k] for k in ("embed_dim", "num_heads", "depth")}
    model = timm.create_model(arch, global_pool="token", num_classes=0, **shape, **extra)
    return move_off_init_(model, seed).eval()
