"""What the commands share: one-line errors and warnings, model building from a name or YAML file, tables."""

from __future__ import annotations

import ast
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import timm
from torch import nn

from timm_ls.errors import CliError
from timm_ls.logs import quieted
from timm_ls.model_source import ModelSource
from timm_ls.names import is_variant_file

from ..checkpoints import CheckpointError, open_checkpoint
from ..checkpoints.mapping.fit import ReportLine
from ..config import shown
from ..hub import HubError, fetch_hub_weights
from ..identity import identify_checkpoint
from ..variants import VARIANTS, Variant, VariantNameError, find_variant, register_variant, ungated_tag

# The command line's way around the Hub, for the commands that take --checkpoint.
CHECKPOINT_WAY_OUT = "pass the downloaded file instead with --checkpoint FILE"
MAX_KWARG_CHARS = 10_000  # a per-block list of 1024 init values fits


def count(number: int, noun: str) -> str:
    """`1 seed`, `3 seeds`."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def warn(message: str) -> None:
    """A fallback or a doubt about the input: one line on stderr, so stdout stays the result."""
    print(f"timm-ls: warning: {' '.join(message.split())}", file=sys.stderr)


def parse_model_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """`key=value` pairs, each value a Python literal (else the text), for the config's rules to check by name."""
    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--model-kwargs: got {shown(item)}; write each one as key=value, e.g. depth=2")
        if len(value) > MAX_KWARG_CHARS:
            raise CliError(
                f"--model-kwargs: {shown(key)} is {len(value)} characters long; a model argument is a number, a word "
                f"or a list of at most {MAX_KWARG_CHARS} characters"
            )
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # text, or nested past the parser
            kwargs[key] = value
    return kwargs


def register_variant_file(name: str) -> Variant:
    """Registers a user's YAML variant (its name then works everywhere a registered one does)."""
    path = Path(name)
    if not path.is_file():
        raise CliError(
            f"variant file {path} does not exist; pass the path of a YAML variant file or a registered "
            f"name (`timm-ls list`)"
        )
    with warnings.catch_warnings():  # a file may redefine a shipped variant: that is what the user asked
        warnings.simplefilter("ignore")
        return VARIANTS[register_variant(path)]


def resolve_variant(name: str) -> tuple[Variant, str | None]:
    """A registered `NAME[.TAG]`, or the path of a YAML variant file (which is registered first)."""
    if is_variant_file(name):
        return register_variant_file(name), None
    try:
        return find_variant(name, what="variant")
    except VariantNameError as exc:
        raise CliError(str(exc)) from None


@contextmanager
def load_report() -> Iterator[list[ReportLine]]:
    """The package's log lines while a model loads, each with the level it was logged at (`is_warning`); a
    warning's line reads `warning: MESSAGE`."""
    lines: list[ReportLine] = []

    def keep(r: logging.LogRecord) -> None:
        text = r.getMessage()
        lines.append(ReportLine(f"warning: {text}" if r.levelno >= logging.WARNING else text, r.levelno, text))

    handler = logging.Handler(logging.INFO)
    handler.emit = keep
    logger = logging.getLogger("timm_layerscale")
    old = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate = old


def is_warning(line: str) -> bool:
    """Whether a report line was logged as a warning, by its level, never by its words."""
    return isinstance(line, ReportLine) and line.level >= logging.WARNING


def warn_and_keep_the_rest(report: Sequence[str]) -> list[str]:
    """Each warning of a load report on stderr (`warn`); the other lines, for the caller to show or not."""
    for line in report:
        if is_warning(line):
            warn(line.message)
    return [line for line in report if not is_warning(line)]


def build(
    source: ModelSource, variant: Variant, tag: str | None, offline_random: bool = False
) -> tuple[nn.Module, str]:
    """The model a command asked for; `offline_random` (the demo only) builds random weights, with a warning,
    where `--pretrained` finds neither the Hub nor a cached copy, where every other command stops."""
    name = f"{variant.name}.{tag}" if tag else variant.name
    kwargs = parse_model_kwargs(source.model_kwargs)
    if source.checkpoint:
        # The file is checked (what it is, whether it is whole) before timm reads it: errors are one line.
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=source.checkpoint), **kwargs)
        return model, f"checkpoint {source.checkpoint}"
    if not source.pretrained:
        return timm.create_model(name, **kwargs), "random init (no --checkpoint or --pretrained given)"
    tag = tag or next(iter(variant.tags), None)
    cfg = timm.models.get_pretrained_cfg(f"{variant.name}.{tag}") if tag else None
    if cfg is None or not cfg.hf_hub_id:
        raise CliError(f"{variant.name} has no pretrained weights on the Hub; pass --checkpoint PATH instead")
    # the one Hub request; a gated repo or a missing file is its one-line error, not huggingface_hub's retries
    try:
        with quieted("huggingface_hub"):
            weights = fetch_hub_weights(cfg, cache_dir=kwargs.get("cache_dir"), ungated=ungated_tag(variant, tag))
    except HubError as exc:
        if exc.unreachable is None:
            raise exc.instead(CHECKPOINT_WAY_OUT) from None
        offline = (
            f"--pretrained: the Hub is not reachable ({exc.unreachable}) and {cfg.hf_hub_id} is not in the local cache"
        )
        if not offline_random:
            raise CliError(f"{offline}; {CHECKPOINT_WAY_OUT}") from None
        warn(f"{offline}; using random weights instead")
        fallback = "random init, because the Hub is not reachable (see the warning above)"
        return timm.create_model(name, **kwargs), fallback
    overlay = dict(file=str(weights.path))
    model = timm.create_model(f"{variant.name}.{tag}", pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    return model, weights.origin


def build_from_checkpoint(source: ModelSource, name: str | None) -> tuple[nn.Module, str, str]:
    """The model a checkpoint holds, by the one identity rule of convert, export and inspect (`--model` >
    what it records > its family > its shapes, then `--model-kwargs`), with its weights: the model, where its
    weights come from (and why that variant), and its name."""
    if name is not None:
        variant, tag = resolve_variant(name)  # a YAML file is registered first
        name = f"{variant.name}.{tag}" if tag else variant.name
    kwargs = parse_model_kwargs(source.model_kwargs)
    try:
        with open_checkpoint(source.checkpoint) as ckpt:
            found = identify_checkpoint(ckpt, name, kwargs).model
    except CheckpointError as exc:
        raise CliError(str(exc)) from None
    overlay = {**found.pretrained_cfg, "file": str(source.checkpoint)}
    model = timm.create_model(
        found.full_name, pretrained=True, pretrained_cfg_overlay=overlay, **found.config.rebuild_args()
    )
    return model, f"checkpoint {source.checkpoint} ({found.reason})", found.full_name


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])
