"""iBOT's block masks: Meta's masks from Meta's seeds, counts exact, ratios within Meta's range."""

import random

import numpy as np
import pytest
import torch
from pretrain_fixture import meta, record

from timm_layerscale.pretrain.masking import MaskingGenerator, collate_masks

GRID = 14  # a 224 px crop in patches of 16, as Meta's trainer sizes its generator
RATIOS, PROBABILITY = (0.1, 0.5), 0.5  # ibot.mask_ratio_min_max, ibot.mask_sample_probability


def metas_generator(grid: int = GRID, **kwargs) -> MaskingGenerator:
    return MaskingGenerator(input_size=(grid, grid), max_num_patches=0.5 * grid * grid, **kwargs)


@pytest.mark.parametrize("shift", [False, True])
def test_the_same_seeds_give_metas_batch(shift):
    random.seed(0)
    np.random.seed(0)
    batch = collate_masks(16, GRID * GRID, RATIOS, PROBABILITY, metas_generator(), random_circular_shift=shift)
    tag = f"masking.shift{int(shift)}"
    assert torch.equal(batch["collated_masks"], meta(f"{tag}.collated_masks").bool())
    assert torch.equal(batch["mask_indices_list"], meta(f"{tag}.mask_indices_list"))
    assert torch.equal(batch["masks_weight"], meta(f"{tag}.masks_weight"))
    assert torch.equal(batch["n_masked_patches"], meta(f"{tag}.n_masked_patches"))
    assert batch["upperbound"] == record()[f"{tag}.upperbound"]


def test_the_same_seeds_give_metas_generator_masks():
    random.seed(5)
    np.random.seed(5)
    generator = MaskingGenerator(input_size=(6, 10), max_num_patches=30)
    for count in (0, 6, 19, 30):
        mask = generator(count)
        assert mask.shape == (6, 10) and mask.sum() == count
        assert np.array_equal(mask, meta(f"masking.generator_{count}").bool().numpy())


def test_own_generators_are_reproducible_and_leave_the_global_ones():
    state = random.getstate(), np.random.get_state()[1].copy()
    masks = [metas_generator(rng=random.Random(3), np_rng=np.random.RandomState(3))(60) for _ in range(2)]
    assert np.array_equal(*masks)
    assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])


def test_ratios_stay_within_metas_range():
    n_tokens, n_images = GRID * GRID, 32
    generator = metas_generator(rng=random.Random(0), np_rng=np.random.RandomState(0))
    low, high = int(n_tokens * RATIOS[0]), int(n_tokens * RATIOS[1])
    for _ in range(5):
        batch = collate_masks(n_images, n_tokens, RATIOS, PROBABILITY, generator)
        counts = batch["collated_masks"].sum(1)
        masked = counts[counts > 0]
        assert len(masked) == int(n_images * PROBABILITY)  # Meta's share of masked images
        assert masked.min() > low and masked.max() <= high  # each ratio in (0.1, 0.5]
        assert sorted(masked.tolist()) == sorted(int(n_tokens * r) for r in torch.linspace(*RATIOS, 17)[1:])
        assert batch["upperbound"] == int(counts.sum()) == int(batch["n_masked_patches"])
        torch.testing.assert_close(batch["masks_weight"], (1 / counts[counts > 0]).repeat_interleave(masked))


def test_masks_are_blocks_not_scattered_patches():
    """Most of a mask is rectangles: masked patches mostly have a masked 4-neighbour."""
    generator = metas_generator(rng=random.Random(1), np_rng=np.random.RandomState(1))
    mask = torch.from_numpy(generator(60))
    padded = torch.nn.functional.pad(mask.float(), (1, 1, 1, 1))
    neighbours = padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:]
    assert (neighbours[mask] > 0).float().mean() > 0.8
