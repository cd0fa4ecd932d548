"""torch.distributed.checkpoint folders, read one tensor at a time in one process, with nothing unpickled freely.

DCP writes a `.metadata` pickle (what each key is and where its chunks lie) beside `__<rank>_<n>.distcp` data
files. torch's own reader unpickles `.metadata` with `pickle.load` and non-tensor items with
`weights_only=False`; here `.metadata` goes through an unpickler that knows only DCP's metadata classes and
bounds its work (unpickler.py), what it made is checked against one schema before any use
(schema.py), and only tensor items are ever requested (each is read by DCP with
`torch.load(weights_only=True)`).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, reason, torch_load_error
from .schema import LIMITS, Limits, Work, check_metadata
from .unpickler import MetadataUnpickler, Refused

__all__ = [
    "METADATA_FILE",
    "MetadataUnpickler",
    "read_metadata",
    "stored_files",
    "tensor_items",
    "tensor_reader",
    "tensors_only_planner",
]

METADATA_FILE = ".metadata"
# torch.distributed.checkpoint is imported inside the functions that use it: its import takes about 0.4 s,
# which every `import timm` would pay (the start-up hook imports this package) to read a folder few loads read.


def read_metadata(folder: Path, limits: Limits = LIMITS, work: Work | None = None) -> Any:
    """The folder's DCP `Metadata`, unpickled within `limits` and checked against the schema (schema.py);
    `work`, where given, counts what the read did."""
    path = folder / METADATA_FILE
    work = work if work is not None else Work()
    size = path.stat().st_size
    if size > limits.metadata_bytes:
        raise CheckpointError(
            f"{path} is {size} bytes, more than any distributed checkpoint metadata ({limits.metadata_bytes}); "
            f"the checkpoint is corrupt: copy the whole folder again"
        )
    try:
        metadata = MetadataUnpickler(io.BytesIO(path.read_bytes()), limits, work).load()
    except Refused as exc:
        raise CheckpointError(f"refused to read {path}: it {exc}; use a checkpoint you trust") from exc
    except Exception as exc:  # any unpickling failure: truncated, corrupt, another pickle
        detail = type(exc).__name__ + (f": {reason(exc)}" if str(exc) else "")
        raise CheckpointError(
            f"{path} is not readable distributed checkpoint metadata ({detail}); the checkpoint is truncated or "
            f"corrupt: copy the whole folder again"
        ) from exc
    check_metadata(metadata, folder, limits, work)
    return metadata


def tensor_items(metadata: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every tensor item; bytes items (iteration, param groups, ...) are left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: (torch.Size(item.size), item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def stored_files(folder: Path, metadata: Any) -> tuple[Path, ...]:
    """The files a read of the folder opens: `.metadata` and every data file it lists."""
    return (folder / METADATA_FILE, *(folder / name for name in sorted(_data_files(metadata))))


def _data_files(metadata: Any) -> set[str]:
    return {info.relative_path for info in metadata.storage_data.values()}


def tensors_only_planner(folder: Path) -> Any:
    """DCP's default load planner, refusing any bytes item: DCP unpickles those with weights_only=False."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise CheckpointError(f"refused to read {read_item.dest_index.fqn} from {folder}: it is not a tensor")

    # The state dicts read here are flat: without flattening, the planner does not build the set of every
    # key of the checkpoint for each tensor read (which made reading all N tensors take N^2 steps).
    return TensorsOnly(flatten_state_dict=False)


# DCP's file reader unpickles each tensor item with `torch.load`, whose default is weights_only=True from
# torch 2.6 on; before it, a tensor item of a folder could run code when read. This variable turns that default
# off in torch.load (where a call leaves weights_only unset, as DCP's reader may), with the same truth values.
SAFE_TENSOR_READS_SINCE = (2, 6)
UNSAFE_DEFAULT_VARIABLE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
TORCH_TRUE_VALUES = ("1", "y", "yes", "true")


def tensor_reader(folder: Path, metadata: Any) -> Callable[[str], torch.Tensor]:
    """`read(key)` loads that one tensor item with DCP's own file reader and planner, without a process group."""
    if torch.torch_version.TorchVersion(torch.__version__) < SAFE_TENSOR_READS_SINCE:
        raise CheckpointError(
            f"{folder} is a distributed checkpoint, whose tensors torch {torch.__version__} reads with "
            f"weights_only=False (code in the file would run); upgrade torch to 2.6 or newer to read it"
        )
    if os.environ.get(UNSAFE_DEFAULT_VARIABLE, "0").lower() in TORCH_TRUE_VALUES:
        raise CheckpointError(
            f"{folder} is a distributed checkpoint, and {UNSAFE_DEFAULT_VARIABLE} is set, which makes torch read its "
            f"tensors with weights_only=False (code in the file would run); unset it to read the folder"
        )
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException

    items = tensor_items(metadata)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata  # parsed once, by the restricted unpickler

    def read(key: str) -> torch.Tensor:
        shape, dtype = items[key]
        target = {key: torch.empty(shape, dtype=dtype)}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                load(target, storage_reader=Reader(folder), planner=tensors_only_planner(folder), no_dist=True)
        except CheckpointException as exc:  # DCP wraps what failed, per rank
            failure = next(iter(exc.failures.values()))[0]
            raise _read_error(folder, key, failure) from failure
        except Exception as exc:
            raise _read_error(folder, key, exc) from exc
        return target[key]

    return read


def _read_error(folder: Path, key: str, exc: BaseException) -> CheckpointError:
    return torch_load_error(
        folder, exc, f"distributed checkpoint: its tensor {key} failed", "copy the whole folder again"
    )
