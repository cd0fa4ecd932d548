"""What the command checks before it loads torch: choices, every path it is to read, every path it is to write.

A source that names a path (it has a path separator or a file suffix) and does not exist gets the same line
in every command; a bare word may still be a model name, which the command itself looks up. Destinations
follow the one rule of `destinations`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from .destinations import destination_problem, format_destination_problem
from .errors import CliError
from .image_folder import TASKS, read_image_folder
from .int8_request import image_folder_files, int8_problem, parse_min_cosine
from .names import (
    CAST_DTYPES,
    EXPORT_DTYPES,
    FILE_SUFFIXES,
    FORMAT_NAMES,
    FORMATS,
    KEEP,
    WEIGHTS_SETS,
    FormatSpec,
    format_spec,
    is_variant_file,
    suffix_of,
)
from .paths import IMAGE_SUFFIXES, demo_out, image_files
from .pretrain_request import PretrainRequest, check_data, pretrain_request, run_folder_problem
from .probe_request import ProbeRequest, probe_request

CHECKPOINT = "checkpoint"
VARIANT_FILE = "variant file"
# What to pass instead, by what a missing path was meant to be.
FIXES = {
    CHECKPOINT: "pass a weights file (.safetensors, .pth, .bin) or a checkpoint folder",
    VARIANT_FILE: "pass the path of a YAML variant file or a registered name (`timm-ls list`)",
    "experiment file": "pass the path of an experiment YAML file (the shipped ones: configs/experiments/)",
    "Meta training YAML": "pass the path of Meta's DINOv3 training YAML",
    "script": "pass the path of timm's train.py or validate.py",
    "image": "pass the path of an image file with --image",
    "image file": "pass the path of an image file or of a folder of them",
}


def missing(kind: str, path: str | Path) -> str:
    """The one line for a path to read that does not exist."""
    return f"{kind} {path} does not exist; {FIXES[kind]}"


def names_a_path(text: str) -> bool:
    """Whether `text` can only be a path: a separator or a file suffix (`NAME.TAG` is no suffix)."""
    return "/" in text or os.sep in text or suffix_of(text) in FILE_SUFFIXES


def _require(kind: str, path: str | None) -> None:
    if path is not None and not Path(path).exists():
        raise CliError(missing(kind, path))


def _model_source(text: str | None, kind: str = CHECKPOINT) -> None:
    """A source that is a path or a name: a missing path is refused, a bare word left to the command."""
    if text is None:
        return
    if is_variant_file(text):
        _require(VARIANT_FILE, text)
    elif names_a_path(text):
        _require(kind, text)


def _destination(dst: str, **rule: object) -> None:
    problem = destination_problem(dst, overwrite_hint="--overwrite", **rule)
    if problem:
        raise CliError(problem)


def _choice(value: str | None, flag: str, allowed: tuple[str, ...], what: str) -> None:
    if value is not None and value not in allowed:
        raise CliError(f"unknown {what} {value!r}; pass {flag} one of {', '.join(allowed)}")


def _plot(args: argparse.Namespace) -> None:
    if args.plot is not None:
        _destination(args.plot, folder=False, what="--plot", overwrite=True, suffixes=(".png",))


def check_convert(args: argparse.Namespace) -> None:
    _choice(args.to, "--to", FORMAT_NAMES, "target")
    spec = format_spec(args.to)
    _choice(args.dtype, "--dtype", (KEEP, *CAST_DTYPES), "dtype")
    _choice(args.weights, "--weights", WEIGHTS_SETS, "weights set")
    _format_options(args, spec)
    _require(CHECKPOINT, args.src)
    _model_source(args.model, VARIANT_FILE)
    for option in spec.options:
        if option.file:
            _require(option.file, getattr(args, option.dest))
    problem = format_destination_problem(spec, args.dst, overwrite=args.overwrite, sources=[args.src])
    if problem:
        raise CliError(problem)


def _format_options(args: argparse.Namespace, spec: FormatSpec) -> None:
    """An option of another format's, set: one line naming the format that takes it."""
    for other in FORMATS:
        given = [o.flag for o in other.options if other is not spec and getattr(args, o.dest) != o.default]
        if given:
            raise CliError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for --to {other.name}")


def check_export(args: argparse.Namespace) -> None:
    _choice(args.dtype, "--dtype", EXPORT_DTYPES, "dtype")
    _model_source(args.source)
    _model_source(args.model, VARIANT_FILE)
    data = Path(args.dst).parent / (Path(args.dst).name + ".data")  # `.` has no name to add to
    _destination(
        args.dst, folder=False, what="export", overwrite=args.overwrite, suffixes=(".onnx",), companions=[data]
    )
    _int8(args)


def _int8(args: argparse.Namespace) -> None:
    """The int8 options together, `--min-cosine`'s value and the image folders' files (their pixels are the
    package's to read)."""
    try:
        parse_min_cosine(args.min_cosine)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    problem = int8_problem(args.int8, args.dtype, args.calibrate, args.images, args.min_cosine)
    if problem:
        raise CliError(problem)
    for flag, folder in (("--calibrate", args.calibrate), ("--images", args.images)):
        if folder is not None:
            try:
                image_folder_files(folder, flag)
            except ValueError as exc:
                raise CliError(str(exc)) from None


def check_inspect(args: argparse.Namespace) -> None:
    _model_source(args.source)
    _require(CHECKPOINT, args.checkpoint)
    _plot(args)


def check_demo(args: argparse.Namespace) -> None:
    _require(CHECKPOINT, args.checkpoint)
    _model_source(args.variant, VARIANT_FILE)
    _require("experiment file", args.config)
    if args.image and not (args.checkpoint or args.pretrained):
        raise CliError("--image runs images through a model with --checkpoint or --pretrained weights; add one")
    for image in args.image:
        _require("image", image)
    if not args.no_plot:
        _plot(args)
    out = demo_out(args.out)
    if args.out is not None or out.parent.is_dir():  # the default's parents (the user's cache) are made on use
        _destination(str(out), folder=True, what="demo --out", overwrite=True, into=True)


def check_ablate(args: argparse.Namespace) -> None:
    _require("experiment file", args.config)
    _model_source(args.variant, VARIANT_FILE)
    _destination(args.out, folder=True, what="ablate --out", overwrite=True, into=True)


def parse_size(text: str) -> int | None:
    """`--size`: a positive number of pixels, or None for `native`."""
    if text == "native":
        return None
    if not text.isdigit() or int(text) < 1:
        raise CliError(f"--size: got {text!r}; pass the shorter side in pixels (e.g. 768) or native")
    return int(text)


def parse_layer(text: str) -> int | None:
    """`--layer`: a block index (negative counts from the end), or None for `last`."""
    if text == "last":
        return None
    try:
        return int(text)
    except ValueError:
        raise CliError(f"--layer: got {text!r}; pass a block index (0 is the first, -1 the last) or last") from None


def check_features(args: argparse.Namespace) -> None:
    _choice(args.dtype, "--dtype", CAST_DTYPES, "dtype")
    parse_size(args.size)
    parse_layer(args.layer)
    if args.batch < 1:
        raise CliError(f"--batch: got {args.batch}; pass 1 or more images per forward")
    for source in args.images:
        _require("image file", source)
        if Path(source).is_dir() and not image_files([source]):
            raise CliError(f"{source} holds no images ({', '.join(IMAGE_SUFFIXES)}); pass a folder of images")
    stems: dict[str, Path] = {}
    for image in image_files(args.images):
        if image.stem in stems and stems[image.stem] != image:
            raise CliError(
                f"{stems[image.stem]} and {image} would both write {image.stem}_pca.png; rename one or run them apart"
            )
        stems[image.stem] = image
    if args.model is None and not args.checkpoint:
        raise CliError(
            "--model: pass the model to run (a vit_ls NAME[.TAG], a YAML variant file or a timm ViT), "
            "or --checkpoint PATH"
        )
    if args.model is not None:
        _model_source(args.model, VARIANT_FILE)
    _require(CHECKPOINT, args.checkpoint)
    _destination(args.out, folder=True, what="features --out", overwrite=args.overwrite, into=args.overwrite)


def check_probe(args: argparse.Namespace) -> ProbeRequest:
    """Every flag and path of `timm-ls probe`; the request the command runs."""
    _choice(args.task, "--task", TASKS, "task")
    _choice(args.dtype, "--dtype", CAST_DTYPES, "dtype")
    request = probe_request(args)
    if not args.model and not args.checkpoint:
        raise CliError("probe needs a model: pass --model NAME (or a --checkpoint that records its model)")
    for model in args.model or []:
        _model_source(model, VARIANT_FILE)
    _require(CHECKPOINT, args.checkpoint)
    if not Path(args.data).exists():
        raise CliError(f"DATA {args.data} does not exist; pass a folder of images laid out as DATA/train/<class>/*")
    folder = read_image_folder(args.data, args.task)
    if Path(args.out).resolve().is_relative_to(Path(args.data).resolve()):
        raise CliError(
            f"--out {args.out} is inside DATA {args.data}, where it would read as data; choose a folder outside"
        )
    # DIR keeps the feature cache across runs: its files are replaced, anything else in it left alone.
    _destination(args.out, folder=True, what="probe --out", overwrite=True, into=True, sources=[args.data])
    return dataclasses.replace(request, folder=folder)


def check_pretrain(args: argparse.Namespace) -> PretrainRequest:
    """Every flag and path of `timm-ls pretrain` (a resumed run's from its record); the request it runs."""
    request = pretrain_request(args)
    for model, kind in ((request.model, VARIANT_FILE), (request.teacher, VARIANT_FILE)):
        _model_source(model, kind)
    for checkpoint in (request.checkpoint, request.teacher_checkpoint):
        _require(CHECKPOINT, checkpoint)
    check_data(request.data)
    problem = run_folder_problem(request, args.overwrite)
    if problem:
        raise CliError(problem)
    return request


def check_run(args: argparse.Namespace) -> None:
    _require("script", args.script)


# Each command's checks; a command with a request of its own gets it back, to run it as parsed here.
CHECKS: dict[str, Callable[[argparse.Namespace], object]] = {
    "convert": check_convert,
    "export": check_export,
    "inspect": check_inspect,
    "demo": check_demo,
    "ablate": check_ablate,
    "run": check_run,
    "features": check_features,
    "probe": check_probe,
    "pretrain": check_pretrain,
    "list": lambda args: None,
}
