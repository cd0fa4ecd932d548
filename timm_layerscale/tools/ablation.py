"""`timm-ls ablate`'s runs as one application: the same deep, narrow ViT-LS trained with each LayerScale init
value and seed, all else equal, side by side in spawned processes (`run_ablation`), and what they write:
curves.csv, gammas.csv, curves.png, summary.txt and experiment.yaml (the record: rerun it with --config).

Every run shares the weights seed, batch order, learning-rate schedule, step budget and data (shapes
generated from a seed, nothing downloaded); only `init_values` differs.

The command reads the experiment and its flags, checks the destination and says what runs; the rest is here.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import multiprocessing
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import timm
import torch
import yaml
from torch import nn
from tqdm import tqdm

from timm_ls.names import is_variant_file

from ..config import resolve_init_values
from ..variants import find_variant, register_variant
from .experiment import Experiment
from .files import write_atomically
from .gammas import gamma_stats
from .plots import plot_curves
from .shapes import CLASSES, make_shapes
from .trainer import train

CURVE_COLUMNS = ("init_values", "seed", "step", "lr", "train_loss", "train_acc", "test_loss", "test_acc")
GAMMA_COLUMNS = ("init_values", "seed", "block", "attn_mean_abs_gamma", "mlp_mean_abs_gamma")
OUTPUTS = ("curves.csv", "curves.png", "gammas.csv", "summary.txt", "experiment.yaml")


def init_label(value: Any) -> str:
    resolved = resolve_init_values(value, 1)[0][0]
    return "off" if resolved is None else f"{resolved:g}"


# ----------------------------------------------------------------------------------------------- runs


def model_name(text: str) -> str:
    """The timm name of the experiment's variant: a registered `NAME[.TAG]`, or a YAML variant file registered
    first (in each worker too: a spawned process starts with the shipped variants only)."""
    if is_variant_file(text):
        with warnings.catch_warnings():  # a file may redefine a shipped variant: that is what the user asked
            warnings.simplefilter("ignore")
            return register_variant(Path(text))
    variant, tag = find_variant(text, what="variant")
    return f"{variant.name}.{tag}" if tag else variant.name


def build_model(experiment: Experiment, init_value: Any, seed: int, **kwargs: Any) -> nn.Module:
    """A run's model. The weights come from `seed` alone: the runs of one seed differ only in their gammas."""
    name = model_name(experiment.variant)
    torch.manual_seed(seed)
    return timm.create_model(
        name,
        num_classes=len(CLASSES),
        **{**experiment.model, "init_values": init_value},
        **kwargs,
    )


def run_one(experiment: Experiment, init_value: Any, seed: int, progress=None) -> dict[str, Any]:
    """One training run; in a worker process, with one thread, or in this process."""
    torch.set_num_threads(1)
    data = make_shapes(experiment.data)
    model = build_model(experiment, init_value, seed)
    label = init_label(init_value)
    start = time.perf_counter()
    result = train(
        model,
        data,
        experiment.train,
        seed=seed,
        on_step=None if progress is None else lambda step, loss: progress.put((label, seed, 1)),
    )
    gammas = [
        (b.label, b.attn.mean if b.attn else math.nan, b.mlp.mean if b.mlp else math.nan)
        for b in gamma_stats(model.state_dict())
    ]
    if progress is not None and result.diverged_at is not None:
        progress.put((label, seed, experiment.train.steps - result.diverged_at + 1))
    return dict(
        label=label,
        seed=seed,
        history=result.history,
        diverged_at=result.diverged_at,
        gammas=gammas,
        seconds=time.perf_counter() - start,
    )


_worker_progress = None  # in a worker process: the queue its steps are reported on


def _start_worker(progress) -> None:
    global _worker_progress
    _worker_progress = progress


def _run_in_worker(experiment: Experiment, init_value: Any, seed: int) -> dict[str, Any]:
    return run_one(experiment, init_value, seed, progress=_worker_progress)


def run_all(experiment: Experiment, jobs: int) -> list[dict[str, Any]]:
    plan = [(v, s) for s in experiment.seeds for v in experiment.init_values]
    with tqdm(
        total=len(plan) * experiment.train.steps, desc="ablation", unit="step", file=sys.stderr, disable=None
    ) as bar:
        if jobs == 1:
            results = []
            for value, seed in plan:
                bar.set_postfix_str(f"init_values={init_label(value)} seed={seed}")
                results.append(run_one(experiment, value, seed, progress=_BarQueue(bar)))
            return results
        # spawn, not fork: a forked copy of a process that has run OpenMP threads can hang.
        context = multiprocessing.get_context("spawn")
        progress = context.Queue()
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker, initargs=(progress,)) as pool:
            futures = [pool.submit(_run_in_worker, experiment, v, s) for v, s in plan]
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=0.2)
                while not progress.empty():
                    bar.update(progress.get()[2])
            return [f.result() for f in futures]


class _BarQueue:
    """The queue interface over a progress bar, for runs in this process."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def put(self, item: tuple[str, int, int]) -> None:
        self.bar.update(item[2])


# ---------------------------------------------------------------------------------------------- outputs


def _csv(columns: tuple[str, ...], rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
    return out.getvalue()


def _spread(values: list[float]) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.1%}" + (f" (seeds {min(values):.1%} to {max(values):.1%})" if len(values) > 1 else "")


def _final_accuracies(results: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per init value, each run's last held-out accuracy (NaN for a run that diverged or never finished)."""
    labels = list(dict.fromkeys(r["label"] for r in results))
    return {
        label: [
            r["history"][-1]["test_acc"] if r["history"] and not r["diverged_at"] else math.nan
            for r in results
            if r["label"] == label
        ]
        for label in labels
    }


def _run_line(label: str, runs: list[dict[str, Any]], accs: list[float]) -> str:
    """One init value's runs: accuracy, loss, divergence and the gammas they ended with."""
    diverged = [r for r in runs if r["diverged_at"]]
    losses = [r["history"][-1]["train_loss"] for r in runs if r["history"] and not r["diverged_at"]]
    line = f"init_values {label}: "
    line += f"held-out accuracy {_spread(accs)}" if accs else "no finished run"
    if losses:
        line += f", last training loss {sum(losses) / len(losses):.3f}"
    if diverged:
        line += f"; {len(diverged)} of {len(runs)} runs diverged (NaN/Inf loss, at step {diverged[0]['diverged_at']})"
    gammas = [g for r in runs for _, a, m in r["gammas"] for g in (a, m) if math.isfinite(g)]
    if gammas:
        line += f"; mean |gamma| at the end {sum(gammas) / len(gammas):.3g}"
    return line


def _mean(accs: list[float]) -> float:
    """The mean accuracy of an init value's runs; -inf unless every run finished."""
    finite = [a for a in accs if math.isfinite(a)]
    return sum(finite) / len(finite) if finite and len(finite) == len(accs) else -math.inf


def _verdict(final_acc: dict[str, list[float]], ranked: list[str], seeds: int) -> str:
    """Off against the best init, said as the seeds allow: one seed, beyond the spread, or within it."""

    def spread(label: str) -> float:
        finite = [a for a in final_acc[label] if math.isfinite(a)]
        return max(finite) - min(finite) if finite else 0.0

    best = next(label for label in ranked if label != "off")
    gap = _mean(final_acc[best]) - _mean(final_acc["off"])
    noise = max(spread(best), spread("off"))
    if seeds == 1:
        return (
            f"best LayerScale init {best} vs off: {gap * 100:+.1f} points of held-out accuracy, from one seed, "
            f"so a gap of a few points may be noise; run --seeds 0 1 2 to see the spread"
        )
    if abs(gap) > noise:
        winner = (
            f"LayerScale helped here: init {best} beat off"
            if gap > 0
            else f"LayerScale did not help here: off beat the best init ({best})"
        )
        return f"{winner} by {abs(gap) * 100:.1f} points, more than the seeds' spread ({noise * 100:.1f})"
    return (
        f"no clear difference: off and the best init ({best}) are {abs(gap) * 100:.1f} points apart, within the "
        f"seeds' spread ({noise * 100:.1f})"
    )


def _ranked(final_acc: dict[str, list[float]]) -> list[str]:
    return sorted(final_acc, key=lambda label: _mean(final_acc[label]), reverse=True)


def summarise(experiment: Experiment, results: list[dict[str, Any]]) -> list[str]:
    """What happened, in plain words, including when LayerScale did not help."""
    final_acc = _final_accuracies(results)
    model = experiment.model
    lines = [
        f"{experiment.variant} with {' '.join(f'{k}={v}' for k, v in model.items())}, {experiment.train.describe()}, "
        f"{'seed' if len(experiment.seeds) == 1 else 'seeds'} {', '.join(map(str, experiment.seeds))}; "
        f"data: {experiment.data.describe()}"
    ]
    for label, accs in final_acc.items():
        runs = [r for r in results if r["label"] == label]
        lines.append(_run_line(label, runs, [a for a in accs if math.isfinite(a)]))
    ranked = _ranked(final_acc)
    if "off" in final_acc and len(final_acc) > 1:
        lines.append(_verdict(final_acc, ranked, len(experiment.seeds)))
    lines.append("ranking by mean held-out accuracy: " + " > ".join(ranked))
    return lines


def check_models(experiment: Experiment) -> None:
    """Every run's model is built on `meta` first: a bad name, size or init value fails now, not in a worker."""
    for value in experiment.init_values:
        build_model(experiment, value, seed=0, device="meta")


def _title(experiment: Experiment) -> str:
    model, train = experiment.model, experiment.train
    seeds = len(experiment.seeds)
    return (
        f"{experiment.variant} depth {model.get('depth')}, width {model.get('embed_dim')}: {train.steps} steps, "
        f"batch {train.batch_size}, lr {train.lr:g}, on generated shapes; "
        f"{'mean of ' + str(seeds) + ' seeds, band min to max' if seeds > 1 else 'one seed'}"
    )


def _final_gammas(results: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per init value with LayerScale: mean |gamma| per block at the end, over both branches and the seeds."""
    per_label: dict[str, list[list[float]]] = {}
    for r in results:
        values = [(a + m) / 2 for _, a, m in r["gammas"]]
        if values and all(math.isfinite(v) for v in values):
            per_label.setdefault(r["label"], []).append(values)
    return {label: [sum(col) / len(col) for col in zip(*runs)] for label, runs in per_label.items()}


def _write_outputs(experiment: Experiment, results: list[dict[str, Any]], out: Path, draw: bool) -> list[str]:
    """The run's files in `out` (curves.png where `draw`); the summary's lines."""
    curves = [dict(init_values=r["label"], seed=r["seed"], **row) for r in results for row in r["history"]]
    write_atomically(out / "curves.csv", _csv(CURVE_COLUMNS, curves))
    gamma_rows = [
        dict(init_values=r["label"], seed=r["seed"], block=block, attn_mean_abs_gamma=a, mlp_mean_abs_gamma=m)
        for r in results
        for block, a, m in r["gammas"]
    ]
    write_atomically(out / "gammas.csv", _csv(GAMMA_COLUMNS, gamma_rows))
    plain = dataclasses.asdict(experiment)
    plain.pop("source")
    plain["init_values"] = [v if v == "off" else float(v) for v in map(init_label, experiment.init_values)]
    plain["seeds"] = list(experiment.seeds)
    write_atomically(out / "experiment.yaml", yaml.safe_dump(plain, sort_keys=False))
    summary = summarise(experiment, results)
    write_atomically(out / "summary.txt", "\n".join(summary) + "\n")
    if draw:
        by_label: dict[str, list[dict[str, float]]] = {}
        for row in curves:
            by_label.setdefault(row["init_values"], []).append(row)
        plot_curves(by_label, out / "curves.png", _title(experiment), gammas=_final_gammas(results))
    return summary


def run_ablation(experiment: Experiment, out: Path, jobs: int, draw: bool) -> list[str]:
    """Every (init value, seed) run of `experiment`, `jobs` at a time, and their files written into the folder
    `out` (made here; its parent exists); the summary's lines."""
    results = run_all(experiment, jobs)
    out.mkdir(exist_ok=True)
    return _write_outputs(experiment, results, out, draw)
