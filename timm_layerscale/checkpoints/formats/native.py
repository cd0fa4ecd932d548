"""This package's own folders: `model.safetensors` in the native keys (Meta's, plus a classifier head) and
timm's `config.json` naming a shipped `vit_ls` architecture with every model argument, so `local-dir:` and
`hf-hub:` rebuild the exact model. What `--to native`, `save_native` and `push_to_hub` write.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from timm_ls.names import NATIVE_SPEC

from ...config import VitLsConfig
from ..mapping.keys import KeyTable, row
from ..write.writers import Progress, atomic_destination, write_safetensors, write_text
from .base import (
    CONFIG_FILE,
    NATIVE_KEYS,
    WEIGHTS_FILE,
    Format,
    Job,
    PreparedWrite,
    SourceConfig,
    native_keys,
    pretrained_cfg_fields,
    pretrained_cfg_of,
)

Tensor = torch.Tensor


def native_config(config: VitLsConfig, architecture: str, pretrained_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """timm's config.json for this package's weights. Every model arg is written, so the folder does not depend
    on the variant's YAML defaults of the day."""
    return {
        "architecture": architecture,
        "num_classes": config.num_classes,
        "num_features": config.embed_dim,
        "global_pool": config.global_pool,
        "model_args": config.rebuild_args(),
        "pretrained_cfg": pretrained_cfg_fields(pretrained_cfg, config.num_classes),
    }


def write_native_files(
    folder: Path,
    tensors: Mapping[str, Tensor],
    config: VitLsConfig,
    architecture: str,
    pretrained_cfg: Mapping[str, Any],
    progress: Progress | None = None,
) -> None:
    write_safetensors(folder / WEIGHTS_FILE, tensors, progress=progress)
    write_text(folder / CONFIG_FILE, json.dumps(native_config(config, architecture, pretrained_cfg), indent=2))


def write_native_folder(
    folder: Path,
    tensors: Mapping[str, Tensor],
    config: VitLsConfig,
    architecture: str,
    pretrained_cfg: Mapping[str, Any],
    overwrite: bool = False,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Writes `model.safetensors` and timm's `config.json` for `tensors` (native keys, a plan or a state dict),
    and `extra_files` (name -> text, a model card), under a temporary name renamed to `folder` when complete."""
    folder = Path(folder)
    with atomic_destination(folder, overwrite, folder=True, what="save_native", ours=Native.spec.files) as tmp:
        write_native_files(tmp, tensors, config, architecture, pretrained_cfg)
        for name, text in (extra_files or {}).items():
            write_text(tmp / name, text)
    return folder


class Native(Format):
    spec = NATIVE_SPEC
    title = "timm-layerscale keys"
    table = KeyTable(tuple(row(key, key) for key in NATIVE_KEYS))

    def recognise(self, keys: Sequence[str]) -> bool:
        return native_keys(keys) and any(key.startswith("head.") for key in keys)

    def names_config(self, cfg: Mapping[str, Any]) -> bool:
        """Whether a config.json is this format's: a vit_ls architecture with its model args."""
        return isinstance(cfg.get("model_args"), dict) and str(cfg.get("architecture", "")).startswith("vit_ls")

    def read_config(self, cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> SourceConfig | None:
        if not self.names_config(cfg):
            return None
        fields = set(VitLsConfig.field_names())
        args = {k: v for k, v in cfg["model_args"].items() if k in fields}
        for name, value in args.items():  # as the file gives them, before any is used
            VitLsConfig.check_value(name, value, f"{where}: model_args")
        return SourceConfig(args, pretrained_cfg_of(cfg, where), str(cfg["architecture"]))

    def prepare_write(self, job: Job) -> PreparedWrite:
        tensors, config = job.tensors, job.config
        self.holding(config)  # every shipped family's record names native; one added may not

        def write(tmp: Path, bar: Progress | None) -> None:
            write_native_files(tmp, tensors, config, job.architecture, job.pretrained_cfg, bar)

        return PreparedWrite(tensors, write, [], [])


NATIVE = Native()
