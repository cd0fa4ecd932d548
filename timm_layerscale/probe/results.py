"""What `timm-ls probe` records in DIR/results.json: one row per model and `--layer` choice, under a record of
the run; and the doubt a row's numbers raise (features too alike across images for a score to mean anything).

A row names the tokens each protocol read (`tokens`: kNN's are always the CLS token, as Meta's; the logistic
regression's are `--tokens`) and how much those features differ across images (`spread`: each dimension's
standard deviation over the images, averaged, relative to the features' mean magnitude).
"""

from __future__ import annotations

from timm_ls.image_folder import SEGMENTATION, ImageFolder
from timm_ls.probe_request import ProbeRequest

from ..tools.feature_run import Loaded

# Below this spread features are alike across images, whatever the images: a random-init model's CLS tokens
# spread by 1e-6 to 1e-4 of their magnitude (the depth's rounding and weights too small to mix the patches
# in), a bf16 run resolves 4e-3, trained features and random-init mean patch tokens spread by 0.1 and more.
ALIKE = 1e-3
PROTOCOLS = {"knn": "kNN", "logreg": "the logistic regression"}
SHOWN = {"cls": "CLS tokens", "avgpool": "mean patch tokens (avgpool)", "cls+avgpool": "CLS+avgpool tokens"}


def row(loaded: Loaded, layer: str, measured: dict, read: dict, folder: ImageFolder, request: ProbeRequest) -> dict:
    """One row: the model and its weights, the `--layer` choice as written, what `probe.evaluate` measured,
    how the features were read (`read`: weights_digest, transform, skipped_images)."""
    seg = folder.task == SEGMENTATION
    return {
        "model": loaded.name,
        "weights": loaded.source,
        "weights_digest": read["weights_digest"],
        "layer": layer,
        **measured,
        "transform": read["transform"],
        "dtype": request.dtype,
        "skipped_images": read["skipped_images"],
        "seeds": {
            "val_split": request.seed if folder.val is None else None,
            "logreg_holdout": request.seed,
            "head": request.seed if seg else None,
        },
    }


def record(folder: ImageFolder, request: ProbeRequest, rows: list[dict]) -> dict:
    """results.json: the task, the data and its classes, where the val set came from, the rows."""
    return {
        "task": folder.task,
        "data": str(request.data),
        "classes": folder.classes,
        "val": "folder" if folder.val else f"split {request.val_split} of train",
        "rows": rows,
    }


def flat_features_warnings(found: dict) -> list[str]:
    """One line for a classification row whose tokens barely differ across images (their spread below
    `ALIKE`): naming the tokens and the protocols that read them, and what to pass instead."""
    flat = [p for p, spread in found.get("spread", {}).items() if spread < ALIKE]
    if not flat:
        return []
    tokens = {found["tokens"][p] for p in flat}
    named = " and ".join(SHOWN[t] for t in sorted(tokens))
    readers = " and ".join(PROTOCOLS[p] for p in flat)
    spread = max(found["spread"][p] for p in flat)
    instead = "--tokens avgpool or " if "avgpool" not in tokens and "logreg" in flat else ""
    return [
        f"{found['model']} layer {found['layer']}: the {named} read by {readers} are alike across images (spread "
        f"{spread:.1e} of their magnitude, under {ALIKE:g}), so the scores on them say nothing of the model; "
        f"pass {instead}a trained checkpoint (--checkpoint or --pretrained)"
    ]
