"""DCP folders for the tests: a training run saved on two ranks as Meta's DINOv3 trainer saves it, pickle
opcodes written by hand, and `.metadata` pickles taken apart into opcodes and put together again."""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import timm
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from support import SUPPORT, TINY, free_port, move_off_init_

NAME = "vit_ls_small_patch16_dinov3"
ITERATION = 199
METADATA = "torch.distributed.checkpoint.metadata"
# `timm-ls convert SRC DST --to meta` arguments for the tiny model's folders.
CONVERT = ["--model", NAME, "--model-kwargs", *(f"{k}={v}" for k, v in TINY.items())]


# ------------------------------------------------------------------------------------ opcodes by hand


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(value: str) -> bytes:
    data = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def integer(value: int) -> bytes:
    """The smallest opcode of a Python int (LONG1 beyond 32 bits), as pickle writes it."""
    if -(2**31) <= value < 2**31:
        return pickle.BININT + struct.pack("<i", value)
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(data)]) + data


def tup(*items: bytes) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def dct(**items: bytes) -> bytes:
    pairs = b"".join(text(k) + v for k, v in items.items())
    return pickle.EMPTY_DICT + (pickle.MARK + pairs + pickle.SETITEMS if items else b"")


def lst(*items: bytes) -> bytes:
    return pickle.EMPTY_LIST + (pickle.MARK + b"".join(items) + pickle.APPENDS if items else b"")


def call(func: bytes, *args: bytes) -> bytes:
    return func + tup(*args) + pickle.REDUCE


def new(cls: bytes) -> bytes:
    return cls + pickle.EMPTY_TUPLE + pickle.NEWOBJ


def build(target: bytes, state: bytes) -> bytes:
    return target + state + pickle.BUILD


def slots(**items: bytes) -> bytes:
    """A (state, slotstate) pair: pickle sets each slotstate item with setattr, on whatever the target is."""
    return tup(pickle.NONE, dct(**items))


def deep_tuple(depth: int) -> bytes:
    """`((...(None,)...),)`, `depth` tuples deep: one byte a level."""
    return pickle.NONE + pickle.TUPLE1 * depth


def deep_list(depth: int) -> bytes:
    """`[[...[]...]]`, `depth` lists deep: two bytes a level."""
    return pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1)


SIZE = glob("torch", "Size")
LAYOUT = glob("torch.serialization", "_get_layout")
MEM_FORMAT = glob(METADATA, "_MEM_FORMAT_ENCODING")
POSIX = glob("pathlib", "PurePosixPath")


# ------------------------------------------------------------------------- a pickle as a list of opcodes


def opcodes(data: bytes) -> list[tuple[str, object, bytes]]:
    """(name, argument, bytes) of each opcode, FRAME left out (frames are optional: unframed, it reads the same)."""
    ops = list(pickletools.genops(data))
    starts = [pos for _, _, pos in ops] + [len(data)]
    return [(op.name, arg, data[starts[i] : starts[i + 1]]) for i, (op, arg, _) in enumerate(ops) if op.name != "FRAME"]


def joined(ops: list[tuple[str, object, bytes]]) -> bytes:
    return b"".join(raw for _, _, raw in ops)


def splice(data: bytes, place: str, fragment: bytes) -> bytes:
    """The real pickle with `fragment` put at `place`: before the Metadata (its object popped again), as
    StorageMeta.save_id, or as the first tensor's TensorProperties.requires_grad."""
    ops = opcodes(data)
    if place == "first":
        index = next(i for i, (name, _, _) in enumerate(ops) if name not in ("PROTO",))
        return joined(ops[:index]) + fragment + pickle.POP + joined(ops[index:])
    if place == "save_id":
        key = next(i for i, (name, arg, _) in enumerate(ops) if "UNICODE" in name and arg == "save_id")
        index = next(i for i in range(key + 1, len(ops)) if "UNICODE" in ops[i][0])
    else:
        index = next(i for i, (name, _, _) in enumerate(ops) if name == "NEWFALSE")
        assert any(arg == "TensorProperties" for _, arg, _ in ops[:index])
    return joined(ops[:index]) + fragment + joined(ops[index + 1 :])


def with_metadata(source: Path, folder: Path, data: bytes) -> Path:
    """A copy of the DCP folder `source` (its data files linked, not copied) with `data` as its `.metadata`."""
    shutil.copytree(source, folder, copy_function=os.link)
    (folder / ".metadata").unlink()
    (folder / ".metadata").write_bytes(data)
    return folder


def save_tiny_model(folder: Path) -> Path:
    """A DCP folder as a training loop saves one in one process: a tiny model and the iteration."""
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model(NAME, num_classes=0, **TINY))
    dcp.save({"model": model.state_dict(), "iteration": 7}, checkpoint_id=folder, no_dist=True)
    return folder


def run_commands(cases: dict[str, Path], root: Path, convert: list[str] = CONVERT) -> dict[str, dict]:
    """`timm-ls convert` (to `--to meta` with `convert`) and `timm-ls inspect` on each folder of `cases`, all in
    one separate process (dcp_attacks.py), valid folders first: each case's exit codes and output, what it
    changed in pathlib, torch and the unpickler's allowed objects, and the modules it imported."""
    (root / "out").mkdir(parents=True)
    plan = root / "plan.json"
    plan.write_text(
        json.dumps({"cases": {k: str(v) for k, v in cases.items()}, "convert": convert, "out": str(root / "out")})
    )
    worker = SUPPORT / "dcp_attacks.py"
    run = subprocess.run([sys.executable, str(worker), str(plan), str(root / "results.json")], timeout=600)
    assert run.returncode == 0, f"the worker died ({run.returncode}): a case crashed the interpreter"
    return json.loads((root / "results.json").read_text())


def laid_out(folder: Path, tensors: dict[str, tuple[list[int], list[tuple[list[int], list[int]]]]]) -> Path:
    """A DCP folder of float32 tensors `{key: (size, [(offsets, sizes) of each chunk])}` as DCP describes them,
    each chunk stored in the bytes its elements take, one after another in `__0_0.distcp` (a sparse file of
    zeros: the metadata is what is checked); returns the folder."""
    items, storage, end = {}, {}, 0
    for key, (size, chunks) in tensors.items():
        listed = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
        items[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), listed)
        for chunk in listed:
            length = 4 * chunk.sizes.numel()
            storage[MetadataIndex(key, chunk.offsets)] = _StorageInfo("__0_0.distcp", end, length)
            end += length
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(items, storage_data=storage)))
    with (folder / "__0_0.distcp").open("wb") as f:
        f.truncate(end)
    return folder


def stored_items(metadata) -> list[tuple[str, str, int, int]]:
    """(key, file, offset, length) of every item DCP stored, tensors and bytes alike."""
    return [(i.fqn, s.relative_path, s.offset, s.length) for i, s in metadata.storage_data.items()]


# --------------------------------------------------------------------- a DINOv3 training run on two ranks


def prefixed(prefix: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in sd.items()}


def tiny_backbone(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return move_off_init_(timm.create_model(NAME, **TINY), seed).state_dict()


def meta_arch(backbone_sd: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """One of SSLMetaArch's ModuleDicts: the backbone and the DINO and iBOT heads."""
    g = torch.Generator().manual_seed(seed)
    heads = {
        f"{head}.{part}": torch.randn(shape, generator=g)
        for head in ("dino_head", "ibot_head")
        for part, shape in (("mlp.0.weight", (32, 64)), ("mlp.0.bias", (32,)), ("last_layer.weight", (16, 32)))
    }
    return {**prefixed("backbone.", backbone_sd), **heads}


def meta_training_state(student, teacher, ema=None) -> dict:
    """What Meta's `save_checkpoint` passes to dcp.save: iteration, the model's state dict and the optimizer's.

    Without distillation `model_ema` is the teacher module itself, so its keys repeat the teacher's values.
    """
    model = {
        **prefixed("student.", meta_arch(student, 1)),
        **prefixed("teacher.", meta_arch(teacher, 2)),
        **prefixed("model_ema.", meta_arch(teacher if ema is None else ema, 2)),
        "dino_loss.center": torch.randn(1, 16),
        "ibot_patch_loss.center": torch.randn(1, 1, 16),
    }
    params = [k for k in model if k.startswith("student.")]
    optimizer = {
        "state": {k: {"step": torch.tensor(float(ITERATION)), "exp_avg": torch.randn(model[k].shape)} for k in params},
        "param_groups": [{"lr": 1e-3, "weight_decay": 0.04, "params": params}],
    }
    return {"iteration": ITERATION, "model": model, "optimizer": optimizer}


def save_meta_run(root: Path) -> dict:
    """A DINOv3 training output folder saved on two ranks: `ckpt/199/` and `eval/training_199/`."""
    student, teacher = tiny_backbone(1), tiny_backbone(2)
    state = meta_training_state(student, teacher)
    torch.save(state, root / "state.pt")
    torch.save({"iteration": f"training_{ITERATION}", "model": meta_arch(teacher, 2)}, root / "eval.pt")
    ckpt, sharded = (
        root / "ckpt" / str(ITERATION),
        root / "eval" / f"training_{ITERATION}" / "sharded_teacher_checkpoint",
    )
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    env["OMP_NUM_THREADS"] = "1"
    script = [sys.executable, str(SUPPORT / "dcp_ranks.py")]
    args = [str(root / "state.pt"), str(ckpt), str(root / "eval.pt"), str(sharded)]
    ranks = [subprocess.Popen([*script, *args], env={**env, "RANK": str(r)}) for r in range(2)]
    assert [r.wait(timeout=300) for r in ranks] == [0, 0]
    return dict(root=root, ckpt=ckpt, sharded=sharded, student=student, teacher=teacher, state=state)
