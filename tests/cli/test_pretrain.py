"""`timm-ls pretrain`: a run end to end (its model read back by timm and by convert), resume from the
command line, and every refusal in one line with nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file
from support import free_port, image_folder, move_off_init_

from timm_layerscale.publish import save_native
from timm_ls.main import interrupted_line, main, parse

TINY = ["--model-kwargs", "depth=1", "img_size=32"]
STUDENT = ["--model", "vit_ls_tiny_patch16_dinov3", *TINY]
DISTILL = ["--method", "distill", "--teacher", "vit_ls_tiny_patch16_dinov3", *STUDENT, "--size", "32"]
SHORT = ["--steps", "2", "--batch-size", "2"]


@pytest.fixture
def images(tmp_path) -> Path:
    image_folder(tmp_path / "images" / "a", n=3, size=40)
    image_folder(tmp_path / "images" / "b" / "deeper", n=2, size=36)
    return tmp_path / "images"


def one_line(argv: list[str], capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("timm-ls: error: "), err
    return lines[0]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_distillation_writes_a_model_timm_and_convert_read_and_its_checkpoint(images, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["pretrain", str(images), "--out", str(run), *DISTILL, *SHORT]) == 0
    out = capsys.readouterr().out
    assert "distill: 5 images, step 2" in out and f"wrote {run / 'model'}" in out
    assert [line["step"] for line in metrics(run)] == [0, 1]
    assert {"loss", "global", "dense", "lr", "student_feature_std"} <= set(metrics(run)[0])
    model = timm.create_model(f"local-dir:{run / 'model'}", pretrained=True)
    saved = load_file(run / "checkpoint" / "training.safetensors")
    student = {k.removeprefix("method.student."): v for k, v in saved.items() if k.startswith("method.student.")}
    assert student and all(torch.equal(v, student[k]) for k, v in model.state_dict().items())
    assert not any("teacher" in key for key in saved)  # the frozen teacher is loaded again, never saved
    assert main(["convert", str(run / "model"), str(tmp_path / "meta.pth"), "--to", "meta"]) == 0


def test_a_dinov3_run_writes_every_part_and_a_model_probe_reads(images, tmp_path, capsys):
    run = tmp_path / "run"
    dinov3 = [
        *STUDENT,
        "--size",
        "32",
        "--local-crops",
        "2",
        "--prototypes",
        "64",
        "--gram",
        "--head-warmup-steps",
        "1",
    ]
    assert main(["pretrain", str(images), "--out", str(run), *dinov3, "--steps", "3", "--batch-size", "2"]) == 0
    assert "dinov3: 5 images, step 3" in capsys.readouterr().out
    first = metrics(run)[0]
    assert {"dino_local", "dino_global", "koleo", "ibot", "gram", "teacher_entropy", "student_cls_std"} <= set(first)
    assert first["lr"] == 0.0  # the backbone's rate during the heads' warm-up (the first group's)
    saved = load_file(run / "checkpoint" / "training.safetensors")
    assert any(k.startswith("method.teacher.") for k in saved) and any(
        k.startswith("method.gram_teacher.") for k in saved
    )
    model = timm.create_model(f"local-dir:{run / 'model'}", pretrained=True)
    student = {k.removeprefix("method.student."): v for k, v in saved.items() if k.startswith("method.student.")}
    assert all(torch.equal(v, student[k]) for k, v in model.state_dict().items())
    classes = tmp_path / "labelled"
    for split, n in (("train", 6), ("val", 2)):
        for name in ("a", "b"):
            image_folder(classes / split / name, n=n, size=32 + 8 * (name == "b"))
    probe = ["probe", str(classes), "--model", "vit_ls_tiny_patch16_dinov3", "--checkpoint", str(run / "model")]
    assert main([*probe, "--out", str(tmp_path / "probe"), "--max-iter", "5"]) == 0
    assert (tmp_path / "probe" / "results.json").is_file()


def test_resume_goes_on_with_the_recorded_settings_to_a_new_end(images, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["pretrain", str(images), "--out", str(run), *DISTILL, *SHORT, "--seed", "5"]) == 0
    first = metrics(run)
    assert main(["pretrain", "--resume", str(run), "--steps", "3"]) == 0
    capsys.readouterr()
    lines = metrics(run)
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[:2] == first
    record = json.loads((run / "checkpoint" / "training.json").read_text())
    assert record["step"] == 2 and record["settings"]["request"]["seed"] == 5
    assert record["settings"]["request"]["steps"] == 3


def test_an_interrupted_run_says_where_its_checkpoint_is(images, tmp_path, capsys):
    run = tmp_path / "run"
    args = parse(["pretrain", str(images), "--out", str(run), *DISTILL])
    assert interrupted_line(args) == f"timm-ls: interrupted; no checkpoint was written to {run}"
    assert main(["pretrain", str(images), "--out", str(run), *DISTILL, *SHORT]) == 0
    assert f"--resume {run} goes on from it" in interrupted_line(args)


def refusals(images: Path, tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    one = tmp_path / "one"
    image_folder(one, n=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "out")
    new = ["pretrain", str(images), "--out", out]
    return {
        "no data": (["pretrain", str(tmp_path / "none"), "--out", out, *STUDENT], "does not exist"),
        "no images": (["pretrain", str(empty), "--out", out, *STUDENT], "holds 0 image"),
        "one image": (["pretrain", str(one), "--out", out, *STUDENT], "holds 1 image"),
        "no out": (["pretrain", str(images), *STUDENT], "pass both"),
        "out in data": (["pretrain", str(images), "--out", str(images / "run"), *STUDENT], "inside DATA"),
        "no model": ([*new], "pass --model"),
        "unknown method": ([*new, *STUDENT, "--method", "mae"], "unknown method 'mae'"),
        "no teacher": ([*new, *STUDENT, "--method", "distill"], "pass --teacher"),
        "teacher for dinov3": ([*new, *STUDENT, "--teacher", "x"], "leave out --teacher"),
        "gram for distill": ([*new, *DISTILL, "--gram", "--local-crops", "2"], "--gram, --local-crops: for"),
        "warm-up": ([*new, *DISTILL, "--steps", "5", "--warmup-steps", "5"], "--warmup-steps 5 leaves no step"),
        "save past the end": ([*new, *DISTILL, "--steps", "5", "--save-every", "6"], "--save-every 6 is past"),
        "zero steps": ([*new, *DISTILL, "--steps", "0"], "--steps: got 0"),
        "no lr": ([*new, *DISTILL, "--lr", "0"], "--lr 0.0"),
        "size": ([*new, *DISTILL[:-1], "40"], "cannot take 40x40 images"),
        "dinov3 of a convnet": ([*new, "--model", "convnext_atto"], "--method dinov3 trains a vit_ls"),
        "missing checkpoint": ([*new, *STUDENT, "--checkpoint", "nope/w.safetensors"], "does not exist"),
        "resume nothing": (["pretrain", "--resume", str(tmp_path / "none")], "no checkpoint there"),
    }


CASES = [
    "no data",
    "no images",
    "one image",
    "no out",
    "out in data",
    "no model",
    "unknown method",
    "no teacher",
    "teacher for dinov3",
    "gram for distill",
    "warm-up",
    "save past the end",
    "zero steps",
    "no lr",
    "size",
    "dinov3 of a convnet",
    "missing checkpoint",
    "resume nothing",
]


@pytest.mark.parametrize("case", CASES)
def test_a_refusal_is_one_line_and_writes_nothing(case, images, tmp_path, capsys):
    argv, expected = refusals(images, tmp_path)[case]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert expected in one_line(argv, capsys)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_run_s_folder_is_refused_to_a_new_run_and_resume_refuses_new_settings(images, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["pretrain", str(images), "--out", str(run), *DISTILL, *SHORT]) == 0
    capsys.readouterr()
    state = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = ["pretrain", str(images), "--out", str(run), *DISTILL, *SHORT]
    assert "holds a run (checkpoint, metrics.jsonl, model)" in one_line(again, capsys)
    assert "leave out --lr, --seed" in one_line(["pretrain", "--resume", str(run), "--lr", "1", "--seed", "2"], capsys)
    assert "the run is at step 2 of 2" in one_line(["pretrain", "--resume", str(run)], capsys)
    other = ["pretrain", "--resume", str(run), "--out", str(tmp_path / "elsewhere")]
    assert "leave out --out" in one_line(other, capsys)
    assert state == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "record",
    [b"", b"\x00\xff" * 50, b"[]", b'{"settings": {"request": {"steps": 3}}}', b'{"settings": 7}'],
    ids=["empty", "binary", "a list", "few settings", "no request"],
)
def test_a_crafted_record_is_refused_in_one_line(record, tmp_path, capsys):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "training.json").write_bytes(record)
    assert "is not a pretrain checkpoint's record" in one_line(["pretrain", "--resume", str(tmp_path / "run")], capsys)


def moved_checkpoint(folder: Path) -> Path:
    """A tiny student with its gammas, biases and norms far from their inits: a random-init one's class tokens
    are alike to 1e-6 across images, where KoLeo's log-distances turn rounding into percent."""
    model = timm.create_model("vit_ls_tiny_patch16_dinov3", depth=1, img_size=32)
    return save_native(move_off_init_(model), folder)


def test_torchrun_s_two_ranks_give_one_process_s_losses(images, tmp_path, capsys):
    start = ["--checkpoint", str(moved_checkpoint(tmp_path / "start")), "--size", "32", "--local-crops", "2"]
    dinov3 = [*start, "--prototypes", "64", "--steps", "3", "--batch-size", "4", "--gram"]
    assert main(["pretrain", str(images), "--out", str(tmp_path / "one"), *dinov3]) == 0
    port = str(free_port())
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    argv = [*launcher, "-m", "timm_ls", "pretrain", str(images), "--out", str(tmp_path / "two"), *dinov3]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("dinov3: 5 images, step 3") == 1  # rank 0 alone prints and writes
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(one) == len(two) == 3
    for key in ("loss", "dino_local", "dino_global", "koleo", "ibot", "gram", "teacher_entropy"):
        for a, b in zip(one, two):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a["step"], a[key], b[key])
    assert timm.create_model(f"local-dir:{tmp_path / 'two' / 'model'}", pretrained=True)
