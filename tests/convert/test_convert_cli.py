"""`timm-ls convert` end to end: one case in its own interpreter, the others through the same `main`."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import timm
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from support import TINY, move_off_init_
from transformers import Dinov2Config, Dinov2Model

from timm_layerscale import CheckpointError, convert_checkpoint
from timm_ls.errors import CliError
from timm_ls.main import main

CLI = [sys.executable, "-m", "timm_ls"]
SMALL = ["--model", "vit_ls_small_patch16_dinov3", "--model-kwargs", *(f"{k}={v}" for k, v in TINY.items())]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def contiguous(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("convert-cli")
    torch.manual_seed(0)
    small = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=0, **TINY))
    save_file(contiguous(small), root / "small.safetensors")
    nan = contiguous(small)
    nan["blocks.0.ls1.gamma"][0] = float("nan")
    save_file(nan, root / "nan.safetensors")
    (root / "exists").mkdir()
    (root / "exists" / "keep.txt").write_text("mine")
    foreign = {
        "dinov2": timm.create_model("vit_small_patch14_dinov2", depth=1, embed_dim=64, num_heads=4, img_size=56),
        "deit3": timm.create_model("deit3_small_patch16_224", depth=1, embed_dim=64, num_heads=4, img_size=64),
        "cait": timm.create_model(
            "cait_xxs24_224", depth=1, depth_token_only=1, embed_dim=64, num_heads=4, img_size=64
        ),
        "hf_dinov2": Dinov2Model(
            Dinov2Config(
                hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128, image_size=56
            )
        ),
    }
    for name, model in foreign.items():
        save_file(contiguous(model), root / f"{name}.safetensors")
    (root / "notes.txt").write_text("not a checkpoint\n" * 40)
    (root / "truncated.safetensors").write_bytes((root / "small.safetensors").read_bytes()[:5000])
    return root


@pytest.fixture(scope="module")
def runs(files: Path) -> dict[str, Run]:
    small = str(files / "small.safetensors")
    cases = {
        "fused_hf": ["convert", small, str(files / "out-hf"), "--to", "hf", "--fuse-layerscale", *SMALL],
        "unknown_to": ["convert", small, str(files / "x1"), "--to", "onnx", *SMALL],
        "unknown_dtype": ["convert", small, str(files / "x2"), "--to", "hf", "--dtype", "int4", *SMALL],
        "unknown_weights": ["convert", small, str(files / "x3"), "--to", "hf", "--weights", "best", *SMALL],
        "unknown_model": ["convert", small, str(files / "x4"), "--to", "hf", "--model", "vit_ls_smal_patch16_dinov3"],
        "exists": ["convert", small, str(files / "exists"), "--to", "native", *SMALL],
        "no_variant": ["convert", small, str(files / "x5"), "--to", "native"],
        "missing": ["convert", str(files / "absent.pth"), str(files / "x6"), "--to", "native"],
        "nan": ["convert", str(files / "nan.safetensors"), str(files / "out-nan"), "--to", "native", *SMALL],
        "nan_strict": [
            "convert",
            str(files / "nan.safetensors"),
            str(files / "x7"),
            "--to",
            "native",
            "--strict",
            *SMALL,
        ],
        "meta_suffix": ["convert", small, str(files / "x8.onnx"), "--to", "meta", *SMALL],
        "text_file": ["convert", str(files / "notes.txt"), str(files / "x9"), "--to", "native", *SMALL],
        "truncated": ["convert", str(files / "truncated.safetensors"), str(files / "x10"), "--to", "hf", *SMALL],
        **{
            name: ["convert", str(files / f"{name}.safetensors"), str(files / f"x-{name}"), "--to", "native"]
            for name in ("dinov2", "deit3", "cait", "hf_dinov2")
        },
    }
    results = {}
    for name, args in cases.items():
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = main(args)
        results[name] = Run(code, out.getvalue(), err.getvalue())
    # The installed command, in its own interpreter:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = ["convert", small, str(files / "out-native"), "--to", "native", *SMALL]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300)
    results["ok"] = Run(proc.returncode, proc.stdout, proc.stderr)
    return results


def test_a_conversion_prints_one_summary_line(runs: dict[str, Run], files: Path) -> None:
    run = runs["ok"]
    assert run.returncode == 0, run.stderr
    summary = run.stdout.splitlines()[-1]
    source = files / "small.safetensors"
    assert summary.startswith(f"converted {source} (safetensors file, Meta DINOv3 keys, weights: the only weights set)")
    assert f"to native {files / 'out-native'}: vit_ls_small_patch16_dinov3 (given, with " in summary
    assert " tensors, " in summary and " KB, " in summary and summary.endswith(" s")
    assert sorted(p.name for p in (files / "out-native").iterdir()) == ["config.json", "model.safetensors"]


def test_fused_conversion_says_so(runs: dict[str, Run]) -> None:
    run = runs["fused_hf"]
    assert run.returncode == 0, run.stderr
    assert "LayerScale: folded 4 gammas into the projections before them" in run.stdout
    assert "not held by hf: rope_embed.periods" in run.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown_to", "unknown target 'onnx'; pass --to one of native, meta, meta-train, hf, timm"),
        ("unknown_dtype", "unknown dtype 'int4'; pass --dtype one of keep, fp32, bf16, fp16"),
        ("unknown_weights", "unknown weights set 'best'; pass --weights one of auto, ema, raw"),
        ("unknown_model", "unknown model 'vit_ls_smal_patch16_dinov3'; did you mean vit_ls_small_patch16_dinov3"),
        ("exists", "exists; pass --overwrite"),
        ("no_variant", "match no registered variant; the nearest is vit_ls_tiny_patch16_dinov3: cls_token is"),
        ("missing", "absent.pth does not exist"),
        ("nan_strict", "LayerScale gammas are NaN or Inf in blocks 0.attn"),
        ("meta_suffix", "--to meta writes one file: name it .pth, .pt, .bin or .safetensors"),
        ("text_file", "notes.txt"),
        ("truncated", "truncated.safetensors"),
        ("dinov2", "this is a DINOv2 checkpoint: it has a learned position embedding (pos_embed [1, 17, 64])"),
        ("hf_dinov2", "this is a DINOv2 checkpoint: it has a learned position embedding (embeddings.position_embed"),
        ("deit3", "this is a DeiT-III checkpoint: it has a learned position embedding (pos_embed [1, 16, 64])"),
        ("cait", "this is a CaiT checkpoint"),
    ],
)
def test_bad_input_is_one_error_line_and_leaves_nothing(runs: dict[str, Run], files: Path, case, expected) -> None:
    run = runs[case]
    assert run.returncode == 2, run.stdout
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("timm-ls: error: "), run.stderr
    assert expected in run.stderr
    assert "Traceback" not in run.stderr
    leftovers = [p.name for p in files.iterdir() if p.name.startswith((".x", "x")) or ".tmp-" in p.name]
    assert leftovers == []
    assert (files / "exists" / "keep.txt").read_text() == "mine"


def test_nan_gammas_are_a_warning_without_strict(runs: dict[str, Run]) -> None:
    run = runs["nan"]
    assert run.returncode == 0, run.stderr
    assert (
        run.stderr == "timm-ls: warning: LayerScale gammas are NaN or Inf in blocks 0.attn: the checkpoint is broken\n"
    )


def test_debug_shows_the_traceback(files: Path) -> None:
    args = ["convert", str(files / "small.safetensors"), str(files / "exists"), "--to", "native", *SMALL]
    with pytest.raises(CliError, match="or choose another path"):  # the front's check, before torch
        main(["--debug", *args])
    args = ["convert", str(files / "small.safetensors"), str(files / "out-x"), "--to", "native", "--model", "nope"]
    with pytest.raises(CheckpointError, match="unknown model 'nope'"):  # the command's own
        main(["--debug", *args])


# ------------------------------------------------------------------------------- the source is never replaced


@pytest.fixture(scope="module")
def sources(files: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A safetensors file, a Hub folder (weights + config.json), sharded hf and a DCP folder, and links to them."""
    root = tmp_path_factory.mktemp("sources")
    shutil.copy(files / "small.safetensors", root / "small.safetensors")
    small = str(root / "small.safetensors")
    assert main(["convert", small, str(root / "native"), "--to", "native", *SMALL]) == 0
    convert_checkpoint(
        root / "small.safetensors", root / "sharded", to="hf", model=SMALL[1], model_kwargs=TINY, max_shard_size=20_000
    )
    assert len(list((root / "sharded").glob("model-*.safetensors"))) > 2
    dcp.save({"model": load_file(root / "small.safetensors")}, checkpoint_id=root / "dcp", no_dist=True)
    (root / "holder").mkdir()
    shutil.copy(root / "small.safetensors", root / "holder" / "inner.safetensors")
    (root / "holds_a_link").mkdir()
    os.link(root / "small.safetensors", root / "holds_a_link" / "model.safetensors")  # a name --to hf writes
    os.link(root / "small.safetensors", root / "hard.safetensors")
    (root / "sym.safetensors").symlink_to(root / "small.safetensors")
    os.link(root / "dcp" / "__0_0.distcp", root / "distcp.pth")
    os.link(root / "native" / "config.json", root / "config.pth")
    return root


REPLACING = {
    "a Hub folder's weights": ("native", "native/model.safetensors", "meta", "native/model.safetensors"),
    "a shard of the index": ("sharded", "sharded/SHARD", "meta", "sharded/SHARD"),
    "the source itself": ("small.safetensors", "small.safetensors", "meta", "small.safetensors"),
    "a folder holding the source": ("holder/inner.safetensors", "holder", "hf", "holder/inner.safetensors"),
    "a hard link to the source": ("small.safetensors", "hard.safetensors", "meta", "small.safetensors"),
    "a symlink to the source": ("small.safetensors", "sym.safetensors", "meta", "small.safetensors"),
    "a folder holding a hard link": (
        "small.safetensors",
        "holds_a_link",
        "hf",
        "small.safetensors (SOURCES/holds_a_link/model.safetensors is the same file)",
    ),
    "the DCP folder": ("dcp", "dcp", "hf", "dcp"),
    "a DCP data file, linked": ("dcp", "distcp.pth", "meta", "dcp/__0_0.distcp"),
    "a Hub folder's config.json, linked": ("native", "config.pth", "meta", "native/config.json"),
}


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (links as their targets' bytes) by its digest: what a refusal must leave."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("case", list(REPLACING))
def test_overwrite_never_replaces_the_source(sources: Path, case: str, capsys) -> None:
    shard = sorted((sources / "sharded").glob("model-*.safetensors"))[1].name
    src, dst, to, replaced = (part.replace("SHARD", shard).replace("SOURCES", str(sources)) for part in REPLACING[case])
    before = snapshot(sources)
    args = ["convert", str(sources / src), str(sources / dst), "--to", to, "--overwrite", *SMALL]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    kind = "folder" if (sources / replaced).is_dir() else "file"
    refusal = f"{sources / dst} would replace the source {kind} {sources / replaced}; choose another destination"
    assert err == f"timm-ls: error: {refusal}\n"
    assert snapshot(sources) == before
    assert not [p for p in sources.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]


def test_a_new_file_beside_the_source_is_fine(sources: Path, capsys) -> None:
    """Writing into the source's folder replaces nothing it reads; nor does a DST under a DCP folder."""
    before = snapshot(sources / "native")
    assert main(["convert", str(sources / "native"), str(sources / "native" / "meta.pth"), "--to", "meta"]) == 0
    assert snapshot(sources / "native") == {**before, "meta.pth": snapshot(sources / "native")["meta.pth"]}
    assert main(["convert", str(sources / "native"), str(sources / "other"), "--to", "hf", "--overwrite"]) == 0
    assert main(["convert", str(sources / "dcp"), str(sources / "dcp" / "out.pth"), "--to", "meta", *SMALL]) == 0
    (sources / "stale").mkdir()
    (sources / "stale" / "model.safetensors").symlink_to(sources / "absent.safetensors")  # a dangling link
    assert main(["convert", str(sources / "native"), str(sources / "stale"), "--to", "hf", "--overwrite"]) == 0
    capsys.readouterr()


def test_a_native_folder_to_meta_summary_counts_its_model_arguments_and_json_lists_them(
    runs: dict[str, Run], files: Path, capsys
) -> None:
    native = files / "out-native"  # with its config.json: every model argument, named there
    assert main(["convert", str(native), str(files / "short.pth"), "--to", "meta"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert "vit_ls_small_patch16_dinov3 (recorded in config.json, with 43 model arguments)" in summary
    assert len(summary) - len(str(native)) - len(str(files / "short.pth")) <= 200, summary
    assert main(["convert", str(native), str(files / "short.safetensors"), "--to", "meta", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["keys"] == "timm-layerscale keys" and result["target"] == "meta"
    assert result["source_format"] == result["layout"] == "native"  # `layout`: its old name, still written
    assert result["model_args"]["embed_dim"] == TINY["embed_dim"] and len(result["model_args"]) == 45
    assert result["summary"].startswith(f"converted {native} (Hub folder, timm-layerscale keys, weights: ")
    assert result["destination"] == str(files / "short.safetensors") and (files / "short.safetensors").is_file()


def test_a_few_model_arguments_are_listed_in_the_summary(runs: dict[str, Run]) -> None:
    summary = runs["ok"].stdout.splitlines()[-1]
    assert "(given, with embed_dim=64 num_heads=4 depth=2)" in summary


@pytest.mark.parametrize("nested", [True, False], ids=["under state_dict", "flat"])
def test_a_task_head_beside_the_backbone_is_named_when_dropped(nested: bool, tmp_path: Path, capsys) -> None:
    """A segmentation checkpoint's backbone converts; its head, which no backbone format holds, is named."""
    model = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", **TINY, num_classes=0))
    state = {f"backbone.{k}": v for k, v in model.state_dict().items()}
    state.update({"decode_head.conv_seg.weight": torch.ones(3, 64, 1, 1), "decode_head.conv_seg.bias": torch.ones(3)})
    torch.save({"state_dict": state, "meta": {"epoch": 1}} if nested else state, tmp_path / "segmentor.pth")
    kwargs = [f"{k}={v}" for k, v in TINY.items()]
    argv = ["convert", str(tmp_path / "segmentor.pth"), str(tmp_path / "out"), "--to", "native", "--model-kwargs"]
    assert main([*argv, *kwargs]) == 0
    out = capsys.readouterr().out
    assert "  dropped 2 tensors beside the backbone, which a backbone does not hold: decode_head.*\n" in out, out
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(loaded["blocks.1.ls2.gamma"], model.state_dict()["blocks.1.ls2.gamma"])


def test_training_only_parts_are_not_named_as_dropped(tmp_path: Path, capsys) -> None:
    model = timm.create_model("vit_ls_small_patch16_dinov3", **TINY, num_classes=0)
    state = {f"teacher.backbone.{k}": v for k, v in model.state_dict().items()}
    state.update({"teacher.dino_head.mlp.0.weight": torch.ones(8, 64), "teacher.dino_loss.center": torch.ones(1, 8)})
    state.update({f"student.backbone.{k}": v for k, v in model.state_dict().items()})
    torch.save(state, tmp_path / "train.pth")
    kwargs = [f"{k}={v}" for k, v in TINY.items()]
    argv = ["convert", str(tmp_path / "train.pth"), str(tmp_path / "out"), "--to", "native", "--model-kwargs"]
    assert main([*argv, *kwargs]) == 0
    assert "beside the backbone" not in capsys.readouterr().out
