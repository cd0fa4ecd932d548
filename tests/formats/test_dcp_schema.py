"""The schema of DCP metadata and the bounds of its unpickling, rule by rule: what DCP writes passes (one rank,
two ranks, 2-D grids, empty chunks, scalars) and each broken rule is refused in one line naming the file.

Bounds are tested at their edge: a limit equal to what a real file needs passes, one less refuses it.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.dcp import METADATA, SIZE, build, call, dct, glob, integer, laid_out, new, text, tup, with_metadata
from torch.distributed.checkpoint.metadata import MetadataIndex

from timm_layerscale.checkpoints import CheckpointError
from timm_layerscale.checkpoints.read.dcp.reader import read_metadata
from timm_layerscale.checkpoints.read.dcp.schema import LIMITS, Limits, Work, check_metadata

CORRUPT = "; the metadata is corrupt: copy the whole folder again"
NEVER = ", which distributed checkpoint metadata never does (nothing was changed); use a checkpoint you trust"


def read(folder: Path, limits: Limits = LIMITS) -> Work:
    work = Work()
    read_metadata(folder, limits, work)
    return work


def refused(folder: Path, limits: Limits = LIMITS, metadata=None) -> str:
    """The one-line message of reading `folder` (or checking `metadata` as if it were the folder's)."""
    with pytest.raises(CheckpointError) as info:
        if metadata is None:
            read_metadata(folder, limits)
        else:
            check_metadata(metadata, folder, limits)
    message = str(info.value)
    assert "\n" not in message and message.count(str(folder)) >= 1
    return message


def corrupt(folder: Path, what: str) -> str:
    return f"{folder / '.metadata'} {what}{CORRUPT}"


# ------------------------------------------------------------------------------------ what DCP writes


@pytest.mark.parametrize(
    "tensors",
    [
        {"t": ([8, 4], [([0, 0], [4, 4]), ([4, 0], [4, 4])])},  # FSDP: dim 0 across ranks
        {"t": ([8, 4], [([r, c], [2, 2]) for r in range(0, 8, 2) for c in (0, 2)])},  # 2-D: FSDP x TP
        {"t": ([5, 3], [([0, 0], [3, 3]), ([3, 0], [2, 3]), ([5, 0], [0, 3])])},  # uneven, one rank empty
        {"t": ([], [([], [])]), "u": ([0, 3], [([0, 0], [0, 3])])},  # a scalar, an empty tensor
        {"k" * LIMITS.name_length: ([1] * LIMITS.dims, [([0] * LIMITS.dims, [1] * LIMITS.dims)])},  # at the bounds
    ],
    ids=["fsdp", "grid", "uneven", "scalar-and-empty", "longest-name-most-dims"],
)
def test_layouts_dcp_writes_pass(tmp_path, tensors):
    work = read(laid_out(tmp_path / "ckpt", tensors))
    assert work.chunks == sum(len(chunks) for _, chunks in tensors.values())
    assert work.overlap_checks <= LIMITS.overlap_checks_per_chunk * work.chunks


def test_a_real_folder_needs_exactly_this_much(meta_run):
    """The two-rank training folder: 9 levels deep; every count within the file's size. Each limit at what
    the folder needs passes, one less refuses it."""
    work = read(meta_run["ckpt"])
    assert work.depth == 9
    assert max(work.opcodes, work.objects, work.items) <= work.bytes
    assert work.overlap_checks <= work.chunks
    exact = dict(metadata_bytes=work.bytes, depth=work.depth, objects=work.objects, items=work.items)
    read(meta_run["ckpt"], Limits(**exact))
    for name, value in exact.items():
        message = refused(meta_run["ckpt"], Limits(**{**exact, name: value - 1}))
        assert str(value - 1) in message, (name, message)


# ----------------------------------------------------------------------------- chunks and their tensors


@pytest.mark.parametrize(
    ("tensors", "what"),
    [
        (
            {"t": ([64], [([0], [32]), ([16], [32])])},
            "does not cover all of t [64] with stored chunks, each element once",
        ),
        (
            {"t": ([4, 4], [([0, 0], [2, 4]), ([0, 0], [2, 4])])},
            "does not cover all of t [4, 4] with stored chunks, each element once",
        ),
        ({"t": ([64], [([0], [32])])}, "does not cover all of t [64] with stored chunks, each element once"),
        ({"t": ([4], [([1], [4])])}, "gives t [4] a chunk at [1] of [4], outside it"),
        ({"t": ([4, 4], [([0], [4])])}, "gives t [4, 4] a chunk at torch.Size([0]) of torch.Size([4])"),
        ({"t": ([], [([], []), ([], [])])}, "does not cover all of t [] with stored chunks, each element once"),
    ],
    ids=["overlap", "duplicate", "gap", "outside", "wrong-rank", "scalar-twice"],
)
def test_chunks_cover_their_tensor_exactly_once(tmp_path, tensors, what):
    folder = laid_out(tmp_path / "ckpt", tensors)
    assert refused(folder) == corrupt(folder, what)


def test_chunk_counts_and_overlap_checks_are_bounded(tmp_path):
    grid = laid_out(tmp_path / "grid", {"t": ([4, 4], [([r, c], [2, 2]) for r in (0, 2) for c in (0, 2)])})
    assert read(grid).overlap_checks == 2  # the sweep compares each chunk with its row's other only
    columns = laid_out(tmp_path / "tp", {"t": ([2, 8], [([0, c], [2, 2]) for c in range(0, 8, 2)])})
    assert read(columns).overlap_checks == 0  # split along dim 1 only: swept along it, nothing to compare
    assert "splits a tensor into 4 chunks too entangled to check" in refused(grid, Limits(overlap_checks_per_chunk=0))
    assert "splits t into 4 chunks, more than any checkpoint" in refused(grid, Limits(chunks_per_tensor=3))
    read(grid, Limits(chunks_per_tensor=4, chunks=4))
    assert "(in all: 3)" in refused(grid, Limits(chunks=3))
    two = laid_out(tmp_path / "two", {"t": ([1], [([0], [1])]), "u": ([1], [([0], [1])])})
    read(two, Limits(keys=2))
    assert "lists 2 items, more than the 1 any checkpoint holds" in refused(two, Limits(keys=1))


def test_the_bytes_of_a_tensor_are_bounded_by_its_stored_chunks(tmp_path):
    folder = laid_out(tmp_path / "ckpt", {"t": ([8], [([0], [8])])})
    metadata = read_metadata(folder)
    metadata.state_dict_metadata["t"].properties.dtype = torch.float64  # 8 elements of 8 bytes in 32
    assert refused(folder, metadata=metadata) == corrupt(
        folder,
        "gives the chunk of t at [0] [8] torch.float64 elements (64 bytes), more than the 32 bytes it is stored in",
    )
    metadata.state_dict_metadata["t"].properties.dtype = torch.int32  # the same 32 bytes: read as stored
    check_metadata(metadata, folder)


# ----------------------------------------------------------------------------- each field of each class


def changed(folder: Path, change: Callable) -> object:
    metadata = read_metadata(folder)
    change(metadata)
    return metadata


def item(md, key: str = "t"):
    return md.state_dict_metadata[key]


def entry(md, key: str = "t"):
    return next(info for index, info in md.storage_data.items() if index.fqn == key)


FIELDS = [
    (lambda md: setattr(md, "state_dict_metadata", []), "lists no stored items"),
    (lambda md: setattr(md, "version", 5), "gives as its storage_meta and version None and 5"),
    (lambda md: setattr(md, "storage_meta", "x"), "gives as its storage_meta and version 'x' and None"),
    (
        lambda md: md.state_dict_metadata.update({7: item(md)}),
        "names an item 7, not a string of at most 1024 characters",
    ),
    (lambda md: md.state_dict_metadata.update({"k" * 1025: item(md)}), "names an item 'kkkkkkkkkkkk"),
    (lambda md: md.state_dict_metadata.update({"u": 5}), "gives u 5, not a tensor or bytes item"),
    (lambda md: vars(item(md).properties).pop("dtype"), "holds a TensorProperties without its dtype"),
    (lambda md: setattr(item(md).properties, "dtype", torch.qint8), "gives t the dtype torch.qint8, which is no dtype"),
    (lambda md: setattr(item(md).properties, "dtype", "torch.float32"), "gives t the dtype 'torch.float32', which"),
    (lambda md: setattr(item(md).properties, "layout", torch.sparse_coo), "gives t the layout torch.sparse_coo, which"),
    (lambda md: setattr(item(md), "size", torch.Size([2**61])), "gives t the size torch.Size([2305843009213693952])"),
    (lambda md: setattr(item(md), "size", torch.Size([1] * 65)), "gives t the size torch.Size([1, 1, 1, 1, 1, 1,"),
    (lambda md: setattr(item(md).chunks[0], "sizes", torch.Size([-1])), "gives t [2] a chunk at torch.Size([0]) of"),
    (lambda md: setattr(item(md).chunks[0], "offsets", torch.Size([-1])), "gives t [2] a chunk at torch.Size([-1]) of"),
    (lambda md: item(md, "u").chunks.append(item(md).chunks[0]), "gives u a chunk that another tensor or place lists"),
    (lambda md: setattr(item(md, "u"), "chunks", item(md).chunks), "gives u the list of chunks of another tensor"),
    (lambda md: setattr(entry(md), "relative_path", ""), "puts t in '', outside the folder"),
    (lambda md: setattr(entry(md), "relative_path", ".."), "puts t in '..', outside the folder"),
    (lambda md: setattr(entry(md), "relative_path", "a/b"), "puts t in 'a/b', outside the folder"),
    (lambda md: setattr(entry(md), "relative_path", "a\0b"), "puts t in 'a\\x00b', outside the folder"),
    (lambda md: setattr(entry(md), "relative_path", "a" * 256), "puts t in 'aaaaaaaa"),
    (lambda md: setattr(entry(md), "offset", -1), "puts t at bytes -1 to 8 of __0_0.distcp"),
    (lambda md: setattr(entry(md), "length", 9.0), "puts t at bytes 0 to 9.0 of __0_0.distcp"),
    (lambda md: setattr(entry(md), "length", 17), "puts t at bytes 0 to 17 of __0_0.distcp, which holds 16"),
    (lambda md: setattr(entry(md, "u"), "offset", 7), "puts u on bytes of __0_0.distcp that also hold t"),
    (lambda md: md.storage_data.pop(MetadataIndex("u", [0])), "does not cover all of u with stored chunks (none is"),
    (
        lambda md: setattr(entry(md), "transform_descriptors", ["stream.zstd/1"]),
        "stores t transformed (['stream.zstd/1'], e.g. compressed), which this reader does not read",
    ),
]


@pytest.mark.parametrize(("change", "what"), FIELDS, ids=range(len(FIELDS)))
def test_each_field_is_checked(tmp_path, change, what):
    folder = laid_out(tmp_path / "ckpt", {"t": ([2], [([0], [2])]), "u": ([2], [([0], [2])])})
    message = refused(folder, metadata=changed(folder, change))
    assert message.startswith(f"{folder / '.metadata'} {what}") and message.endswith(CORRUPT), message


def test_an_empty_chunk_takes_no_bytes_wherever_it_is_listed(tmp_path):
    folder = laid_out(tmp_path / "ckpt", {"t": ([2], [([0], [2])]), "u": ([0], [([0], [0])])})
    check_metadata(changed(folder, lambda md: setattr(entry(md, "u"), "offset", 4)), folder)  # inside t's bytes


def test_a_folder_without_a_listed_file(tmp_path):
    folder = laid_out(tmp_path / "ckpt", {"t": ([2], [([0], [2])])})
    metadata = changed(folder, lambda md: setattr(entry(md), "relative_path", "__1_0.distcp"))
    assert (
        refused(folder, metadata=metadata)
        == f"{folder} lacks __1_0.distcp, which its .metadata lists; copy the whole folder"
    )


def test_fields_older_dcp_leaves_out_may_be_missing(tmp_path):
    folder = laid_out(tmp_path / "ckpt", {"t": ([2], [([0], [2])])})
    metadata = read_metadata(folder)
    for absent in (metadata, entry(metadata)):
        vars(absent).pop("storage_meta" if absent is metadata else "transform_descriptors", None)
    vars(metadata).pop("version", None)
    check_metadata(metadata, folder)


# --------------------------------------------------------------------------------- the unpickler's rules


def pickled(*fragments: bytes) -> bytes:
    return b"\x80\x04" + b"".join(fragments) + pickle.STOP


STORAGE_META = glob(METADATA, "StorageMeta")
INDEX = glob(METADATA, "MetadataIndex")
UNPICKLED = [
    (pickle.EMPTY_LIST + pickle.MEMOIZE + pickle.TUPLE1 + pickle.POP + b"h\x00" + pickle.NONE + pickle.APPEND,
     "appends to a list already inside another object" + NEVER),
    (pickle.EMPTY_DICT + pickle.MEMOIZE + pickle.EMPTY_LIST + pickle.MARK + b"h\x00" + pickle.APPENDS + pickle.POP
     + b"h\x00" + text("k") + pickle.NONE + pickle.SETITEM, "sets an item of a dict already inside another object"),
    (pickle.EMPTY_SET + pickle.MEMOIZE + pickle.TUPLE1 + pickle.POP + b"h\x00" + pickle.MARK + text("k")
     + pickle.ADDITEMS, "adds to a set already inside another object"),
    (new(STORAGE_META) + pickle.MEMOIZE + pickle.TUPLE1 + pickle.POP + build(b"h\x00", dct(save_id=text("x"))),
     "sets the state of a torch.distributed.checkpoint.metadata.StorageMeta (pickle BUILD)"),
    (pickle.EMPTY_DICT + new(INDEX) + pickle.NONE + pickle.SETITEM,
     "uses a torch.distributed.checkpoint.metadata.MetadataIndex as a key or set element" + NEVER),
    (pickle.EMPTY_DICT + build(new(INDEX), dct(fqn=integer(1))) + pickle.NONE + pickle.SETITEM,
     "uses a torch.distributed.checkpoint.metadata.MetadataIndex as a key"),
    (pickle.EMPTY_DICT + build(new(INDEX), dct(fqn=text("k" * 1025))) + pickle.NONE + pickle.SETITEM,
     "uses a torch.distributed.checkpoint.metadata.MetadataIndex as a key"),
    (pickle.EMPTY_DICT + build(new(INDEX), dct(fqn=text("k"), offset=tup(integer(0)))) + pickle.NONE + pickle.SETITEM,
     "uses a torch.distributed.checkpoint.metadata.MetadataIndex as a key"),
    (pickle.EMPTY_DICT + tup(integer(1)) + pickle.NONE + pickle.SETITEM, "uses a builtins.tuple as a key" + " or set"),
    (pickle.MARK + pickle.BINFLOAT + bytes(8) + pickle.NONE + pickle.DICT, "uses a builtins.float as a key or set"),
    (pickle.MARK + integer(1) + pickle.FROZENSET, "uses a builtins.int as a key or set element"),
    (pickle.EMPTY_SET + pickle.MARK + text("k") + integer(1) + pickle.ADDITEMS, "uses a builtins.int as a key or set"),
    (pickle.EMPTY_DICT + text("k" * 1025) + pickle.NONE + pickle.SETITEM, "uses a string of 1025 characters as a key"),
    (call(SIZE, tup(*[integer(1)] * 65)), "calls the class torch.Size with ((1, 1, 1, 1, 1, 1, ...),) (pickle REDUCE)"),
    (call(SIZE, tup(integer(2**61))), "calls the class torch.Size with ((2305843009213693952,),) (pickle REDUCE)"),
    (call(SIZE, tup(integer(-(2**61)))), "calls the class torch.Size with ((-2305843009213693952,),)"),
    (pickle.BYTEARRAY8 + (2**40).to_bytes(8, "little"), "makes a bytearray or an out-of-band buffer" + NEVER),
    (pickle.MARK + pickle.NONE + pickle.NONE + pickle.NONE + pickle.DICT, "(UnpicklingError: DICT with a key and no"),
]  # fmt: skip


@pytest.mark.parametrize(("fragment", "what"), UNPICKLED, ids=range(len(UNPICKLED)))
def test_the_unpickler_refuses_before_it_changes_or_hashes(dcp_folder, tmp_path, fragment, what):
    folder = with_metadata(dcp_folder, tmp_path / "ckpt", pickled(fragment, pickle.POP, b"N"))
    assert what in refused(folder)


def test_what_the_unpickler_takes_at_its_bounds(dcp_folder, tmp_path):
    edge = pickled(pickle.EMPTY_DICT, text("k" * 1024), call(SIZE, tup(integer(2**61 - 1), integer(1 - 2**61))),
                   pickle.SETITEM, pickle.POP, pickle.NONE)  # fmt: skip
    folder = with_metadata(dcp_folder, tmp_path / "ckpt", edge)
    assert "holds a NoneType, not distributed checkpoint metadata" in refused(folder)


def test_limits_are_one_frozen_table():
    assert dataclasses.is_dataclass(LIMITS) and Limits() == LIMITS
    with pytest.raises(dataclasses.FrozenInstanceError):
        LIMITS.depth = 10**6  # type: ignore[misc]
    assert (LIMITS.depth, LIMITS.dims, LIMITS.name_length, LIMITS.size_value) == (32, 64, 1024, 2**61)
