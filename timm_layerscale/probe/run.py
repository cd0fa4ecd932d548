"""`timm-ls probe` as one application: the request's data checked (`check_data`), then each model's rows
(`probe_model`): features from the cache or the model, Meta's protocols on each `--layer` choice, the rows
results.json records (`probe.results`) and the lines the command prints.

The command parses the flags into a `ProbeRequest` and loads each model; everything else is here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from timm_ls.image_folder import SEGMENTATION, ImageFolder
from timm_ls.probe_request import ProbeRequest

from ..tools.feature_run import DTYPES, Loaded
from . import data, evaluate, report, results
from .cache import FeatureCache, weights_digest
from .extract import Extraction, SplitFeatures, split_features
from .knn import KS
from .split import stratified_split


def count(number: int, noun: str) -> str:
    """`1 image`, `3 images`."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def check_data(folder: ImageFolder, request: ProbeRequest) -> int:
    """Everything about the data that can be refused, before any model is built or anything written; the
    number of classes."""
    splits = [folder.train, *([folder.val] if folder.val else [])]
    if request.strict:
        for split in splits:
            data.refuse_unreadable(split.images)
    if folder.task != SEGMENTATION:
        _check_train_size(folder, request)
        return len(folder.classes)
    train, *val = [data.mask_classes(split.images, split.masks) for split in splits]
    return evaluate.segmentation_classes(train, val[0] if val else train)


def _check_train_size(folder: ImageFolder, request: ProbeRequest) -> None:
    labels, fraction = folder.train.labels, request.val_split
    train = len(labels) if folder.val else len(labels) - sum(stratified_split(labels, fraction, request.seed))
    if train < min(KS):
        where = "" if folder.val else f" once --val-split {fraction} is held out"
        raise ValueError(
            f"{folder.train.images[0].parent.parent} leaves {count(train, 'train image')}{where}; the kNN needs "
            f"{min(KS)} or more (its smallest k): add images"
        )


@dataclass
class Features:
    """One model's features of train and val, and what reading them says."""

    transform: object
    digest: str
    train: SplitFeatures
    val: SplitFeatures | None
    seconds: float
    skipped: list[str]
    lines: list[str] = field(default_factory=list)  # for stdout
    warnings: list[str] = field(default_factory=list)  # for stderr, one line each


def _extract(folder: ImageFolder, loaded: Loaded, request: ProbeRequest, blocks: list[int], device) -> Features:
    """Train's and val's features of one model, from the cache where it has them."""
    seg = folder.task == SEGMENTATION
    transform = data.segmentation_transform(loaded.model) if seg else data.classification_transform(loaded.model)
    digest = weights_digest(loaded.model)
    dtype = DTYPES[request.dtype]
    loaded.model.to(device, dtype)
    cache = FeatureCache(request.out / "features", loaded.name, digest, data.describe(transform), request.dtype)
    how = Extraction(loaded.model, transform, blocks, request.batch, device, dtype, patches=seg)
    start = time.perf_counter()
    found = [
        split_features(how, cache, name, split.images, split.masks, f"{name} features")
        for name, split in (("train", folder.train), ("val", folder.val))
        if split is not None
    ]
    seconds = round(time.perf_counter() - start, 3)
    computed, cached = sum(f.computed for f in found), sum(f.cached for f in found)
    skipped = [name for f in found for name in f.skipped]
    got = Features(transform, digest, found[0], found[1] if len(found) > 1 else None, seconds, skipped)
    if computed:
        ran, where = count(computed, "image"), cache.folder
        got.lines.append(f"features: {loaded.name}: {ran} run through the model, {cached} from the cache {where}")
    else:
        got.lines.append(f"features: {loaded.name}: all {count(cached, 'image')} cached in {cache.folder}; no forward")
    if skipped:
        more = f" and {len(skipped) - 1} more" if len(skipped) > 1 else ""
        got.warnings.append(
            f"skipped {count(len(skipped), 'image')} that cannot be read: {skipped[0]}{more} (--strict refuses them)"
        )
    return got


def _pictures(request: ProbeRequest, folder: ImageFolder, sets, transform, result, num_classes: int, tag: str):
    rows = sets.val_rows[: request.pictures].tolist()
    images = (folder.val or folder.train).images
    paths = [images[sets.val.kept[r]] for r in rows]
    shown = [transform.picture(data.load_image(p)) for p in paths]
    truths = [sets.val.masks[r] for r in rows]
    names = [str(p) for p in paths]
    return report.write_pictures(request.out, names, shown, truths, result.predictions, num_classes, tag)


@dataclass
class ModelRows:
    """One model's rows of results.json, and the lines the command prints of it."""

    rows: list[dict]
    lines: list[str]
    warnings: list[str]


def probe_model(loaded: Loaded, folder: ImageFolder, request: ProbeRequest, device, num_classes: int) -> ModelRows:
    """One row per `--layer` choice of `request` for the model `loaded`."""
    depth = len(loaded.model.blocks)
    layer_sets = [(choice.text, choice.blocks(depth)) for choice in request.layers]
    got = _extract(folder, loaded, request, sorted({b for _, found in layer_sets for b in found}), device)
    seg = folder.task == SEGMENTATION
    labels = (folder.train.labels, folder.val.labels if folder.val else None) if not seg else (None, None)
    sets = evaluate.make_sets(got.train, got.val, *labels, request.val_split, request.seed)
    rows, warnings = [], list(got.warnings)
    for text, found in layer_sets:
        if seg:
            row, result = evaluate.segmentation_row(sets, found, num_classes, request.steps, request.seed)
            drawn = _pictures(request, folder, sets, got.transform, result, num_classes, f"{len(rows)}_{text}")
            row["pictures"] = [str(p) for p in drawn]
        else:
            row = evaluate.classification_row(sets, found, request.tokens, num_classes, request.seed, request.max_iter)
        row["times_s"]["features"] = got.seconds
        read = {"weights_digest": got.digest, "transform": data.describe(got.transform), "skipped_images": got.skipped}
        rows.append(results.row(loaded, text, row, read, folder, request))
        warnings += results.flat_features_warnings(rows[-1])
    return ModelRows(rows, got.lines, warnings)


def write_outputs(folder: ImageFolder, request: ProbeRequest, rows: list[dict]) -> list[str]:
    """results.json and, for several rows, the chart; the lines that say where."""
    lines = [f"results: {report.write_results(request.out, results.record(folder, request, rows))}"]
    if len(rows) > 1:
        lines.append(report.write_chart(request.out, rows, folder.task))
    return lines
