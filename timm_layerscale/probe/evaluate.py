"""One row of a probe: a layer set's features taken from the split features, then Meta's protocols on them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from timm_ls.probe_request import KNN_TOKENS, TOKENS

from .data import IGNORE
from .extract import SplitFeatures
from .knn import knn
from .logreg import logistic_regression
from .segment import concatenated, linear_segmentation
from .split import stratified_split


@dataclass
class Sets:
    """Train and val as rows of the split features: which rows, and their labels (classification)."""

    train: SplitFeatures
    train_rows: torch.Tensor
    val: SplitFeatures
    val_rows: torch.Tensor
    train_labels: torch.Tensor | None = None
    val_labels: torch.Tensor | None = None


def make_sets(train: SplitFeatures, val: SplitFeatures | None, labels, val_labels, fraction: float, seed: int) -> Sets:
    """The val set: the val folder's images, else a seeded stratified part of train's (Meta's rule)."""
    kept = torch.tensor([labels[i] for i in train.kept], dtype=torch.long) if labels else None
    if val is not None:
        rows = torch.arange(len(train.kept))
        held_labels = torch.tensor([val_labels[i] for i in val.kept], dtype=torch.long) if labels else None
        return Sets(train, rows, val, torch.arange(len(val.kept)), kept, held_labels)
    held = torch.tensor(stratified_split(kept.tolist() if kept is not None else [0] * len(train.kept), fraction, seed))
    if not held.any() or held.all():
        raise ValueError(
            f"--val-split {fraction}: {len(train.kept)} train images leave no val set; add images or a val folder"
        )
    train_rows, val_rows = (~held).nonzero().squeeze(1), held.nonzero().squeeze(1)
    pick = (lambda rows: kept[rows]) if kept is not None else (lambda rows: None)
    return Sets(train, train_rows, train, val_rows, pick(train_rows), pick(val_rows))


def tokens_of(split: SplitFeatures, rows: torch.Tensor, blocks: list[int], tokens: str) -> torch.Tensor:
    """The classifier's input: `cls` (each block's CLS, concatenated), `avgpool` (each block's mean patch token)
    or `cls+avgpool` (Meta's linear input: the CLS tokens, then the last block's mean patch token); any other
    value is a `ValueError`."""
    if tokens not in TOKENS:
        raise ValueError(f"unknown token choice {tokens!r}; pass --tokens one of {', '.join(TOKENS)}")
    cls = [split.blocks[b]["cls"][rows] for b in blocks]
    if tokens == "cls":
        return torch.cat(cls, dim=1)
    if tokens == "avgpool":
        return torch.cat([split.blocks[b]["avgpool"][rows] for b in blocks], dim=1)
    return torch.cat([*cls, split.blocks[blocks[-1]]["avgpool"][rows]], dim=1)


def spread(features: torch.Tensor) -> float:
    """How much features differ across images: each dimension's standard deviation over the rows, averaged,
    relative to the features' mean magnitude (0 for features that are all zero)."""
    x = features.double()
    scale = x.abs().mean()
    return float(x.std(dim=0).mean() / scale) if scale > 0 else 0.0


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    return fn(*args, **kwargs), round(time.perf_counter() - start, 3)


def classification_row(sets: Sets, blocks: list[int], tokens: str, num_classes: int, seed: int, max_iter: int) -> dict:
    """kNN on the CLS tokens (`KNN_TOKENS`) and logistic regression on `tokens`; every number results.json
    records, with the tokens each protocol read and how much they differ across images (`spread`)."""
    both = ((sets.train, sets.train_rows), (sets.val, sets.val_rows))
    cls = [tokens_of(s, r, blocks, KNN_TOKENS) for s, r in both]
    found, knn_s = _timed(knn, cls[0], sets.train_labels, cls[1], sets.val_labels, num_classes=num_classes)
    x_train = tokens_of(sets.train, sets.train_rows, blocks, tokens)
    x_val = tokens_of(sets.val, sets.val_rows, blocks, tokens)
    fitted, logreg_s = _timed(
        logistic_regression, x_train, sets.train_labels, x_val, sets.val_labels, seed=seed, max_iter=max_iter
    )
    return {
        "blocks": blocks,
        "tokens": {"knn": KNN_TOKENS, "logreg": tokens},
        "spread": {"knn": spread(torch.cat(cls)), "logreg": spread(torch.cat([x_train, x_val]))},
        "train_images": len(sets.train_rows),
        "val_images": len(sets.val_rows),
        "feature_dim": {"knn": cls[0].shape[1], "logreg": x_train.shape[1]},
        "knn": {
            "temperature": 0.07,
            "ks": found.ks,
            "top1": {str(k): v for k, v in found.top1.items()},
            "top5": {str(k): v for k, v in found.top5.items()},
            "per_class": {str(k): v for k, v in found.per_class.items()},
        },
        "logreg": {
            "best_c": fitted.best_c,
            "top1": fitted.top1,
            "per_class": fitted.per_class,
            "sweep": [{"C": c, "held_out_top1": score} for c, score in fitted.sweep],
            "unconverged_fits": fitted.unconverged,
            "max_iter": max_iter,
        },
        "times_s": {"knn": knn_s, "logreg": logreg_s},
    }


def segmentation_classes(train_classes: set[int], val_classes: set[int]) -> int:
    """The number of classes: one past the largest index in train's masks; a val class train lacks is refused."""
    seen, held = train_classes - {IGNORE}, val_classes - {IGNORE}
    if not seen:
        raise ValueError("every train mask is 255 (ignored) everywhere; a mask holds class indices 0 to 254")
    missing = sorted(held - seen)
    if missing:
        raise ValueError(
            f"val masks hold class {missing[0]}, which no train mask has; every val class needs train pixels"
        )
    return max(seen) + 1


def segmentation_row(sets: Sets, blocks: list[int], num_classes: int, steps: int, seed: int):
    """Meta's linear head on the blocks' patch maps; the row and the result (for the pictures)."""
    train_maps = concatenated([sets.train.blocks[b]["patches"][sets.train_rows] for b in blocks])
    val_maps = concatenated([sets.val.blocks[b]["patches"][sets.val_rows] for b in blocks])
    masks = sets.train.masks[sets.train_rows], sets.val.masks[sets.val_rows]
    found, seconds = _timed(
        linear_segmentation, train_maps, masks[0], val_maps, masks[1], num_classes, steps=steps, seed=seed
    )
    row = {
        "blocks": blocks,
        "train_images": len(sets.train_rows),
        "val_images": len(sets.val_rows),
        "feature_dim": train_maps.shape[1],
        "miou": found.miou,
        "pixel_accuracy": found.pixel_accuracy,
        "iou_per_class": found.iou,
        "steps": steps,
        "final_loss": found.losses[-1],
        "times_s": {"head": seconds},
    }
    return row, found
