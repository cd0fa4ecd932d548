"""The images of a pretraining run and the order they come in: a stream of per-epoch permutations, cut into
global batches, each image's views drawn from its own seed, so that any step's batch can be made again."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms.v2.functional import pil_to_tensor

from ..probe.data import load_image
from .method import Method, Shard

ONE_PROCESS = Shard()


def epoch_order(n_images: int, seed: int, epoch: int) -> Tensor:
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]))
    return torch.randperm(n_images, generator=generator)


def global_batch(n_images: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The image indices of step `step`'s global batch: the steps read the epochs' permutations one after the
    other, a batch running on into the next epoch where one ends."""
    start = step * batch_size
    indices: list[int] = []
    while len(indices) < batch_size:
        epoch, offset = divmod(start + len(indices), n_images)
        order = epoch_order(n_images, seed, epoch)
        indices += order[offset : offset + batch_size - len(indices)].tolist()
    return indices


def image_seed(seed: int, step: int, position: int) -> int:
    """The seed of the views of the image at `position` in step `step`'s global batch."""
    return int(np.random.SeedSequence([seed, step, position]).generate_state(1)[0])


def collate_generator(seed: int, step: int) -> np.random.Generator:
    """What a method's `collate` draws from at `step` (iBOT's masks): one stream per step, on every rank."""
    return np.random.default_rng([seed, step, 1])


def shard_slice(batch_size: int, shard: Shard) -> slice:
    per_rank = batch_size // shard.world
    return slice(shard.rank * per_rank, (shard.rank + 1) * per_rank)


def read_image(path: Path) -> Tensor:
    """uint8 `[3, H, W]` RGB."""
    return pil_to_tensor(load_image(path))


def make_batch(
    method: Method, files: Sequence[Path], batch_size: int, seed: int, step: int, shard: Shard = ONE_PROCESS
) -> dict[str, Tensor]:
    """This rank's part of step `step`'s batch: the views of its images, each drawn under the image's seed
    (torch's global generator forked, so the caller's draws are untouched), collated."""
    indices = global_batch(len(files), batch_size, seed, step)
    part = shard_slice(batch_size, shard)
    samples = []
    for position, index in list(enumerate(indices))[part]:
        image = read_image(files[index])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(image_seed(seed, step, position))
            samples.append(method.views(image))
    return method.collate(samples, collate_generator(seed, step), shard)
