"""A pretraining run's checkpoint, `OUT/checkpoint/`: the method's tensors and the optimiser's state in
`training.safetensors`, everything else (the step, the run's settings, the optimiser's groups) in
`training.json`. Nothing is unpickled to resume, and the folder is replaced whole or not at all."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from ..checkpoints.write.writers import atomic_destination, write_safetensors, write_text

CHECKPOINT_DIR = "checkpoint"
TENSORS_FILE = "training.safetensors"
STATE_FILE = "training.json"
FILES = (TENSORS_FILE, STATE_FILE)
FORMAT = "timm-layerscale pretrain checkpoint 1"


@dataclass(frozen=True)
class Saved:
    """A checkpoint read back: the last step done, the run's settings, and the tensors to load."""

    step: int
    settings: dict[str, Any]
    method: dict[str, Tensor]
    optimizer: dict[str, Any]


def optimizer_tensors(state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """An optimiser's `state_dict` split: its per-parameter tensors by `optim.INDEX.NAME`, and the rest (the
    groups, and per-parameter values that are not tensors) as JSON values."""
    tensors, plain = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{index}.{name}"] = value.detach().contiguous()
            else:
                plain[f"{index}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "values": plain}


def optimizer_state(tensors: Mapping[str, Tensor], plain: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            index, name = key.removeprefix("optim.").split(".", 1)
            state.setdefault(int(index), {})[name] = value
    for key, value in plain["values"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": plain["param_groups"]}


def save_checkpoint(
    out: Path, method: nn.Module, optimizer: torch.optim.Optimizer, step: int, settings: Mapping[str, Any]
) -> Path:
    """Writes `out/checkpoint/` after step `step` (0-based, done), replacing the one before as a whole."""
    tensors = {f"method.{k}": v.detach().contiguous() for k, v in method.state_dict().items()}
    optim, plain = optimizer_tensors(optimizer.state_dict())
    record = {"format": FORMAT, "step": step, "settings": dict(settings), "optimizer": plain}
    folder = Path(out) / CHECKPOINT_DIR
    with atomic_destination(folder, overwrite=True, folder=True, what="the checkpoint", ours=FILES) as tmp:
        write_safetensors(tmp / TENSORS_FILE, {**tensors, **optim})
        write_text(tmp / STATE_FILE, json.dumps(record, indent=1))
    return folder


def checkpoint_folder(path: Path) -> Path:
    """A run's folder or its `checkpoint/` -> the checkpoint folder."""
    path = Path(path)
    return path if (path / STATE_FILE).is_file() else path / CHECKPOINT_DIR


def read_settings(path: Path) -> tuple[int, dict[str, Any]]:
    """The step and the run's settings of a checkpoint, without its tensors: a `ValueError` where the folder
    holds no checkpoint of ours."""
    folder = checkpoint_folder(path)
    state_file = folder / STATE_FILE
    if not state_file.is_file() or not (folder / TENSORS_FILE).is_file():
        raise ValueError(f"{path} holds no pretraining checkpoint ({CHECKPOINT_DIR}/{STATE_FILE}): pass a run's --out")
    try:
        record = json.loads(state_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{state_file} is not a checkpoint record ({exc}): pass a run's --out") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("step"), int):
        raise ValueError(f"{state_file} is not a {FORMAT!r} record: pass a run's --out")
    return record["step"], record


def load_checkpoint(path: Path) -> Saved:
    step, record = read_settings(path)
    tensors = load_file(str(checkpoint_folder(path) / TENSORS_FILE))
    method = {k.removeprefix("method."): v for k, v in tensors.items() if k.startswith("method.")}
    return Saved(step, record["settings"], method, optimizer_state(tensors, record["optimizer"]))
