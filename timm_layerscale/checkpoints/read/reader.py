"""One lazy reader for every checkpoint source: tensors are read one key at a time, never all at once.

`open_checkpoint(source)` finds out what the source is by itself (a safetensors file, a torch zip or legacy
file, a sharded safetensors index, a Hub-layout folder, a torch.distributed.checkpoint folder, or a state dict
already in memory), picks one weights set of it (EMA/teacher or raw), strips the wrappers around the backbone
(`module.`, `backbone.`, ...) and drops pretraining heads, so its keys are a backbone state dict in whatever
format it was saved in. Shapes and dtypes are known before any tensor is read. A source that is not a
checkpoint, or is damaged, raises `CheckpointError` with one line naming what it is and the fix.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..dtypes import torch_dtype, unknown_name_reason
from ..errors import CheckpointError, reason, torch_load_error
from ..mapping.plan import LazyTensors, TensorInfo
from . import dcp
from .bounds import check_count, read_config_json
from .sniff import PASS_WEIGHTS, sniff
from .weights_sets import ONLY_SET as ONLY_SET  # where a format names a source's only set
from .weights_sets import left_out, select_weights

# What a source is: `LazyCheckpoint.kind`.
KIND_SAFETENSORS = "safetensors file"
KIND_SHARDED_SAFETENSORS = "sharded safetensors"
KIND_SHARDED_TORCH = "sharded torch files"
KIND_TORCH = "torch file"
KIND_LEGACY_TORCH = "legacy torch file"
KIND_DCP = "distributed checkpoint"
KIND_HUB_FOLDER = "Hub folder"
KIND_STATE_DICT = "state dict"
# Weights files of a Hub-layout folder (transformers and timm), best first.
HUB_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Meta's DINOv3 training writes the EMA teacher for evaluation as one of these, inside `eval/<iteration>/`.
META_EVAL_TEACHER = ("sharded_teacher_checkpoint", "teacher_checkpoint.pth")
WEIGHTS_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".tar", ".ckpt")


class LazyCheckpoint(LazyTensors):
    """The tensors of one weights set of a checkpoint. `ckpt[key]` reads that tensor only.

    `kind` says what the source is (`KIND_*`), `weights` which set was taken; `info(key)` gives the shape and
    dtype without reading, `nbytes` the size of the set. `files` are the files it reads and `hub_config` the
    parsed `config.json` of a Hub-layout folder; `recorded` what a train.py checkpoint records of its model, in
    config.json's words (`architecture`, `model_args`). `heads` holds the set's `dino_head.*`/`ibot_head.*` tensors
    when they were asked for (else None). Tensors may be views of the mapped file: clone before
    changing one in place. Use it as a context manager, or `close()` it, to release the files.
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
        files: tuple[Path, ...] = (),
        heads: LazyCheckpoint | None = None,
        recorded: dict[str, Any] | None = None,
        left_out: list[str] | None = None,
    ) -> None:
        self.path = path
        self.heads = heads
        self.kind = kind
        self.weights = weights
        self.hub_config = hub_config
        self.recorded = recorded
        self.files = files
        self.left_out = left_out or []  # what the chosen set holds beside the backbone (`left_out`)
        self._infos = infos
        self._read_tensor = read
        self._close = close

    def _read(self, key: str) -> torch.Tensor:
        return self._read_tensor(key)

    @property
    def summary(self) -> str:
        """What was read and which weights set, e.g. `distributed checkpoint ckpt/99 (model_ema)`."""
        return f"{self.kind} {self.path} ({self.weights})"

    def close(self) -> None:
        self._close()

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Flat:
    """A source's tensors under their stored keys, before a weights set is chosen."""

    kind: str
    infos: dict[str, TensorInfo]
    read: Callable[[str], torch.Tensor]
    files: tuple[Path, ...]
    close: Callable[[], None] = lambda: None
    hub_config: dict[str, Any] | None = None
    recorded: dict[str, Any] | None = None  # what a training checkpoint says of its model (`recorded_model`)


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix.rstrip("."), tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")


def _flat_tree(tree: Any, kind: str, source: str, files: tuple[Path, ...] = ()) -> _Flat:
    flat = dict(_flatten(tree))
    check_count(len(flat), Path(source))
    if not flat:
        got = type(tree).__name__ + (
            f" with keys {', '.join(map(str, list(tree)[:5]))}" if isinstance(tree, Mapping) and tree else ""
        )
        raise CheckpointError(f"{source} holds no tensors (got {got}); {PASS_WEIGHTS}")
    infos = {k: TensorInfo(v.shape, v.dtype) for k, v in flat.items()}
    return _Flat(kind, infos, flat.__getitem__, files)


def _flat_safetensors(path: Path) -> _Flat:
    try:
        handle = safe_open(str(path), framework="pt")
        infos = {}
        check_count(len(handle.keys()), path)
        for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            view = handle.get_slice(key)
            infos[key] = TensorInfo(torch.Size(view.get_shape()), _safetensors_dtype(view.get_dtype(), key, path))
    except SafetensorError as exc:
        raise CheckpointError(
            f"{path} is a truncated or corrupt safetensors file ({reason(exc)}); save or download it again"
        ) from exc
    except RuntimeError as exc:
        # A file larger than the memory the kernel lets one mapping commit (a 27 GB 7B on a 24 GB machine).
        if "mmap" not in str(exc):
            raise
        return _flat_safetensors_read(path)
    if not infos:
        raise CheckpointError(f"{path} holds no tensors (an empty safetensors file); {PASS_WEIGHTS}")
    return _Flat(KIND_SAFETENSORS, infos, handle.get_tensor, (path,))


def _flat_safetensors_read(path: Path) -> _Flat:
    """A safetensors file read tensor by tensor with positioned reads, for one that cannot be mapped whole."""
    corrupt = f"{path} is a truncated or corrupt safetensors file"
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= size - 8:
            raise CheckpointError(f"{corrupt} (header length {length}); save or download it again")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointError(f"{corrupt} ({reason(exc)}); save or download it again") from exc
    infos, spans = {}, {}
    check_count(len(header) if isinstance(header, dict) else 0, path)
    for key, entry in header.items() if isinstance(header, dict) else ():
        if key == "__metadata__":
            continue
        try:
            info = TensorInfo(torch.Size(entry["shape"]), _safetensors_dtype(entry["dtype"], key, path))
            begin, end = (8 + length + int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{corrupt} (entry {key}: {reason(exc)}); save or download it again") from exc
        if end - begin != info.nbytes or end > size:
            raise CheckpointError(f"{corrupt} ({key} is cut short or misplaced); save or download it again")
        infos[key], spans[key] = info, begin
    if not infos:
        raise CheckpointError(f"{path} holds no tensors (an empty safetensors file); {PASS_WEIGHTS}")
    fd = os.open(path, os.O_RDONLY)

    def read(key: str) -> torch.Tensor:
        info = infos[key]
        tensor = torch.empty(info.shape, dtype=info.dtype)
        buffer, done = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), 0
        while done < info.nbytes:
            got = os.preadv(fd, [buffer[done:]], spans[key] + done)
            if got <= 0:
                raise CheckpointError(f"{corrupt} (reading {key} ended early); save or download it again")
            done += got
        return tensor

    def close() -> None:
        nonlocal fd
        if fd >= 0:
            os.close(fd)
            fd = -1

    return _Flat(KIND_SAFETENSORS, infos, read, (path,), close)


def _safetensors_dtype(name: str, key: str, path: Path) -> torch.dtype:
    dtype = torch_dtype(name)
    if dtype is None:
        raise CheckpointError(f"{path} stores {key} as {unknown_name_reason(name)}; save it as F32, BF16 or F16")
    return dtype


def _flat_torch(path: Path, legacy: bool) -> _Flat:
    try:
        # mmap: tensors stay in the file's pages until a conversion touches them. Legacy files cannot be mapped.
        with torch.serialization.safe_globals([argparse.Namespace]):  # timm's train.py saves its args
            tree = torch.load(path, map_location="cpu", mmap=not legacy, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for refused or damaged files
        raise torch_load_error(path, exc) from exc
    flat = _flat_tree(tree, KIND_LEGACY_TORCH if legacy else KIND_TORCH, str(path), (path,))
    flat.recorded = recorded_model(tree)
    return flat


def recorded_model(tree: Any) -> dict[str, Any] | None:
    """What timm's train.py records of the model beside its weights, in the words of timm's config.json:
    `{"architecture": args.model, "model_args": args.model_kwargs}`; None for any other file."""
    arch = tree.get("arch") if isinstance(tree, Mapping) else None
    if not isinstance(arch, str):
        return None
    kwargs = getattr(tree.get("args"), "model_kwargs", None)
    return {"architecture": arch, "model_args": dict(kwargs) if isinstance(kwargs, Mapping) else {}}


def _flat_dcp(folder: Path) -> _Flat:
    metadata = dcp.read_metadata(folder)
    items = dcp.tensor_items(metadata)
    infos = {key: TensorInfo(*item) for key, item in items.items()}
    read = dcp.tensor_reader(folder, metadata)
    files = dcp.stored_files(folder, metadata)
    if folder.name == META_EVAL_TEACHER[0]:
        # Meta saves the EMA teacher here under `model.`: name it as the teacher it is.
        renamed = {"teacher." + k.removeprefix("model."): k for k in infos}
        return _Flat(KIND_DCP, {k: infos[v] for k, v in renamed.items()}, lambda k: read(renamed[k]), files)
    return _Flat(KIND_DCP, infos, read, files)


def read_index(index: Path) -> dict[str, str]:
    """A sharded checkpoint's weight map, {key: shard file}, each shard checked to lie beside the index."""
    try:
        data = json.loads(index.read_text())
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{index} is not a valid JSON index ({reason(exc)}); download it again") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map of keys to shard files; pass a sharded checkpoint's index")
    for name in dict.fromkeys(weight_map.values()):
        if not isinstance(name, str) or ".." in Path(name).parts or Path(name).is_absolute():
            raise CheckpointError(f"{index} names shard {name!r} outside its folder; the index is corrupt")
    return weight_map


def _flat_index(index: Path) -> _Flat:
    weight_map = read_index(index)
    check_count(len(weight_map), index)
    shards: dict[str, _Flat] = {}
    for name in dict.fromkeys(weight_map.values()):
        shard = index.parent / name
        if not shard.is_file():
            raise CheckpointError(f"{index} names shard {name}, which is missing; download every shard it lists")
        shards[name] = _open_file(shard)
    infos = {}
    for key, name in weight_map.items():
        if key not in shards[name].infos:
            raise CheckpointError(
                f"{index} puts {key} in {name}, which does not hold it; the index and shards do not match: "
                f"download them again"
            )
        infos[key] = shards[name].infos[key]

    def close() -> None:
        for shard in shards.values():
            shard.close()

    kinds = {shard.kind for shard in shards.values()}
    kind = KIND_SHARDED_SAFETENSORS if kinds == {KIND_SAFETENSORS} else KIND_SHARDED_TORCH
    files = (index, *(index.parent / name for name in shards))
    return _Flat(kind, infos, lambda k: shards[weight_map[k]].read(k), files, close)


def _open_file(path: Path) -> _Flat:
    if path.name.endswith(".index.json"):
        return _flat_index(path)
    found = sniff(path)
    if found == "safetensors":
        return _flat_safetensors(path)
    return _flat_torch(path, legacy=found == "legacy torch")


def _open_folder(folder: Path) -> _Flat:
    if (folder / dcp.METADATA_FILE).is_file():
        return _flat_dcp(folder)
    weights = next((folder / name for name in HUB_WEIGHTS if (folder / name).is_file()), None)
    config_path = folder / "config.json"
    if weights is not None:
        flat = _open_file(weights)
        if config_path.is_file():
            flat.hub_config = read_config_json(config_path)
            flat.kind = KIND_HUB_FOLDER
            flat.files = (*flat.files, config_path)
        return flat
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return _flat_index(indexes[0])
    if indexes:
        raise CheckpointError(
            f"{folder} holds {len(indexes)} sharded indexes ({', '.join(i.name for i in indexes)}); pass one"
        )
    for name in META_EVAL_TEACHER:
        if (folder / name).exists():
            return _open_path(folder / name)
    hint = _folder_hint(folder)
    raise CheckpointError(
        f"{folder} is a folder with no checkpoint in it (no {dcp.METADATA_FILE}, {', '.join(HUB_WEIGHTS[::2])} or "
        f"*.safetensors.index.json){hint}"
    )


def _folder_hint(folder: Path) -> str:
    iterations = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if iterations:
        return f"; it holds one checkpoint per iteration: pass one of them, e.g. {iterations[-1]}"
    if (folder / "ckpt").is_dir() or (folder / "eval").is_dir():
        return f"; for a DINOv3 training run pass {folder}/ckpt/<iteration> or {folder}/eval/<iteration>"
    files = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHTS_SUFFIXES)
    if len(files) == 1:
        return f"; pass the file {folder / files[0]}"
    return f"; {PASS_WEIGHTS}"


def _open_path(path: Path) -> _Flat:
    if path.is_dir():
        return _open_folder(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; {PASS_WEIGHTS}")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file (a device or pipe?); {PASS_WEIGHTS}")
    return _open_file(path)


def open_checkpoint(
    source: str | Path | Mapping[str, Any], weights: str = "auto", heads: bool = False
) -> LazyCheckpoint:
    """Opens a checkpoint lazily and picks its weights set (`auto`: EMA/teacher where there is one).

    The backbone's tensors are the mapping; with `heads`, the set's DINOv3 pretraining heads are kept
    apart in `.heads` (under `dino_head.`/`ibot_head.`), else dropped as every load drops them.

    Sources: a `.safetensors` file, a torch file (`.pth`, `.bin`, `.pt`, timm's `.pth.tar`, Meta's
    `teacher_checkpoint.pth`, legacy non-zip files), a sharded index (`*.index.json`), a folder (Hub layout with
    `config.json`, sharded safetensors, torch.distributed.checkpoint, Meta's `eval/<iteration>/`), or an
    already loaded (possibly nested) state dict.
    """
    if isinstance(source, Mapping):
        flat = _flat_tree(source, KIND_STATE_DICT, "the checkpoint")
        path = Path("the checkpoint")
    else:
        path = Path(source)
        flat = _open_path(path)
    head_keys: dict[str, str] | None = {} if heads else None
    try:
        taken, keys = select_weights(list(flat.infos), weights, str(path), head_keys)
    except CheckpointError:
        flat.close()
        raise
    kept = None
    if head_keys is not None:
        head_infos = {k: flat.infos[f] for k, f in head_keys.items()}
        kept = LazyCheckpoint(path, flat.kind, taken, head_infos, lambda k: flat.read(head_keys[k]))
    infos = {k: flat.infos[f] for k, f in keys.items()}
    dropped = left_out(list(flat.infos), {*keys.values(), *(head_keys or {}).values()}, taken)
    read = lambda k: flat.read(keys[k])  # noqa: E731
    return LazyCheckpoint(
        path, flat.kind, taken, infos, read, flat.close, flat.hub_config, flat.files, kept, flat.recorded, dropped
    )
