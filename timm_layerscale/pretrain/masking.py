"""iBOT's block masks, drawn as Meta's `MaskingGenerator` and its collate draw them: for a batch, a share
`mask_probability` of the images is masked, with ratios spread evenly over `mask_ratio_tuple`.

The draws use Python's `random` and NumPy's global generator in Meta's order (or the generators given), so
with both seeded as Meta's trainer seeds them the masks are Meta's.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
from torch import Tensor

MAX_BLOCK_TRIES = 10  # attempts at placing one block before a draw gives up


class MaskingGenerator:
    """Boolean `[height, width]` masks of `num_masking_patches` patches: rectangles of `min_num_patches` to
    `max_num_patches` patches and aspect ratio `min_aspect` to `max_aspect` (log-uniform; default its
    inverse) added until the count is reached or a rectangle fits nowhere, then random single patches to
    make up the count. Meta's arguments; `rng` (a `random.Random`) and `np_rng` (a `np.random.RandomState`)
    are not Meta's and default to the global generators Meta's draws from."""

    def __init__(
        self,
        input_size: int | tuple[int, int],
        num_masking_patches: int | None = None,
        min_num_patches: int = 4,
        max_num_patches: float | None = None,
        min_aspect: float = 0.3,
        max_aspect: float | None = None,
        *,
        rng: random.Random | None = None,
        np_rng: np.random.RandomState | None = None,
    ):
        if not isinstance(input_size, tuple):
            input_size = (input_size, input_size)
        self.height, self.width = input_size
        self.num_patches = self.height * self.width
        self.num_masking_patches = num_masking_patches
        self.min_num_patches = min_num_patches
        self.max_num_patches = num_masking_patches if max_num_patches is None else max_num_patches
        max_aspect = max_aspect or 1 / min_aspect
        self.log_aspect_ratio = (math.log(min_aspect), math.log(max_aspect))
        self.rng: Any = rng or random
        self.np_rng: Any = np_rng or np.random

    def __repr__(self) -> str:
        low, high = self.log_aspect_ratio
        return (
            f"MaskingGenerator({self.height}, {self.width} -> [{self.min_num_patches} ~ {self.max_num_patches}], "
            f"max = {self.num_masking_patches}, {low:.3f} ~ {high:.3f})"
        )

    def get_shape(self) -> tuple[int, int]:
        return self.height, self.width

    def _mask(self, mask: np.ndarray, max_mask_patches: float) -> int:
        """Adds one rectangle that masks at least one new patch and at most `max_mask_patches`; returns how
        many it added (0 when `MAX_BLOCK_TRIES` draws found none)."""
        for _ in range(MAX_BLOCK_TRIES):
            target_area = self.rng.uniform(self.min_num_patches, max_mask_patches)
            aspect_ratio = math.exp(self.rng.uniform(*self.log_aspect_ratio))
            h = round(math.sqrt(target_area * aspect_ratio))
            w = round(math.sqrt(target_area / aspect_ratio))
            if w >= self.width or h >= self.height:
                continue
            top = self.rng.randint(0, self.height - h)
            left = self.rng.randint(0, self.width - w)
            block = mask[top : top + h, left : left + w]
            added = h * w - int(block.sum())
            if 0 < added <= max_mask_patches:
                block[...] = True
                return added
        return 0

    def __call__(self, num_masking_patches: int = 0) -> np.ndarray:
        mask = np.zeros(shape=self.get_shape(), dtype=bool)
        mask_count = 0
        while mask_count < num_masking_patches:
            max_mask_patches = min(num_masking_patches - mask_count, self.max_num_patches)
            delta = self._mask(mask, max_mask_patches)
            if delta == 0:
                break
            mask_count += delta
        return self.complete_mask_randomly(mask, num_masking_patches)

    def complete_mask_randomly(self, mask: np.ndarray, num_masking_patches: int) -> np.ndarray:
        """Masks random unmasked patches until exactly `num_masking_patches` are masked."""
        flat = mask.flatten()
        to_add = self.np_rng.choice(np.where(~flat)[0], size=num_masking_patches - flat.sum(), replace=False)
        flat[to_add] = True
        return flat.reshape(mask.shape)


def collate_masks(
    n_images: int,
    n_tokens: int,
    mask_ratio_tuple: tuple[float, float],
    mask_probability: float,
    mask_generator: MaskingGenerator,
    random_circular_shift: bool = False,
) -> dict[str, Tensor | int]:
    """The masks of one batch of `n_images` global crops of `n_tokens` patches, as Meta's
    `collate_data_and_cast` makes them: `int(n_images * mask_probability)` images masked, the i-th with
    `int(n_tokens * r)` patches where r steps evenly from `mask_ratio_tuple`'s low end to its high end (the
    i+1-th of `n + 1` points), the others unmasked, then all shuffled.

    Returns `collated_masks` (`[n_images, n_tokens]` bool), `mask_indices_list` (the flat indices of its
    True entries), `masks_weight` (`1 / (the image's masked count)` for each), `upperbound` (the sum of the
    masked counts asked for) and `n_masked_patches` (a one-element tensor: the masked count)."""
    n_masked_images = int(n_images * mask_probability)
    ratios = torch.linspace(*mask_ratio_tuple, n_masked_images + 1)
    masks, upperbound = [], 0
    for ratio in ratios[1:]:
        mask = torch.BoolTensor(mask_generator(int(n_tokens * ratio)))
        if random_circular_shift:
            shift = (mask_generator.rng.randint(0, mask.shape[0] - 1), mask_generator.rng.randint(0, mask.shape[1] - 1))
            mask = torch.roll(mask, shift, (0, 1))
        masks.append(mask)
        upperbound += int(n_tokens * ratio)
    masks += [torch.BoolTensor(mask_generator(0)) for _ in range(n_masked_images, n_images)]
    mask_generator.rng.shuffle(masks)
    collated = torch.stack(masks).flatten(1)
    indices = collated.flatten().nonzero().flatten()
    weights = (1 / collated.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(collated)[collated]
    return {
        "collated_masks": collated,
        "mask_indices_list": indices,
        "masks_weight": weights,
        "upperbound": upperbound,
        "n_masked_patches": torch.full((1,), fill_value=indices.shape[0], dtype=torch.long),
    }
