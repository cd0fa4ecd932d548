"""What a probe run says: a table on stdout, DIR/results.json, a chart of several rows, segmentation pictures."""

from __future__ import annotations

import importlib.util
import io
import json
import math
from pathlib import Path

import numpy as np

from timm_ls.paths import install_hint

from ..tools.dense import write_png
from ..tools.files import write_atomically

RESULTS, CHART, PICTURES = "results.json", "probe.png", "pictures"
CHART_K = 20  # the k the chart shows (DINOv2's and DINOv3's reported kNN), else the largest one run


def _percent(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


def classification_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    ks = sorted({int(k) for row in rows for k in row["knn"]["top1"]})
    header = ["model", "layer", "kNN tokens", *(f"kNN k={k}" for k in ks), "logreg tokens", "logreg", "C"]
    body = []
    for row in rows:
        top1 = row["knn"]["top1"]
        logreg = row["logreg"]
        body.append(
            [
                row["model"],
                row["layer"],
                row["tokens"]["knn"],
                *(_percent(top1.get(str(k))) for k in ks),
                row["tokens"]["logreg"],
                _percent(logreg["top1"]),
                f"{logreg['best_c']:.3g}",
            ]
        )
    return header, body


def table_of(task: str, rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The printed table's header and rows for `task`'s rows."""
    return (segmentation_table if task == "segmentation" else classification_table)(rows)


def segmentation_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "layer", "mIoU", "pixel acc."]
    return header, [[r["model"], r["layer"], _percent(r["miou"]), _percent(r["pixel_accuracy"])] for r in rows]


def write_results(out: Path, record: dict) -> Path:
    path = out / RESULTS
    write_atomically(path, json.dumps(record, indent=2, allow_nan=True) + "\n")
    return path


def _chart_values(rows: list[dict], task: str) -> tuple[list[str], dict[str, list[float]]]:
    labels = [f"{r['model']}\n{r['layer']}" for r in rows]
    if task == "segmentation":
        return labels, {"mIoU": [r["miou"] for r in rows], "pixel accuracy": [r["pixel_accuracy"] for r in rows]}
    ks = sorted({int(k) for r in rows for k in r["knn"]["top1"]})
    k = CHART_K if CHART_K in ks else ks[-1]
    knn = [r["knn"]["top1"].get(str(k), float("nan")) for r in rows]
    return labels, {f"kNN top-1 (k={k})": knn, "logistic regression top-1": [r["logreg"]["top1"] for r in rows]}


def write_chart(out: Path, rows: list[dict], task: str) -> str:
    """A bar chart of the rows' accuracies as DIR/probe.png; the line the command prints about it."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"chart: not drawn, matplotlib is not installed; {install_hint('tools')}"
    import matplotlib  # an optional dependency (the tools extra): imported only to draw

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # after the backend is chosen

    labels, series = _chart_values(rows, task)
    figure, axes = plt.subplots(figsize=(max(5.0, 1.4 * len(rows) + 2), 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        axes.bar(np.arange(len(rows)) + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    axes.set_xticks(np.arange(len(rows)), labels, fontsize=7)
    axes.set_ylabel("percent")
    axes.set_ylim(0, 100)
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    write_atomically(out / CHART, buffer.getvalue())
    return f"chart: {out / CHART}"


def palette(num_classes: int) -> np.ndarray:
    """A fixed colour per class index (golden-ratio hues), black for 255 (ignored)."""
    colours = np.zeros((256, 3), dtype=np.uint8)
    for c in range(min(num_classes, 255)):
        hue = (c * 0.618034) % 1.0
        colours[c] = [int(255 * (0.5 + 0.5 * math.cos(2 * math.pi * (hue + shift)))) for shift in (0, 1 / 3, 2 / 3)]
    return colours


def write_pictures(out: Path, names: list[str], images, truths, predictions, num_classes: int, tag: str) -> list[Path]:
    """DIR/pictures/<tag>_<stem>.png per val image: the image, its truth and the prediction side by side."""
    folder = out / PICTURES
    folder.mkdir(exist_ok=True)
    colours, written = palette(num_classes), []
    for name, image, truth, guess in zip(names, images, truths, predictions):
        row = np.concatenate([image, colours[truth.numpy()], colours[guess.numpy().astype(np.uint8)]], axis=1)
        path = folder / f"{tag}_{Path(name).stem}.png"
        write_png(path, np.ascontiguousarray(row))
        written.append(path)
    return written
