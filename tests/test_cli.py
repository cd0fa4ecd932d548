"""`timm-ls` end to end, each case in its own interpreter; the cases run side by side to keep the file quick."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

import timm_layerscale

CLI = [sys.executable, "-m", "timm_layerscale.cli"]
TINY = ["--model-kwargs", "depth=2"]
# (block, attn gamma, mlp gamma) written into the checkpoint, and the table row they must give.
GAMMAS = {
    0: (torch.full((384,), 0.25), torch.linspace(0.5, 1.5, 384)),
    1: (torch.full((384,), -0.75), torch.linspace(2.0, 3.0, 384)),
}
GAMMA_ROWS = [["0", "0.25", "0.25", "0.25", "1", "0.5", "1.5"], ["1", "0.75", "-0.75", "-0.75", "2.5", "2", "3"]]


# What timm's train.py does with the model arguments, in a few lines.
TRAIN_LIKE_SCRIPT = """
import argparse, sys
import timm
from timm.utils.misc import ParseKwargs
parser = argparse.ArgumentParser()
parser.add_argument("--model")
parser.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs)
args = parser.parse_args()
model = timm.create_model(args.model, **args.model_kwargs)
print(args.model, sys.argv[1:], sum(k.endswith("gamma") for k in model.state_dict()), "gammas")
sys.exit(3)
"""


class Evil:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def state_dict(name: str, **kwargs) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in timm.create_model(name, depth=2, **kwargs).state_dict().items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    small = state_dict("vit_ls_small_patch16_dinov3")
    for block, (attn, mlp) in GAMMAS.items():
        small[f"blocks.{block}.ls1.gamma"], small[f"blocks.{block}.ls2.gamma"] = attn, mlp
    save_file(small, root / "small.safetensors")
    save_file(state_dict("vit_ls_base_patch16_dinov3"), root / "base.safetensors")
    (root / "truncated.safetensors").write_bytes((root / "small.safetensors").read_bytes()[:5000])
    torch.save({"state_dict": small, "extra": Evil(root / "marker")}, root / "evil.pth")
    (root / "train_like.py").write_text(TRAIN_LIKE_SCRIPT)
    return root


@pytest.fixture(scope="module")
def runs(files: Path) -> dict[str, Run]:
    train_like = ["run", str(files / "train_like.py"), "--model", "vit_ls_small_patch16_dinov3", "--model-kwargs"]
    cases = {
        "demo": [],
        "list": ["list"],
        "checkpoint": ["--checkpoint", str(files / "small.safetensors"), *TINY],
        "missing": ["--checkpoint", str(files / "absent.safetensors"), *TINY],
        "truncated": ["--checkpoint", str(files / "truncated.safetensors"), *TINY],
        "malicious": ["--checkpoint", str(files / "evil.pth"), *TINY],
        "wrong_arch": ["--checkpoint", str(files / "base.safetensors"), *TINY],
        "bad_config": ["--model-kwargs", "depth=2", "init_values=-1"],
        "unknown_variant": ["--variant", "vit_ls_smal_patch16_dinov3"],
        "run": [*train_like, "depth=3", "init_values=off"],
        "run_ls_on": [*train_like, "depth=3", "init_values=1e-6"],
        "run_missing": ["run", str(files / "absent.py")],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = {
        name: subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name, args in cases.items()
    }
    outputs = {name: p.communicate(timeout=300) for name, p in procs.items()}
    return {name: Run(procs[name].returncode, *out) for name, out in outputs.items()}


def gamma_rows(stdout: str) -> list[list[str]]:
    table = stdout.split("LayerScale gammas:\n", 1)[1].splitlines()
    assert table[0].split()[:2] == ["block", "attn"]
    return [line.split() for line in table[1:]]


def test_default_demo_runs_the_shipped_images_with_random_weights(runs: dict[str, Run]) -> None:
    run = runs["demo"]
    assert run.returncode == 0, run.stderr
    assert "variant: vit_ls_small_patch16_dinov3\n" in run.stdout
    assert "configs/vit_ls_small_patch16_dinov3.yaml" in run.stdout
    assert "weights: random init (no --checkpoint or --pretrained given)" in run.stdout
    assert "shapes_256x256.png: 256x256 -> input [1, 3, 256, 256]" in run.stdout
    assert "landscape_320x224.png: 320x224 -> input [1, 3, 256, 256]" in run.stdout
    assert run.stdout.count("pooled [1, 384], patch tokens [1, 256, 384]") == 2
    rows = gamma_rows(run.stdout)
    assert [row[0] for row in rows] == [str(i) for i in range(12)]
    assert all(row[1:] == ["1e-05"] * 6 for row in rows)


def test_list_shows_every_variant_with_size_tags_and_config(runs: dict[str, Run]) -> None:
    run = runs["list"]
    assert run.returncode == 0, run.stderr
    lines = {line.split()[0]: line for line in run.stdout.splitlines()[1:]}
    assert sorted(lines) == sorted(timm_layerscale.VARIANTS) and len(lines) == 7
    assert "21.6M" in lines["vit_ls_small_patch16_dinov3"] and "6,716.0M" in lines["vit_ls_7b_patch16_dinov3"]
    assert "lvd1689m (timm/vit_small_patch16_dinov3_qkvb.lvd1689m)" in lines["vit_ls_small_patch16_dinov3"]
    assert "sat493m (timm/vit_large_patch16_dinov3_qkvb.sat493m)" in lines["vit_ls_large_patch16_dinov3"]
    assert lines["vit_ls_large_plus_patch16_dinov3"].rstrip().endswith(" -")
    for name, line in lines.items():
        assert f"configs/{name}.yaml" in line


def test_checkpoint_gammas_show_in_the_table(runs: dict[str, Run], files: Path) -> None:
    run = runs["checkpoint"]
    assert run.returncode == 0, run.stderr
    assert f"weights: checkpoint {files / 'small.safetensors'}" in run.stdout
    assert "loaded a meta checkpoint" in run.stdout
    assert gamma_rows(run.stdout) == GAMMA_ROWS


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "absent.safetensors does not exist"),
        ("truncated", "truncated or corrupt"),
        ("malicious", "refused to load"),
        ("wrong_arch", "does not fit"),
        ("bad_config", "init_values: got -1"),
        ("unknown_variant", "did you mean vit_ls_small_patch16_dinov3"),
        ("run_missing", "absent.py does not exist"),
    ],
)
def test_bad_input_is_one_error_line(runs: dict[str, Run], case: str, expected: str) -> None:
    run = runs[case]
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("timm-ls: error: "), run.stderr
    assert expected in run.stderr
    assert "Traceback" not in run.stderr


def test_malicious_pickle_runs_nothing(runs: dict[str, Run], files: Path) -> None:
    assert runs["malicious"].returncode == 2
    assert not (files / "marker").exists()
    with zipfile.ZipFile(files / "evil.pth") as archive:  # the file really asks the unpickler to run code
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert b"system" in pickled


def test_run_gives_timm_scripts_the_variants(runs: dict[str, Run]) -> None:
    """`timm-ls run train.py ...`: the script sees the registry and its own arguments and exit code."""
    assert runs["run"].returncode == 3, runs["run"].stderr
    assert runs["run"].stdout.split("[")[0] == "vit_ls_small_patch16_dinov3 "
    assert runs["run"].stdout.rstrip().endswith("'init_values=off'] 0 gammas")
    assert runs["run_ls_on"].stdout.rstrip().endswith("6 gammas")
