"""`timm-ls probe` through the command: kNN against a dense numpy computation on features taken from the model
here, the cache found again (no forward, files untouched), a block added reusing the rest, several rows and
a chart, segmentation's mIoU, and every bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file
from support import move_off_init_

from timm_layerscale.probe import C_GRID
from timm_ls.main import main

OURS = "vit_ls_small_patch16_dinov3"
TINY = ["depth=2", "embed_dim=64", "num_heads=2"]
COLOURS = {"blue": (40, 60, 220), "green": (40, 200, 60), "red": (220, 40, 40)}  # sorted: timm's class order


def draw_classes(root, per_class: dict[str, int], seed: int = 0) -> None:
    """One folder per colour, each image a disc of that colour on a dark random background."""
    rng = np.random.default_rng(seed)
    for split, n in per_class.items():
        for name, colour in COLOURS.items():
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                image = Image.new("RGB", (48, 40), tuple(int(v) for v in rng.integers(0, 80, 3)))
                x, y = rng.integers(0, 20, 2)
                ImageDraw.Draw(image).ellipse((x, y, x + 24, y + 20), fill=colour)
                image.save(root / split / name / f"{i:03d}.png")


def draw_scenes(root, per_split: dict[str, int], seed: int = 0) -> None:
    """A red disc (class 1) and a blue square (class 2) on grey (class 0), with their masks."""
    rng = np.random.default_rng(seed)
    for split, n in per_split.items():
        for sub in ("images", "masks"):
            (root / split / sub).mkdir(parents=True)
        for i in range(n):
            image, mask = Image.new("RGB", (64, 48), (30, 30, 30)), Image.new("L", (64, 48), 0)
            for cls, colour in ((1, (220, 40, 40)), (2, (40, 60, 220))):
                x, y = rng.integers(0, 36), rng.integers(0, 24)
                for target, fill in ((image, colour), (mask, cls)):
                    pen = ImageDraw.Draw(target)
                    (pen.ellipse if cls == 1 else pen.rectangle)((x, y, x + 24, y + 20), fill=fill)
            image.save(root / split / "images" / f"{i:03d}.png")
            mask.save(root / split / "masks" / f"{i:03d}.png")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A two-block, 64-wide model moved off its init, as a file --checkpoint takes."""
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model(OURS, depth=2, embed_dim=64, num_heads=2)).eval()
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save_file(model.state_dict(), path)
    return model, path


def probe(data, out, weights_file, *extra: str) -> list[str]:
    args = ["probe", str(data), "--model", OURS, "--checkpoint", str(weights_file), "--model-kwargs", *TINY]
    return [*args, "--threads", "1", "--max-iter", "30", "--out", str(out), *extra]


def numpy_knn_top1(train, train_labels, test, test_labels, k, largest, classes, T=0.07):
    """Meta's protocol from its description: normalised features, dense cosine similarity, weights
    softmax(sim / T) over the `largest` k run, the first k of them as one-hot votes summed per class."""
    a = train / np.linalg.norm(train, axis=1, keepdims=True)
    b = test / np.linalg.norm(test, axis=1, keepdims=True)
    sim = b @ a.T
    order = np.argsort(-sim, axis=1, kind="stable")[:, :largest]
    top = np.take_along_axis(sim, order, axis=1) / T
    w = np.exp(top - top.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    votes = np.zeros((len(test), classes))
    for row in range(len(test)):
        np.add.at(votes[row], train_labels[order[row, :k]], w[row, :k])
    return 100 * (votes.argmax(1) == test_labels).mean()


def direct_cls(model, folder):
    """The last block's normed CLS token of every image of `folder`, with timm's eval transform (no package code)."""
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    paths = sorted(folder.glob("*/*.png"))
    x = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
    with torch.no_grad():
        tokens = model.forward_features(x)
    return tokens[:, 0].double().numpy(), np.array([sorted(COLOURS).index(p.parent.name) for p in paths])


def test_classification_knn_matches_numpy_and_the_cache_is_found_again(tmp_path, weights, capsys):
    model, weights_file = weights
    data, out = tmp_path / "data", tmp_path / "out"
    draw_classes(data, {"train": 12, "val": 5})
    assert main(probe(data, out, weights_file)) == 0
    printed = capsys.readouterr().out
    assert "51 images run through the model, 0 from the cache" in printed
    record = json.loads((out / "results.json").read_text())
    (row,) = record["rows"]
    assert record["classes"] == sorted(COLOURS) and row["layer"] == "last" and row["blocks"] == [1]
    assert row["knn"]["ks"] == [10, 20] and (row["train_images"], row["val_images"]) == (36, 15)
    train, train_labels = direct_cls(model, data / "train")
    val, val_labels = direct_cls(model, data / "val")
    for k in (10, 20):
        expected = numpy_knn_top1(train, train_labels, val, val_labels, k, 20, 3)
        assert abs(row["knn"]["top1"][str(k)] - expected) < 1e-4  # percent, float32 means
    assert row["logreg"]["best_c"] in C_GRID and len(row["logreg"]["sweep"]) == 45
    assert row["weights"].startswith(f"checkpoint {weights_file} (") and row["transform"].startswith("Compose(")

    files = sorted((out / "features").rglob("*.safetensors"))
    stamps = [f.stat().st_mtime_ns for f in files]
    assert main(probe(data, out, weights_file)) == 0
    assert "all 51 images cached in" in capsys.readouterr().out
    assert [f.stat().st_mtime_ns for f in files] == stamps
    again = json.loads((out / "results.json").read_text())["rows"][0]
    assert again["knn"] == row["knn"] and again["logreg"]["best_c"] == row["logreg"]["best_c"]


def test_several_layers_are_rows_with_a_chart_and_reuse_cached_blocks(tmp_path, weights, capsys):
    _, weights_file = weights
    data, out = tmp_path / "data", tmp_path / "out"
    draw_classes(data, {"train": 8})
    assert main(probe(data, out, weights_file, "--val-split", "0.5")) == 0
    last = sorted((out / "features").rglob("block001/*.safetensors"))
    stamps = [f.stat().st_mtime_ns for f in last]
    capsys.readouterr()
    assert (
        main(probe(data, out, weights_file, "--val-split", "0.5", "--layer", "0", "last", "--tokens", "avgpool")) == 0
    )
    printed = capsys.readouterr().out
    assert [f.stat().st_mtime_ns for f in last] == stamps  # only block 0 was computed
    assert len(list((out / "features").rglob("block000/*.safetensors"))) == 1
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["layer"] for r in rows] == ["0", "last"] and rows[0]["feature_dim"] == {"knn": 64, "logreg": 64}
    assert (rows[0]["train_images"], rows[0]["val_images"]) == (12, 12)
    assert (out / "probe.png").stat().st_size > 0 and "chart:" in printed


def test_segmentation_reaches_a_stated_miou_and_draws_pictures(tmp_path, weights, capsys):
    _, weights_file = weights
    data, out = tmp_path / "data", tmp_path / "out"
    draw_scenes(data, {"train": 12, "val": 4})
    assert main(probe(data, out, weights_file, "--task", "segmentation", "--steps", "60", "--pictures", "2")) == 0
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["miou"] > 50 and row["pixel_accuracy"] > 75, row  # a constant guess scores mIoU < 30
    assert len(row["iou_per_class"]) == 3 and row["steps"] == 60
    pictures = sorted((out / "pictures").iterdir())
    assert len(pictures) == 2
    size = Image.open(data / "val" / "images" / "000.png").size
    assert Image.open(pictures[0]).size[0] == 3 * Image.open(pictures[0]).size[1] and size == (64, 48)


def _layout(root, case: str) -> str:
    """A data folder with one thing wrong; the words the one error line must hold."""
    if case == "no train folder":
        (root / "val" / "a").mkdir(parents=True)
        return "has no train/ folder"
    if case == "one class":
        draw_classes(root, {"train": 2})
        for name in ("green", "red"):
            for f in (root / "train" / name).iterdir():
                f.unlink()
            (root / "train" / name).rmdir()
        return "holds one class (blue)"
    if case == "val class not in train":
        draw_classes(root, {"train": 4, "val": 1})
        (root / "val" / "blue").rename(root / "val" / "purple")
        return "has the class 'purple', which train/ does not have"
    if case == "empty class folder":
        draw_classes(root, {"train": 4})
        (root / "train" / "grey").mkdir()
        return "grey holds no images"
    if case == "unreadable image with --strict":
        draw_classes(root, {"train": 4})
        (root / "train" / "red" / "000.png").write_bytes(b"not a png")
        return "cannot read image"
    if case == "mask size differs":
        draw_scenes(root, {"train": 2})
        Image.new("L", (32, 32)).save(root / "train" / "masks" / "001.png")
        return "mask needs its image's size"
    if case == "image without a mask":
        draw_scenes(root, {"train": 2})
        (root / "train" / "masks" / "001.png").unlink()
        return "has no mask"
    if case == "val mask class not in train":
        draw_scenes(root, {"train": 2, "val": 1})
        Image.new("L", (64, 48), 7).save(root / "val" / "masks" / "000.png")
        return "val masks hold class 7, which no train mask has"
    draw_classes(root, {"train": 2})
    return "leaves 3 train images once --val-split 0.2 is held out"


BAD_LAYOUTS = [
    "no train folder",
    "one class",
    "val class not in train",
    "empty class folder",
    "unreadable image with --strict",
    "mask size differs",
    "image without a mask",
    "val mask class not in train",
    "too few train images for k=10",
]


@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_bad_data_is_one_line_and_nothing_is_written(tmp_path, weights, capsys, case):
    data, out = tmp_path / "data", tmp_path / "out"
    words = _layout(data, case)
    extra = ["--task", "segmentation"] if "mask" in case else []
    extra += ["--strict"] if "strict" in case else []
    assert main(probe(data, out, weights[1], *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("timm-ls: error: ") and words in err[0], err
    assert not out.exists()


def test_an_unreadable_image_is_skipped_with_a_count(tmp_path, weights, capsys):
    data, out = tmp_path / "data", tmp_path / "out"
    draw_classes(data, {"train": 5})
    broken = data / "train" / "red" / "004.png"
    broken.write_bytes(b"not a png")
    assert main(probe(data, out, weights[1], "--val-split", "0.3")) == 0
    captured = capsys.readouterr()
    assert f"timm-ls: warning: skipped 1 image that cannot be read: {broken}" in captured.err
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["skipped_images"] == [str(broken)] and row["train_images"] + row["val_images"] == 14


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--layer", "7"], "--layer 7: the model has 2 blocks"),
        (["--layer", "middle"], "--layer: got 'middle'"),
        (["--val-split", "1.5"], "--val-split: got 1.5"),
        (["--tokens", "patch"], "unknown token choice 'patch'"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, weights, capsys, flags, words):
    data, out = tmp_path / "data", tmp_path / "out"
    draw_classes(data, {"train": 5})
    assert main(probe(data, out, weights[1], *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


# The front in a fresh interpreter, which then names the heavy packages it imported.
WATCH = """
import sys
from timm_ls.main import main
code = main(sys.argv[1:])
print("IMPORTED", ",".join(n for n in ("torch", "timm", "timm_layerscale") if n in sys.modules) or "-", file=sys.stderr)
raise SystemExit(code)
"""


def front(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WATCH, *args], capture_output=True, text=True, timeout=120)


def imported(run: subprocess.CompletedProcess[str]) -> str:
    return run.stderr.strip().splitlines()[-1].removeprefix("IMPORTED ")


def test_the_front_refuses_before_torch(tmp_path):
    draw_classes(tmp_path / "data", {"train": 2, "val": 1})
    (tmp_path / "data" / "val" / "blue").rename(tmp_path / "data" / "val" / "purple")
    run = front("probe", str(tmp_path / "data"), "--model", OURS, "--out", str(tmp_path / "data" / "out"))
    assert run.returncode == 2 and "which train/ does not have" in run.stderr and imported(run) == "-"
    (tmp_path / "data" / "val" / "purple").rename(tmp_path / "data" / "val" / "blue")
    inside = front("probe", str(tmp_path / "data"), "--model", OURS, "--out", str(tmp_path / "data" / "train" / "o"))
    assert inside.returncode == 2 and "inside DATA" in inside.stderr and imported(inside) == "-"
    assert not (tmp_path / "data" / "train" / "o").exists()
