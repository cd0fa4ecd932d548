"""`timm-ls` end to end, each case in its own interpreter; the cases run side by side to keep the file quick."""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

import timm_layerscale
from timm_layerscale.cli.common import is_warning, load_report
from timm_layerscale.cli.listing import _shipped as listing_shipped
from timm_ls.errors import CliError
from timm_ls.main import main

CLI = [sys.executable, "-m", "timm_ls"]
TINY = ["--model-kwargs", "depth=2"]
# (block, attn gamma, mlp gamma) written into the checkpoint, and the table row they must give:
# block, then per branch mean |gamma|, median, max and the share of channels below 1e-3.
GAMMAS = {
    0: (torch.full((384,), 0.25), torch.linspace(0.5, 1.5, 384)),
    1: (torch.cat([torch.full((96,), 1e-4), torch.full((288,), -0.75)]), torch.linspace(2.0, 3.0, 384)),
}
GAMMA_ROWS = [
    ["0", "0.25", "0.25", "0.25", "0%", "1", "1", "1.5", "0%"],
    ["1", "0.563", "0.75", "0.75", "25%", "2.5", "2.5", "3", "0%"],
]
# The main job at a tiny size: the same code path as the default experiment, in seconds.
TINY_DEMO = """
variant: vit_ls_small_patch16_dinov3
model: {depth: 2, embed_dim: 32, num_heads: 4, img_size: 16, patch_size: 8}
data: {image_size: 16, train_size: 96, test_size: 48}
train: {steps: 8, batch_size: 16, lr: 3.0e-3, warmup: 2, eval_every: 4}
"""
TINY_VARIANT = """
base: vit_ls_small_patch16_dinov3
model: {depth: 3, init_values: 1.0e-3}
"""


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
    (root / "tiny_demo.yaml").write_text(TINY_DEMO)
    (root / "my_vit.yaml").write_text(TINY_VARIANT)
    return root


@pytest.fixture(scope="module")
def runs(files: Path) -> dict[str, Run]:
    train_like = ["run", str(files / "train_like.py"), "--model", "vit_ls_small_patch16_dinov3", "--model-kwargs"]
    demo = ["--config", str(files / "tiny_demo.yaml")]
    cases = {
        "demo": [*demo, "--plot", str(files / "demo.png"), "--out", str(files / "demo_out")],
        "demo_json": [*demo, "--json", "--no-plot", "--out", str(files / "json_out")],
        "demo_yaml_variant": [
            *demo,
            "--variant",
            str(files / "my_vit.yaml"),
            "--no-plot",
            "--out",
            str(files / "yaml_out"),
        ],
        "version": ["--version"],
        "list": ["list"],
        "list_json": ["list", "--json"],
        "short_warmup": [*demo, "--steps", "1", "--no-plot", "--out", str(files / "warmup_out")],
        "checkpoint": ["--checkpoint", str(files / "small.safetensors"), *TINY],
        "missing": ["--checkpoint", str(files / "absent.safetensors"), *TINY],
        "truncated": ["--checkpoint", str(files / "truncated.safetensors"), *TINY],
        "malicious": ["--checkpoint", str(files / "evil.pth"), *TINY],
        "wrong_arch": [
            "--checkpoint",
            str(files / "base.safetensors"),
            "--variant",
            "vit_ls_small_patch16_dinov3",
            *TINY,
        ],
        "bad_config": ["--model-kwargs", "depth=2", "init_values=-1"],
        "unknown_variant": ["--variant", "vit_ls_smal_patch16_dinov3"],
        "run": [*train_like, "depth=3", "init_values=off"],
        "run_ls_on": [*train_like, "depth=3", "init_values=1e-6"],
        "run_yaml": ["run", str(files / "train_like.py"), "--model", str(files / "my_vit.yaml")],
        "run_missing": ["run", str(files / "absent.py")],
        "image_without_weights": ["--image", str(files / "absent.png")],
        "missing_variant_file": ["--variant", str(files / "absent.yaml")],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def run(args: list[str]) -> Run:
        done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, cwd=files, timeout=300)
        return Run(done.returncode, done.stdout, done.stderr)

    # As many interpreters at a time as there are cores: more would only add memory, not speed.
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return dict(zip(cases, pool.map(run, cases.values())))


def gamma_rows(stdout: str) -> list[list[str]]:
    table = stdout.split("LayerScale gammas: ", 1)[1].splitlines()[1:]
    assert table[0].split() == [
        "block",
        "attn",
        "mean",
        "median",
        "max",
        "muted",
        "mlp",
        "mean",
        "median",
        "max",
        "muted",
    ]
    return [line.split() for line in table[1:] if line[:1].isdigit()]


def test_default_command_trains_a_small_variant_and_shows_its_gammas_move(runs: dict[str, Run], files: Path) -> None:
    run = runs["demo"]
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("LayerScale multiplies the output of each residual branch")  # what a gamma is
    assert "model: vit_ls_small_patch16_dinov3 shrunk to train on CPU (depth=2 embed_dim=32" in out
    assert "LayerScale init 1e-05" in out
    assert "weights: random (seed 0); nothing pretrained or downloaded" in out
    assert "data: 6 kinds of shape (disk, ring, square, frame, triangle, plus) drawn here from seed 0" in out
    assert "96 images to train on, 48 others held out" in out
    assert "training: 8 steps of batch 16, AdamW lr 0.003" in out
    table = out.split("moved: mean |after - before|\n", 1)[1].splitlines()
    assert table[0].split() == ["block", "attn", "before", "after", "moved", "mlp", "before", "after", "moved"]
    rows = [line.split() for line in table[1:3]]
    assert [row[0] for row in rows] == ["0", "1"]
    for row in rows:
        assert row[1] == row[4] == "1e-05"
        after, moved = float(row[2]), float(row[3])
        assert after > 1e-4 and moved > 1e-4  # 8 Adam steps at lr 3e-3 move every gamma far from 1e-5
    assert f"plot: {files / 'demo.png'}" in out
    assert Image.open(files / "demo.png").format == "PNG"
    assert "timm-ls --pretrained" in out  # where to go next


def test_default_command_json_has_the_run_and_repeats_exactly(runs: dict[str, Run]) -> None:
    assert runs["demo_json"].returncode == 0, runs["demo_json"].stderr
    result = json.loads(runs["demo_json"].stdout)
    assert result["weights"] == "random (seed 0)" and result["plot"] is None
    assert result["data"]["train_size"] == 96 and result["train"]["steps"] == 8
    assert [row["step"] for row in result["history"]] == [4, 8]
    columns = ["step", "lr", "train_loss", "train_acc", "test_loss", "test_acc"]
    assert all(list(row) == columns and all(math.isfinite(v) for v in row.values()) for row in result["history"])
    accuracy = result["accuracy"]
    assert accuracy["chance"] == pytest.approx(1 / 6) and accuracy["after"] == result["history"][-1]["test_acc"]
    for block in result["gammas"]:
        for branch in ("attn", "mlp"):
            gamma = block[branch]
            assert gamma["before"]["mean"] == gamma["before"]["max"] == 1e-5
            assert gamma["moved"] > 1e-4 and math.isfinite(gamma["after"]["mean"])
    # The text run, another process, used the same seeds and data: the same numbers.
    text = runs["demo"].stdout
    assert f"{accuracy['before']:.1%} before training" in text and f"{accuracy['after']:.1%} after 8 steps" in text
    table = text.split("moved: mean |after - before|\n", 1)[1].splitlines()[1:3]
    after = [[f"{b[branch]['after']['mean']:.3g}" for branch in ("attn", "mlp")] for b in result["gammas"]]
    assert [[row.split()[2], row.split()[5]] for row in table] == after


def test_steps_inside_the_warmup_get_one_line_saying_so(runs: dict[str, Run]) -> None:
    run = runs["short_warmup"]
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stderr.splitlines() if "warmup" in line]
    assert notes == [
        "timm-ls: warning: training stops at step 1, inside the 2-step warmup: the learning rate climbs to 0.0015, "
        "never to its peak 0.003, and never decays; give more steps or a shorter warmup"
    ]
    assert "warmup" not in runs["demo"].stderr  # 8 steps after a warmup of 2: nothing to say


def test_default_command_takes_a_yaml_variant_file(runs: dict[str, Run]) -> None:
    run = runs["demo_yaml_variant"]
    assert run.returncode == 0, run.stderr
    assert "model: my_vit shrunk to train on CPU" in run.stdout
    assert "LayerScale init 0.001" in run.stdout  # from the file, not the base variant


def test_version(runs: dict[str, Run]) -> None:
    assert runs["version"].returncode == 0
    assert runs["version"].stdout.startswith(f"timm-ls {timm_layerscale.__version__} (timm {timm.__version__}")


# The variants a fresh process registers (tests in this process may register more).
SHIPPED = sorted(path.stem for path in timm_layerscale.config_dir().glob("*.yaml"))


def test_list_shows_every_variant_with_size_and_tags_in_short_lines(runs: dict[str, Run]) -> None:
    run = runs["list"]
    assert run.returncode == 0, run.stderr
    *table, hint = run.stdout.splitlines()
    lines = {line.split()[0]: line for line in table[1:]}
    assert sorted(lines) == SHIPPED
    assert "21.6M" in lines["vit_ls_small_patch16_dinov3"] and "6,716.0M" in lines["vit_ls_7b_patch16_dinov3"]
    assert "  lvd1689m, lvd1689m_facebook, eupe_lvd1689m  " in lines["vit_ls_small_patch16_dinov3"]
    # each tag's licence: the first tag's, then each tag with another
    assert lines["vit_ls_small_patch16_dinov3"].endswith(
        "  dinov3-license; eupe_lvd1689m: fair-noncommercial-research-license"
    )
    assert lines["vit_ls_base_patch16_lingbot"].endswith("  apache-2.0")
    assert lines["vit_ls_base_patch16_sapiens2"].endswith("  sapiens2-license")
    assert lines["vit_ls_large_plus_patch16_dinov3"].split()[-2:] == ["-", "-"]
    assert all("/" not in line for line in table), table  # no Hub repos, no paths
    assert hint == "Hub repos and YAML files: timm-ls list --json"


def test_list_json_has_each_tags_hub_repo_and_yaml_file(runs: dict[str, Run], files: Path) -> None:
    run = runs["list_json"]
    assert run.returncode == 0, run.stderr
    found = {v["name"]: v for v in json.loads(run.stdout)}
    assert sorted(found) == SHIPPED
    small = found["vit_ls_small_patch16_dinov3"]
    assert round(small["params"] / 1e5) == 216  # 21.6M
    assert small["tags"]["lvd1689m"] == "timm/vit_small_patch16_dinov3_qkvb.lvd1689m"
    assert found["vit_ls_large_patch16_dinov3"]["tags"]["sat493m"] == "timm/vit_large_patch16_dinov3_qkvb.sat493m"
    assert small["licenses"] == {
        "lvd1689m": "dinov3-license",
        "lvd1689m_facebook": "dinov3-license",
        "eupe_lvd1689m": "fair-noncommercial-research-license",
    }
    for name, variant in found.items():
        assert Path(variant["config"]).name == f"{name}.yaml" and Path(variant["config"]).is_file()
        assert variant["shipped"] is True
    assert not listing_shipped(str(files / "my_vit.yaml"))  # a user's own YAML would get a config column


def test_checkpoint_gammas_show_in_the_table(runs: dict[str, Run], files: Path) -> None:
    run = runs["checkpoint"]
    assert run.returncode == 0, run.stderr
    assert f"weights: checkpoint {files / 'small.safetensors'}" in run.stdout
    assert "  loaded a checkpoint with Meta DINOv3 keys\n" in run.stdout
    assert gamma_rows(run.stdout) == GAMMA_ROWS
    # The shipped images run at their own size: nothing is cropped or resized behind the user's back.
    assert "shapes_256x256.png: 256x256, run at its own size (no crop, no resize) -> 256 patch tokens" in run.stdout
    assert "landscape_320x224.png: 320x224, run at its own size (no crop, no resize) -> 280 patch tokens" in run.stdout
    plot = files / "timm-ls-demo" / "layerscale_gammas.png"  # the default: in the job's own folder
    assert f"plot: {plot} (mean |gamma| per block" in run.stdout and Image.open(plot).format == "PNG"
    assert not (files / "layerscale_gammas.png").exists()


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
        ("image_without_weights", "--image runs images through a model with --checkpoint or --pretrained"),
        ("missing_variant_file", "absent.yaml does not exist; pass the path of a YAML variant file"),
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
    assert runs["run_yaml"].returncode == 3, runs["run_yaml"].stderr
    assert runs["run_yaml"].stdout.startswith("my_vit ['--model', 'my_vit'] 6 gammas")


def test_moved_is_the_distance_from_the_init_not_the_size(files: Path, capsys, tmp_path: Path) -> None:
    """Starting at 1, gammas stay near 1 in 8 steps: they are large but have moved little."""
    args = ["--config", str(files / "tiny_demo.yaml"), "--json", "--no-plot", "--model-kwargs", "init_values=1.0"]
    args += ["--out", str(tmp_path)]  # the model is saved: not into the user's cache, as from a checkout
    assert main(args) == 0
    for block in json.loads(capsys.readouterr().out)["gammas"]:
        for branch in ("attn", "mlp"):
            gamma = block[branch]
            assert gamma["before"]["mean"] == 1.0 and 0.9 < gamma["after"]["mean"] < 1.1
            assert 1e-4 < gamma["moved"] < 0.05
            assert gamma["moved"] >= abs(gamma["after"]["mean"] - 1.0) - 1e-7  # mean |a - b| >= |mean a - mean b|


def test_images_of_other_sizes_are_resized_and_the_output_says_so(files: Path, capsys, tmp_path: Path) -> None:
    Image.new("RGB", (330, 200), (200, 30, 30)).save(tmp_path / "odd.png")
    args = ["--checkpoint", str(files / "small.safetensors"), *TINY, "--image", str(tmp_path / "odd.png"), "--no-plot"]
    assert main(args) == 0
    out = capsys.readouterr().out
    expected = "odd.png: 330x200, resized to 336x208 without cropping (sides must be multiples of 16) -> 273 patch"
    assert expected in out


def test_seed_picks_the_random_weights(files: Path, capsys, tmp_path: Path) -> None:
    reports = []
    for seed in ("0", "1"):
        args = ["--config", str(files / "tiny_demo.yaml"), "--json", "--no-plot", "--seed", seed, "--out", tmp_path]
        assert main([str(a) for a in args]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    seed0, seed1 = reports
    assert seed1["weights"] == "random (seed 1)"
    assert seed1["loss"]["before"] != seed0["loss"]["before"]  # other weights before any batch is drawn
    assert all(math.isfinite(v) for v in (*seed0["loss"].values(), *seed1["loss"].values()))


def test_debug_goes_before_the_default_command_too(files: Path, capsys) -> None:
    absent = str(files / "absent.yaml")
    with pytest.raises(CliError, match=r"absent\.yaml does not exist"):
        main(["--debug", "--variant", absent])
    assert main(["--variant", absent]) == 2
    assert capsys.readouterr().err.startswith("timm-ls: error: variant file ")


def test_a_load_reports_lines_are_warnings_by_their_level_not_their_words():
    """A commands' load report keeps each line's level: an information line that begins with "warning: " is not
    a warning, and a warning's line is marked and gives its message alone."""
    logger = logging.getLogger("timm_layerscale")
    with load_report() as report:
        logger.info("warning: a word, not a level")
        logger.warning("gammas look untrained")
    info, warning = report
    assert not is_warning(info) and info == "warning: a word, not a level"
    assert is_warning(warning) and warning == "warning: gammas look untrained"
    assert warning.message == "gammas look untrained"
