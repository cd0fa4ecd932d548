"""What `timm-ls pretrain` is asked, parsed and checked in the command's front (torch-free): the method, the
models, the run's length and settings, the data's files and the destination. A resumed run takes its settings
from its checkpoint's record (`DIR/checkpoint/training.json`), read here as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .destinations import destination_problem
from .errors import CliError
from .paths import IMAGE_SUFFIXES

METHODS = ("distill", "dinov3")
RUN_FILES = ("checkpoint", "metrics.jsonl", "model")  # what a run writes into --out
RECORD = Path("checkpoint") / "training.json"
# What a resumed run may change; everything else is the checkpoint's.
RESUMABLE = ("steps", "save_every", "device", "threads")
# A new run's settings where no flag sets them (the parser's defaults are None, so that `--resume` can tell
# what was given). The learning rate is a continued run's, not Meta's from scratch (docs/pretrain.md); the
# warm-ups, None here, are a tenth of --steps.
DEFAULTS: dict[str, Any] = {
    "method": "dinov3",
    "steps": 1000,
    "batch_size": 32,
    "lr": 1e-4,
    "min_lr": 1e-6,
    "weight_decay": 0.04,
    "seed": 0,
    "save_every": 0,
    "gram": False,
    "local_crops": 8,
    "prototypes": 65536,
    "bf16": False,
    "device": "cpu",
    "pretrained": False,
    "teacher_pretrained": False,
    "model_kwargs": (),
}
DINOV3_ONLY = ("gram", "head_warmup_steps", "local_crops", "prototypes")
TEACHER_FLAGS = ("teacher", "teacher_checkpoint", "teacher_pretrained")


@dataclass(frozen=True)
class PretrainRequest:
    """Every setting of one run, checked: the record a checkpoint keeps, so that `--resume` rebuilds it."""

    data: str
    out: str
    method: str
    model: str
    checkpoint: str | None
    pretrained: bool
    model_kwargs: tuple[str, ...]
    teacher: str | None
    teacher_checkpoint: str | None
    teacher_pretrained: bool
    steps: int
    batch_size: int
    size: int | None
    lr: float
    min_lr: float
    weight_decay: float
    warmup_steps: int
    seed: int
    save_every: int
    gram: bool
    head_warmup_steps: int
    local_crops: int
    prototypes: int
    bf16: bool
    device: str
    threads: int | None
    resume: bool = False

    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "resume"}


def unlabeled_images(data: Path) -> list[Path]:
    """Every image file under `data`, at any depth (an ImageFolder's class folders too), hidden folders left out,
    in path order."""
    found = []
    for path in sorted(data.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(data).parts)
        if not hidden and path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            found.append(path)
    return found


def check_data(data: str) -> list[Path]:
    folder = Path(data)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise CliError(f"DATA {data} {what}; pass a folder of images (any layout, read at any depth)")
    files = unlabeled_images(folder)
    if len(files) < 2:
        raise CliError(
            f"DATA {data} holds {len(files)} image(s) ({', '.join(IMAGE_SUFFIXES)}); self-supervised training "
            "needs at least 2: add images"
        )
    return files


def _positive(flag: str, value: float | None, least: float = 1) -> None:
    if value is not None and value < least:
        raise CliError(f"{flag}: got {value}; pass {least:g} or more")


def _check_values(args: argparse.Namespace) -> None:
    for flag, dest in (("--steps", "steps"), ("--batch-size", "batch_size"), ("--threads", "threads")):
        _positive(flag, getattr(args, dest))
    for flag, dest in (("--save-every", "save_every"), ("--warmup-steps", "warmup_steps")):
        _positive(flag, getattr(args, dest), 0)
    _positive("--head-warmup-steps", args.head_warmup_steps, 0)
    _positive("--local-crops", args.local_crops, 0)
    _positive("--prototypes", args.prototypes, 2)
    _positive("--size", args.size, 16)
    for flag, dest in (("--warmup-steps", "warmup_steps"), ("--head-warmup-steps", "head_warmup_steps")):
        if getattr(args, dest) >= args.steps:
            raise CliError(f"{flag} {getattr(args, dest)} leaves no step of --steps {args.steps}; pass fewer")
    if not args.lr > 0 or not 0 <= args.min_lr <= args.lr:
        raise CliError(f"--lr {args.lr} and --min-lr {args.min_lr}: pass a positive --lr and 0 <= --min-lr <= --lr")
    if not 0 <= args.weight_decay < 1:
        raise CliError(f"--weight-decay: got {args.weight_decay}; pass a value from 0 to below 1 (e.g. 0.04)")


def _flags(names: list[str]) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


def _check_method(args: argparse.Namespace) -> None:
    """The method and the flags only the other method takes, before the defaults are put in."""
    method = args.method or DEFAULTS["method"]
    if method not in METHODS:
        raise CliError(f"unknown method {method!r}; pass --method one of {', '.join(METHODS)}")
    if args.model is None and not args.checkpoint:
        raise CliError("pretrain trains a model: pass --model NAME (or a --checkpoint that records its model)")
    if method == "distill" and not args.teacher:
        raise CliError("--method distill learns from a teacher: pass --teacher NAME (and its weights)")
    if method == "dinov3" and (given := [name for name in TEACHER_FLAGS if getattr(args, name) is not None]):
        raise CliError(f"--method dinov3 makes its teacher from the model (an EMA copy): leave out {_flags(given)}")
    if method == "distill" and (given := [name for name in DINOV3_ONLY if getattr(args, name) is not None]):
        raise CliError(f"{_flags(given)}: for --method dinov3 only; leave them out of a distillation")


def _given(args: argparse.Namespace) -> list[str]:
    """The run's settings set on the command line (every one's parser default is None)."""
    skip = {"command", "debug", "data", "out", "resume", "overwrite", *RESUMABLE}
    return [k for k, v in vars(args).items() if k not in skip and v is not None]


def read_record(run: str) -> dict[str, Any]:
    """The settings of the run `run` (its --out), from its checkpoint's record, or one line."""
    path = Path(run) / RECORD
    if not path.is_file():
        raise CliError(f"--resume {run}: no checkpoint there ({RECORD}); pass the --out of a pretrain run")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        settings = record["settings"]["request"]
        fields = {f.name for f in dataclasses.fields(PretrainRequest)} - {"resume"}
        if not isinstance(settings, dict) or set(settings) != fields:
            raise KeyError("request")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CliError(
            f"--resume {run}: {path} is not a pretrain checkpoint's record ({exc}); pass a run's --out"
        ) from None
    return settings


def resumed_request(args: argparse.Namespace) -> PretrainRequest:
    given = _given(args)
    if given:
        raise CliError(f"--resume takes the run's settings from its checkpoint; leave out {_flags(given)}")
    if args.out not in (None, args.resume):
        raise CliError(f"--resume {args.resume} goes on writing there; leave out --out {args.out}")
    settings = read_record(args.resume)
    settings.update({name: getattr(args, name) for name in RESUMABLE if getattr(args, name) is not None})
    settings["out"] = args.resume
    settings["model_kwargs"] = tuple(settings["model_kwargs"] or ())
    try:
        return PretrainRequest(**settings, resume=True)
    except TypeError as exc:
        raise CliError(f"--resume {args.resume}: its record does not fit this version ({exc})") from None


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """A new run's flags, each one not given at its default (`DEFAULTS`; the warm-ups a tenth of the run, and
    no head warm-up for a distillation, whose heads are all it starts with)."""
    values = {k: DEFAULTS[k] if v is None and k in DEFAULTS else v for k, v in vars(args).items()}
    tenth = values["steps"] // 10
    if values["warmup_steps"] is None:
        values["warmup_steps"] = tenth
    if values["head_warmup_steps"] is None:
        values["head_warmup_steps"] = tenth if values["method"] == "dinov3" else 0
    values["model_kwargs"] = tuple(values["model_kwargs"])
    return argparse.Namespace(**values)


def pretrain_request(args: argparse.Namespace) -> PretrainRequest:
    """The request `args` make (a new run or a resumed one), its values checked; the paths are checked by
    `check_pretrain_paths`."""
    if args.resume:
        request = resumed_request(args)
    else:
        if args.out is None or args.data is None:
            raise CliError("pretrain DATA --out DIR: pass both (or --resume DIR to go on with a run)")
        _check_method(args)
        args = with_defaults(args)
        fields = {f.name for f in dataclasses.fields(PretrainRequest)} - {"resume"}
        request = PretrainRequest(**{name: getattr(args, name) for name in fields})
    _check_values(argparse.Namespace(**request.settings()))
    if request.save_every > request.steps:
        raise CliError(f"--save-every {request.save_every} is past --steps {request.steps}; pass at most --steps")
    return request


def run_folder_problem(request: PretrainRequest, overwrite: bool) -> str | None:
    """Why `--out` cannot take this run: the destination rule, and a folder holding another run."""
    out = Path(request.out)
    problem = destination_problem(
        out, folder=True, what="pretrain --out", overwrite=True, into=True, sources=[request.data]
    )
    if problem or request.resume:
        return problem
    if out.resolve().is_relative_to(Path(request.data).resolve()):
        return f"--out {out} is inside DATA {request.data}, where it would read as data; choose a folder outside"
    held = [name for name in RUN_FILES if (out / name).exists()]
    if held and not overwrite:
        return f"--out {out} holds a run ({', '.join(held)}); pass --resume {out} to go on with it or --overwrite"
    return None
