"""What DCP `.metadata` may hold, checked after unpickling and before any use; the bounds of the whole read.

The unpickler (unpickler.py) makes only DCP's own classes, within the `Limits` on nesting and counts.
`check_metadata` then checks what was made against one schema: every field of the expected type, names of
bounded length, sizes and offsets non-negative ints with each chunk inside its tensor and the chunks an exact
cover of it, dtypes and layouts from the fixed tables (dtypes.py), and no tensor larger than the bytes its
chunks are stored in, which lie inside the data files without overlapping. So after it, nothing that reads the
metadata (this package, DCP's planner and reader) can be led into an error other than `CheckpointError`,
an allocation larger than the data files, or work that grows faster than the files.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...dtypes import TORCH_DTYPES, TORCH_LAYOUTS
from ...errors import CheckpointError


@dataclass(frozen=True)
class Limits:
    """The bounds of one read of a `.metadata`: what no checkpoint DCP writes comes near."""

    # The file is read whole before unpickling (so a length in it can never make a large buffer). DCP writes
    # some 10 bytes of pickle per object (a 7B model with its optimizer on 64 ranks: about 10 MB).
    metadata_bytes: int = 1 << 26
    # The memory the objects made take (estimated as they are made: each object's size and its bookkeeping,
    # each item's slot): at most `memory_per_byte` times the file's size (DCP's own files take about 30; one
    # opcode of one byte can make a 200-byte set), at least `memory_floor`, and never above `memory`.
    memory_per_byte: int = 48
    memory_floor: int = 1 << 26
    memory: int = 1 << 30
    # DCP nests 9 deep (Metadata, its dicts, a tensor, its chunk list, a chunk, its torch.Size); the hashing
    # and repr of objects recurse in C, and a few hundred thousand levels overflow the C stack.
    depth: int = 32
    # Containers and instances made, and elements put into containers. Each opcode is at least one byte and
    # pushes at most one object, so neither count can exceed the file's size (checked as it goes, with the
    # opcodes); these absolute caps bound memory (under 200 bytes per object). A 7B model trained on 512
    # ranks, optimizer included, has about 2 million chunks: some 20 million objects.
    objects: int = 1 << 25
    items: int = 1 << 26
    # Characters of a key (DCP's are state dict keys, under 200); keys and set elements are strings or
    # MetadataIndex only, and a shared key is compared in full on each insertion: this bounds that work.
    name_length: int = 1024
    file_name_length: int = 255
    # Dimensions of a torch.Size and the magnitude of each value: below 2**61 an int is its own hash, so no two
    # offsets of a MetadataIndex can be chosen to collide in a dict.
    dims: int = 64
    size_value: int = 1 << 61
    # Items of `state_dict_metadata` (a 7B's model, EMA and optimizer states: some 5000) and chunks: all tensors
    # together, and of one tensor (one per rank).
    keys: int = 1 << 14
    chunks: int = 1 << 24
    chunks_per_tensor: int = 1 << 16
    # Pairs of chunks compared to prove that none overlap, per chunk: a sweep along the most divided
    # dimension compares each chunk with those beside it across the others (1 for FSDP, the TP degree for 2-D).
    overlap_checks_per_chunk: int = 64


LIMITS = Limits()


@dataclass
class Work:
    """What one read of a `.metadata` did: each count is checked against `Limits` as it grows."""

    bytes: int = 0  # the file's size
    opcodes: int = 0
    objects: int = 0  # containers and instances made
    items: int = 0  # elements put into containers
    depth: int = 0  # the deepest nesting made
    memory: int = 0  # bytes the objects made take, estimated
    chunks: int = 0  # chunks the schema checked
    overlap_checks: int = 0  # pairs of chunks compared


_DTYPES = frozenset(TORCH_DTYPES.values())
_LAYOUTS = frozenset(TORCH_LAYOUTS.values())
_ABSENT = object()
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80


def shown(value: Any) -> str:
    """A value of the file in a message: short, on one line, whatever it is."""
    return _SHOWN.repr(value)


class _Corrupt(Exception):
    """What the schema found; read_metadata names the file and the fix."""


def check_metadata(metadata: Any, folder: Path, limits: Limits = LIMITS, work: Work | None = None) -> None:
    """Raises CheckpointError, naming `folder`'s `.metadata`, unless `metadata` fits the schema."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = folder / ".metadata"
    work = work if work is not None else Work()
    try:
        if type(metadata) is not Metadata:
            raise CheckpointError(
                f"{where} holds a {type(metadata).__name__}, not distributed checkpoint metadata; pass a folder "
                f"written by torch.distributed.checkpoint.save"
            )
        items, storage = _top_level(metadata, limits)
        _check_storage(storage, limits)
        _check_files(storage, folder, where)
        chunks_seen: set[int] = set()
        for key, item in items.items():
            _check_item(key, item, storage, limits, work, chunks_seen)
    except _Corrupt as exc:
        raise CheckpointError(f"{where} {exc}; the metadata is corrupt: copy the whole folder again") from None


def _field(obj: Any, name: str) -> Any:
    """A dataclass field as unpickled: the instance's own value, else the class's plain default."""
    value = getattr(obj, name, _ABSENT)
    if value is _ABSENT:
        raise _Corrupt(f"holds a {type(obj).__name__} without its {name}")
    return value


def _top_level(metadata: Any, limits: Limits) -> tuple[dict, dict]:
    from torch.distributed.checkpoint import metadata as dcp_metadata

    items, storage = _field(metadata, "state_dict_metadata"), _field(metadata, "storage_data")
    if type(items) is not dict or type(storage) is not dict:
        raise _Corrupt("lists no stored items")
    if len(items) > limits.keys:
        raise _Corrupt(f"lists {len(items)} items, more than the {limits.keys} any checkpoint holds")
    # Fields that older DCP versions lack, and nothing here reads: checked for their kind only.
    storage_meta, version = getattr(metadata, "storage_meta", None), getattr(metadata, "version", None)
    storage_meta_kinds = (vars(dcp_metadata).get("StorageMeta"), type(None))
    if type(storage_meta) not in storage_meta_kinds or type(version) not in (str, type(None)):
        raise _Corrupt(f"gives as its storage_meta and version {shown(storage_meta)} and {shown(version)}")
    return items, storage


def _size(value: Any, limits: Limits, ndim: int | None = None) -> bool:
    """A torch.Size of non-negative ints (of `ndim` dimensions where given)."""
    return (
        type(value) is torch.Size
        and len(value) <= limits.dims
        and (ndim is None or len(value) == ndim)
        and all(type(n) is int and 0 <= n < limits.size_value for n in value)
    )


def _name(value: Any, limits: Limits) -> bool:
    return type(value) is str and len(value) <= limits.name_length


def _check_storage(storage: dict, limits: Limits) -> None:
    """Every stored item: a MetadataIndex naming it, and where its bytes lie, in a file of the folder."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise _Corrupt(f"lists a stored item as {type(index).__name__}: {type(info).__name__}")
        fqn, offset = _field(index, "fqn"), _field(index, "offset")
        if not _name(fqn, limits) or not (offset is None or _size(offset, limits)):
            raise _Corrupt(f"names a stored item {shown(fqn)} at {shown(offset)}")
        name = _field(info, "relative_path")
        if not _file_name(name, limits):
            raise _Corrupt(f"puts {fqn} in {shown(name)}, outside the folder")
        start, length = _field(info, "offset"), _field(info, "length")
        if type(start) is not int or type(length) is not int or start < 0 or length < 0:
            raise _Corrupt(f"puts {fqn} at bytes {shown(start)} to {shown(length)} of {name}")
        transforms = getattr(info, "transform_descriptors", None)  # absent in older torch
        if transforms is not None and (type(transforms) not in (list, tuple) or transforms):
            raise _Corrupt(
                f"stores {fqn} transformed ({shown(transforms)}, e.g. compressed), which this reader does not "
                f"read (its size is unknown until read); save the checkpoint without DCP's extensions"
            )


def _file_name(name: Any, limits: Limits) -> bool:
    return (
        type(name) is str
        and 0 < len(name) <= limits.file_name_length
        and name not in (".", "..")
        and "/" not in name
        and "\0" not in name
        and Path(name).name == name
    )


def _check_files(storage: dict, folder: Path, where: Path) -> None:
    """Every data file is in the folder, and holds the bytes listed in it, no two items on the same bytes."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, index.fqn))
    for name in sorted(spans):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder} lacks {name}, which its {where.name} lists; copy the whole folder")
        size, end, before = path.stat().st_size, 0, ""
        for start, stop, fqn in sorted(spans[name]):
            if stop > size:
                raise _Corrupt(f"puts {fqn} at bytes {start} to {stop} of {name}, which holds {size}")
            if stop == start:
                continue
            if start < end:
                raise _Corrupt(f"puts {fqn} on bytes of {name} that also hold {before}")
            end, before = stop, fqn


def _check_item(key: Any, item: Any, storage: dict, limits: Limits, work: Work, chunks_seen: set[int]) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if not _name(key, limits):
        raise _Corrupt(f"names an item {shown(key)}, not a string of at most {limits.name_length} characters")
    if type(item) is BytesStorageMetadata:
        return  # pickled bytes: never read (DCP unpickles them with weights_only=False)
    if type(item) is not TensorStorageMetadata:
        raise _Corrupt(f"gives {key} {shown(item)}, not a tensor or bytes item")
    dtype = _check_properties(key, _field(item, "properties"))
    size, chunks = _field(item, "size"), _field(item, "chunks")
    if not _size(size, limits):
        raise _Corrupt(f"gives {key} the size {shown(size)}, not a torch.Size of non-negative ints")
    if type(chunks) is not list:
        raise _Corrupt(f"gives {key} as its chunks {shown(chunks)}, not a list")
    if id(chunks) in chunks_seen:  # DCP never shares; shared, N tensors could list N chunks each in a file of N
        raise _Corrupt(f"gives {key} the list of chunks of another tensor")
    chunks_seen.add(id(chunks))
    work.chunks += len(chunks)
    if len(chunks) > limits.chunks_per_tensor or work.chunks > limits.chunks:
        raise _Corrupt(f"splits {key} into {len(chunks)} chunks, more than any checkpoint (in all: {limits.chunks})")
    for chunk in chunks:
        _check_chunk(key, chunk, size, limits, chunks_seen)
    if sum(math.prod(chunk.sizes) for chunk in chunks) != math.prod(size) or _overlapping(chunks, limits, work):
        raise _Corrupt(f"does not cover all of {key} {list(size)} with stored chunks, each element once")
    _check_stored_bytes(key, chunks, dtype, storage)


def _check_properties(key: str, properties: Any) -> torch.dtype:
    from torch.distributed.checkpoint.metadata import TensorProperties

    if type(properties) is not TensorProperties:
        raise _Corrupt(f"gives {key} the properties {shown(properties)}")
    dtype, layout = _field(properties, "dtype"), _field(properties, "layout")
    if type(dtype) is not torch.dtype or dtype not in _DTYPES:
        raise _Corrupt(f"gives {key} the dtype {shown(dtype)}, which is no dtype this package reads")
    if type(layout) is not torch.layout or layout not in _LAYOUTS:
        raise _Corrupt(f"gives {key} the layout {shown(layout)}, which distributed checkpoints never store")
    return dtype  # requires_grad, memory_format, pin_memory: deprecated in DCP, read by nothing


def _check_chunk(key: str, chunk: Any, size: torch.Size, limits: Limits, chunks_seen: set[int]) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    if type(chunk) is not ChunkStorageMetadata:
        raise _Corrupt(f"gives {key} the chunk {shown(chunk)}, not a ChunkStorageMetadata")
    if id(chunk) in chunks_seen:
        raise _Corrupt(f"gives {key} a chunk that another tensor or place lists too")
    chunks_seen.add(id(chunk))
    offsets, sizes = _field(chunk, "offsets"), _field(chunk, "sizes")
    if not _size(offsets, limits, len(size)) or not _size(sizes, limits, len(size)):
        raise _Corrupt(f"gives {key} {list(size)} a chunk at {shown(offsets)} of {shown(sizes)}")
    if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
        raise _Corrupt(f"gives {key} {list(size)} a chunk at {list(offsets)} of {list(sizes)}, outside it")


def _overlapping(chunks: list, limits: Limits, work: Work) -> bool:
    """Whether two chunks (each inside the tensor) share an element: a sweep along the dimension that the
    chunks divide most, comparing each chunk with those still open there."""
    filled = [chunk for chunk in chunks if all(chunk.sizes)]
    ndim = len(filled[0].offsets) if filled else 0
    if ndim == 0:
        return len(filled) > 1
    sweep = max(range(ndim), key=lambda d: len({chunk.offsets[d] for chunk in filled}))
    budget = work.overlap_checks + limits.overlap_checks_per_chunk * len(filled)
    open_chunks: list[Any] = []
    for chunk in sorted(filled, key=lambda c: c.offsets[sweep]):
        start = chunk.offsets[sweep]
        open_chunks = [c for c in open_chunks if c.offsets[sweep] + c.sizes[sweep] > start]
        work.overlap_checks += len(open_chunks)
        if work.overlap_checks > budget:
            raise _Corrupt(f"splits a tensor into {len(chunks)} chunks too entangled to check")
        if any(_boxes_meet(chunk, other) for other in open_chunks):
            return True
        open_chunks.append(chunk)
    return False


def _boxes_meet(a: Any, b: Any) -> bool:
    return all(
        oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


def _check_stored_bytes(key: str, chunks: list, dtype: torch.dtype, storage: dict) -> None:
    """Each chunk is stored, in at least as many bytes as its elements take (DCP stores them uncompressed)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for chunk in chunks:
        info = storage.get(MetadataIndex(key, chunk.offsets))
        if info is None:
            where = list(chunk.offsets)
            raise _Corrupt(f"does not cover all of {key} with stored chunks (none is stored at {where})")
        needed = math.prod(chunk.sizes) * dtype.itemsize
        if needed > info.length:
            raise _Corrupt(
                f"gives the chunk of {key} at {list(chunk.offsets)} {list(chunk.sizes)} {dtype} elements "
                f"({needed} bytes), more than the {info.length} bytes it is stored in"
            )
