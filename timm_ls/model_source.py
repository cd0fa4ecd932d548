"""Where a command's model and its weights come from, as the package's loaders take it: torch-free, so the
front makes it from the flags and the loaders never see the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSource:
    """`--checkpoint PATH` or `--pretrained` (never both; neither: random init) and `--model-kwargs K=V ...`."""

    checkpoint: str | None = None
    pretrained: bool = False
    model_kwargs: tuple[str, ...] = ()

    @classmethod
    def of(cls, args: argparse.Namespace) -> ModelSource:
        """The source a command's parsed flags name (a command without `--model-kwargs` passes none)."""
        return cls(args.checkpoint, bool(args.pretrained), tuple(getattr(args, "model_kwargs", None) or ()))
