"""`timm-ls probe DATA --model NAME ... --out DIR`: Meta's frozen-feature protocols on a folder of images.

The command reads the folder, loads each model as `timm-ls features` does (`features.load_model`), and hands
the rest to `timm_layerscale.probe`: features cached per block (`probe.extract`, `probe.cache`), the protocols
(`probe.evaluate`) and what is printed and written (`probe.report`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from timm_ls.image_folder import SEGMENTATION, ImageFolder, read_image_folder
from timm_ls.model_source import ModelSource

from ..probe import data, evaluate, report
from ..probe.cache import FeatureCache, weights_digest
from ..probe.extract import Extraction, split_features
from ..probe.knn import KS
from ..probe.split import stratified_split
from ..tools.feature_run import DTYPES
from .common import CliError, count, table, warn
from .features import find_device, load_model


def _check_data(folder: ImageFolder, args: argparse.Namespace) -> int:
    """Everything about the data that can be refused, before any model is built or anything written; the
    number of classes."""
    splits = [folder.train, *([folder.val] if folder.val else [])]
    if args.strict:
        for split in splits:
            data.refuse_unreadable(split.images)
    if folder.task != SEGMENTATION:
        _check_train_size(folder, args)
        return len(folder.classes)
    for split in splits:
        data.check_mask_sizes(split.images, split.masks)
    train = data.mask_classes(folder.train.masks)
    return evaluate.segmentation_classes(train, data.mask_classes(folder.val.masks) if folder.val else train)


def _check_train_size(folder: ImageFolder, args: argparse.Namespace) -> None:
    labels = folder.train.labels
    train = len(labels) if folder.val else len(labels) - sum(stratified_split(labels, args.val_split, args.seed))
    if train < min(KS):
        where = "" if folder.val else f" once --val-split {args.val_split} is held out"
        raise CliError(
            f"{folder.train.images[0].parent.parent} leaves {count(train, 'train image')}{where}; the kNN needs "
            f"{min(KS)} or more (its smallest k): add images"
        )


def _extract(folder: ImageFolder, loaded, args, blocks: list[int], device):
    """Train's and val's features of one model, from the cache where it has them."""
    seg = folder.task == SEGMENTATION
    transform = data.segmentation_transform(loaded.model) if seg else data.classification_transform(loaded.model)
    digest = weights_digest(loaded.model)
    loaded.model.to(device, DTYPES[args.dtype])
    cache = FeatureCache(Path(args.out) / "features", loaded.name, digest, data.describe(transform), args.dtype)
    how = Extraction(loaded.model, transform, blocks, args.batch, device, DTYPES[args.dtype], patches=seg)
    start = time.perf_counter()
    found = [
        split_features(how, cache, name, split.images, split.masks, f"{name} features")
        for name, split in (("train", folder.train), ("val", folder.val))
        if split is not None
    ]
    seconds = round(time.perf_counter() - start, 3)
    computed, cached = sum(f.computed for f in found), sum(f.cached for f in found)
    where = cache.folder
    if computed:
        ran = count(computed, "image")
        print(f"features: {loaded.name}: {ran} run through the model, {cached} from the cache {where}")
    else:
        print(f"features: {loaded.name}: all {count(cached, 'image')} cached in {where}; no forward")
    skipped = [name for f in found for name in f.skipped]
    if skipped:
        warn(
            f"skipped {count(len(skipped), 'image')} that cannot be read: {skipped[0]}"
            + (f" and {len(skipped) - 1} more" if len(skipped) > 1 else "")
            + " (--strict refuses them)"
        )
    return transform, digest, found[0], found[1] if len(found) > 1 else None, seconds, skipped


def _pictures(args, folder: ImageFolder, sets, transform, result, num_classes: int, tag: str) -> list[Path]:
    rows = sets.val_rows[: args.pictures].tolist()
    images = (folder.val or folder.train).images
    paths = [images[sets.val.kept[r]] for r in rows]
    shown = [transform.picture(data.load_image(p)) for p in paths]
    truths = [sets.val.masks[r] for r in rows]
    return report.write_pictures(
        Path(args.out), [str(p) for p in paths], shown, truths, result.predictions, num_classes, tag
    )


def _rows_of_model(args, folder: ImageFolder, name: str | None, device, num_classes: int) -> list[dict]:
    torch.manual_seed(0)  # random-init weights are the same on every run: their cache is found again
    loaded = load_model(name, ModelSource.of(args))
    depth = len(loaded.model.blocks)
    layer_sets = [(text, evaluate.layer_blocks(text, depth)) for text in args.layer or ["last"]]
    blocks = sorted({b for _, found in layer_sets for b in found})
    transform, digest, train, val, seconds, skipped = _extract(folder, loaded, args, blocks, device)
    seg = folder.task == SEGMENTATION
    labels = folder.train.labels if not seg else None
    sets = evaluate.make_sets(
        train, val, labels, folder.val.labels if folder.val and not seg else None, args.val_split, args.seed
    )
    rows = []
    for text, found in layer_sets:
        if seg:
            row, result = evaluate.segmentation_row(sets, found, num_classes, args.steps, args.seed)
            tag = f"{len(rows)}_{text}"
            row["pictures"] = [str(p) for p in _pictures(args, folder, sets, transform, result, num_classes, tag)]
        else:
            row = evaluate.classification_row(sets, found, args.tokens, num_classes, args.seed, args.max_iter)
        row["times_s"]["features"] = seconds
        rows.append(
            {
                "model": loaded.name,
                "weights": loaded.source,
                "weights_digest": digest,
                "layer": text,
                **row,
                "transform": data.describe(transform),
                "dtype": args.dtype,
                "skipped_images": skipped,
                "seeds": {
                    "val_split": args.seed if folder.val is None else None,
                    "logreg_holdout": args.seed,
                    "head": args.seed if seg else None,
                },
            }
        )
    return rows


def execute(args: argparse.Namespace) -> int:
    device = find_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = read_image_folder(args.data, args.task)
    num_classes = _check_data(folder, args)
    rows = []
    for name in args.model or [None]:
        rows += _rows_of_model(args, folder, name, device, num_classes)
    seg = folder.task == SEGMENTATION
    header, body = (report.segmentation_table if seg else report.classification_table)(rows)
    print(table(header, body))
    record = {
        "task": folder.task,
        "data": str(args.data),
        "classes": folder.classes,
        "val": "folder" if folder.val else f"split {args.val_split} of train",
        "rows": rows,
    }
    print(f"results: {report.write_results(Path(args.out), record)}")
    if len(rows) > 1:
        print(report.write_chart(Path(args.out), rows, folder.task))
    return 0
