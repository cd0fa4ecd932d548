"""The main job writes its picture and its trained model into a folder of its own, never into a checkout.

The default folder is `./timm-ls-demo`, or `<user cache>/timm-layerscale/demo` when the current folder is
inside a git checkout of this repository; `--out DIR` names another. The model is read back with timm's own
`local-dir:` loading and compared with the gammas the job reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image

from timm_ls.paths import DEMO_FOLDER, demo_out

CLI = [sys.executable, "-m", "timm_ls"]
TINY_DEMO = """
variant: vit_ls_small_patch16_dinov3
model: {depth: 2, embed_dim: 32, num_heads: 4, img_size: 16, patch_size: 8}
data: {image_size: 16, train_size: 96, test_size: 48}
train: {steps: 8, batch_size: 16, lr: 3.0e-3, warmup: 2, eval_every: 4}
"""
PYPROJECT = '[project]\nname = "{name}"\nversion = "0.1.0"\n'


def main_job(cwd: Path, config: Path, *args: str, cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(cache or cwd / "nocache")}
    command = [*CLI, "--config", str(config), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def clone(root: Path, name: str = "timm-layerscale") -> Path:
    (root / ".git").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT.format(name=name))
    return root


@pytest.fixture
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny_demo.yaml"
    path.write_text(TINY_DEMO)
    return path


def test_the_main_job_writes_only_its_folder_and_the_model_loads(tmp_path: Path, config: Path) -> None:
    run = main_job(tmp_path, config, "--json", cache=tmp_path.parent / f"{tmp_path.name}-cache")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    folder = tmp_path / DEMO_FOLDER
    assert os.listdir(tmp_path) == [DEMO_FOLDER]
    assert sorted(os.listdir(folder)) == ["layerscale_gammas.png", "model"]
    assert result["plot"] == str(folder / "layerscale_gammas.png") and result["saved"] == str(folder / "model")
    assert Image.open(folder / "layerscale_gammas.png").format == "PNG"
    model = timm.create_model(f"local-dir:{folder / 'model'}", pretrained=True)
    assert model.config.depth == 2 and model.config.embed_dim == 32
    for block, reported in zip(model.blocks, result["gammas"]):
        for gamma, branch in ((block.ls1.gamma, "attn"), (block.ls2.gamma, "mlp")):
            assert torch.isclose(gamma.abs().mean(), torch.tensor(reported[branch]["after"]["mean"]), rtol=1e-5)
            assert gamma.abs().mean() > 1e-4  # trained, not the 1e-5 init


def test_inside_a_checkout_of_this_repository_it_writes_into_the_cache(tmp_path: Path, config: Path) -> None:
    repo = clone(tmp_path / "clone")
    (repo / "docs").mkdir()
    run = main_job(repo / "docs", config, "--steps", "2", cache=tmp_path / "cache")
    assert run.returncode == 0, run.stderr
    folder = tmp_path / "cache" / "timm-layerscale" / "demo"
    assert f"saved: the trained model in {folder / 'model'} " in run.stdout
    assert f"plot: {folder / 'layerscale_gammas.png'} " in run.stdout
    assert sorted(p.name for p in repo.rglob("*")) == [".git", "docs", "pyproject.toml"]


def test_the_rule_for_the_default_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ours, other = clone(tmp_path / "ours"), clone(tmp_path / "other", name="my-app")
    (ours / "a" / "b").mkdir(parents=True)
    assert demo_out(None, cwd=ours / "a" / "b") == tmp_path / "cache" / "timm-layerscale" / "demo"
    assert demo_out(None, cwd=other) == other / DEMO_FOLDER  # another project's checkout: like any folder
    assert demo_out(None, cwd=tmp_path) == tmp_path / DEMO_FOLDER
    assert demo_out("mine", cwd=ours) == Path("mine")  # asked for: written where asked, in a checkout too


def test_out_names_the_folder_and_a_file_there_is_one_line(tmp_path: Path, config: Path) -> None:
    run = main_job(tmp_path, config, "--steps", "2", "--no-plot", "--out", "results")
    assert run.returncode == 0, run.stderr
    assert os.listdir(tmp_path) == ["results"] and os.listdir(tmp_path / "results") == ["model"]
    (tmp_path / "taken").write_text("")
    run = main_job(tmp_path, config, "--out", "taken")
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1
    assert run.stderr.startswith("timm-ls: error: taken is a file and demo --out writes a folder")
    assert (tmp_path / "taken").read_text() == ""
