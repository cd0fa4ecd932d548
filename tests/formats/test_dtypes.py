"""Every dtype the reader accepts, the writers write, and the two agree with safetensors' own library."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from timm_layerscale.checkpoints import CheckpointError, open_checkpoint
from timm_layerscale.checkpoints.dtypes import SAFETENSORS_DTYPES, safetensors_name
from timm_layerscale.checkpoints.write.writers import write_safetensors, write_torch_file


def _sample(dtype: torch.dtype) -> torch.Tensor:
    """A small tensor of `dtype` whose bytes are not all alike (made from raw bytes: no op needs the dtype)."""
    count = 6 * dtype.itemsize
    raw = torch.arange(count, dtype=torch.uint8) * 37 % 251
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(2, -1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("name", list(SAFETENSORS_DTYPES))
def test_each_safetensors_dtype_writes_and_reads_both_ways(name, tmp_path):
    dtype = SAFETENSORS_DTYPES[name]
    tensor = _sample(dtype)
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, {"x": tensor})
    assert _same(load_file(ours)["x"], tensor)  # safetensors reads what we wrote
    theirs = tmp_path / "theirs.safetensors"
    try:
        save_file({"x": tensor}, theirs)
    except (ValueError, KeyError, TypeError):  # a dtype this safetensors release does not write itself
        theirs = ours
    with open_checkpoint(theirs) as ckpt:  # we read what safetensors wrote
        assert ckpt.info("x").dtype == dtype
        assert _same(ckpt["x"], tensor)
    pth = tmp_path / "x.pth"
    write_torch_file(pth, {"x": tensor})
    with open_checkpoint(pth) as ckpt:
        assert _same(ckpt["x"], tensor)


def test_the_float8_and_unsigned_types_are_in_the_table():
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        assert safetensors_name(dtype) is not None
    if hasattr(torch, "uint32"):
        assert safetensors_name(torch.uint32) == "U32"


def test_a_dtype_safetensors_has_no_name_for_is_refused_before_writing(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(CheckpointError, match=r"complex128, which the safetensors format has no name for"):
        write_safetensors(path, {"x": torch.zeros(2, dtype=torch.complex128)})
    assert not path.exists()


def _raw_safetensors(path: Path, dtype_name: str) -> None:
    header = json.dumps({"x": {"dtype": dtype_name, "shape": [2], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))


def test_a_file_with_an_unknown_dtype_name_is_one_line(tmp_path):
    path = tmp_path / "x.safetensors"
    _raw_safetensors(path, "C128")
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    assert "C128" in message
