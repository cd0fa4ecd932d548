"""A seeded, structure-aware fuzzer of DCP `.metadata`: mutations of a real folder's metadata (two ranks, so
tensors of two chunks, and a bytes item), from tests/support/dcp_mutations.py: values, opcodes, sizes,
sharing through the memo, nesting.

Every case must end in one of two ways: a `CheckpointError` of one line naming the folder, or a correct read.
A read is correct when every tensor either fails with a one-line `CheckpointError` or has the shape and dtype
the metadata gives it, and every tensor whose metadata the mutation left alone reads exactly as saved. Each
accepted metadata needs no more bytes for its tensors than the data files hold. Each case's work stays within
the read's bounds, and no case changes torch, pathlib or the unpickler's allowed objects. A sample of the
cases runs through `timm-ls convert` and `timm-ls inspect` in one separate process (no crash, exit 0 or 2 with
one line). Failures name the seed and the mutation: `Mutator(data).case(seed)` rebuilds the file.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from support.dcp import run_commands, with_metadata
from support.dcp_attacks import attributes, changes
from support.dcp_mutations import Mutator
from torch.distributed.checkpoint.metadata import MetadataIndex

from timm_layerscale.checkpoints import CheckpointError
from timm_layerscale.checkpoints.read.dcp.reader import read_metadata, tensor_items, tensor_reader
from timm_layerscale.checkpoints.read.dcp.schema import LIMITS, Work
from timm_layerscale.checkpoints.read.reader import open_checkpoint

SEED = 20261201
BATCHES, PER_BATCH = 6, 50  # 300 cases in-process
EVERY = 8  # one case in 8 also through the commands


def describe(metadata, key: str) -> tuple:
    """What DCP reads one tensor from: its size, dtype, chunks and where each chunk's bytes lie."""
    item = metadata.state_dict_metadata[key]
    stored = []
    for chunk in sorted(item.chunks, key=lambda c: tuple(c.offsets)):
        info = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        stored.append((tuple(chunk.offsets), tuple(chunk.sizes), info.relative_path, info.offset, info.length))
    return tuple(item.size), item.properties.dtype, tuple(stored)


class Source:
    """The folder fuzzed: its metadata's bytes, and each tensor as saved, with what it was read from."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.data = (folder / ".metadata").read_bytes()
        self.mutator = Mutator(self.data)
        metadata = read_metadata(folder)
        read = tensor_reader(folder, metadata)
        self.tensors = {key: read(key) for key in tensor_items(metadata)}
        self.described = {key: describe(metadata, key) for key in self.tensors}


@pytest.fixture(scope="module")
def source(meta_run, tmp_path_factory) -> Source:
    return Source(shutil.copytree(meta_run["sharded"], tmp_path_factory.mktemp("fuzz") / "ckpt"))


def one_line(exc: CheckpointError, folder: Path) -> str:
    message = str(exc)
    assert "\n" not in message and str(folder) in message and "; " in message, message
    return message


def within_bounds(work: Work) -> None:
    assert work.opcodes <= work.bytes <= LIMITS.metadata_bytes
    assert work.objects <= min(work.bytes, LIMITS.objects) and work.items <= min(work.bytes, LIMITS.items)
    assert work.depth <= LIMITS.depth
    assert work.chunks <= LIMITS.chunks and work.overlap_checks <= (LIMITS.overlap_checks_per_chunk + 1) * work.chunks


def within_data_files(metadata, folder: Path) -> None:
    """The element counts of all tensors together take no more bytes than the data files hold."""
    files = {info.relative_path for info in metadata.storage_data.values()}
    held = sum((folder / name).stat().st_size for name in files)
    needed = sum(math.prod(shape) * dtype.itemsize for shape, dtype in tensor_items(metadata).values())
    assert needed <= held


def reads_correctly(metadata, folder: Path, source: Source) -> None:
    """Each tensor through DCP's reader, as `open_checkpoint` reads it: the metadata's shape and dtype, and
    what was saved wherever the metadata of the tensor is unchanged."""
    read = tensor_reader(folder, metadata)
    for key, (shape, dtype) in tensor_items(metadata).items():
        unchanged = source.described.get(key) == describe(metadata, key)
        try:
            value = read(key)
        except CheckpointError as exc:
            assert not unchanged, (key, str(exc))
            one_line(exc, folder)
            continue
        assert (value.shape, value.dtype) == (shape, dtype), key
        assert not unchanged or torch.equal(value, source.tensors[key]), key


def reads_as_users_read(folder: Path) -> None:
    try:
        checkpoint = open_checkpoint(folder)
    except CheckpointError as exc:
        one_line(exc, folder)
        return
    with checkpoint:
        for key in checkpoint:
            try:
                value = checkpoint[key]
            except CheckpointError as exc:
                one_line(exc, folder)
                continue
            assert (value.shape, value.dtype) == (checkpoint.info(key).shape, checkpoint.info(key).dtype)


def run_case(source: Source, folder: Path, data: bytes) -> str:
    """'read', or the message of the refusal."""
    (folder / ".metadata").write_bytes(data)
    work = Work()
    try:
        metadata = read_metadata(folder, LIMITS, work)
    except CheckpointError as exc:
        return one_line(exc, folder)
    finally:
        within_bounds(work)
    within_data_files(metadata, folder)
    reads_correctly(metadata, folder, source)
    reads_as_users_read(folder)
    return "read"


@pytest.mark.parametrize("batch", range(BATCHES))
def test_fuzzed_metadata_is_refused_in_one_line_or_read_correctly(source, tmp_path, batch):
    folder = with_metadata(source.folder, tmp_path / "ckpt", source.data)
    before = attributes()
    outcomes = []
    for seed in range(SEED + batch * PER_BATCH, SEED + (batch + 1) * PER_BATCH):
        data, done = source.mutator.case(seed)
        try:
            outcomes.append(run_case(source, folder, data))
            assert changes(before, attributes()) == []
        except BaseException as exc:
            raise AssertionError(f"case {seed} ({'; '.join(done)}): {type(exc).__name__}: {exc}") from exc
    assert "read" in outcomes and len(set(outcomes)) > 5, outcomes  # both ends, many kinds of refusal


def test_the_fuzzer_reaches_every_rule_of_the_reader(source, tmp_path):
    """Across the cases: reads, refusals by the unpickler, by the schema, and for a missing file."""
    folder = with_metadata(source.folder, tmp_path / "ckpt", source.data)
    outcomes = [run_case(source, folder, source.mutator.case(seed)[0]) for seed in range(SEED, SEED + 120)]
    assert outcomes.count("read") >= 10
    for found in ("refused to read", "nests objects more than 32 deep", "not readable distributed checkpoint",
                  "the metadata is corrupt", "as a key or set element"):  # fmt: skip
        assert any(found in outcome for outcome in outcomes), found


def test_a_sample_through_the_commands_exits_0_or_2_in_one_line(source, tmp_path):
    cases, expected = {"valid": source.folder}, {}
    for seed in range(SEED, SEED + BATCHES * PER_BATCH, EVERY):
        data, _ = source.mutator.case(seed)
        folder = with_metadata(source.folder, tmp_path / str(seed), data)
        cases[str(seed)] = folder
        try:
            read_metadata(folder)
            expected[str(seed)] = None
        except CheckpointError as exc:
            expected[str(seed)] = " ".join(str(exc).split())
    results = run_commands(cases, tmp_path / "commands")
    for case, refusal in expected.items():
        result = results[case]
        for command in ("convert", "inspect"):
            code, out, err = result[command]
            assert code in (0, 2), (case, command, err)
            assert code == 0 or ((out, err.count("\n")) == ("", 1) and err.startswith("timm-ls: error: ")), (case, err)
            assert refusal is None or (code, err) == (2, f"timm-ls: error: {refusal}\n"), (case, command, err)
        assert result["changed"] == [] and result["imported"] == [] and result["paths_work"], case
        assert result["written"] == (result["convert"][0] == 0), case
