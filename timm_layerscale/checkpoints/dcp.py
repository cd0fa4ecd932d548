"""torch.distributed.checkpoint folders, read one tensor at a time in one process, with nothing unpickled freely.

DCP writes a `.metadata` pickle (what each key is and where its chunks lie) beside `__<rank>_<n>.distcp` data
files. torch's own reader unpickles `.metadata` with `pickle.load` and non-tensor items with
`weights_only=False`; here `.metadata` goes through an unpickler that knows only DCP's metadata classes, and
only tensor items are ever requested (each is read by DCP with `torch.load(weights_only=True)`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import reprlib
import types
import warnings
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from .errors import CheckpointError, torch_load_error

METADATA_FILE = ".metadata"
# torch.distributed.checkpoint is imported inside the functions that use it: its import takes about 0.4 s,
# which every `import timm` would pay (the start-up hook imports this package) to read a folder few loads read.


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in _dataclasses()
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = metadata._MEM_FORMAT_ENCODING
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout
    # StorageMeta.checkpoint_id: the path it was saved to, kept as a pure path (no file system access).
    for name in ("PosixPath", "PurePosixPath"):
        allowed[("pathlib", name)] = PurePosixPath
    for name in ("WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = PureWindowsPath
    return allowed


def _dataclasses() -> tuple[type, ...]:
    """The classes whose instances DCP metadata holds: each made empty (NEWOBJ), then given its fields (BUILD)."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
    )
    return (*(getattr(metadata, name) for name in names if hasattr(metadata, name)), filesystem._StorageInfo)


def _layout(name: str) -> torch.layout:
    layout = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layout


def _calls() -> tuple[tuple[Callable[..., Any], Callable[[tuple[Any, ...]], bool]], ...]:
    """What REDUCE may call, each with the only arguments DCP's pickles pass it."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    def one(kind: type) -> Callable[[tuple[Any, ...]], bool]:
        return lambda args: len(args) == 1 and type(args[0]) is kind

    def strings(args: tuple[Any, ...]) -> bool:
        return all(type(a) is str for a in args)

    def size(args: tuple[Any, ...]) -> bool:
        return len(args) == 1 and type(args[0]) is tuple and all(type(n) is int for n in args[0])

    return (
        (torch.Size, size),
        (_layout, one(str)),
        (_MEM_FORMAT_ENCODING, one(int)),
        (PurePosixPath, strings),
        (PureWindowsPath, strings),
    )


class _Refused(pickle.UnpicklingError):
    pass


def _named(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.ModuleType):
        return f"the module {obj.__name__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"the function {getattr(obj, '__module__', None)}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def _never(what: str) -> _Refused:
    return _Refused(f"{what}, which distributed checkpoint metadata never does (nothing was changed)")


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata and nothing else: its dataclasses, torch dtypes, sizes and pure paths.

    Any other global is refused unrun. pickle's pure-Python unpickler, so that each operation is checked
    before it runs: only DCP's dataclasses are instantiated (empty, then BUILD gives each instance, once, a
    state of its own fields), REDUCE calls only torch.Size, the layout and memory-format lookups and pure
    paths, with the arguments DCP gives them, items and elements go only into dicts, lists and sets. So
    nothing in the pickle sets an attribute on a class, a module or a function, and no code runs.
    """

    def __init__(self, file: io.BufferedIOBase) -> None:
        super().__init__(file)
        self._allowed = _allowed_globals()
        self._calls = _calls()
        self._fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in _dataclasses()}
        self._required = {
            cls: {f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING}
            for cls in self._fields
        }
        self._setstate = {cls for cls in self._fields if "__setstate__" in vars(cls)}  # TensorProperties
        self._made: dict[int, Any] = {}  # id -> instance made here, not built yet (held, so ids stay unique)
        self._built: list[Any] = []

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return self._allowed[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(
            f"asks for {module}.{name}, which distributed checkpoint metadata never holds, so it could run code "
            f"(nothing was run)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(
            f"asks for persistent id {pid!r}, which distributed checkpoint metadata never holds, so it could run "
            f"code (nothing was run)"
        )

    def load(self) -> Any:
        result = super().load()
        for obj in [*self._made.values(), *self._built]:
            missing = self._required[type(obj)] - vars(obj).keys()
            if missing:
                raise pickle.UnpicklingError(f"a {type(obj).__name__} without its fields {', '.join(sorted(missing))}")
        return result

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        if not any(cls is allowed for allowed in self._fields):
            raise _never(f"creates an instance of {_named(cls)} (pickle NEWOBJ)")
        if args != () or kwargs != {}:
            given = reprlib.repr(args) + (f" and keywords {reprlib.repr(kwargs)}" if kwargs != {} else "")
            raise _never(f"creates a {cls.__qualname__} with arguments {given} (pickle NEWOBJ)")
        obj = cls.__new__(cls)
        self._made[id(obj)] = obj
        self.append(obj)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._new(self.stack.pop(), args, {})

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        self._new(self.stack.pop(), args, kwargs)

    def load_reduce(self) -> None:
        args, func = self.stack.pop(), self.stack[-1]
        check = next((check for allowed, check in self._calls if func is allowed), None)
        if check is None:
            raise _never(f"calls {_named(func)} (pickle REDUCE)")
        if type(args) is not tuple or not check(args):
            raise _never(f"calls {_named(func)} with {reprlib.repr(args)} (pickle REDUCE)")
        self.stack[-1] = func(*args)

    def load_build(self) -> None:
        state, obj = self.stack.pop(), self.stack[-1]
        if self._made.pop(id(obj), None) is not obj:
            built = any(obj is b for b in self._built)
            raise _never(f"sets the state of {_named(obj)}{' again' if built else ''} (pickle BUILD)")
        self._built.append(obj)
        cls, fields = type(obj), self._fields[type(obj)]
        if cls in self._setstate:  # TensorProperties: a tuple, one item per field
            if type(state) is not tuple or len(state) != len(fields):
                raise _never(f"gives a {cls.__qualname__} the state {reprlib.repr(state)} (pickle BUILD)")
            cls.__setstate__(obj, state)
            return
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            unknown = sorted(map(repr, set(state) - fields)) if type(state) is dict else [reprlib.repr(state)]
            raise _never(f"gives a {cls.__qualname__} {', '.join(unknown)}, not its fields (pickle BUILD)")
        vars(obj).update(state)

    def _into(self, kind: type, target: Any, opcode: str) -> None:
        if type(target) is not kind:
            raise _never(f"{opcode} {_named(target)}")

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._into(dict, self.stack[-1], "sets an item of")
        self.stack[-1][key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._into(dict, self.stack[-1], "sets items of")
        self.stack[-1].update(zip(items[::2], items[1::2]))

    def load_append(self) -> None:
        value = self.stack.pop()
        self._into(list, self.stack[-1], "appends to")
        self.stack[-1].append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._into(list, self.stack[-1], "appends to")
        self.stack[-1].extend(items)

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._into(set, self.stack[-1], "adds to")
        self.stack[-1].update(items)

    def load_refused(self) -> None:
        raise _never("instantiates a class by INST/OBJ or takes an object from pickle's extension registry")

    dispatch = {
        **pickle._Unpickler.dispatch,
        pickle.NEWOBJ[0]: load_newobj,
        pickle.NEWOBJ_EX[0]: load_newobj_ex,
        pickle.REDUCE[0]: load_reduce,
        pickle.BUILD[0]: load_build,
        pickle.SETITEM[0]: load_setitem,
        pickle.SETITEMS[0]: load_setitems,
        pickle.APPEND[0]: load_append,
        pickle.APPENDS[0]: load_appends,
        pickle.ADDITEMS[0]: load_additems,
        pickle.INST[0]: load_refused,
        pickle.OBJ[0]: load_refused,
        pickle.EXT1[0]: load_refused,
        pickle.EXT2[0]: load_refused,
        pickle.EXT4[0]: load_refused,
    }


def read_metadata(folder: Path) -> Any:
    """The folder's DCP `Metadata`, checked: every item's file lies in the folder, every tensor fully covered."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = folder / METADATA_FILE
    try:
        with path.open("rb") as f:
            metadata = MetadataUnpickler(f).load()
    except _Refused as exc:
        raise CheckpointError(f"refused to read {path}: it {exc}; use a checkpoint you trust") from exc
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
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    where = folder / METADATA_FILE
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{where} lists no stored items; the metadata is corrupt: copy the whole folder again")
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and not _well_formed(item):
            raise CheckpointError(
                f"{where} gives {key} no valid dtype, size or chunks; the metadata is corrupt: copy the whole "
                f"folder again"
            )
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointError(
                f"{where} lists a stored item as {type(index).__name__}: {type(info).__name__}; the metadata is "
                f"corrupt: copy the whole folder again"
            )
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name:
            raise CheckpointError(f"{where} puts {index.fqn} in {name!r}, outside the folder; the metadata is corrupt")
    for name in sorted(_data_files(metadata)):
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


def _well_formed(item: Any) -> bool:
    """A tensor item with a dtype, a size and chunks of sizes, as DCP's reader needs it."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    return (
        isinstance(item.properties, TensorProperties)
        and isinstance(item.properties.dtype, torch.dtype)
        and isinstance(item.size, torch.Size)
        and isinstance(item.chunks, list)
        and all(
            isinstance(chunk, ChunkStorageMetadata)
            and isinstance(chunk.offsets, torch.Size)
            and isinstance(chunk.sizes, torch.Size)
            for chunk in item.chunks
        )
    )


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

    return TensorsOnly()


# DCP's file reader unpickles each tensor item with `torch.load`, whose default is weights_only=True from
# torch 2.6 on; before it, a tensor item of a folder could run code when read.
SAFE_TENSOR_READS_SINCE = (2, 6)


def tensor_reader(folder: Path, metadata: Any) -> Callable[[str], torch.Tensor]:
    """`read(key)` loads that one tensor item with DCP's own file reader and planner, without a process group."""
    if torch.torch_version.TorchVersion(torch.__version__) < SAFE_TENSOR_READS_SINCE:
        raise CheckpointError(
            f"{folder} is a distributed checkpoint, whose tensors torch {torch.__version__} reads with "
            f"weights_only=False (code in the file would run); upgrade torch to 2.6 or newer to read it"
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
