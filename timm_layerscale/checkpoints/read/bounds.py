"""What a checkpoint may list and say of itself, bounded: its count of entries, checked before any per-entry work,
and its config.json, read only at a config's size and nesting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, reason
from . import dcp

# Entries a checkpoint may list: far above any model of ours with its training state (a 7B's model, EMA and
# optimizer: some 5000), so a header of many more is refused by its count before any per-entry work.
MAX_ENTRIES = dcp.LIMITS.keys
CONFIG_MAX_BYTES = 1 << 24  # transformers' and timm's config.json are a few kilobytes


def check_count(entries: int, path: Path) -> None:
    if entries > MAX_ENTRIES:
        raise CheckpointError(
            f"{path} lists {entries} tensors, more than any checkpoint of these models holds ({MAX_ENTRIES}); the "
            f"file is corrupt or not a ViT checkpoint: save or download it again"
        )


def read_config_json(path: Path) -> dict[str, Any]:
    """A Hub folder's config.json as a mapping, or one line saying why it is none."""
    size = path.stat().st_size
    if size > CONFIG_MAX_BYTES:
        raise CheckpointError(
            f"{path} is {size} bytes, more than a model config holds ({CONFIG_MAX_BYTES}); download it again"
        )
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError, RecursionError) as exc:  # RecursionError: nested past the parser
        raise CheckpointError(f"{path} is not valid JSON ({reason(exc)}); download it again") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a model config (a JSON object); download it again")
    return config
