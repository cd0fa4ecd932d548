"""torch.distributed.checkpoint folders written in one process, each tensor made only when its bytes are written.

`torch.distributed.checkpoint.save` plans from a state dict of tensors and writes them with its
`FileSystemWriter`. Here the state dict holds meta tensors (shapes and dtypes only); the planner makes each
real tensor from the lazy source when the writer asks for it, and releases the previous one's storage (the
writer keeps a reference to every tensor of a file until the file is closed), so private memory stays near
the largest tensor. The files are DCP's own: `torch.distributed.checkpoint.load` reads them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..mapping.plan import info_of
from .writers import Progress, made_as_planned

Tensor = torch.Tensor


def write_dcp(
    folder: Path,
    tensors: Mapping[str, Tensor],
    under: str,
    items: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> int:
    """Writes `tensors` (a plan, lazy checkpoint or state dict) as DCP items `{under}.{key}` into `folder`,
    with the small picklable `items` (e.g. `{"iteration": 0}`) beside them; returns the tensor bytes written."""
    # Imported on use, as in dcp.py: about 0.4 s that every `import timm` would pay otherwise.
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    infos = {key: info_of(tensors, key) for key in tensors}
    placeholders = {key: torch.empty(info.shape, dtype=info.dtype, device="meta") for key, info in infos.items()}
    prefix = under + "."

    class Streaming(DefaultSavePlanner):
        last: Tensor | None = None

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            if self.last is not None:  # written: the writer's reference may keep it, its bytes need not stay
                self.last.untyped_storage().resize_(0)
            key = write_item.index.fqn.removeprefix(prefix)
            info = infos[key]
            made = made_as_planned(tensors, key, info)
            # A copy of our own: the source's tensor may share storage with the next one or be a mapped file.
            self.last = torch.empty(info.shape, dtype=info.dtype).copy_(made.detach().to("cpu"))
            del made
            if progress is not None:
                progress(info.nbytes)
            return self.last

    writer = FileSystemWriter(folder, single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            save({**dict(items or {}), under: placeholders}, storage_writer=writer, planner=Streaming(), no_dist=True)
    except CheckpointException as exc:  # DCP wraps what failed, per rank: raise that (a CheckpointError stays one)
        raise next(iter(exc.failures.values()))[0] from None
    return sum(info.nbytes for info in infos.values())
