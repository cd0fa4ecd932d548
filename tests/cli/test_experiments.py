"""The generated data, the trainer and `timm-ls ablate`, end to end at a tiny size."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import yaml
from PIL import Image
from support import REPO

from timm_layerscale.tools.experiment import load_experiment
from timm_layerscale.tools.shapes import CLASSES, ShapesSpec, make_shapes
from timm_layerscale.tools.trainer import TrainConfig, lr_at, train
from timm_ls.main import main
from timm_ls.paths import install_hint

TINY_ABLATION = """
variant: vit_ls_small_patch16_dinov3
model: {depth: 3, embed_dim: 32, num_heads: 4, img_size: 16, patch_size: 8}
init_values: ["off", 1.0e-4]
seeds: [0, 1]
data: {image_size: 16, train_size: 64, test_size: 32}
train: {steps: 6, batch_size: 8, lr: 1.0e-3, warmup: 2, eval_every: 3}
"""
CURVE_COLUMNS = ["init_values", "seed", "step", "lr", "train_loss", "train_acc", "test_loss", "test_acc"]
BLOCK_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from timm_ls.main import main; sys.exit(main())"


def test_held_out_images_are_other_draws_even_at_the_same_size():
    shapes = make_shapes(ShapesSpec(image_size=16, train_size=30, test_size=30))
    assert not torch.equal(shapes.train_images, shapes.test_images)


def test_shapes_repeat_exactly_and_are_balanced():
    spec = ShapesSpec(image_size=16, train_size=60, test_size=30)
    a, b = make_shapes(spec), make_shapes(spec)
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_labels, b.test_labels)
    assert a.train_images.shape == (60, 3, 16, 16) and a.num_classes == len(CLASSES) == 6
    assert torch.bincount(a.train_labels).tolist() == [10] * 6
    assert not torch.equal(a.train_images[:30], a.test_images)  # held-out images are other draws
    other = make_shapes(ShapesSpec(image_size=16, train_size=60, test_size=30, seed=1))
    assert not torch.equal(a.train_images, other.train_images)
    assert abs(a.train_images.mean()) < 0.5 and 0.5 < a.train_images.std() < 2


def test_lr_warms_up_then_decays_to_zero():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.5) and lr_at(100, cfg) == pytest.approx(0.0)


def test_a_diverging_run_stops_and_says_where():
    data = make_shapes(ShapesSpec(image_size=16, train_size=32, test_size=16))
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_ls_small_patch16_dinov3", depth=2, embed_dim=32, num_heads=4, img_size=16, patch_size=8, num_classes=6
    )
    result = train(model, data, TrainConfig(steps=50, batch_size=8, lr=1e30, warmup=0, eval_every=1))
    assert result.diverged_at is not None and 1 < result.diverged_at <= 50
    assert len(result.history) == result.diverged_at - 1  # no row after the bad step


def test_each_history_row_averages_the_steps_since_the_last():
    data = make_shapes(ShapesSpec(image_size=16, train_size=32, test_size=16))
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_ls_small_patch16_dinov3", depth=1, embed_dim=32, num_heads=4, img_size=16, patch_size=8, num_classes=6
    )
    losses = []
    result = train(
        model, data, TrainConfig(steps=4, batch_size=8, eval_every=2), on_step=lambda _, loss: losses.append(loss)
    )
    assert [row["step"] for row in result.history] == [2, 4]
    assert [row["train_loss"] for row in result.history] == pytest.approx([sum(losses[:2]) / 2, sum(losses[2:]) / 2])
    assert all(row["train_acc"] * 16 == round(row["train_acc"] * 16) for row in result.history)


def test_runs_of_a_seed_start_from_the_same_weights_but_their_gammas():
    from timm_layerscale.tools.ablation import build_model

    experiment = load_experiment(REPO / "configs" / "experiments" / "ablate.yaml")
    experiment = experiment.replace(model={**experiment.model, "depth": 2})
    off, small, other_seed = (
        build_model(experiment, v, s).state_dict() for v, s in (("off", 0), (1e-6, 0), ("off", 1))
    )
    assert sorted(small) == sorted(
        [*off, "blocks.0.ls1.gamma", "blocks.0.ls2.gamma", "blocks.1.ls1.gamma", "blocks.1.ls2.gamma"]
    )
    assert all(torch.equal(off[k], small[k]) for k in off)
    assert not torch.equal(off["blocks.0.attn.qkv.weight"], other_seed["blocks.0.attn.qkv.weight"])


def test_gammas_are_not_weight_decayed():
    data = make_shapes(ShapesSpec(image_size=16, train_size=32, test_size=16))
    model = timm.create_model(
        "vit_ls_small_patch16_dinov3", depth=1, embed_dim=32, num_heads=4, img_size=16, patch_size=8, num_classes=6
    )
    with torch.no_grad():
        model.blocks[0].ls1.gamma.fill_(1.0)
    model.blocks[0].ls1.gamma.register_hook(lambda g: torch.zeros_like(g))  # only decay could move it
    train(model, data, TrainConfig(steps=3, batch_size=8, lr=0.1, warmup=0, weight_decay=0.5))
    assert torch.equal(model.blocks[0].ls1.gamma.detach(), torch.ones(32))


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def ablation(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ablate")
    (root / "tiny.yaml").write_text(TINY_ABLATION)
    assert main(["ablate", "--config", str(root / "tiny.yaml"), "--out", str(root / "out"), "--jobs", "1"]) == 0
    return root


def test_ablate_writes_curves_gammas_summary_and_plot(ablation, capsys):
    out = ablation / "out"
    curves = read_csv(out / "curves.csv")
    assert list(curves[0]) == CURVE_COLUMNS
    assert [(r["init_values"], r["seed"], r["step"]) for r in curves] == [
        (v, s, step) for s in ("0", "1") for v in ("off", "0.0001") for step in ("3", "6")
    ]
    assert all(math.isfinite(float(r[c])) for r in curves for c in CURVE_COLUMNS[2:])
    by_seed = [[r["train_loss"] for r in curves if r["seed"] == seed] for seed in ("0", "1")]
    assert by_seed[0] != by_seed[1]  # each seed its own weights and batch order
    gammas = read_csv(out / "gammas.csv")
    assert list(gammas[0]) == ["init_values", "seed", "block", "attn_mean_abs_gamma", "mlp_mean_abs_gamma"]
    assert {r["init_values"] for r in gammas} == {"0.0001"} and len(gammas) == 2 * 3  # LayerScale off: no gammas
    assert all(1e-4 < float(r["attn_mean_abs_gamma"]) < 1 for r in gammas)  # they moved
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("vit_ls_small_patch16_dinov3 with depth=3 embed_dim=32")
    assert summary[1].startswith("init_values off: held-out accuracy ") and "seeds " in summary[1]
    assert summary[2].startswith("init_values 0.0001: held-out accuracy ") and "mean |gamma| at the end" in summary[2]
    assert any(
        line.startswith(("LayerScale helped", "LayerScale did not help", "no clear difference")) for line in summary
    )
    image = Image.open(out / "curves.png")
    assert image.format == "PNG" and image.size == (1480, 380)
    umask = os.umask(0)
    os.umask(umask)
    assert {(out / name).stat().st_mode & 0o777 for name in ("curves.csv", "curves.png")} == {0o666 & ~umask}
    assert not list(out.glob(".*"))  # no temporary file left


def test_ablate_repeats_exactly_from_its_own_record_in_parallel(ablation):
    """experiment.yaml is the full record: rerun from it, two runs at a time, it gives the same curves."""
    record = yaml.safe_load((ablation / "out" / "experiment.yaml").read_text())
    assert record["init_values"] == ["off", 1e-4] and record["seeds"] == [0, 1] and record["train"]["steps"] == 6
    assert load_experiment(ablation / "out" / "experiment.yaml").model["depth"] == 3
    args = ["ablate", "--config", str(ablation / "out" / "experiment.yaml"), "--out", str(ablation / "again")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "timm_ls", *args, "--jobs", "2"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "4 runs (2 init values x 2 seeds), 6 steps each, 2 at a time" in result.stdout
    assert (ablation / "again" / "curves.csv").read_text() == (ablation / "out" / "curves.csv").read_text()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--out", "{out}"],
            "already holds results (curves.csv, curves.png, gammas.csv, summary.txt, experiment.yaml)",
        ),
        (["--init-values", "off", "-1"], "init_values: got -1"),
        (["--init-values", "off", "0"], "repeats a value"),
        (["--steps", "0"], "train.steps: got 0; allowed: a positive integer"),
        (["--width", "30"], "num_heads: got 4; allowed: a divisor of embed_dim=30"),
        (["--config", "{root}/bad.yaml"], "unknown key(s) ['trian']; allowed: ['description', 'variant'"),
        (["--variant", "nope.yaml"], "variant file nope.yaml does not exist"),
    ],
)
def test_ablate_bad_input_is_one_error_line(args, expected, ablation, capsys):
    (ablation / "bad.yaml").write_text(TINY_ABLATION.replace("train:", "trian:"))
    args = [a.format(out=ablation / "out", root=ablation) for a in args]
    config = [] if "--config" in args else ["--config", str(ablation / "tiny.yaml")]
    out_dir = [] if "--out" in args else ["--out", str(ablation / "never")]
    code = main(["ablate", *config, *out_dir, *args])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("timm-ls: error: ") and err.count("\n") == 1 and expected in err, err
    assert not (ablation / "never").exists()


def test_without_matplotlib_the_commands_say_what_to_install(ablation, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    hint = install_hint("tools", cwd=tmp_path)  # the commands run in tmp_path
    tiny = ablation / "tiny.yaml"
    ablate = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCK_MATPLOTLIB,
            "ablate",
            "--config",
            tiny,
            "--out",
            tmp_path / "a",
            "--jobs",
            "1",
            "--seeds",
            "0",
            "--init-values",
            "1e-4",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert ablate.returncode == 0, ablate.stderr
    assert (
        ablate.stderr.startswith("timm-ls: warning: no curves.png: plotting needs matplotlib") and hint in ablate.stderr
    )
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "curves.csv",
        "experiment.yaml",
        "gammas.csv",
        "summary.txt",
    ]
    inspect = subprocess.run(
        [sys.executable, "-c", BLOCK_MATPLOTLIB, "inspect", "vit_ls_small_patch16_dinov3", "--plot", "g.png"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert inspect.returncode == 2 and inspect.stderr.startswith("timm-ls: error: --plot: plotting needs matplotlib")
    assert hint in inspect.stderr and not (tmp_path / "g.png").exists()


def fake_results(final_acc: dict[str, list[float]], diverged: tuple[str, int] | None = None) -> list[dict]:
    """Runs as `run_one` returns them, with the given final held-out accuracy per seed."""
    results = []
    for label, accs in final_acc.items():
        for seed, acc in enumerate(accs):
            history = [dict(step=10, lr=0.1, train_loss=1.0 - acc, train_acc=acc, test_loss=1.0, test_acc=acc)]
            gammas = [] if label == "off" else [("0", 0.02, 0.04)]
            stop = diverged[1] if diverged and diverged[0] == label and seed == 0 else None
            results.append(dict(label=label, seed=seed, history=history, diverged_at=stop, gammas=gammas))
    return results


@pytest.mark.parametrize(
    ("final_acc", "verdict"),
    [
        (
            {"off": [0.30, 0.32, 0.31], "0.1": [0.60, 0.62, 0.64], "1e-06": [0.40, 0.41, 0.42]},
            "LayerScale helped here: init 0.1 beat off by 31.0 points, more than the seeds' spread (4.0)",
        ),
        (
            {"off": [0.70, 0.72, 0.71], "0.1": [0.60, 0.62, 0.64]},
            "LayerScale did not help here: off beat the best init (0.1) by 9.0 points, more than the seeds' "
            "spread (4.0)",
        ),
        (
            {"off": [0.60, 0.70, 0.65], "0.1": [0.62, 0.64, 0.66]},
            "no clear difference: off and the best init (0.1) are 1.0 points apart, within the seeds' spread (10.0)",
        ),
        (
            {"off": [0.50], "0.1": [0.55]},
            "best LayerScale init 0.1 vs off: +5.0 points of held-out accuracy, from one seed, so a gap of a few",
        ),
    ],
)
def test_summary_says_what_happened(final_acc, verdict):
    from timm_layerscale.tools.ablation import summarise

    experiment = load_experiment(REPO / "configs" / "experiments" / "ablate.yaml")
    experiment = experiment.replace(seeds=tuple(range(len(next(iter(final_acc.values()))))))
    lines = summarise(experiment, fake_results(final_acc))
    assert any(line.startswith(verdict) for line in lines), lines
    ranked = sorted(final_acc, key=lambda k: -sum(final_acc[k]))
    assert lines[-1] == "ranking by mean held-out accuracy: " + " > ".join(ranked)


def test_summary_counts_diverged_runs_and_ranks_them_last():
    from timm_layerscale.tools.ablation import summarise

    experiment = load_experiment(REPO / "configs" / "experiments" / "ablate.yaml")
    experiment = experiment.replace(seeds=(0, 1))
    lines = summarise(experiment, fake_results({"off": [0.9, 0.8], "1e-06": [0.5, 0.6]}, diverged=("off", 42)))
    off = next(line for line in lines if line.startswith("init_values off: "))
    assert off.startswith("init_values off: held-out accuracy 80.0%") and "1 of 2 runs diverged" in off
    assert "at step 42" in off
    assert lines[-1] == "ranking by mean held-out accuracy: 1e-06 > off"
    assert "mean |gamma| at the end 0.03" in next(line for line in lines if line.startswith("init_values 1e-06"))


def test_the_curves_show_accuracy_in_percent_as_the_text_does_with_the_legend_off_the_data():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from timm_layerscale.tools.plots import curves_figure

    runs = {r["label"]: [] for r in fake_results({"off": [0.3], "0.1": [0.6]})}
    for r in fake_results({"off": [0.3, 0.5], "0.1": [0.6, 0.8]}):
        runs[r["label"]] += [dict(row, seed=r["seed"]) for row in r["history"]]
    fig = curves_figure(runs, "title", gammas={"0.1": [0.02, 0.04]})
    FigureCanvasAgg(fig).draw()
    loss, accuracy, _ = fig.axes
    assert "%" in accuracy.get_ylabel() and "%" not in loss.get_ylabel()
    means = {line.get_label(): list(line.get_ydata()) for line in accuracy.get_lines()}
    assert means == {"off": [pytest.approx(40.0)], "0.1": [pytest.approx(70.0)]}  # the mean of the seeds, in %
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["off", "0.1"]
    assert not any(legend.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)


def test_one_seed_reads_as_one_seed_and_a_run_inside_its_warmup_says_so(monkeypatch, tmp_path, capsys):
    import timm_layerscale.tools.ablation as ablation

    monkeypatch.setattr(ablation, "run_all", lambda experiment, jobs: fake_results({"off": [0.5], "0.1": [0.55]}))
    args = ["ablate", "--seeds", "0", "--init-values", "off", "0.1", "--depth", "2", "--width", "32"]
    assert main([*args, "--out", str(tmp_path / "a"), "--steps", "30"]) == 0
    out, err = capsys.readouterr()
    assert "ablation: 2 runs (2 init values x 1 seed), 30 steps each" in out
    assert ", seed 0; data: " in (tmp_path / "a" / "summary.txt").read_text()
    assert err.count("\n") == 1 and "training stops at step 30, inside the 50-step warmup" in err
    assert main([*args, "--out", str(tmp_path / "b"), "--steps", "50"]) == 0
    assert "warmup" not in capsys.readouterr().err


def test_the_warmup_note_says_how_far_the_learning_rate_got():
    assert TrainConfig(steps=50, warmup=50).short_warmup_note() is None
    assert TrainConfig(steps=0, warmup=0).short_warmup_note() is None
    note = TrainConfig(steps=30, warmup=50, lr=2e-3).short_warmup_note()
    assert note.startswith("training stops at step 30, inside the 50-step warmup: the learning rate climbs to 0.0012")
    assert "never to its peak 0.002" in note
