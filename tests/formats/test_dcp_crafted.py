"""Crafted `.metadata` files, spliced into a real DCP folder, that once crashed a read (SIGSEGV), raised a
traceback or took time quadratic in their size: each is refused in one line within counted, linear work,
in-process and through `timm-ls convert` and `timm-ls inspect` (exit 2, nothing written, nothing else on
stderr, no module imported, nothing of torch or pathlib changed).

The work is measured by the read's counters (`Work`), never by a clock: benchmarks/dcp_metadata.py times it.
The schema's rules one by one are in test_dcp_schema.py.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
from support.dcp import (
    LAYOUT,
    call,
    deep_list,
    deep_tuple,
    glob,
    joined,
    opcodes,
    run_commands,
    splice,
    text,
    with_metadata,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from timm_layerscale.checkpoints import CheckpointError
from timm_layerscale.checkpoints.read.dcp.reader import read_metadata
from timm_layerscale.checkpoints.read.dcp.schema import LIMITS, Limits, Work
from timm_layerscale.checkpoints.read.reader import open_checkpoint

GAMMA = "model.blocks.0.ls1.gamma"
DEEP = 300_000
SHARED = 12_000
CORRUPT = "; the metadata is corrupt: copy the whole folder again"
TRUST = ", which distributed checkpoint metadata never does (nothing was changed); use a checkpoint you trust"


def refusal(folder: Path, limits: Limits = LIMITS) -> tuple[str, Work]:
    """The one-line CheckpointError that reading `folder` gives, and the work the read did."""
    work = Work()
    with pytest.raises(CheckpointError) as info:
        read_metadata(folder, limits, work)
    message = str(info.value)
    assert "\n" not in message and str(folder) in message
    assert work.opcodes <= work.bytes and work.objects <= work.bytes and work.items <= work.bytes
    assert work.depth <= limits.depth
    return message, work


def rewritten(source: Path, folder: Path, change) -> Path:
    """A copy of `source` whose metadata `change(metadata)` altered, pickled as torch pickles it."""
    metadata = read_metadata(source)
    change(metadata)
    return with_metadata(source, folder, pickle.dumps(metadata))


def sized(metadata: Metadata, key: str, size: list[int]) -> None:
    """The tensor `key` and its one chunk given the size `size`."""
    item = metadata.state_dict_metadata[key]
    item.size = item.chunks[0].sizes = torch.Size(size)
    item.chunks[0].offsets = torch.Size([0] * len(size))


# --------------------------------------------------------------------------------------- crafted files


def unbuilt_properties(data: bytes) -> bytes:
    """The first TensorProperties made (NEWOBJ) and its state built, but never given it: BUILD becomes POP."""
    ops = opcodes(data)
    made = next(i for i, (name, arg, _) in enumerate(ops) if arg == "TensorProperties")
    build = next(i for i in range(made, len(ops)) if ops[i][0] == "BUILD")
    return joined(ops[:build]) + pickle.POP + joined(ops[build + 1 :])


def replaced_string(data: bytes, value: str, fragment: bytes) -> bytes:
    """The first string opcode of `value` replaced by `fragment` (memoized in its place, so every later
    reference to the string gets the fragment's object)."""
    ops = opcodes(data)
    index = next(i for i, (name, arg, _) in enumerate(ops) if "UNICODE" in name and arg == value)
    return joined(ops[:index]) + fragment + joined(ops[index + 1 :])


def shared_chunk_list(folder: Path, n: int) -> Path:
    """`n` tensors of `n` elements that share one list of `n` chunks through the pickle's memo: a file linear in
    `n` whose every tensor lists all the chunks, so a check that walks each tensor's chunks takes `n`^2 steps."""
    folder.mkdir()
    chunks = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(n)]
    properties, size = TensorProperties(dtype=torch.float32), torch.Size([n])
    items = {f"model.t{j}": TensorStorageMetadata(properties, size, chunks) for j in range(n)}
    storage = {MetadataIndex("model.t0", [i]): _StorageInfo("__0_0.distcp", 4 * i, 4) for i in range(n)}
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(items, storage_data=storage)))
    (folder / "__0_0.distcp").write_bytes(bytes(4 * n))
    return folder


def crafted_cases(source: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Each crafted folder, with what its refusal says."""
    real = (source / ".metadata").read_bytes()
    deep_key = pickle.EMPTY_DICT + deep_tuple(DEEP) + pickle.NONE + pickle.SETITEM
    raw = {
        "deep tuple, SETITEM key": (splice(real, "first", deep_key), "nests objects more than 32 deep" + TRUST),
        "deep tuple, DICT key": (
            splice(real, "first", pickle.MARK + deep_tuple(DEEP) + pickle.NONE + pickle.DICT),
            "nests objects more than 32 deep" + TRUST,
        ),
        "deep tuple, in FROZENSET": (
            splice(real, "first", pickle.MARK + deep_tuple(DEEP) + pickle.FROZENSET),
            "nests objects more than 32 deep" + TRUST,
        ),
        "deep relative_path": (
            replaced_string(real, "__0_0.distcp", deep_list(100_000)),
            "nests objects more than 32 deep" + TRUST,
        ),
        "TensorProperties never built": (unbuilt_properties(real), "holds a TensorProperties without its dtype"),
        "an int as a name": (
            replaced_string(real, "model.cls_token", pickle.BININT1 + b"\x07"),
            "it uses a builtins.int as a key or set element" + TRUST,
        ),
        "torch.has_cuda": (splice(real, "first", glob("torch", "has_cuda")), "asks for torch.has_cuda, which"),
        "torch.set_vital": (splice(real, "first", glob("torch", "set_vital")), "asks for torch.set_vital, which"),
        "torch._dynamo": (splice(real, "first", glob("torch", "_dynamo")), "asks for torch._dynamo, which"),
        "torch.strided as a global": (splice(real, "first", glob("torch", "strided")), "asks for torch.strided"),
        "a dtype as a layout": (
            splice(real, "first", call(LAYOUT, text("torch.float32"))),
            "(UnpicklingError: unknown tensor layout 'torch.float32')",
        ),
    }
    cases = {
        name: (with_metadata(source, root / f"{n}", data), said) for n, (name, (data, said)) in enumerate(raw.items())
    }
    cases["a negative size"] = (
        rewritten(source, root / "negative", lambda md: sized(md, GAMMA, [-64])),
        f"gives {GAMMA} the size torch.Size([-64]), not a torch.Size of non-negative ints" + CORRUPT,
    )
    cases["a gamma of 2^40 elements"] = (
        rewritten(source, root / "huge", lambda md: sized(md, GAMMA, [2**40])),
        f"gives the chunk of {GAMMA} at [0] [1099511627776] torch.float32 elements (4398046511104 bytes), more "
        f"than the ",
    )
    cases[f"{SHARED} tensors sharing one chunk list"] = (
        shared_chunk_list(root / "shared", SHARED),
        "gives model.t1 the list of chunks of another tensor" + CORRUPT,
    )
    return cases


@pytest.fixture(scope="module")
def crafted(dcp_folder, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return crafted_cases(dcp_folder, tmp_path_factory.mktemp("crafted"))


@pytest.fixture(scope="module")
def commands(dcp_folder, crafted, tmp_path_factory) -> dict[str, dict]:
    """Both commands on every crafted folder, in one separate process (a crash would end it: no SIGSEGV)."""
    return run_commands({"valid": dcp_folder, **{k: v[0] for k, v in crafted.items()}}, tmp_path_factory.mktemp("cli"))


def test_the_crafted_files_are_as_large_as_reported(crafted):
    sizes = {name: (folder / ".metadata").stat().st_size for name, (folder, _) in crafted.items()}
    assert sizes["deep tuple, SETITEM key"] > 300_000
    assert sizes[f"{SHARED} tensors sharing one chunk list"] > 800_000


@pytest.mark.parametrize(
    "case",
    [
        "deep tuple, SETITEM key",
        "deep tuple, DICT key",
        "deep tuple, in FROZENSET",
        "deep relative_path",
        "TensorProperties never built",
        "an int as a name",
        "torch.has_cuda",
        "torch.set_vital",
        "torch._dynamo",
        "torch.strided as a global",
        "a dtype as a layout",
        "a negative size",
        "a gamma of 2^40 elements",
        f"{SHARED} tensors sharing one chunk list",
    ],
)
def test_each_crafted_file_is_one_line_and_exit_2(crafted, commands, case):
    folder, said = crafted[case]
    message, _ = refusal(folder)
    assert said in message, message
    result = commands[case]
    for command in ("convert", "inspect"):
        code, out, err = result[command]
        assert (code, out) == (2, ""), (command, result[command])
        assert err.startswith("timm-ls: error: ") and err.count("\n") == 1, err  # no warning, no traceback
        assert " ".join(said.split()) in err, err
    assert result["changed"] == [] and result["imported"] == [] and result["paths_work"]
    assert not result["written"]


def test_the_valid_folder_reads_in_the_same_process(commands):
    assert commands["valid"]["convert"][0] == commands["valid"]["inspect"][0] == 0


@pytest.mark.parametrize("case", ["deep tuple, SETITEM key", "deep tuple, DICT key", "deep tuple, in FROZENSET"])
def test_deep_nesting_is_refused_before_anything_is_hashed(crafted, case):
    """Refused 32 levels down, a few dozen opcodes into a file of 300,000 levels: nothing deeper was made."""
    _, work = refusal(crafted[case][0])
    assert work.depth == LIMITS.depth
    assert work.opcodes < 100 < 300_000 < work.bytes


def test_shared_chunk_lists_are_refused_in_linear_work(crafted):
    """The first tensor's chunks are checked once (12,000), the second tensor's same list refused unwalked."""
    _, work = refusal(crafted[f"{SHARED} tensors sharing one chunk list"][0])
    assert work.chunks == SHARED
    assert work.overlap_checks <= SHARED
    assert work.objects < 20 * SHARED and work.items < 40 * SHARED


def test_torch_names_run_nothing_of_torch_in_process(crafted):
    """The dtype table is looked up, never `getattr(torch, ...)`: no deprecation warning, no import."""
    modules = set(sys.modules)
    for case in ("torch.has_cuda", "torch.set_vital", "torch._dynamo", "torch.strided as a global"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            refusal(crafted[case][0])
        assert caught == [], (case, [str(w.message) for w in caught])
    assert set(sys.modules) == modules


def test_every_dtype_of_the_table_reads_and_others_are_refused(dcp_folder, tmp_path):
    from timm_layerscale.checkpoints.dtypes import TORCH_DTYPES

    for n, (name, dtype) in enumerate(TORCH_DTYPES.items()):

        def to(md, dtype=dtype):
            md.state_dict_metadata["model.cls_token"].properties.dtype = dtype

        folder = rewritten(dcp_folder, tmp_path / f"{n}", to)
        assert open_checkpoint(folder).info("cls_token").dtype == dtype, name
    for name in ("qint8", "float", "has_mps", "Tensor", "load"):
        data = replaced_string((dcp_folder / ".metadata").read_bytes(), "float32", text(name))
        message, _ = refusal(with_metadata(dcp_folder, tmp_path / name, data))
        assert f"it asks for torch.{name}, which distributed checkpoint metadata never holds" in message
