"""Reading DCP `.metadata`: time and counted work grow linearly with the file, crafted files included.

    python benchmarks/dcp_metadata.py --workdir /tmp [--rounds 5] [--max-tensors 16000]

`read_metadata` (the checked unpickler, then the schema) on files of growing size, each size timed in turn
within every round (the order rotating from round to round, so drift on a shared machine hits all alike);
medians over the rounds, with the read's own counters (`Work`) beside them:

- valid: N tensors of two chunks each (two ranks), as torch pickles DCP's metadata, data files sparse;
- shared chunk list: N tensors sharing one list of N chunks through the memo (refused: once N^2 work);
- deep tuple key: a tuple D levels deep as a dict key before a small metadata (refused: once a SIGSEGV);
- every tensor read: `open_checkpoint` of a folder `torch.distributed.checkpoint.save` wrote with N small
  tensors, then each tensor read (per read, DCP's planner no longer builds the set of all N keys).

Linear growth shows as a constant time per KB (and per tensor) down each block of rows.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

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

from timm_layerscale.checkpoints import CheckpointError, open_checkpoint
from timm_layerscale.checkpoints.read.dcp.reader import read_metadata
from timm_layerscale.checkpoints.read.dcp.schema import Work


def write(folder: Path, metadata: Metadata, data_bytes: int) -> Path:
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with (folder / "__0_0.distcp").open("wb") as f:
        f.truncate(data_bytes)  # sparse: the metadata is what is read
    return folder


def valid(folder: Path, n: int) -> Path:
    """N tensors [64, 8] of two chunks each, stored one after another."""
    items, storage, end = {}, {}, 0
    for i in range(n):
        halves = [ChunkStorageMetadata(torch.Size([r * 32, 0]), torch.Size([32, 8])) for r in range(2)]
        items[f"model.blocks.{i}.weight"] = TensorStorageMetadata(TensorProperties(), torch.Size([64, 8]), halves)
        for chunk in halves:
            storage[MetadataIndex(f"model.blocks.{i}.weight", chunk.offsets)] = _StorageInfo("__0_0.distcp", end, 1024)
            end += 1024
    return write(folder, Metadata(items, storage_data=storage), end)


def shared(folder: Path, n: int) -> Path:
    chunks = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(n)]
    properties, size = TensorProperties(), torch.Size([n])
    items = {f"model.t{j}": TensorStorageMetadata(properties, size, chunks) for j in range(n)}
    storage = {MetadataIndex("model.t0", [i]): _StorageInfo("__0_0.distcp", 4 * i, 4) for i in range(n)}
    return write(folder, Metadata(items, storage_data=storage), 4 * n)


def deep_key(folder: Path, depth: int, real: bytes) -> Path:
    fragment = pickle.EMPTY_DICT + pickle.NONE + pickle.TUPLE1 * depth + pickle.NONE + pickle.SETITEM + pickle.POP
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(real[:2] + fragment + real[2:])  # after PROTO: framing is optional
    return folder


def saved(folder: Path, n: int) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"model": {f"blocks.{i}.weight": torch.full((4,), float(i)) for i in range(n)}}
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder


def read_all(folder: Path) -> int:
    with open_checkpoint(folder) as checkpoint:
        return sum(checkpoint[key].numel() for key in checkpoint)


def counted(folder: Path) -> Work:
    work = Work()
    with contextlib.suppress(CheckpointError):
        read_metadata(folder, work=work)
    return work


def timed(cases: dict[str, tuple[Path, Callable[[Path], object]]], rounds: int) -> dict[str, float]:
    names, times = list(cases), {name: [] for name in cases}
    for folder, call in cases.values():  # warm-up: imports, allocator
        with contextlib.suppress(CheckpointError):
            call(folder)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            folder, call = cases[name]
            start = time.perf_counter()
            with contextlib.suppress(CheckpointError):
                call(folder)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def run(root: Path, rounds: int, max_tensors: int) -> None:
    sizes = [n for n in (1000, 2000, 4000, 8000, 16000) if n <= max_tensors]
    blocks = {
        "valid": {n: (valid(root / f"valid-{n}", n), read_metadata) for n in sizes},
        "shared chunk list": {n: (shared(root / f"shared-{n}", n), read_metadata) for n in sizes},
    }
    real = (valid(root / "base", 10) / ".metadata").read_bytes()
    depths = (10_000, 100_000, 300_000, 1_000_000)
    blocks["deep tuple key"] = {d: (deep_key(root / f"deep-{d}", d, real), read_metadata) for d in depths}
    blocks["every tensor read"] = {n // 4: (saved(root / f"saved-{n}", n // 4), read_all) for n in sizes[:4]}
    print(f"{rounds} rounds, Python {sys.version.split()[0]}, torch {torch.__version__}, {root}")
    print("| case | N | .metadata (KB) | median (ms) | per KB (µs) | per N (µs) | opcodes | objects | chunks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for block, cases in blocks.items():
        medians = timed({str(n): case for n, case in cases.items()}, rounds)
        for n, (folder, _) in cases.items():
            kb, work, ms = (folder / ".metadata").stat().st_size / 1024, counted(folder), medians[str(n)] * 1e3
            row = [block, f"{n:,}", f"{kb:,.0f}", f"{ms:,.1f}", f"{ms * 1e3 / kb:.1f}", f"{ms * 1e3 / n:.2f}"]
            print("| " + " | ".join([*row, f"{work.opcodes:,}", f"{work.objects:,}", f"{work.chunks:,}"]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tensors", type=int, default=16000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.workdir, prefix="dcp-metadata-"))
    try:
        run(root, args.rounds, args.max_tensors)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
