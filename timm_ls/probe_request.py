"""What `timm-ls probe` is asked, parsed once in the command's front (torch-free) and handed to the package:
the blocks each row reads (`--layer`), the tokens its logistic regression reads (`--tokens`), the sizes and
seeds of the run. The package's probe takes this request and never re-reads the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from .errors import CliError
from .image_folder import ImageFolder
from .layer_sets import LAYER_SETS, feature_layers
from .model_source import ModelSource

TOKENS = ("cls", "avgpool", "cls+avgpool")  # what the logistic regression may read
KNN_TOKENS = "cls"  # what the kNN reads, always: the CLS token, as Meta's kNN evaluation does


@dataclass(frozen=True)
class LayerChoice:
    """One `--layer` value: a block index (`index`, negative from the end) or a layer-set name (`text`);
    `text` is what the user wrote, the row's label."""

    text: str
    index: int | None = None

    def blocks(self, depth: int) -> list[int]:
        """The block indices this choice reads in a model of `depth` blocks, in order."""
        if self.index is None:
            return list(feature_layers(self.text, depth))
        index = self.index + depth if self.index < 0 else self.index
        if not 0 <= index < depth:
            raise ValueError(
                f"--layer {self.text}: the model has {depth} blocks; pass 0 to {depth - 1}, -1 or a layer set"
            )
        return [index]


def parse_layer(text: str) -> LayerChoice:
    """One `probe --layer` value, or one line naming what it takes."""
    if text in LAYER_SETS:
        return LayerChoice(text)
    try:
        return LayerChoice(text, int(text))
    except ValueError:
        raise CliError(
            f"--layer: got {text!r}; pass a block index (0 is the first, -1 the last), {', '.join(LAYER_SETS)}"
        ) from None


@dataclass(frozen=True)
class ProbeRequest:
    """Every flag of `timm-ls probe`, checked and typed."""

    data: Path
    out: Path
    task: str
    models: tuple[str | None, ...]
    source: ModelSource
    layers: tuple[LayerChoice, ...]
    tokens: str
    val_split: float
    seed: int
    batch: int
    strict: bool
    max_iter: int
    steps: int
    pictures: int
    dtype: str
    device: str
    threads: int | None
    folder: ImageFolder | None = None  # DATA as read by the front's check


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (("--batch", args.batch), ("--steps", args.steps), ("--max-iter", args.max_iter)):
        if value < 1:
            raise CliError(f"{flag}: got {value}; pass 1 or more")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads: got {args.threads}; pass 1 or more")
    if args.pictures < 0:
        raise CliError(f"--pictures: got {args.pictures}; pass 0 or more")
    if not 0 < args.val_split < 1:
        raise CliError(f"--val-split: got {args.val_split}; pass the held-out part of train, between 0 and 1")


def probe_request(args: argparse.Namespace) -> ProbeRequest:
    """The request `args` make: `--layer`, `--tokens` and the counts checked here, once (the paths and the
    choices shared with other commands are the front's checks)."""
    if args.tokens not in TOKENS:
        raise CliError(f"unknown token choice {args.tokens!r}; pass --tokens one of {', '.join(TOKENS)}")
    layers = tuple(parse_layer(text) for text in args.layer or ["last"])
    _check_counts(args)
    return ProbeRequest(
        data=Path(args.data),
        out=Path(args.out),
        task=args.task,
        models=tuple(args.model or [None]),
        source=ModelSource.of(args),
        layers=layers,
        tokens=args.tokens,
        val_split=args.val_split,
        seed=args.seed,
        batch=args.batch,
        strict=args.strict,
        max_iter=args.max_iter,
        steps=args.steps,
        pictures=args.pictures,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
    )
