"""Where each token of a NaFlex batch sits: patch centres on each image's own grid, and which keys are real.

An image's grid is `patch_coord.amax + 1` over its valid patches (timm's NaFlexVit reads it the same way),
so the per-side coordinate normalisation sees each image's own height and width, as the image path
does for a batch of one size.
"""

import torch
import torch.nn.functional as F


def naflex_patch_centres(
    patch_coord: torch.Tensor,
    patch_valid: torch.Tensor,
    normalize_coords: str = "separate",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Patch centres [B, N, 2] (y, x) in `dtype` (bf16 for bf16 RoPE, computed in it as the image path does),
    normalised to [-1, 1] over each image's grid as `patch_centre_coords` normalises one grid
    (`normalize_coords`: per side, or by the longer or shorter)."""
    grid = patch_coord.masked_fill(~patch_valid.unsqueeze(-1), 0).amax(dim=1) + 1  # [B, 2]: height, width
    if normalize_coords == "max":
        grid = grid.amax(dim=-1, keepdim=True)
    elif normalize_coords == "min":
        grid = grid.amin(dim=-1, keepdim=True)
    coords = (patch_coord.to(dtype) + 0.5) / grid.to(dtype).unsqueeze(1)
    return 2.0 * coords - 1.0


def padding_key_mask(patch_valid: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor | None:
    """The keys each query may attend to, [B, 1, 1, prefix + N] bool (prefix tokens always), or None when no
    token is padding, so a full batch keeps SDPA's fastest kernels. Padding queries still attend to the real
    keys (a row with no key would be NaN), but no real token ever attends to padding."""
    if bool(patch_valid.all()):
        return None
    return F.pad(patch_valid, (num_prefix_tokens, 0), value=True)[:, None, None, :]
