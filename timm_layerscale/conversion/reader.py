"""One lazy reader for every checkpoint source: tensors are read one key at a time, never all at once.

`open_checkpoint(path)` picks one weights set of the file (EMA/teacher or raw), strips the wrappers around
the backbone (`module.`, `backbone.`, ...) and drops pretraining heads, so its keys are a backbone state
dict in whatever layout the file was saved in. Shapes and dtypes are known before any tensor is read.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from .errors import CheckpointError

Weights = Literal["auto", "ema", "raw"]

# Weights sets a training checkpoint may hold, as top-level names, best first.
EMA_SETS = ("model_ema", "teacher", "state_dict_ema")
RAW_SETS = ("student", "state_dict", "model")
# Other top-level names of training checkpoints: a file whose top level is only these and sets is a container.
TRAINING_STATE = ("optimizer", "scheduler", "lr_scheduler", "scaler", "grad_scaler", "iteration", "epoch", "args")
# Prefixes that wrap a backbone in training checkpoints, DDP and torch.compile models.
WRAPPER_PREFIXES = ("module.", "backbone.", "_orig_mod.")
# Keys of pretraining heads and other parts no backbone holds.
TRAINING_ONLY = re.compile(r"^(dino_head|ibot_head|dino_loss|ibot_patch_loss|koleo_loss|projectors|gram)\.")


@dataclass(frozen=True)
class TensorInfo:
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of one weights set of a checkpoint. `ckpt[key]` reads that tensor only.

    `kind` says what the source is, `weights` which set was taken; `info(key)` gives the shape and dtype
    without reading. Use it as a context manager, or `close()` it, to release the files.
    """

    def __init__(
        self,
        path: Path,
        kind: str,
        weights: str,
        infos: dict[str, TensorInfo],
        read: Callable[[str], torch.Tensor],
        close: Callable[[], None] = lambda: None,
        hub_config: dict[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.kind = kind
        self.weights = weights
        self.hub_config = hub_config
        self._infos = infos
        self._read = read
        self._close = close

    def info(self, key: str) -> TensorInfo:
        return self._infos[key]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._infos:
            raise KeyError(key)
        return self._read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self._infos.values())

    def close(self) -> None:
        self._close()

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def select_weights(keys: list[str], weights: Weights, source: str) -> tuple[str, dict[str, str]]:
    """Picks one weights set among flat keys; returns its name and {backbone key: flat key}.

    A training checkpoint nests weights sets under top-level names (`teacher.`, `state_dict_ema.`, ...);
    anything else at the top level (`blocks.`, `embeddings.`, `module.`) makes the file one plain set.
    """
    top = {k.split(".", 1)[0] for k in keys}
    sets = (*EMA_SETS, *RAW_SETS)
    container = top & set(sets) and all(t in sets or t in TRAINING_STATE or TRAINING_ONLY.match(t + ".") for t in top)
    ema = [s for s in EMA_SETS if container and s in top]
    raw = [s for s in RAW_SETS if container and s in top]
    if weights == "ema" and not ema:
        raise CheckpointError(f"{source} holds no EMA or teacher weights; pass --weights raw (or auto)")
    if weights == "raw" and container and not raw:
        raise CheckpointError(f"{source} holds only EMA or teacher weights; pass --weights ema (or auto)")
    if not container:
        return "the only weights set", _strip_wrappers({k: k for k in keys})
    chosen = (ema if weights != "raw" and ema else raw)[0]
    prefix = chosen + "."
    return chosen, _strip_wrappers({k[len(prefix) :]: k for k in keys if k.startswith(prefix)})


def _strip_wrappers(keys: dict[str, str]) -> dict[str, str]:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            inside = [k for k in keys if k.startswith(prefix)]
            if inside and len(inside) >= len(keys) // 2:
                keys = {k[len(prefix) :]: v for k, v in keys.items() if k.startswith(prefix)}
                changed = True
    return {k: v for k, v in keys.items() if not TRAINING_ONLY.match(k)}


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix.rstrip("."), tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")


def _open_tree(tree: Any, weights: Weights, source: str) -> LazyCheckpoint:
    flat = dict(_flatten(tree))
    if not flat:
        got = type(tree).__name__ + (
            f" with keys {', '.join(map(str, list(tree)[:5]))}" if isinstance(tree, Mapping) else ""
        )
        raise CheckpointError(
            f"{source} holds no tensors (got {got}); pass a file of model weights (.safetensors or a torch state dict)"
        )
    taken, keys = select_weights(list(flat), weights, source)
    infos = {k: TensorInfo(flat[f].shape, flat[f].dtype) for k, f in keys.items()}
    return LazyCheckpoint(Path(source), "state dict", taken, infos, lambda k: flat[keys[k]])


def _open_safetensors(path: Path, weights: Weights) -> LazyCheckpoint:
    handle = safe_open(str(path), framework="pt")
    flat = list(handle.keys())
    taken, keys = select_weights(flat, weights, str(path))
    infos = {}
    for key, flat_key in keys.items():
        view = handle.get_slice(flat_key)
        infos[key] = TensorInfo(torch.Size(view.get_shape()), _SAFETENSORS_DTYPES[view.get_dtype()])
    return LazyCheckpoint(path, "safetensors file", taken, infos, lambda k: handle.get_tensor(keys[k]))


def _open_torch(path: Path, weights: Weights) -> LazyCheckpoint:
    # mmap: tensors stay in the file's pages until a conversion touches them.
    with torch.serialization.safe_globals([argparse.Namespace]):  # timm's train.py saves its args
        tree = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    checkpoint = _open_tree(tree, weights, str(path))
    checkpoint.path, checkpoint.kind = path, "torch file"
    return checkpoint


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def open_checkpoint(source: str | Path | Mapping[str, Any], weights: Weights = "auto") -> LazyCheckpoint:
    """Opens a checkpoint lazily: `.safetensors`, a torch file (`.pth`, `.bin`, `.pt`, timm's `.pth.tar`),
    or an already loaded (possibly nested) state dict."""
    if isinstance(source, Mapping):
        return _open_tree(source, weights, "the checkpoint")
    path = Path(source)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; pass the path of a .safetensors or .pth file")
    with path.open("rb") as f:
        head = f.read(8)
    if head[:2] == b"PK":
        return _open_torch(path, weights)
    return _open_safetensors(path, weights)
