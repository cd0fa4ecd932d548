"""The DCP writer (checkpoints/write/dcp.py): torch's own folder layout in one process, one data file per rank,
and each streamed tensor's memory released as soon as it is written."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping

import torch
import torch.distributed.checkpoint as dcp

from timm_layerscale.checkpoints import TensorInfo
from timm_layerscale.checkpoints.write.dcp import write_dcp

# Sizes no other tensor of the test process has, so that each tensor is known by its shape alone.
SHAPES = {"a": (1237,), "b": (97, 13), "c": (2311,), "d": (3, 5, 7, 11)}


class Streamed(Mapping[str, torch.Tensor]):
    """A lazy source as the converters give the writer: shapes first, each tensor made when asked for. On
    each request it records the writer's copies of the tensors made before, by shape, and their bytes."""

    def __init__(self) -> None:
        self.made: dict[str, torch.Tensor] = {}  # kept: the writer's copies are the other tensors of a shape
        self.copies_then: dict[str, list[int]] = {}

    def info(self, key: str) -> TensorInfo:
        return TensorInfo(torch.Size(SHAPES[key]), torch.float32)

    def __getitem__(self, key: str) -> torch.Tensor:
        self.copies_then[key] = [
            t.untyped_storage().nbytes() for earlier in self.made for t in copies(SHAPES[earlier], self.made[earlier])
        ]
        self.made[key] = torch.arange(torch.Size(SHAPES[key]).numel(), dtype=torch.float32).reshape(SHAPES[key])
        return self.made[key]

    def __iter__(self) -> Iterator[str]:
        return iter(SHAPES)

    def __len__(self) -> int:
        return len(SHAPES)


def copies(shape: tuple[int, ...], own: torch.Tensor) -> list[torch.Tensor]:
    """Live tensors of `shape` that are not views of `own`: the writer's copies of it."""
    return [
        t
        for t in gc.get_objects()
        if type(t) is torch.Tensor
        and not t.is_meta
        and t.shape == shape
        and (t.untyped_storage().nbytes() == 0 or t.untyped_storage().data_ptr() != own.untyped_storage().data_ptr())
    ]


def test_each_streamed_tensor_is_released_once_written(tmp_path):
    """When the next tensor is asked for, the writer's copy of each tensor before it holds no bytes (DCP's
    writer keeps a reference to every tensor of a file until the file is closed)."""
    source = Streamed()
    write_dcp(tmp_path / "out", source, "model")
    assert list(source.copies_then) == list(SHAPES)
    for key, held in list(source.copies_then.items())[1:]:
        assert held and set(held) == {0}, (key, held)  # copies exist, each emptied


def test_one_data_file_per_rank_that_torch_reads_back(tmp_path):
    write_dcp(tmp_path / "out", Streamed(), "model", items={"iteration": 3})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".metadata", "__0_0.distcp"]
    state = {"model": {k: torch.zeros(s) for k, s in SHAPES.items()}, "iteration": 0}
    dcp.load(state, checkpoint_id=tmp_path / "out", no_dist=True)
    assert state["iteration"] == 3
    for key, shape in SHAPES.items():
        assert torch.equal(
            state["model"][key], torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        )
