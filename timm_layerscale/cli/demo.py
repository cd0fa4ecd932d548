"""`timm-ls [demo]`, the main job: watch LayerScale learn, or read a trained model's gammas.

Without weights it trains a small vit_ls from random weights on shapes generated from a seed (about 20 s
on 2 CPU cores, nothing downloaded) and shows each block's gammas before and after. With
`--pretrained` or `--checkpoint` it shows that model's gammas and runs the shipped images through it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import timm
import torch
from PIL import Image
from timm.data import resolve_data_config
from torch import nn
from torchvision.transforms.functional import normalize, to_tensor
from tqdm import tqdm

from timm_ls import paths
from timm_ls.model_source import ModelSource

from ..publish import save_native
from ..tools.dense import read_image
from ..tools.experiment import Experiment, check, load_experiment
from ..tools.gammas import BRANCHES, BranchStats, block_name, find_gamma_keys, gamma_stats, short_number
from ..tools.shapes import Shapes, make_shapes
from ..tools.trainer import TrainResult, evaluate, train
from ..variants import VARIANTS
from .common import (
    CliError,
    build,
    build_from_checkpoint,
    load_report,
    parse_model_kwargs,
    resolve_variant,
    table,
    warn,
    warn_and_keep_the_rest,
)
from .gamma_report import draw, plot_target, stats_table

ASSETS = paths.assets_dir()
WHAT_IS_A_GAMMA = (
    "LayerScale multiplies the output of each residual branch (the attention and the MLP of every block) by "
    "gamma, a learned gain per channel that starts tiny, so each block starts close to doing nothing and "
    "training turns up the branches the network needs."
)


def execute(args: argparse.Namespace) -> int:
    # The default picture goes into the job's own folder (its rule: timm_ls.paths.demo_out), as the model does.
    out = paths.demo_out(args.out)
    args = argparse.Namespace(**{**vars(args), "out": str(out), "default_plot": str(out / args.default_plot)})
    if args.checkpoint or args.pretrained:
        return show_model(args)
    if args.image:
        raise CliError("--image runs images through a model with --checkpoint or --pretrained weights; add one")
    return watch_training(args)


# ------------------------------------------------------------------------------------------------ training


def _gammas(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    keys, _ = find_gamma_keys(list(state))
    return {k: state[k].detach().clone() for branches in keys.values() for k in branches.values()}


def _experiment(args: argparse.Namespace) -> Experiment:
    experiment = load_experiment(args.config)
    if args.steps is not None:
        experiment = check(experiment.replace(train=dataclasses.replace(experiment.train, steps=args.steps)), "--steps")
    if args.threads < 1:
        raise CliError(f"--threads: got {args.threads}; allowed: a positive integer")
    if note := experiment.train.short_warmup_note():
        warn(note)
    return experiment


def _gamma_changes(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
) -> list[tuple[str, dict[str, tuple[BranchStats, BranchStats, float] | None]]]:
    """Per block: for each branch its stats before and after and how far it moved (mean |after - before|)."""
    keys, _ = find_gamma_keys(list(after))
    blocks = []
    for block, branches in zip(gamma_stats(after), keys.values()):
        changes = {}
        for branch in BRANCHES:
            key = branches.get(branch)
            moved = None if key is None else (after[key] - before[key]).abs().mean().item()
            changes[branch] = None if key is None else (BranchStats.of(before[key]), BranchStats.of(after[key]), moved)
        blocks.append((block.label, changes))
    return blocks


@dataclasses.dataclass
class _Run:
    """One training run of the main job: what was trained, on what, and what came out."""

    name: str
    overrides: dict
    model: nn.Module
    data: Shapes
    before: dict
    loss_before: float
    acc_before: float
    plot: Path | None
    result: TrainResult | None = None
    seconds: float = 0.0
    saved: Path | None = None  # the trained model's folder

    @property
    def shrink(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.overrides.items())

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def last(self) -> dict:
        history = self.result.history if self.result else []
        return history[-1] if history else dict(step=0, test_loss=math.nan, test_acc=math.nan)


def watch_training(args: argparse.Namespace) -> int:
    experiment = _experiment(args)
    run = _start(args, experiment)
    if not args.json:
        print(_introduction(args, experiment, run), flush=True)
    _train(args, experiment, run)
    after = _gammas(run.model)
    changes = _gamma_changes(run.before, after)
    title = f"{run.name} ({run.shrink}), {experiment.train.steps} steps on generated shapes"
    Path(args.out).mkdir(parents=True, exist_ok=True)  # a given --out's parent exists; the default's may not
    side = experiment.data.image_size  # what it learned on: its data config says so, not the variant's size
    run.model.pretrained_cfg = {**run.model.pretrained_cfg, "input_size": (3, side, side)}
    run.saved = save_native(run.model.eval(), Path(args.out) / "model", overwrite=True)
    plot_line = draw(run.plot, gamma_stats(after), title, before=gamma_stats(run.before))
    if args.json:
        print(json.dumps(_json_report(args, experiment, run, changes, plot_line), indent=1))
    else:
        print(_text_report(run, changes, plot_line))
    return 0


def _start(args: argparse.Namespace, experiment: Experiment) -> _Run:
    """The shrunk model from its seed, its gammas and its held-out score before any step."""
    variant, tag = resolve_variant(args.variant or experiment.variant)
    name = f"{variant.name}.{tag}" if tag else variant.name
    overrides = {**experiment.model, **parse_model_kwargs(args.model_kwargs)}
    plot = plot_target(args)  # a bad --plot fails before the training does
    torch.set_num_threads(args.threads)
    data = make_shapes(experiment.data)
    torch.manual_seed(args.seed)
    model = timm.create_model(name, num_classes=data.num_classes, **overrides)
    before = _gammas(model)
    if not before:
        raise CliError(
            "this model has LayerScale off (init_values=off), so there are no gammas to watch; pass another "
            "init value, or run `timm-ls ablate` to compare training with and without LayerScale"
        )
    loss_before, acc_before = evaluate(model, data.test_images, data.test_labels)
    return _Run(name, overrides, model, data, before, loss_before, acc_before, plot)


def _introduction(args: argparse.Namespace, experiment: Experiment, run: _Run) -> str:
    inits = sorted({v for pair in run.model.config.layer_init_values for v in pair if v is not None})
    return (
        f"{WHAT_IS_A_GAMMA}\n\n"
        f"model: {run.name} shrunk to train on CPU ({run.shrink}); {run.parameters / 1e6:.2f}M parameters; "
        f"LayerScale init {', '.join(f'{v:g}' for v in inits)}\n"
        f"weights: random (seed {args.seed}); nothing pretrained or downloaded\n"
        f"data: {experiment.data.describe()}\n"
        f"training: {experiment.train.describe()}; experiment {experiment.source}"
    )


def _train(args: argparse.Namespace, experiment: Experiment, run: _Run) -> None:
    """The training steps behind a progress bar on stderr; a warning if the loss diverged."""
    start = time.perf_counter()
    with tqdm(total=experiment.train.steps, desc="training", unit="step", file=sys.stderr, disable=None) as bar:

        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        run.result = train(run.model, run.data, experiment.train, seed=args.seed, on_step=on_step)
    run.seconds = time.perf_counter() - start
    if run.result.diverged_at is not None:
        warn(f"the training loss became NaN or Inf at step {run.result.diverged_at}; try a lower lr in {args.config}")


def _json_report(args: argparse.Namespace, experiment: Experiment, run: _Run, changes: list, plot_line: str) -> dict:
    gammas = [
        dict(
            block=label,
            **{
                b: None if c is None else dict(before=asdict(c[0]), after=asdict(c[1]), moved=c[2])
                for b, c in branches.items()
            },
        )
        for label, branches in changes
    ]
    return dict(
        model=run.name,
        model_kwargs=run.overrides,
        parameters=run.parameters,
        weights=f"random (seed {args.seed})",
        data=asdict(experiment.data),
        train=asdict(experiment.train),
        seconds=round(run.seconds, 2),
        diverged_at=run.result.diverged_at,
        accuracy=dict(before=run.acc_before, after=run.last["test_acc"], chance=1 / run.data.num_classes),
        loss=dict(before=run.loss_before, after=run.last["test_loss"]),
        history=run.result.history,
        gammas=gammas,
        plot=str(run.plot) if plot_line else None,
        saved=str(run.saved),
    )


def _text_report(run: _Run, changes: list, plot_line: str) -> str:
    last = run.last
    rows = []
    for label, branches in changes:
        row = [label]
        for c in branches.values():
            row += (
                ["off", "", ""] if c is None else [short_number(c[0].mean), short_number(c[1].mean), short_number(c[2])]
            )
        rows.append(row)
    loudest = max(
        ((label, b, c[1].mean) for label, branches in changes for b, c in branches.items() if c is not None),
        key=lambda t: t[2],
    )
    lines = [
        f"held-out accuracy: {run.acc_before:.1%} before training (chance {1 / run.data.num_classes:.1%}), "
        f"{last['test_acc']:.1%} after {last['step']} steps ({run.seconds:.0f} s)",
        "",
        "LayerScale gammas, mean |gamma| over each branch's channels; moved: mean |after - before|",
        table(["block", "attn before", "after", "moved", "mlp before", "after", "moved"], rows),
        f"loudest branch now: {block_name(loudest[0])} {loudest[1]} (mean |gamma| {loudest[2]:.3g})",
        *([plot_line] if plot_line else []),
        f"saved: the trained model in {run.saved} (`timm-ls inspect {run.saved}`, or "
        f"timm.create_model('local-dir:{run.saved}', pretrained=True))",
        "",
        "next: `timm-ls --pretrained` shows the gammas DINOv3 learned in pretraining, `timm-ls inspect FILE` "
        "those of any checkpoint, `timm-ls ablate` compares training with and without LayerScale",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ weights


def fit_image(picture: Image.Image, model: nn.Module) -> tuple[Image.Image, str]:
    """The model's input size for this picture, and how it got there, in words: never a silent crop."""
    width, height = picture.size
    if not model.dynamic_img_size:
        target_h, target_w = model.patch_embed.img_size
        why = "this model takes one size only"
    else:
        p = model.patch_size
        target_w, target_h = (max(p, int(side / p + 0.5) * p) for side in (width, height))  # halves round up
        why = f"sides must be multiples of {p}"
    if (target_w, target_h) == (width, height):
        return picture, f"{width}x{height}, run at its own size (no crop, no resize)"
    resized = picture.resize((target_w, target_h), Image.BICUBIC)
    return resized, f"{width}x{height}, resized to {target_w}x{target_h} without cropping ({why})"


def _model_with_weights(args: argparse.Namespace) -> tuple[nn.Module, str, str]:
    """The model and where its weights come from: a checkpoint by the one identity rule (--variant then only
    names it), else the variant's pretrained weights."""
    if args.checkpoint:
        return build_from_checkpoint(ModelSource.of(args), args.variant)
    variant, tag = resolve_variant(args.variant or load_experiment(args.config).variant)
    model, source = build(ModelSource.of(args), variant, tag, offline_random=True)
    return model, source, f"{variant.name}{f'.{tag}' if tag else ''}"


def show_model(args: argparse.Namespace) -> int:
    images = [Path(p) for p in args.image] if args.image else sorted(ASSETS.glob("*.png"))
    pictures = [read_image(p) for p in images]
    plot = plot_target(args)
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)  # the job's own folder, for the default picture
    with load_report() as report:
        model, source, name = _model_with_weights(args)
    model.eval()
    report = warn_and_keep_the_rest(report)
    overrides = " ".join(args.model_kwargs)
    out = [
        f"variant: {name}{f' ({overrides})' if overrides else ''}",
        f"config: {VARIANTS[name.partition('.')[0]].source}",
        f"weights: {source}",
        *(f"  {line}" for line in report),
    ]
    data_cfg = resolve_data_config({}, model=model)
    prefix = model.num_prefix_tokens
    image_rows = []
    for path, picture in zip(images, pictures):
        fitted, how = fit_image(picture, model)
        x = normalize(to_tensor(fitted), data_cfg["mean"], data_cfg["std"])
        try:
            with torch.inference_mode():
                tokens = model.forward_features(x.unsqueeze(0))
                pooled = model.forward_head(tokens, pre_logits=True)
        except (RuntimeError, AssertionError, ValueError) as exc:
            raise CliError(f"the model cannot run on {path.name} ({exc}); check --model-kwargs") from exc
        patches = tokens.shape[1] - prefix
        out.append(f"{path.name}: {how} -> {patches} patch tokens, pooled feature of {pooled.shape[-1]}")
        image_rows.append(dict(image=str(path), input=how, patch_tokens=patches, pooled=pooled.shape[-1]))
    blocks = gamma_stats(model.state_dict())
    if not blocks:
        out.append("LayerScale: off in this model (no gammas)")
    plot_line = draw(plot, blocks, f"{name}: {source}") if blocks else ""
    if args.json:
        print(
            json.dumps(
                dict(
                    model=name,
                    weights=source,
                    images=image_rows,
                    gammas=[b.to_dict() for b in blocks],
                    plot=str(plot) if plot_line else None,
                ),
                indent=1,
            )
        )
        return 0
    print("\n".join(out))
    if blocks:
        print("LayerScale gammas: " + stats_table(blocks))
    if plot_line:
        print(plot_line)
    return 0
