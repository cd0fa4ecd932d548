"""torch.distributed.checkpoint folders, read one tensor at a time in one process, with nothing unpickled freely.

DCP writes a `.metadata` pickle (what each key is and where its chunks lie) beside `__<rank>_<n>.distcp` data
files. torch's own reader unpickles `.metadata` with `pickle.load` and non-tensor items with
`weights_only=False`; here `.metadata` goes through an unpickler that knows only DCP's metadata classes, and
only tensor items are ever requested (each is read by DCP with `torch.load(weights_only=True)`).
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from .errors import CheckpointError, torch_load_error

METADATA_FILE = ".metadata"


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(metadata, name)
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout
    # StorageMeta.checkpoint_id: the path it was saved to, kept as a pure path (no file system access).
    for name in ("PosixPath", "PurePosixPath"):
        allowed[("pathlib", name)] = PurePosixPath
    for name in ("WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = PureWindowsPath
    return allowed


def _layout(name: str) -> torch.layout:
    layout = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layout


class _Refused(pickle.UnpicklingError):
    pass


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its dataclasses, torch dtypes and sizes; any other global is refused unrun."""

    def __init__(self, file: io.BufferedIOBase) -> None:
        super().__init__(file)
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return self._allowed[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r}")


def read_metadata(folder: Path) -> Any:
    """The folder's DCP `Metadata`, checked: every item's file lies in the folder, every tensor fully covered."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = folder / METADATA_FILE
    try:
        with path.open("rb") as f:
            metadata = MetadataUnpickler(f).load()
    except _Refused as exc:
        raise CheckpointError(
            f"refused to read {path}: it asks for {exc}, which distributed checkpoint metadata never holds, so it "
            f"could run code (nothing was run); use a checkpoint you trust"
        ) from exc
    except Exception as exc:  # any unpickling failure: truncated, corrupt, another pickle
        raise CheckpointError(
            f"{path} is not readable distributed checkpoint metadata ({type(exc).__name__}: {exc}); the "
            f"checkpoint is truncated or corrupt: copy the whole folder again"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not distributed checkpoint metadata; pass a folder "
            f"written by torch.distributed.checkpoint.save"
        )
    _check_metadata(metadata, folder)
    return metadata


def _check_metadata(metadata: Any, folder: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    where = folder / METADATA_FILE
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{where} lists no stored items; the metadata is corrupt: copy the whole folder again")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name:
            raise CheckpointError(f"{where} puts {index.fqn} in {name!r}, outside the folder; the metadata is corrupt")
    for name in sorted({info.relative_path for info in storage.values()}):
        if not (folder / name).is_file():  # also "", "." and "..": the folder or its parent
            raise CheckpointError(f"{folder} lacks {name}, which its {METADATA_FILE} lists; copy the whole folder")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        stored = all(MetadataIndex(key, chunk.offsets) in storage for chunk in item.chunks)
        if not stored or sum(math.prod(chunk.sizes) for chunk in item.chunks) != math.prod(item.size):
            raise CheckpointError(
                f"{where} does not cover all of {key} {list(item.size)} with stored chunks; the metadata is "
                f"corrupt: copy the whole folder again"
            )


def tensor_items(metadata: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every tensor item; bytes items (iteration, param groups, ...) are left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: (torch.Size(item.size), item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def tensor_reader(folder: Path, metadata: Any) -> Callable[[str], torch.Tensor]:
    """`read(key)` loads that one tensor item with DCP's own file reader and planner, without a process group."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    items = tensor_items(metadata)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata  # parsed once, by the restricted unpickler

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DCP unpickles bytes items with weights_only=False: never let one through.
            raise CheckpointError(f"refused to read {read_item.dest_index.fqn} from {folder}: it is not a tensor")

    def read(key: str) -> torch.Tensor:
        shape, dtype = items[key]
        target = {key: torch.empty(shape, dtype=dtype)}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                load(target, storage_reader=Reader(folder), planner=TensorsOnly(), no_dist=True)
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
