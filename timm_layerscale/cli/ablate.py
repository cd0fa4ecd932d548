"""`timm-ls ablate`: the same deep, narrow ViT-LS trained with each LayerScale init value, all else equal.

This module reads the experiment with its flags, checks the destination and says what runs; the runs and
their files are `tools.ablation.run_ablation`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

from ..tools.ablation import OUTPUTS, check_models, init_label, run_ablation
from ..tools.experiment import Experiment, check, load_experiment
from ..tools.plots import missing_matplotlib, plotting_available
from .common import CliError, count, parse_model_kwargs, warn


def _with_flags(experiment: Experiment, args: argparse.Namespace) -> Experiment:
    model = dict(experiment.model)
    for flag, key in (("depth", "depth"), ("width", "embed_dim"), ("heads", "num_heads")):
        if getattr(args, flag) is not None:
            model[key] = getattr(args, flag)
    model.update(parse_model_kwargs(args.model_kwargs))
    if "init_values" in model:
        raise CliError("set init_values with --init-values (a list, one run each), not --model-kwargs")
    train_changes = {
        k: getattr(args, k) for k in ("steps", "lr", "warmup", "batch_size") if getattr(args, k) is not None
    }
    experiment = experiment.replace(
        variant=args.variant or experiment.variant,
        model=model,
        init_values=tuple(args.init_values) if args.init_values else experiment.init_values,
        seeds=tuple(args.seeds) if args.seeds else experiment.seeds,
        train=dataclasses.replace(experiment.train, **train_changes),
    )
    if not experiment.init_values:
        raise CliError(f"{experiment.source}: no init_values to compare; list some, e.g. --init-values off 1e-6")
    labels = [init_label(v) for v in experiment.init_values]  # checks each value
    if len(set(labels)) != len(labels):
        raise CliError(f"--init-values: {labels} repeats a value; give each once")
    experiment = check(experiment, "--config and flags")
    if note := experiment.train.short_warmup_note():
        warn(note)
    return experiment


def execute(args: argparse.Namespace) -> int:
    experiment = _with_flags(load_experiment(args.config), args)
    check_models(experiment)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file; pass a folder")
    existing = [name for name in OUTPUTS if (out / name).exists()]
    if existing and not args.overwrite:
        raise CliError(f"{out} already holds results ({', '.join(existing)}); pass another --out or --overwrite")
    runs = len(experiment.init_values) * len(experiment.seeds)
    jobs = args.jobs or min(
        runs, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    if jobs < 1:
        raise CliError(f"--jobs: got {jobs}; allowed: a positive integer")
    draw = plotting_available()
    if not draw:
        warn(f"no curves.png: {missing_matplotlib()}; the CSV files and the summary are still written")
    print(
        f"ablation: {runs} runs ({count(len(experiment.init_values), 'init value')} x "
        f"{count(len(experiment.seeds), 'seed')}), "
        f"{experiment.train.steps} steps each, {jobs} at a time; results go to {out}/",
        flush=True,
    )
    start = time.perf_counter()
    summary = run_ablation(experiment, out, jobs, draw)  # its folder's parent exists: checked before torch loaded
    print("\n".join(summary[1:]))
    print(
        f"wrote {', '.join(n for n in OUTPUTS if draw or n != 'curves.png')} to {out}/ "
        f"in {time.perf_counter() - start:.0f} s"
    )
    return 0
