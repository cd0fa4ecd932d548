"""The patch embedding of a NaFlex batch: the image path's convolution kernel, applied to loose patches.

A convolution with stride = kernel is a linear map of each patch, so the kernel `[D, C, P, P]` flattened in
the batch's layout (`(P, P, C)` or `(C, P, P)`) embeds the patches exactly as the image path does. Patches
of another size get the kernel resampled first (FlexiViT's pseudo-inverse resize, timm's
`resample_patch_embed`, as timm's NaFlexVit with `enable_patch_interpolator=True`), differentiably, so
training at several patch sizes trains the one kernel.
"""

import torch
import torch.nn.functional as F
from timm.layers import resample_patch_embed

from .naflex_batch import NaFlexBatch


def embed_patches(
    batch: NaFlexBatch,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    channels_last: bool = True,
    resample: bool = True,
) -> torch.Tensor:
    """The batch's patches [B, N, ...] -> tokens [B, N, D] through the convolution kernel `weight` [D, C, P, P]."""
    patch_size = batch.patch_size
    if patch_size != tuple(weight.shape[-2:]):
        if not resample:
            raise ValueError(
                f"NaFlex batch: patches of {patch_size[0]}x{patch_size[1]} pixels, the patch embedding's are "
                f"{weight.shape[-2]}x{weight.shape[-1]}: build the model with enable_patch_interpolator=True to "
                f"resample it, or patchify at the model's patch size"
            )
        weight = resample_patch_embed(weight, list(patch_size), interpolation="bicubic", antialias=True)
    if channels_last:
        weight = weight.permute(0, 2, 3, 1)
    return F.linear(batch.patches.flatten(2).to(weight.dtype), weight.flatten(1), bias)
