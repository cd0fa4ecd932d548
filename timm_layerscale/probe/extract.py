"""Frozen features of a folder of images: batched forwards under `torch.inference_mode`, per block.

Each block's tokens come from `forward_intermediates(norm=True)`, the final norm applied to every block read
(Meta's `get_intermediate_layers(norm=True)`): the CLS token (`cls`), the mean of the patch tokens
(`avgpool`) and, for segmentation, the patch tokens as a map (`patches`, `[N, C, h, w]`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from .cache import Chunk, FeatureCache, chunks
from .data import load_image, read_mask


@torch.inference_mode()
def forward_blocks(model: nn.Module, pixels: torch.Tensor, blocks: Sequence[int], patches: bool = False) -> dict:
    """`{block: {"cls", "avgpool"[, "patches"]}}` (float32, on the CPU) for one batch of normalised images."""
    order = sorted(set(blocks))
    out = model.forward_intermediates(
        pixels, indices=order, norm=True, return_prefix_tokens=True, stop_early=True, intermediates_only=True
    )
    found = {}
    for block, (spatial, prefix) in zip(order, out):
        spatial = spatial.float().cpu()
        found[block] = {"cls": prefix[:, 0].float().cpu(), "avgpool": spatial.mean(dim=(2, 3))}
        if patches:
            found[block]["patches"] = spatial
    return found


def _stack(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]} if parts else {}


def extract_features(
    model: nn.Module,
    images: Sequence[str | Path],
    transform: Callable,
    blocks: Sequence[int],
    *,
    batch: int = 32,
    patches: bool = False,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict[int, dict[str, torch.Tensor]]:
    """The features of `images` (paths) through `transform` (e.g. `probe.classification_transform(model)`),
    per block: `{block: {"cls": [N, C], "avgpool": [N, C], "patches": [N, C, h, w] (with patches=True)}}`.
    The model runs in its own dtype on `device`; an unreadable image is a `ValueError` naming it."""
    dtype = next(model.parameters()).dtype
    parts: dict[int, list] = {b: [] for b in sorted(set(blocks))}
    with tqdm(total=len(images), desc="features", unit="image", file=sys.stderr, disable=not progress or None) as bar:
        for start in range(0, len(images), batch):
            pixels = torch.stack([transform(load_image(Path(p))) for p in images[start : start + batch]])
            for block, tensors in forward_blocks(model, pixels.to(device, dtype), blocks, patches).items():
                parts[block].append(tensors)
            bar.update(len(pixels))
    return {block: _stack(found) for block, found in parts.items()}


BOOKKEEPING = ("index", "masks")  # a cache file's tensors that are not features


@dataclass
class SplitFeatures:
    """One split's features per block over the images that could be read (`kept`, indices into the split)."""

    blocks: dict[int, dict[str, torch.Tensor]]
    kept: list[int]
    skipped: list[str] = field(default_factory=list)
    masks: torch.Tensor | None = None  # segmentation: [N, H, W] uint8, as resized
    computed: int = 0  # images run through the model in this call
    cached: int = 0  # images read from the cache for every block


@dataclass
class Extraction:
    """How one split is read: the model and transform, the blocks and what each image is made of."""

    model: nn.Module
    transform: Callable
    blocks: list[int]
    batch: int
    device: torch.device
    dtype: torch.dtype
    patches: bool = False  # segmentation: keep the patch maps, read the masks


def _read_members(chunk: Chunk, images: list[Path], masks: list[Path], how: Extraction):
    """The chunk's readable images, transformed (and their masks), and the names of those that are not."""
    kept, pixels, resized, skipped = [], [], [], []
    for position, i in enumerate(chunk.members):
        try:
            picture = load_image(images[i])
        except ValueError:
            skipped.append(str(images[i]))
            continue
        kept.append(position)
        pixels.append(how.transform(picture))
        if how.patches:
            resized.append(how.transform.mask(read_mask(masks[i])))
    return kept, pixels, resized, skipped


def _compute(chunk, images, masks, how: Extraction, cache: FeatureCache, missing: list[int], bar) -> int:
    """Runs the chunk's images through the model for the `missing` blocks and writes each block's file."""
    kept, pixels, resized, skipped = _read_members(chunk, images, masks, how)
    parts: dict[int, list] = {b: [] for b in missing}
    for start in range(0, len(pixels), how.batch):
        x = torch.stack(pixels[start : start + how.batch]).to(how.device, how.dtype)
        for block, tensors in forward_blocks(how.model, x, missing, how.patches).items():
            parts[block].append(tensors)
        bar.update(len(x))
    bar.update(len(chunk.members) - len(kept))
    names = [str(images[i]) for i in chunk.members]
    metadata = {"images": json.dumps(names), "skipped": json.dumps(skipped)}
    for block in missing:
        tensors = {**_stack(parts[block]), "index": torch.tensor(kept, dtype=torch.int64)}
        if how.patches:
            tensors["masks"] = torch.stack(resized) if resized else torch.zeros(0, dtype=torch.uint8)
        cache.write(block, chunk, tensors, metadata)
    return len(kept)


def split_features(
    how: Extraction, cache: FeatureCache, split: str, images: list[Path], masks: list[Path], desc: str
) -> SplitFeatures:
    """The split's features for every block of `how`, from the cache where it has them, else computed and
    cached chunk by chunk (so an interrupted run resumes from the last whole chunk)."""
    chunked = chunks(split, [[p, *([masks[i]] if masks else [])] for i, p in enumerate(images)])
    todo = [c for c in chunked if not all(cache.has(b, c) for b in how.blocks)]
    result = SplitFeatures({b: {} for b in how.blocks}, [])
    per_block: dict[int, list] = {b: [] for b in how.blocks}
    masks_found = []
    total = sum(len(c.members) for c in todo)
    with tqdm(total=total, desc=desc, unit="image", file=sys.stderr, disable=None if total else True) as bar:
        for chunk in chunked:
            missing = [b for b in how.blocks if not cache.has(b, chunk)]
            if missing:
                result.computed += _compute(chunk, images, masks, how, cache, missing, bar)
            else:
                result.cached += len(chunk.members)
            for block in how.blocks:
                found = cache.read(block, chunk)
                if found is None:
                    raise OSError(f"{cache.path(block, chunk)} cannot be read back; remove it and run again")
                tensors, metadata = found
                per_block[block].append(tensors)
            index = tensors["index"].tolist()
            result.kept += [chunk.members[p] for p in index]
            result.skipped += json.loads(metadata.get("skipped", "[]"))
            if how.patches:
                masks_found.append(tensors["masks"])
    for block in how.blocks:
        result.blocks[block] = _stack([{k: v for k, v in t.items() if k not in BOOKKEEPING} for t in per_block[block]])
    if how.patches and masks_found:
        result.masks = torch.cat(masks_found)
    return result
