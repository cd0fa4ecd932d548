"""Files out, tensor by tensor: safetensors written header first, then each tensor's bytes as it is made.

safetensors has no streaming writer (its `save_file` takes every tensor at once), so the format is written
here: an 8-byte little-endian header length, the JSON header with each tensor's dtype, shape and byte
range, then the bytes in that order. Private memory stays near the largest tensor, whatever the file's
size. Every output is written under a temporary name beside the destination and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub import constants, split_state_dict_into_shards_factory
from safetensors import safe_open

from .dtypes import safetensors_name
from .errors import CheckpointError
from .plan import info_of
from .reader import TensorInfo

Tensor = torch.Tensor
Progress = Callable[[int], object]  # called with the bytes just written


def write_safetensors(
    path: Path,
    tensors: Mapping[str, Tensor],
    keys: Iterable[str] | None = None,
    metadata: Mapping[str, str] | None = None,
    progress: Progress | None = None,
) -> int:
    """Writes `keys` (all by default) of `tensors` to `path`, reading each only when its turn comes.

    `tensors` may be a plan or a lazy checkpoint: the header is made from their shapes before any tensor
    is read. Returns the bytes of tensor data written.
    """
    keys = list(tensors if keys is None else keys)
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for key in keys:
        info = info_of(tensors, key)
        name = safetensors_name(info.dtype)
        if name is None:
            raise CheckpointError(
                f"{key} has dtype {info.dtype}, which the safetensors format has no name for; pass --dtype fp32, "
                f"bf16 or fp16, or write a .pth"
            )
        header[key] = {
            "dtype": name,
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for key in keys:
            info = info_of(tensors, key)
            tensor = made_as_planned(tensors, key, info)
            f.write(_raw_bytes(tensor))
            if progress is not None:
                progress(info.nbytes)
            del tensor
        _sync(f)
    return offset


def made_as_planned(tensors: Mapping[str, Tensor], key: str, info: TensorInfo) -> Tensor:
    """`tensors[key]`, made now, checked against the shape and dtype the header was written from."""
    tensor = tensors[key]
    if tensor.shape != info.shape or tensor.dtype != info.dtype:
        raise RuntimeError(f"{key}: planned {list(info.shape)} {info.dtype}, made {list(tensor.shape)} {tensor.dtype}")
    return tensor


def _raw_bytes(tensor: Tensor) -> memoryview:
    tensor = tensor.detach().to("cpu").contiguous()
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def write_sharded_safetensors(
    folder: Path,
    tensors: Mapping[str, Tensor],
    max_shard_size: int | str = "5GB",
    progress: Progress | None = None,
) -> list[str]:
    """`model.safetensors`, or shards of at most `max_shard_size` with the index transformers reads."""
    infos = {key: info_of(tensors, key) for key in tensors}
    split = split_state_dict_into_shards_factory(
        infos,
        get_storage_size=lambda info: info.nbytes,
        filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN,
        max_shard_size=max_shard_size,
    )
    for filename, keys in split.filename_to_tensors.items():
        write_safetensors(folder / filename, tensors, keys, progress=progress)
    files = list(split.filename_to_tensors)
    if len(files) > 1:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        write_text(folder / constants.SAFETENSORS_INDEX_FILE, json.dumps(index, indent=2))
        files.append(constants.SAFETENSORS_INDEX_FILE)
    return files


def write_torch_file(
    path: Path, tensors: Mapping[str, Tensor], progress: Progress | None = None, under: str | None = None
) -> int:
    """A flat torch state dict (`torch.save`), or `{under: state dict}`, with private memory kept near one tensor.

    `torch.save` needs every tensor at once, so the tensors are first streamed into a safetensors file
    beside it and saved from that file's memory-mapped pages: the data is written twice.
    """
    staging = path.with_name(path.name + ".staging.safetensors")
    try:
        written = write_safetensors(staging, tensors, progress=progress)
        with safe_open(str(staging), framework="pt") as mapped, path.open("wb") as f:
            state = {key: mapped.get_tensor(key) for key in tensors}
            torch.save(state if under is None else {under: state}, f)
            _sync(f)
    finally:
        staging.unlink(missing_ok=True)
    return written


def write_text(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")
        _sync(f)


@contextmanager
def atomic_destination(dst: Path, overwrite: bool = False, folder: bool = False) -> Iterator[Path]:
    """A temporary path beside `dst` to write into; renamed to `dst` when the block completes.

    An existing `dst` is kept unless `overwrite`; on any error nothing is left behind (not even the
    parent folders this created) and an overwritten `dst` is restored.
    """
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it, or choose another path")
    created = [p for p in (dst.parent, *dst.parent.parents) if not p.exists()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = dst.with_name(f".{dst.name}.tmp-{tag}")
    old = dst.with_name(f".{dst.name}.old-{tag}")
    try:
        if folder:
            tmp.mkdir()
        yield tmp
        if dst.exists() or dst.is_symlink():
            os.replace(dst, old)
        try:
            os.replace(tmp, dst)
        except BaseException:
            if old.exists():
                os.replace(old, dst)
            raise
    except BaseException:
        _remove(tmp)
        for parent in created:  # innermost first
            if parent.exists() and not any(parent.iterdir()):
                parent.rmdir()
        raise
    _remove(old)
    _sync_dir(dst.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
