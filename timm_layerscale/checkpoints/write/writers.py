"""Files out, tensor by tensor: safetensors written header first, then each tensor's bytes as it is made.

safetensors has no streaming writer (its `save_file` takes every tensor at once), so the format is written
here: an 8-byte little-endian header length, the JSON header with each tensor's dtype, shape and byte
range, then the bytes in that order. Private memory stays near the largest tensor, whatever the file's
size. Every output is written into a staging folder beside the destination and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub import constants, split_state_dict_into_shards_factory
from safetensors import safe_open

from timm_ls.destinations import (
    KEPT,
    STAGING,
    destination_problem,
    foreign_problem,
    hold_staging,
    remove_stale_staging,
)
from timm_ls.interrupts import deferred

from ..dtypes import safetensors_name
from ..errors import CheckpointError
from ..mapping.plan import TensorInfo, info_of

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
            _save_interruptibly(state if under is None else {under: state}, f)
            _sync(f)
    finally:
        staging.unlink(missing_ok=True)
    return written


def _save_interruptibly(obj: object, f) -> None:
    """`torch.save`, letting a signal that cuts it short through as itself: torch's zip writer, closed on the
    way out, finds its file cut short and raises a RuntimeError in the signal's place."""
    try:
        torch.save(obj, f)
    except RuntimeError as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise exc.__context__ from None
        raise


def write_text(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")
        _sync(f)


@contextmanager
def atomic_destination(
    dst: Path,
    overwrite: bool = False,
    folder: bool = False,
    *,
    what: str = "the writer",
    companions: Sequence[str] = (),
    ours: Sequence[str] = (),
) -> Iterator[Path]:
    """A temporary path to write `dst` at (a folder made for it when `folder`), put in place when the block
    completes: `dst` appears complete, or not at all.

    The destination follows the one rule (`timm_ls.destinations`): its folder exists, it is named as what is
    written, and it is replaced only with `overwrite`. `companions` are names of files written beside it (an
    ONNX file's `.data`), replaced with it as a group: the old files are kept aside until every new one is in
    place and put back if any rename fails, and an old companion the new write has none of is removed. Only
    a crash between the renames can leave a mixed group. A folder is replaced only while every file in it is
    one of `ours` (names or `fnmatch` patterns of what the writer writes there), checked again just before the
    swap. The staging folder beside `dst` is removed in all cases, and a failed or interrupted write (Ctrl-C,
    and SIGTERM under `timm-ls`) leaves `dst` and its companions as they were; a signal arriving during the
    swap or the clean-up waits until they are done. A write that is killed (SIGKILL, a power cut) leaves its
    staging folder, marked as this package's and no longer locked: the next write of `dst` removes it, in one
    line on stderr (`timm_ls.destinations.remove_stale_staging`).
    """
    dst = Path(dst)
    rule = dict(folder=folder, what=what, overwrite=overwrite, companions=[dst.with_name(n) for n in companions])
    _refuse_unfit(dst, ours, **rule)
    if remove_stale_staging(dst):  # a killed write's set-aside files are back in place: the rule again
        _refuse_unfit(dst, ours, **rule)
    stage = dst.with_name(STAGING.format(name=dst.name, token=uuid.uuid4().hex[:8]))
    lock = hold_staging(stage)  # from here until the lock is released, no other write takes it for stale
    try:
        staged = stage / dst.name
        if folder:
            staged.mkdir()
        yield staged
        problem = foreign_problem(dst, ours, what, "overwrite=True") if folder else None  # one may have come
        if problem:
            raise CheckpointError(problem)
        _replace_group(stage, dst.parent, [dst.name, *companions])
    except BaseException:
        with deferred():  # a second Ctrl-C must not leave the staging folder behind
            _remove(stage)
            os.close(lock)
        raise
    try:
        with deferred():
            _remove(stage)
            _sync_dir(dst.parent)
    except KeyboardInterrupt as exc:  # it arrived once `dst` was in place: say so
        exc.written = dst  # type: ignore[attr-defined]
        raise
    finally:
        os.close(lock)


def _refuse_unfit(dst: Path, ours: Sequence[str], **rule) -> None:
    problem = destination_problem(dst, overwrite_hint="overwrite=True", ours=ours, **rule)
    if problem:
        raise CheckpointError(problem)


@contextmanager
def staged_into(folder: Path) -> Iterator[Path]:
    """A staging folder whose files are moved into the existing `folder` when the block completes, as one group
    (`_replace_group`: the old files of those names kept aside until every new one is in place); the folder's
    other files are left as they are. A failed or interrupted write leaves `folder` as it was."""
    folder = Path(folder)
    remove_stale_staging(folder)
    stage = folder.with_name(STAGING.format(name=folder.name, token=uuid.uuid4().hex[:8]))
    lock = hold_staging(stage)
    try:
        staged = stage / folder.name
        staged.mkdir()
        yield staged
        names = sorted(p.name for p in staged.iterdir())
        for name in names:
            os.replace(staged / name, stage / name)
        _replace_group(stage, folder, names)
    finally:
        with deferred():
            _remove(stage)
            os.close(lock)


def _replace_group(stage: Path, parent: Path, names: Sequence[str]) -> None:
    """Moves the staged `names` into `parent`, the old ones aside first and back again if a move fails or is
    interrupted. Where to undo is read from the folders, not from what was recorded: a signal may come between
    a rename and its record."""
    staged = [name for name in names if (stage / name).exists()]
    try:
        for name in names:
            old = parent / name
            if old.exists() or old.is_symlink():
                os.replace(old, stage / KEPT.format(name=name))
        for name in staged:
            os.replace(stage / name, parent / name)
    except BaseException:
        with deferred():
            for name in names:
                if name in staged and not (stage / name).exists():
                    _remove(parent / name)
                kept = stage / KEPT.format(name=name)
                if kept.exists() or kept.is_symlink():
                    os.replace(kept, parent / name)
        raise


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
