"""ViT checkpoints that are not DINOv3, named by family: they have a learned position embedding where DINOv3
has RoPE and none, so no `vit_ls` variant holds them. Recognition asks here first."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..mapping.gamma_keys import ANY_GAMMA_KEY
from ..mapping.plan import info_of

# Position-embedding tables of ViTs that are not DINOv3 (which has RoPE and no table).
_POS_EMBED = re.compile(r"(^|\.)(pos_embed|position_embeddings)$")
_PATCH_WEIGHT = re.compile(r"(^|\.)(patch_embed\.proj|patch_embeddings(\.projection)?)\.weight$")


def foreign_family(source: Mapping[str, torch.Tensor]) -> str | None:
    """A one-line reason when the keys are a ViT with a learned position embedding, by family."""
    keys = list(source)
    pos_key = next((k for k in keys if _POS_EMBED.search(k)), None)
    if pos_key is None:
        return None
    patch_key = next((k for k in keys if _PATCH_WEIGHT.search(k)), None)
    patch = info_of(source, patch_key).shape[-1] if patch_key else None
    if any(k.startswith(("cls_attn_blocks.", "blocks_token_only.")) for k in keys):
        family, instead = "CaiT", "timm's cait_* models"
    elif patch == 14 or any(k.endswith(("mask_token", "register_tokens")) for k in keys):
        family, instead = "DINOv2", "timm's vit_*_patch14_dinov2 models or transformers' Dinov2Model"
    elif any(ANY_GAMMA_KEY.search(k) for k in keys):
        family, instead = "DeiT-III", "timm's deit3_* models"
    else:
        family, instead = "ViT (not DINOv3)", "timm's vit_* models"
    shape = list(info_of(source, pos_key).shape)
    return (
        f"this is a {family} checkpoint: it has a learned position embedding ({pos_key} {shape}) where DINOv3 "
        f"uses RoPE and has none, so no vit_ls variant can hold it; load it with {instead} instead"
    )
