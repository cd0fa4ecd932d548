"""The checkpoint formats, one module each, and their registry: by name for writing, by recognition for reading.

| format | module | files | config |
|---|---|---|---|
| native | native.py | `model.safetensors` | timm `config.json`: a shipped vit_ls architecture and every model arg |
| meta | meta.py | one `.pth` (or `.safetensors`) | none (Meta's code builds the model) |
| meta-train | meta_train.py | `{"teacher": ...}` `.pth`, or a DCP folder (`model.*`) | Meta's training YAML (printed) |
| hf | hf.py | `model.safetensors` (sharded above 5 GB, with an index) | transformers `config.json` |
| timm | timm.py | `model.safetensors` | timm `config.json`: eva's architecture of the family (`_qkvb` for q/v biases) |
| sapiens2 | sapiens2.py | one `.pth` (or `.safetensors`) | none (upstream's code builds the model) |

Adding a format is one module with a `Format` subclass and one `register_format` call; convert, export, inspect
and loading find it by name or by recognition.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..mapping.gamma_keys import register_spelling
from .base import CONFIG_FILE, WEIGHTS_FILE, Format, Job, PreparedWrite, SourceConfig
from .foreign import foreign_family
from .hf import HF
from .meta import META, native_keys
from .meta_train import META_TRAIN
from .native import NATIVE
from .sapiens2 import SAPIENS2
from .timm import TIMM

__all__ = [
    "CONFIG_FILE",
    "FORMATS",
    "WEIGHTS_FILE",
    "Format",
    "Job",
    "PreparedWrite",
    "SourceConfig",
    "get_format",
    "recognise",
    "register_format",
    "source_config",
    "target_format",
]

FORMATS: dict[str, Format] = {}  # by name, in the order the command lists them
# The order recognition asks the shipped formats in: the most specific keys first (eva's and transformers'
# names, then a native file's head, then Meta's own keys). Formats registered later are asked before them.
SHIPPED_RECOGNITION = ("sapiens2", "timm", "hf", "native", "meta")


def register_format(added: Format) -> Format:
    """Adds a format: `convert_checkpoint(..., to=added.name)` writes it, files it `recognise`s are read (as the
    family its keys say, `family_of_keys`), and reports read LayerScale in its spelling."""
    if not isinstance(added, Format):
        raise TypeError(f"register_format takes a Format, got {type(added).__name__}")
    register_spelling(added.gamma_spelling, added.gamma_pattern)
    FORMATS[added.name] = added
    return added


for _shipped in (NATIVE, META, META_TRAIN, HF, TIMM, SAPIENS2):
    register_format(_shipped)


def get_format(name: str) -> Format:
    candidate = FORMATS.get(name)
    if candidate is None:
        raise CheckpointError(f"unknown target {name!r}; pass --to one of {', '.join(FORMATS)}")
    return candidate


def target_format(
    name: str, options: Mapping[str, Any], dst: Path | None = None, overwrite: bool = False
) -> tuple[Format, dict[str, Any]]:
    """The format `name` with its own options checked (and parsed), and, given `dst`, the destination it is to
    write checked by the one rule; an option no format of that name takes is one line naming who takes it."""
    candidate = get_format(name)
    unknown = [option for option, value in options.items() if option not in candidate.takes and value]
    if unknown:
        takers = [f.name for f in FORMATS.values() if unknown[0] in f.takes]
        raise CheckpointError(f"{unknown[0]} is an option of {' and '.join(takers) or 'no format'}, not of {name}")
    if dst is not None:
        candidate.check_destination(dst, overwrite)
    return candidate, candidate.check_options(
        {**candidate.takes, **{k: v for k, v in options.items() if k in candidate.takes}}
    )


def recognise(source: Mapping[str, torch.Tensor]) -> Format:
    """The format of a checkpoint's keys, or a `CheckpointError` naming what it is instead."""
    foreign = foreign_family(source)
    if foreign:
        raise CheckpointError(foreign)
    keys = list(source)
    config = getattr(source, "hub_config", None)
    if isinstance(config, Mapping) and NATIVE.names_config(config) and native_keys(keys):
        return NATIVE  # this package's folder, written without a head (num_classes=0): Meta's keys, our config
    added = [candidate for name, candidate in FORMATS.items() if name not in SHIPPED_RECOGNITION]
    for candidate in (*added, *(FORMATS[name] for name in SHIPPED_RECOGNITION)):
        if candidate.recognise(keys):
            return candidate
    raise CheckpointError(
        f"unrecognised checkpoint format (first keys: {', '.join(keys[:4])}); expected Meta DINOv3, "
        f"transformers DINOv3ViT/Sapiens2, timm eva or Sapiens2 weights"
    )


def source_config(cfg: Mapping[str, Any] | None, where: str = CONFIG_FILE) -> SourceConfig | None:
    """What a config.json beside a checkpoint says of its model, read by the format it belongs to."""
    for candidate in FORMATS.values():
        found = candidate.read_config(cfg or {}, where) if cfg else None
        if found is not None:
            return found
    return None
