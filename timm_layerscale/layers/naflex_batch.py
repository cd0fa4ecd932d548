"""timm's NaFlex batch (`--naflex-loader`): each image's patches at its own aspect ratio, padded to one length.

The loader's dict holds `patches` ([B, N, P*P*C] flat, or [B, N, Ph, Pw, C] / [B, N, C, Ph, Pw] with
`--naflex-patch-sizes`), `patch_coord` ([B, N, 2], (y, x) in patches), `patch_valid` ([B, N], False for
padding) and `seq_len` (N). Anything else is refused with one line that names what to change.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import VitLsConfig

NAFLEX_KEYS = ("patches", "patch_coord", "patch_valid")
NAFLEX_OPTIONAL_KEYS = ("seq_len",)


@dataclass
class NaFlexBatch:
    patches: torch.Tensor  # [B, N, ...] as the loader made them
    patch_coord: torch.Tensor  # [B, N, 2] (y, x), integer
    patch_valid: torch.Tensor  # [B, N] bool
    patch_size: tuple[int, int]  # (height, width) in pixels


def read_naflex_batch(batch: Mapping[str, Any], config: VitLsConfig) -> NaFlexBatch:
    """The batch's tensors checked against each other, against `config`'s and its patch size, or a
    `ValueError` naming the fix."""
    if not config.use_naflex:
        raise ValueError(
            "this model was built with use_naflex=False and takes images only: build it with use_naflex=True "
            "to pass timm's NaFlex batches (dicts)"
        )
    missing = [key for key in NAFLEX_KEYS if key not in batch]
    unknown = sorted(set(batch) - set(NAFLEX_KEYS) - set(NAFLEX_OPTIONAL_KEYS))
    if missing or unknown:
        raise ValueError(
            f"NaFlex batch: missing key(s) {missing}, unknown key(s) {unknown}; allowed: {list(NAFLEX_KEYS)} "
            f"and optionally {list(NAFLEX_OPTIONAL_KEYS)}, as timm's create_naflex_loader makes them"
        )
    patches, coord, valid = (batch[key] for key in NAFLEX_KEYS)
    if not all(isinstance(t, torch.Tensor) for t in (patches, coord, valid)):
        raise ValueError(
            "NaFlex batch: patches, patch_coord and patch_valid must be tensors: collate the patchified images "
            "with timm's NaFlexCollator (create_naflex_loader does)"
        )
    if patches.dim() not in (3, 5) or coord.dim() != 3 or coord.shape[-1] != 2 or valid.dim() != 2:
        raise ValueError(
            f"NaFlex batch: got patches {list(patches.shape)}, patch_coord {list(coord.shape)}, patch_valid "
            f"{list(valid.shape)}; allowed: patches [B, N, P*P*C] or [B, N, Ph, Pw, C] / [B, N, C, Ph, Pw], "
            f"patch_coord [B, N, 2], patch_valid [B, N]"
        )
    if not patches.shape[:2] == coord.shape[:2] == valid.shape:
        raise ValueError(
            f"NaFlex batch: patches {list(patches.shape)}, patch_coord {list(coord.shape)} and patch_valid "
            f"{list(valid.shape)} disagree on [B, N]: pass the three tensors of one batch"
        )
    if coord.is_floating_point() or coord.is_complex():
        raise ValueError(f"NaFlex batch: patch_coord is {coord.dtype}; allowed: integer patch indices (y, x)")
    size = _patch_size(patches, config.in_chans, config.patchify_channels_last)
    return NaFlexBatch(patches, coord, valid.bool(), size)


def _patch_size(patches: torch.Tensor, in_chans: int, channels_last: bool) -> tuple[int, int]:
    """(height, width) of one patch, from the flat length P*P*C or from the unflattened patch dims."""
    if patches.dim() == 3:
        side = math.isqrt(patches.shape[-1] // in_chans)
        if side < 1 or side * side * in_chans != patches.shape[-1]:
            raise ValueError(
                f"NaFlex batch: patches of {patches.shape[-1]} values are not P*P*{in_chans} (in_chans) for any "
                f"patch size P: patchify the images with {in_chans} channels and square patches"
            )
        return side, side
    channels = patches.shape[-1] if channels_last else patches.shape[2]
    if channels != in_chans:
        layout, other = ("[B, N, Ph, Pw, C]", False) if channels_last else ("[B, N, C, Ph, Pw]", True)
        raise ValueError(
            f"NaFlex batch: patches {list(patches.shape)} have {channels} channels where this model's layout "
            f"{layout} needs in_chans={in_chans}: build the model with patchify_channels_last={other} to "
            f"match the loader's --naflex-patchify-channels-first setting"
        )
    height, width = patches.shape[2:4] if channels_last else patches.shape[3:5]
    return int(height), int(width)
