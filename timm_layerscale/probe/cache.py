"""The feature cache: DIR/features/<model>-<key>/block<I>/<split>-<chunk>-<files>.safetensors.

The folder's key is the model's name, its weights' digest (every tensor's name, dtype, shape and bytes), the
transform and the dtype of the forward; each block's features sit in a folder of their own, so any layer set
is read from the blocks it names, and a chunk's file name holds the digest of its images (their paths, sizes
and modification times), so a changed folder is read again. Every file is written whole or not at all, so an
interrupted run leaves complete files only, and the next run computes just what is missing.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import nn

from ..tools.files import write_atomically

CHUNK = 256  # images per cache file: what an interrupted run loses at most, per block
KEY_FILE = "key.json"


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over the state dict in order: each tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _short(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


@dataclass
class Chunk:
    """A run of a split's images, cached together: `members` index the split's image list."""

    split: str
    index: int
    members: list[int]
    digest: str


def chunks(split: str, files: list[list[Path]], size: int = CHUNK) -> list[Chunk]:
    """The split's images (each with the files it is read from: the image, and a mask) in chunks of `size`."""
    found = []
    for index, start in enumerate(range(0, len(files), size)):
        members = list(range(start, min(start + size, len(files))))
        stamp = "\n".join(f"{p.resolve()}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for i in members for p in files[i])
        found.append(Chunk(split, index, members, _short(stamp)))
    return found


@dataclass
class FeatureCache:
    """One model's cached features under `root` (DIR/features)."""

    root: Path
    model: str
    weights: str  # weights_digest
    transform: str
    dtype: str

    @property
    def key(self) -> dict[str, str]:
        return dict(model=self.model, weights=self.weights, transform=self.transform, dtype=self.dtype)

    @property
    def folder(self) -> Path:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model)[:80]
        return self.root / f"{slug}-{_short(json.dumps(self.key, sort_keys=True))}"

    def path(self, block: int, chunk: Chunk) -> Path:
        return self.folder / f"block{block:03d}" / f"{chunk.split}-{chunk.index:05d}-{chunk.digest}.safetensors"

    def has(self, block: int, chunk: Chunk) -> bool:
        return self.path(block, chunk).is_file()

    def read(self, block: int, chunk: Chunk) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """The chunk's tensors and metadata, or None where the file is missing or is not a whole safetensors."""
        path = self.path(block, chunk)
        try:
            data = path.read_bytes()
            tensors = load(data)
        except (OSError, SafetensorError):
            return None
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        return tensors, header.get("__metadata__", {})

    def write(self, block: int, chunk: Chunk, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        path = self.path(block, chunk)
        path.parent.mkdir(parents=True, exist_ok=True)
        key = self.folder / KEY_FILE
        if not key.is_file():
            write_atomically(key, json.dumps(self.key, indent=2) + "\n")
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        write_atomically(path, save(tensors, metadata={**self.key, **metadata, "block": str(block)}))
