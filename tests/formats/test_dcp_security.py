"""DCP `.metadata` pickles that bend the unpickler's allow-list: each refused before it changes anything.

The allowed globals are real classes and functions, so a pickle may try to operate on them rather than on
instances: BUILD on `PurePosixPath` itself rewrites `.name` for the whole process, BUILD on a function or
an enum member sets attributes every later user sees, REDUCE calls an allowed class with arguments DCP never
passes. Each attack is a few opcodes written here by hand, put before, or spliced deep inside, the real
`.metadata` of a folder that torch.distributed.checkpoint saved, and run through `timm-ls convert` and
`timm-ls inspect` in one separate process (tests/support/dcp_attacks.py), which then compares every attribute of
pathlib, torch and the allowed classes and functions with what they were before.

Then what else a folder may try: pickles that run code, malformed and damaged metadata, bytes items (which DCP
unpickles freely) and a torch whose DCP reader unpickles tensors freely. The schema's rules and bounds, and
the crafted files that once crashed or stalled a read, are in test_dcp_schema.py; the fuzzer in
test_dcp_fuzz.py.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import PureWindowsPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import Exploit
from support.dcp import (
    CONVERT,
    LAYOUT,
    MEM_FORMAT,
    METADATA,
    POSIX,
    SIZE,
    build,
    call,
    dct,
    glob,
    integer,
    lst,
    new,
    run_commands,
    slots,
    splice,
    stored_items,
    text,
    tup,
    with_metadata,
)
from torch.distributed.checkpoint.api import CheckpointException

from timm_layerscale.checkpoints import CheckpointError
from timm_layerscale.checkpoints.read.dcp.reader import read_metadata, tensors_only_planner
from timm_layerscale.checkpoints.read.dcp.unpickler import dataclasses_allowed
from timm_layerscale.checkpoints.read.reader import open_checkpoint

DATACLASSES = [(cls.__module__, cls.__name__) for cls in dataclasses_allowed()]  # each allowed to be built

MARKED = dict(pwned=integer(1))

# Objects an attack may reach: the allowed classes and functions, and the shared instances they return.
TARGETS: dict[str, bytes] = {
    "PurePosixPath": POSIX,
    "PosixPath": glob("pathlib", "PosixPath"),
    "PureWindowsPath": glob("pathlib", "PureWindowsPath"),
    **{name: glob(module, name) for module, name in DATACLASSES},
    "_MEM_FORMAT_ENCODING": MEM_FORMAT,
    "torch.Size": SIZE,
    "_get_layout": LAYOUT,
    "torch.float32": glob("torch", "float32"),
    "torch.strided": call(LAYOUT, text("torch.strided")),
    "a memory format member": call(MEM_FORMAT, integer(0)),
    "a torch.Size": call(SIZE, tup(integer(1))),
    "a PurePosixPath": call(POSIX, text("a")),
}

# name -> (opcodes that leave one object on the stack, what the refusal says)
ATTACKS: dict[str, tuple[bytes, str]] = {
    "BUILD PurePosixPath name": (
        build(POSIX, slots(name=text("../x.distcp"))),
        "sets the state of the class pathlib.PurePosixPath (pickle BUILD)",
    ),
    **{f"BUILD {name} slots": (build(target, slots(**MARKED)), "(pickle BUILD)") for name, target in TARGETS.items()},
    **{f"BUILD {name} dict": (build(target, dct(**MARKED)), "(pickle BUILD)") for name, target in TARGETS.items()},
    "BUILD an instance, unknown field": (
        build(new(glob(METADATA, "StorageMeta")), dct(**MARKED)),
        "gives a StorageMeta 'pwned', not its fields (pickle BUILD)",
    ),
    "BUILD an instance, fields and slots": (
        build(new(glob(METADATA, "StorageMeta")), tup(dct(save_id=text("x")), dct(**MARKED))),
        "gives a StorageMeta ({'save_id': 'x'}, {'pwned': 1}), not its fields (pickle BUILD)",
    ),
    "BUILD an instance twice": (
        build(build(new(glob(METADATA, "StorageMeta")), dct(save_id=text("x"))), dct(save_id=text("y"))),
        "sets the state of a torch.distributed.checkpoint.metadata.StorageMeta again (pickle BUILD)",
    ),
    "BUILD TensorProperties, short tuple": (
        build(new(glob(METADATA, "TensorProperties")), tup(glob("torch", "float32"))),
        "gives a TensorProperties the state",
    ),
    "BUILD TensorProperties, a list": (
        build(new(glob(METADATA, "TensorProperties")), lst(*[pickle.NONE] * 5)),
        "gives a TensorProperties the state [None, None, None, None, None] (pickle BUILD)",
    ),
    "NEWOBJ PurePosixPath": (new(POSIX), "creates an instance of the class pathlib.PurePosixPath (pickle NEWOBJ)"),
    "NEWOBJ a dataclass with arguments": (
        glob(METADATA, "Metadata") + tup(dct()) + pickle.NEWOBJ,
        "creates a Metadata with arguments",
    ),
    "NEWOBJ_EX a dataclass with keywords": (
        glob(METADATA, "StorageMeta") + pickle.EMPTY_TUPLE + dct(save_id=text("x")) + pickle.NEWOBJ_EX,
        "creates a StorageMeta with arguments () and keywords {'save_id': 'x'} (pickle NEWOBJ)",
    ),
    "REDUCE torch.Size of strings": (call(SIZE, tup(text("a"))), "calls the class torch.Size with (('a',),)"),
    "REDUCE torch.Size of a list": (call(SIZE, lst(integer(1))), "calls the class torch.Size with ([1],)"),
    "REDUCE torch.Size with two args": (call(SIZE, tup(), tup()), "calls the class torch.Size with ((), ())"),
    "REDUCE torch.Size with a list of args": (SIZE + lst() + pickle.REDUCE, "calls the class torch.Size with []"),
    "REDUCE PurePosixPath of an int": (call(POSIX, integer(1)), "calls the class pathlib.PurePosixPath with (1,)"),
    "REDUCE PurePosixPath with a list of args": (POSIX + lst(text("a")) + pickle.REDUCE, "PurePosixPath with ['a']"),
    "REDUCE _get_layout with two args": (call(LAYOUT, text("torch.strided"), text("x")), "('torch.strided', 'x')"),
    "REDUCE _MEM_FORMAT_ENCODING with two args": (call(MEM_FORMAT, integer(0), lst()), "ENCODING with (0, [])"),
    "REDUCE _MEM_FORMAT_ENCODING makes an enum": (
        call(MEM_FORMAT, text("X"), lst(text("A"))),
        "calls the class torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING with ('X', ['A'])",
    ),
    "REDUCE _MEM_FORMAT_ENCODING of a bool": (call(MEM_FORMAT, pickle.NEWTRUE), "_MEM_FORMAT_ENCODING with (True,)"),
    "REDUCE _get_layout of an int": (call(LAYOUT, integer(1)), "calls the function timm_layerscale."),
    "REDUCE a dataclass": (call(glob(METADATA, "Metadata"), dct()), "calls the class torch.distributed."),
    "REDUCE a dtype": (call(glob("torch", "float32")), "calls a torch.dtype (pickle REDUCE)"),
    "SETITEM on a class": (POSIX + text("name") + text("x") + pickle.SETITEM, "sets an item of the class pathlib."),
    "SETITEMS on a function": (
        LAYOUT + pickle.MARK + text("pwned") + integer(1) + pickle.SETITEMS,
        "sets items of the function timm_layerscale.checkpoints.read.dcp.unpickler.layout",
    ),
    "SETITEMS on an instance": (
        new(glob(METADATA, "StorageMeta")) + pickle.MARK + text("pwned") + integer(1) + pickle.SETITEMS,
        "sets items of a torch.distributed.checkpoint.metadata.StorageMeta",
    ),
    "APPEND to a class": (SIZE + pickle.NONE + pickle.APPEND, "appends to the class torch.Size"),
    "APPENDS to a class": (
        glob(METADATA, "StorageMeta") + pickle.MARK + pickle.NONE + pickle.APPENDS,
        "appends to the class torch.distributed.checkpoint.metadata.StorageMeta",
    ),
    "APPENDS to a torch.Size": (
        call(SIZE, tup(integer(1))) + pickle.MARK + pickle.NONE + pickle.APPENDS,
        "appends to a torch.Size",
    ),
    "ADDITEMS to a class": (POSIX + pickle.MARK + pickle.NONE + pickle.ADDITEMS, "adds to the class pathlib."),
    "INST": (
        pickle.MARK + pickle.INST + f"{METADATA}\nStorageMeta\n".encode(),
        "instantiates a class by INST/OBJ",
    ),
    "OBJ": (pickle.MARK + glob(METADATA, "StorageMeta") + pickle.OBJ, "instantiates a class by INST/OBJ"),
    "EXT1": (pickle.EXT1 + b"\x01", "takes an object from pickle's extension registry"),
}

# Where an attack goes in the real pickle: before the Metadata, as StorageMeta.save_id, or as the first
# tensor's TensorProperties.requires_grad (Metadata -> dict -> TensorStorageMetadata -> its properties).
PLACES = ("first", "save_id", "requires_grad")


# ----------------------------------------------------------------------------------------------- folders


@pytest.fixture(scope="module")
def results(dcp_folder, tmp_path_factory) -> dict[str, dict]:
    """Each case's exit codes, output and changes, from one process running every case in turn."""
    root = tmp_path_factory.mktemp("attacks")
    real = (dcp_folder / ".metadata").read_bytes()
    cases = {"valid": dcp_folder}
    for place in PLACES:  # the splice alone keeps the metadata valid
        cases[f"valid, {place} spliced"] = with_metadata(
            dcp_folder, root / f"valid-{place}", splice(real, place, text("x"))
        )
    for n, (name, (fragment, _)) in enumerate(ATTACKS.items()):
        for place in PLACES:
            cases[f"{name} at {place}"] = with_metadata(
                dcp_folder, root / f"{n}-{place}", splice(real, place, fragment)
            )
    return run_commands(cases, root)


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("place", [None, *PLACES])
def test_valid_metadata_still_reads(results, place):
    case = results["valid" if place is None else f"valid, {place} spliced"]
    assert case["convert"][0] == 0, case["convert"]
    assert "\nconverted " in "\n" + case["convert"][1]
    assert case["inspect"][0] == 0, case["inspect"]
    assert "LayerScale: lsN.gamma in 2 blocks" in case["inspect"][1]
    assert case["changed"] == [] and case["paths_work"]
    assert place is None or case["imported"] == [], case["imported"]  # the first read imports what reads need


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_is_refused_and_changes_nothing(results, tmp_path_factory, attack, place):
    case = results[f"{attack} at {place}"]
    expected = ATTACKS[attack][1]
    for command in ("convert", "inspect"):
        code, out, err = case[command]
        assert (code, out) == (2, ""), (command, case[command])
        assert err.startswith("timm-ls: error: refused to read ") and err.count("\n") == 1, err
        assert "/.metadata: it " in err and err.endswith("; use a checkpoint you trust\n"), err
        assert expected in err, err
    assert case["changed"] == [] and case["imported"] == [] and not case["written"]
    assert case["paths_work"]


def test_refusals_name_what_was_asked(results):
    """Not one catch-all line: each kind of attack says what it tried."""
    err = results["BUILD _get_layout dict at save_id"]["convert"][2]
    assert (
        "sets the state of the function timm_layerscale.checkpoints.read.dcp.unpickler.layout (pickle BUILD), which"
        in err
    )
    err = results["BUILD a memory format member slots at first"]["inspect"][2]
    assert "sets the state of a torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING (pickle BUILD)" in err
    assert "never does (nothing was changed)" in err


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_the_command_exits_2_with_one_line(dcp_folder, tmp_path, command):
    """The realistic attack in its own interpreter: pathlib bent so that a data file outside the folder passes."""
    real = (dcp_folder / ".metadata").read_bytes()
    bent = splice(real, "save_id", build(POSIX, slots(name=text("../xy.distcp"))))
    assert bent.count(b"\x8c\x0c__0_0.distcp") == 1  # the data file's one name; later items refer back to it
    bent = bent.replace(b"\x8c\x0c__0_0.distcp", b"\x8c\x0c../xy.distcp")
    folder = with_metadata(dcp_folder, tmp_path / "ckpt", bent)
    shutil.copy(dcp_folder / "__0_0.distcp", tmp_path / "xy.distcp")
    args = [folder, tmp_path / "out.pth", "--to", "meta", *CONVERT] if command == "convert" else [folder]
    run = subprocess.run([sys.executable, "-m", "timm_ls", command, *map(str, args)], capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == (
        f"timm-ls: error: refused to read {folder / '.metadata'}: it sets the state of the class "
        f"pathlib.PurePosixPath (pickle BUILD), which distributed checkpoint metadata never does (nothing was "
        f"changed); use a checkpoint you trust\n"
    )
    assert not (tmp_path / "out.pth").exists()


# -------------------------------------------------------------------------------- what else is refused


def test_an_instance_needs_its_fields(dcp_folder, tmp_path):
    data = b"\x80\x02" + build(new(glob(METADATA, "Metadata")), dct()) + pickle.STOP
    folder = with_metadata(dcp_folder, tmp_path / "ckpt", data)
    with pytest.raises(
        CheckpointError, match=r"metadata \(UnpicklingError: a Metadata without its fields state_dict_metadata\)"
    ):
        open_checkpoint(folder)
    never_built = b"\x80\x02" + new(glob(METADATA, "Metadata")) + pickle.STOP
    (folder / ".metadata").write_bytes(never_built)
    with pytest.raises(CheckpointError, match=r"a Metadata without its fields state_dict_metadata"):
        open_checkpoint(folder)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda md, key: setattr(md.state_dict_metadata[key], "properties", None), "gives {key} the properties None"),
        (
            lambda md, key: setattr(md.state_dict_metadata[key].properties, "dtype", "f32"),
            "gives {key} the dtype 'f32', which is no dtype this package reads",
        ),
        (
            lambda md, key: setattr(md.state_dict_metadata[key], "size", [2, 3]),
            "gives {key} the size [2, 3], not a torch.Size of non-negative ints",
        ),
        (
            lambda md, key: setattr(md.state_dict_metadata[key], "chunks", ()),
            "gives {key} as its chunks (), not a list",
        ),
        (
            lambda md, key: md.state_dict_metadata[key].chunks.append(None),
            "gives {key} the chunk None, not a ChunkStorageMetadata",
        ),
        (
            lambda md, key: setattr(md.state_dict_metadata[key].chunks[0], "offsets", (0,)),
            "gives {key} [1, 1, 64] a chunk at (0,) of torch.Size([1, 1, 64])",
        ),
        (
            lambda md, key: setattr(md.state_dict_metadata[key].chunks[0], "sizes", None),
            "gives {key} [1, 1, 64] a chunk at torch.Size([0, 0, 0]) of None",
        ),
        (lambda md, key: md.storage_data.update({key: None}), "lists a stored item as str: NoneType"),
        (
            lambda md, key: md.storage_data.update({key: next(iter(md.storage_data.values()))}),
            "lists a stored item as str: _StorageInfo",
        ),
        (
            lambda md, key: md.storage_data.update({k: None for k in list(md.storage_data)[:1]}),
            "lists a stored item as MetadataIndex: NoneType",
        ),
    ],
)
def test_malformed_items_are_one_line(dcp_folder, tmp_path, damage: Callable, message: str):
    """Fields of the right names but the wrong kinds: one line, not an AttributeError from deep in DCP."""
    md = read_metadata(dcp_folder)
    key = next(k for k in md.state_dict_metadata if k.endswith("cls_token"))
    damage(md, key)
    folder = with_metadata(dcp_folder, tmp_path / "ckpt", pickle.dumps(md))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    assert str(info.value) == (
        f"{folder / '.metadata'} {message.format(key=key)}; the metadata is corrupt: copy the whole folder again"
    )


def test_the_planner_refuses_bytes_items(dcp_folder, tmp_path):
    """The reader asks DCP for tensor items only, so its planner never meets a bytes item; asked for one
    (DCP unpickles those with weights_only=False), it refuses before anything is unpickled."""
    folder = shutil.copytree(dcp_folder, tmp_path / "ckpt")
    marker = tmp_path / "marker"
    md = read_metadata(folder)
    info = next(s for i, s in md.storage_data.items() if i.fqn == "iteration")
    payload = pickle.dumps(Exploit(marker), protocol=2)
    assert len(payload) <= info.length
    with (folder / info.relative_path).open("r+b") as f:
        f.seek(info.offset)
        f.write(payload.ljust(info.length, b"\0"))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"iteration": 0}, checkpoint_id=folder, planner=tensors_only_planner(folder), no_dist=True)
    failure = next(iter(caught.value.failures.values()))[0]
    assert isinstance(failure, CheckpointError)
    assert str(failure) == f"refused to read iteration from {folder}: it is not a tensor"
    assert not marker.exists()
    with pytest.raises(BaseException):  # noqa: B017 (DCP's own planner runs the item, whatever then fails)
        dcp.load({"iteration": 0}, checkpoint_id=folder, no_dist=True)
    assert marker.exists()


# ------------------------------------------------- what DCP's own reader would run: never requested


def test_dcp_never_unpickles_bytes_items(meta_run, tmp_path):
    """The iteration and optimizer param groups are pickles DCP loads with weights_only=False: never requested."""
    folder = shutil.copytree(meta_run["ckpt"], tmp_path / "ckpt")
    marker = tmp_path / "marker"
    payload = pickle.dumps(Exploit(marker), protocol=2)
    bytes_items = [
        item for item in stored_items(read_metadata(folder)) if not item[0].startswith(("model.", "optimizer.state."))
    ]
    assert {item[0] for item in bytes_items} >= {"iteration", "optimizer.param_groups.0.params"}
    for _, name, offset, length in bytes_items:
        with (folder / name).open("r+b") as f:
            f.seek(offset)
            f.write(payload.ljust(length, b"\0"))
    for weights in ("auto", "raw"):
        with open_checkpoint(folder, weights) as ckpt:
            assert len([ckpt[k] for k in ckpt]) == len(meta_run["teacher"])
    assert not marker.exists()
    # The planted items are live: DCP's own loader, asked for the iteration, runs them.
    with pytest.raises(BaseException, match="magic number"):
        dcp.load({"iteration": 0}, checkpoint_id=folder, no_dist=True)
    assert marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        lambda marker: pickle.dumps(Exploit(marker)),
        lambda marker: pickle.dumps(Exploit(marker), protocol=0),
        lambda marker: b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.",
        lambda marker: b"ctorch\nsave\n(I1\nV" + str(marker).encode() + b"\ntR.",
        lambda marker: b"P" + str(marker).encode() + b"\n.",
    ],
    ids=["open", "open-protocol-0", "os.system", "torch.save", "persistent-id"],
)
def test_malicious_dcp_metadata_runs_nothing(meta_run, tmp_path, payload):
    folder = shutil.copytree(meta_run["ckpt"], tmp_path / "ckpt")
    marker = tmp_path / "marker"
    (folder / ".metadata").write_bytes(payload(marker))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    message = str(info.value)
    assert message.startswith(f"refused to read {folder / '.metadata'}: it asks for ")
    assert message.endswith("could run code (nothing was run); use a checkpoint you trust")
    assert not marker.exists()


def test_damaged_dcp_metadata(meta_run, tmp_path):
    folder = shutil.copytree(meta_run["ckpt"], tmp_path / "ckpt")
    metadata = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(metadata[: len(metadata) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable distributed checkpoint metadata \("):
        open_checkpoint(folder)
    (folder / ".metadata").write_bytes(pickle.dumps({"model.cls_token": torch.Size([1])}))
    with pytest.raises(CheckpointError, match="holds a dict, not distributed checkpoint metadata"):
        open_checkpoint(folder)
    (folder / ".metadata").write_bytes(b"ctorch.serialization\n_get_layout\n(Vload\ntR.")
    with pytest.raises(CheckpointError, match=r"metadata \(UnpicklingError: unknown tensor layout 'load'\)"):
        open_checkpoint(folder)
    md = read_metadata(meta_run["ckpt"])  # saved on Windows: its path pickles as a Windows path
    md.storage_meta.checkpoint_id = PureWindowsPath("C:/run/ckpt/199")
    for windows in (b"PureWindowsPath", b"WindowsPath"):
        (folder / ".metadata").write_bytes(pickle.dumps(md, protocol=2).replace(b"PureWindowsPath", windows))
        assert open_checkpoint(folder).weights == "model_ema"
    md = read_metadata(meta_run["ckpt"])
    md.storage_data = None
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"\.metadata lists no stored items; the metadata is corrupt"):
        open_checkpoint(folder)
    md = read_metadata(meta_run["ckpt"])
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../secrets"
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"in '../../secrets', outside the folder"):
        open_checkpoint(folder)
    md = read_metadata(meta_run["ckpt"])
    md.state_dict_metadata["model.student.backbone.blocks.0.attn.qkv.weight"].chunks.pop()  # rank 1's half
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(
        CheckpointError, match=r"not cover all of model\.student\.backbone\.blocks\.0\.attn\.qkv\.weight \[192, 64\]"
    ):
        open_checkpoint(folder)
    md = read_metadata(meta_run["ckpt"])
    key = "model.student.backbone.blocks.0.attn.qkv.weight"
    del md.storage_data[next(i for i in md.storage_data if i.fqn == key)]  # a chunk listed, its bytes not
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"not cover all of model\.student\.backbone\.blocks\.0\.attn\.qkv"):
        open_checkpoint(folder)


def test_dcp_tensors_are_not_read_by_a_torch_that_unpickles_them_freely(meta_run, monkeypatch):
    """Before torch 2.6 DCP's reader loads tensor items with weights_only=False: such a torch reads none."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.5.1"))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(meta_run["ckpt"])
    message = str(info.value)
    assert "\n" not in message
    assert message.endswith(
        "torch 2.5.1 reads with weights_only=False (code in the file would run); "
        "upgrade torch to 2.6 or newer to read it"
    )
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.6.0"))
    with open_checkpoint(meta_run["ckpt"]) as ckpt:
        assert len(ckpt)


@pytest.mark.parametrize("value", ["1", "yes", "TRUE", "y"])
def test_dcp_tensors_are_not_read_while_torch_is_told_to_unpickle_freely(meta_run, monkeypatch, value):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns torch.load's safe default off where a call leaves it unset."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", value)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(meta_run["ckpt"])
    assert str(info.value).endswith(
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set, which makes torch read its tensors with weights_only=False (code "
        "in the file would run); unset it to read the folder"
    )
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0")
    with open_checkpoint(meta_run["ckpt"]) as ckpt:
        assert len(ckpt)
