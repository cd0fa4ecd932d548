"""`timm-ls features` streamed: a signal leaves the destination as it was, the memory count does not grow with the
number of images, and random images (modes, sizes, aspects, truncations, counts) give pictures or one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from support import move_off_init_

from timm_layerscale.cli import features as command
from timm_layerscale.tools import feature_memory, feature_pictures, feature_run
from timm_ls.main import main, parse
from timm_ls.model_source import ModelSource

OURS = "vit_ls_small_patch16_dinov3"
SMALL = ["--model-kwargs", "depth=2", "embed_dim=64", "num_heads=4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "small.safetensors"
    torch.manual_seed(0)
    save_file(move_off_init_(timm.create_model(OURS, depth=2, embed_dim=64, num_heads=4)).state_dict(), path)
    return path


def noise(path, size, seed=0, mode="RGB"):
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path)
    return path


def wait_for(predicate, process, limit=120.0):
    """Polls `predicate` until it holds (the command's own progress, not a time), or the process ends."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the command never got there"
        time.sleep(0.02)


@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "--overwrite into a folder"])
def test_sigterm_mid_run_leaves_the_destination_as_it_was(existing, checkpoint, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(12):
        noise(images / f"im{i:02d}.png", (96, 64), i)
    out = tmp_path / "out"
    before = {}
    if existing:
        out.mkdir()
        (out / "mine.txt").write_text("the user's")
        (out / "im00_pca.png").write_bytes(b"an earlier picture")
        before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = ["features", str(images), "--checkpoint", str(checkpoint), *SMALL, "--out", str(out), "--batch", "1"]
    argv += ["--size", "512", "--overwrite"] if existing else ["--size", "512"]
    process = subprocess.Popen(
        [sys.executable, "-m", "timm_ls", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    spools = lambda: list(tmp_path.glob(f".out.tmp-*/out/{feature_pictures.SPOOL_NAME}"))  # noqa: E731
    wait_for(lambda: any(p.stat().st_size > 0 for p in spools()), process)  # the first forward is spooled
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == f"timm-ls: interrupted; nothing was written to {out}", err
    assert not list(tmp_path.glob(".out.tmp-*")), "the staging folder is removed"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before if existing else not out.exists()


def test_an_interrupted_run_then_a_whole_one_writes_every_picture(checkpoint, tmp_path):
    image = noise(tmp_path / "a.png", (64, 48))
    argv = ["features", str(image), "--checkpoint", str(checkpoint), *SMALL, "--size", "48"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a_pca.png"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging or spool is left"


def job(width, height, size=224):
    return feature_pictures.ImageJob(f"{width}x{height}.png", (width, height), (width, height), (width, height), 16).at(
        size
    )


@pytest.mark.parametrize("per_image", [True, False])
def test_the_memory_count_is_bounded_by_a_batch_not_the_number_of_images(per_image):
    few = [job(640, 480), job(480, 640)] * 4  # full batches of each crop
    many = few * 500
    count = lambda jobs: feature_memory.peak_bytes(jobs, 4, 384, 4, 5, joint=not per_image, masked=False).bytes  # noqa: E731
    assert count(many) == count(few)
    assert count([job(1280, 960, size=448)] * 4) > count(few)  # larger crops count more


def test_the_memory_count_grows_with_the_batch_and_the_model_width():
    jobs = [job(640, 480)] * 8
    peak = lambda batch, dim: feature_memory.peak_bytes(jobs, batch, dim, 4, 5, True, False).bytes  # noqa: E731
    assert peak(1, 384) < peak(8, 384) and peak(1, 384) < peak(1, 1024)
    # A forward of 8 images counts the fitted formula for 8 and every image's pixels.
    forward = feature_memory.forward_phase_bytes(jobs[0], 8, 384, 4, 5, True)
    assert forward > feature_memory.forward_bytes(jobs[0].patches + 5, 384, 8) + 8 * 3 * jobs[0].pixels * 4


MODES = ["1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16", "I", "F"]


def fuzzed_image(path, rng):
    """An image of a random mode, size and aspect, sometimes truncated or replaced by random bytes."""
    width, height = (int(v) for v in rng.choice([1, 3, 15, 16, 17, 40, 97, 300], 2))
    mode = str(rng.choice(MODES))
    array = rng.integers(0, 255, (height, width), dtype=np.uint8)
    image = (
        Image.fromarray(array).convert(mode)
        if mode not in ("I;16", "I", "F")
        else Image.fromarray(array.astype({"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]) * 257)
    )
    suffixes = {"I": [".tiff"], "F": [".tiff"], "CMYK": [".tiff", ".jpg"], "I;16": [".png", ".tiff"]}
    suffix = str(rng.choice(suffixes.get(mode, [".png", ".tiff", ".jpg"])))
    if suffix == ".jpg" and mode not in ("L", "RGB", "CMYK"):
        image = image.convert("RGB")
    file = path.with_suffix(suffix)
    image.save(file)
    damage = rng.random()
    if damage < 0.15:
        data = file.read_bytes()
        file.write_bytes(data[: int(rng.integers(0, len(data)))])
    elif damage < 0.25:
        file.write_bytes(rng.bytes(int(rng.integers(0, 400))))
    return file


@pytest.mark.parametrize("seed", range(10))
def test_random_images_give_pictures_or_one_line(seed, checkpoint, tmp_path, capsys):
    rng = np.random.default_rng(seed)
    folder = tmp_path / "images"
    folder.mkdir()
    files = [fuzzed_image(folder / f"im{i}", rng) for i in range(int(rng.integers(1, 5)))]
    size = str(rng.choice(["native", "16", "48", "100"]))
    argv = ["features", str(folder), "--checkpoint", str(checkpoint), *SMALL, "--size", size]
    argv += ["--per-image"] if rng.random() < 0.3 else []
    argv += ["--foreground"] if rng.random() < 0.3 else []
    code = main([*argv, "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code in (0, 2), captured.err
    if code == 2:
        (line,) = captured.err.strip().splitlines()[-1:]
        assert line.startswith("timm-ls: error: ") and "Traceback" not in captured.err, captured.err
        assert not (tmp_path / "out").exists()
    else:
        written = sorted(p.name for p in (tmp_path / "out").iterdir())
        assert written == sorted(f"{f.stem}_pca.png" for f in files), (written, files)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], os.listdir(tmp_path)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_on_a_gpu_the_count_adds_the_models_weights_at_the_run_dtype(dtype, checkpoint, tmp_path):
    """On the CPU the loaded weights are in memory already; on a GPU they are moved there, so they count."""
    image = noise(tmp_path / "a.png", (64, 48))
    args = parse(["features", str(image), "--checkpoint", str(checkpoint), *SMALL, "--out", "x", "--dtype", dtype])
    loaded = command.load_model(args.model, ModelSource.of(args))
    jobs = feature_pictures.measure_images([image], 768, 16)
    on_cpu = feature_run.need(loaded, jobs, command.settings(args), torch.device("cpu")).total
    on_gpu = feature_run.need(loaded, jobs, command.settings(args), torch.device("cuda")).total
    element = 2 if dtype == "bf16" else 4
    weights = sum(t.numel() for t in [*loaded.model.parameters(), *loaded.model.buffers()]) * element
    assert on_gpu - on_cpu == weights > 0


def test_a_large_file_at_a_small_size_peaks_while_it_is_read(checkpoint, tmp_path, capsys):
    """The file decoded and converted to RGB are both held (PIL's `convert` copies, 4 bytes a pixel each):
    a 4000x3000 file read for a 64 px run peaks there, at no less than those two."""
    image = noise(tmp_path / "big.png", (4000, 3000))
    args = parse(["features", str(image), "--checkpoint", str(checkpoint), *SMALL, "--out", "x", "--size", "64"])
    loaded = command.load_model(args.model, ModelSource.of(args))
    (job,) = feature_pictures.measure_images([image], 64, 16)
    counted = feature_run.need(loaded, [job], command.settings(args), torch.device("cpu"))
    assert counted.peak.phase == "reading" and counted.total >= 2 * 4 * 4000 * 3000
    assert main([*args_of(image, checkpoint), "--size", "64", "--out", str(tmp_path / "out")]) == 0
    assert "at the peak (reading 1 image of 80x64 px" in capsys.readouterr().out


def args_of(image, checkpoint):
    return ["features", str(image), "--checkpoint", str(checkpoint), *SMALL]


def test_a_spool_that_would_not_fit_on_the_disk_is_refused_in_one_line(checkpoint, tmp_path, capsys, monkeypatch):
    image = noise(tmp_path / "a.png", (64, 48))
    monkeypatch.setattr(feature_run, "free_disk", lambda folder: 1000)  # bytes free beside the destination
    assert main([*args_of(image, checkpoint), "--size", "48", "--out", str(tmp_path / "out")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "on disk while the command runs and 0.0 GiB is free beside" in err and "a smaller --size" in err, err
    assert not (tmp_path / "out").exists()
