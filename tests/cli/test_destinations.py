"""What a destination may be replaced with, and what an interrupted write leaves: through the command.

`--overwrite` replaces a folder only while it holds nothing but what its format writes; no destination may be
or hold the current folder or the source; Ctrl-C and SIGTERM leave the destination as it was, in one line.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from pathlib import Path

import pytest
import timm
from safetensors.torch import save_file
from support import TINY, move_off_init_
from support.writes import frozen_when, held_staging, killed_staging, signal_frozen, start, vit_b, writing

from timm_layerscale import convert_checkpoint, save_for_hub, save_native
from timm_layerscale.checkpoints import CheckpointError
from timm_layerscale.checkpoints.formats import native
from timm_ls.checks import check_ablate
from timm_ls.destinations import is_ours
from timm_ls.interrupts import Interrupted, deferred, interruptible
from timm_ls.main import main, parse
from timm_ls.names import FORMATS

NAME = "vit_ls_small_patch16_dinov3"
SMALL = ["--model", NAME, "--model-kwargs", *(f"{k}={v}" for k, v in TINY.items())]
SPECS = {spec.name: spec for spec in FORMATS}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("destinations")
    model = move_off_init_(timm.create_model(NAME, num_classes=0, **TINY))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "small.safetensors")
    return root / "small.safetensors"


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under `root`, hidden ones too, with the files' digests."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(root.rglob("*"))
    }


def assert_refused(code: int, out: str, err: str, expected: str) -> None:
    assert (code, out) == (2, ""), err
    assert err.startswith("timm-ls: error: ") and err.count("\n") == 1, err
    assert expected in err, err


def convert_to(source: Path, dst: Path, to: str, **kwargs) -> None:
    convert_checkpoint(source, dst, to=to, model=NAME, model_kwargs=TINY, **kwargs)


# -------------------------------------------------------------------------- what --overwrite may replace


@pytest.mark.parametrize(
    ("to", "dst", "kwargs"),
    [
        ("native", "native", {}),
        ("hf", "hf", {}),
        ("hf", "sharded", {"max_shard_size": 20_000}),
        ("timm", "timm", {}),
        ("meta-train", "dcp", {}),
    ],
)
def test_every_file_a_format_writes_is_one_it_names(source: Path, tmp_path: Path, to, dst, kwargs) -> None:
    """Measured: what each folder format writes is what its FormatSpec says `--overwrite` may replace."""
    convert_to(source, tmp_path / dst, to, **kwargs)
    written = [p.name for p in (tmp_path / dst).iterdir()]
    assert written and all(is_ours(name, SPECS[to].files) for name in written), written
    assert not any(is_ours(name, SPECS[to].files) for name in ("precious.txt", "model.pth", "notes.json"))
    if to == "hf" and kwargs:
        assert len(written) > 3  # shards and their index


def test_a_folder_holding_files_we_did_not_write_is_refused(source: Path, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "out"
    assert run(capsys, "convert", str(source), str(dst), "--to", "native", *SMALL)[0] == 0
    (dst / "precious.txt").write_text("mine")
    (dst / "notes").mkdir()
    (dst / "notes" / "model.safetensors").write_text("a subfolder is never ours, whatever it holds")
    before = snapshot(tmp_path)
    code, out, err = run(capsys, "convert", str(source), str(dst), "--to", "native", "--overwrite", *SMALL)
    assert_refused(
        code,
        out,
        err,
        f"{dst} holds precious.txt and 1 other, which --to native does not write and --overwrite would delete; "
        f"choose another folder or remove them",
    )
    assert snapshot(tmp_path) == before
    (dst / "notes" / "model.safetensors").unlink()
    (dst / "notes").rmdir()
    code, _, err = run(capsys, "convert", str(source), str(dst), "--to", "native", "--overwrite", *SMALL)
    assert code == 2 and "holds precious.txt, which" in err and "or remove it\n" in err
    assert (dst / "precious.txt").read_text() == "mine"


def test_a_users_readme_is_never_ours_but_our_model_card_is(source: Path, tmp_path: Path, capsys) -> None:
    """README.md is a name the native format writes (a model card), and a name users give their notes: it is
    replaced only when it is a card this package wrote, recognised by its content."""
    dst = tmp_path / "out"
    assert run(capsys, "convert", str(source), str(dst), "--to", "native", *SMALL)[0] == 0
    (dst / "README.md").write_text("# My notes on this run\n")
    before = snapshot(tmp_path)
    code, out, err = run(capsys, "convert", str(source), str(dst), "--to", "native", "--overwrite", *SMALL)
    assert_refused(
        code,
        out,
        err,
        f"{dst} holds README.md, which --to native does not write and --overwrite would delete; "
        f"choose another folder or remove it",
    )
    assert snapshot(tmp_path) == before
    model = timm.create_model(NAME, **TINY)
    save_for_hub(model, tmp_path / "card")  # a folder with our model card
    assert "timm-layerscale" in (tmp_path / "card" / "README.md").read_text()
    code, _, err = run(capsys, "convert", str(source), str(tmp_path / "card"), "--to", "native", "--overwrite", *SMALL)
    assert code == 0, err
    assert (tmp_path / "card" / "model.safetensors").exists()


def test_save_native_refuses_them_too(tmp_path: Path) -> None:
    model = timm.create_model(NAME, **TINY)
    save_native(model, tmp_path / "out")
    (tmp_path / "out" / "precious.txt").write_text("mine")
    with pytest.raises(
        CheckpointError, match=r"holds precious\.txt, which save_native does not write and overwrite=True"
    ):
        save_native(model, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "precious.txt").read_text() == "mine"


def test_a_file_that_comes_during_the_write_is_kept(source: Path, tmp_path: Path, monkeypatch) -> None:
    """The folder is looked at again just before it is replaced."""
    convert_to(source, tmp_path / "out", "native")
    written = native.write_native_files

    def and_a_file_arrives(folder, *args, **kwargs):
        written(folder, *args, **kwargs)
        (tmp_path / "out" / "late.txt").write_text("arrived while converting")

    monkeypatch.setattr(native, "write_native_files", and_a_file_arrives)
    with pytest.raises(CheckpointError, match=r"holds late\.txt"):
        convert_to(source, tmp_path / "out", "native", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "late.txt", "model.safetensors"]


def test_a_folder_of_ours_is_replaced_and_old_files_of_ours_go(source: Path, tmp_path: Path, capsys) -> None:
    """Shards a new unsharded write has no use for, and the staging folder an earlier write left, are removed."""
    dst = tmp_path / "hf"
    convert_to(source, dst, "hf", max_shard_size=20_000)
    killed_staging(dst / ".model.safetensors.tmp-0123abcd")  # left by a killed write of a file in it
    assert len(list(dst.glob("model-*-of-*.safetensors"))) > 2
    code, _, err = run(capsys, "convert", str(source), str(dst), "--to", "hf", "--overwrite", *SMALL)
    assert code == 0, err
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ------------------------------------------------------------------- the current folder and the source


@pytest.mark.parametrize(
    ("dst", "to", "expected"),
    [
        (".", "native", ". is or holds the current folder (WORK); choose another destination"),
        ("..", "hf", ".. is or holds the current folder (WORK); choose another destination"),
        ("ROOT", "timm", "ROOT is or holds the current folder (WORK); choose another destination"),
        ("./sub/..", "meta-train", "sub/.. is or holds the current folder (WORK)"),
        ("holder", "native", "holder would replace the source file holder/small.safetensors; choose another"),
        ("holder/small.safetensors", "meta", "would replace the source file holder/small.safetensors; choose"),
    ],
)
def test_the_current_folder_and_the_source_are_never_replaced(
    source: Path, tmp_path: Path, monkeypatch, capsys, dst, to, expected
) -> None:
    (tmp_path / "work" / "sub").mkdir(parents=True)
    (tmp_path / "holder").mkdir()
    (tmp_path / "holder" / "small.safetensors").write_bytes(source.read_bytes())
    monkeypatch.chdir(tmp_path / "work")
    src = "../holder/small.safetensors"
    dst = dst.replace("ROOT", str(tmp_path)).replace("holder", "../holder")
    expected = expected.replace("ROOT", str(tmp_path)).replace("WORK", str(tmp_path / "work"))
    expected = expected.replace("holder", "../holder")
    before = snapshot(tmp_path)
    for overwrite in ([], ["--overwrite"]):
        assert_refused(*run(capsys, "convert", src, dst, "--to", to, *overwrite, *SMALL), expected)
        assert snapshot(tmp_path) == before


def test_export_refuses_the_current_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "export", NAME, ".", "--overwrite", *SMALL)
    assert_refused(code, out, err, f". is or holds the current folder ({tmp_path}); choose another destination")
    assert list(tmp_path.iterdir()) == []


def test_ablate_still_writes_into_the_current_folder(tmp_path: Path, monkeypatch) -> None:
    """`ablate --out` writes files into its folder, which is never replaced: `.` is fine (the front's check)."""
    monkeypatch.chdir(tmp_path)
    check_ablate(parse(["ablate", "--out", "."]))


# ---------------------------------------------------------------------------------------- interruptions


def test_a_staging_folder_in_a_destination_is_ours_only_when_a_killed_write_of_ours_left_it(
    source: Path, tmp_path: Path, capsys
) -> None:
    """Named as staging is not enough: one without our marker, or one a running write holds, is refused."""
    dst = tmp_path / "out"
    convert_to(source, dst, "native")
    (dst / ".model.safetensors.tmp-4567cdef").mkdir()  # a look-alike: no marker
    (dst / ".model.safetensors.tmp-4567cdef" / "model.safetensors").write_text("someone's")
    writer = held_staging(dst / ".config.json.tmp-89abcdef")
    try:
        before = snapshot(tmp_path)
        code, out, err = run(capsys, "convert", str(source), str(dst), "--to", "native", "--overwrite", *SMALL)
        assert_refused(
            code, out, err, f"{dst} holds .config.json.tmp-89abcdef/ and 1 other, which --to native does not write"
        )
        assert snapshot(tmp_path) == before
    finally:
        writer.communicate("")
    shutil.rmtree(dst / ".model.safetensors.tmp-4567cdef")
    code, _, err = run(capsys, "convert", str(source), str(dst), "--to", "native", "--overwrite", *SMALL)
    assert code == 0, err  # the writer ended: what it left is a killed write's, and goes with the old folder
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]


def test_an_interrupted_swap_puts_the_old_folder_back(source: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """A signal between moving the old folder aside and the new one in: the old one is back, in one line."""
    dst = tmp_path / "out"
    convert_to(source, dst, "native")
    before = snapshot(tmp_path)
    replace, moves = os.replace, []

    def interrupted(src, target):
        moves.append(Path(src).name)
        if Path(target) == dst and len(moves) == 2:  # the new folder moving in, after the old one went aside
            raise Interrupted(signal.SIGTERM)
        replace(src, target)

    monkeypatch.setattr(os, "replace", interrupted)
    code, out, err = run(capsys, "convert", str(source), str(dst), "--to", "native", "--overwrite", *SMALL)
    assert (code, out, err) == (143, "", f"timm-ls: interrupted; nothing was written to {dst}\n")
    assert moves == ["out", "out", ".old-out"]  # aside, in (interrupted), back
    assert snapshot(tmp_path) == before


def test_a_signal_waits_for_the_end_of_a_deferred_block() -> None:
    with interruptible():
        with pytest.raises(Interrupted) as raised, deferred():
            signal.raise_signal(signal.SIGTERM)
            finished = True
        assert finished and raised.value.exit_status == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vit_b(tmp_path_factory.mktemp("big"))


@pytest.mark.parametrize(
    ("signum", "dst", "old"),
    [
        (signal.SIGTERM, "dcp", True),
        (signal.SIGINT, "dcp", False),
        (signal.SIGTERM, "teacher.pth", False),
        (signal.SIGTERM, "teacher.pth", True),
        (signal.SIGINT, "teacher.pth", True),
        (signal.SIGTERM, "teacher.safetensors", True),
        (signal.SIGINT, "teacher.safetensors", True),
    ],
)
def test_a_signal_mid_write_leaves_the_destination_as_it_was(big: Path, tmp_path: Path, signum, dst, old) -> None:
    """The signal comes once the file or folder itself is being written in the staging folder, seen while the
    write is stopped: it cannot finish first, however loaded the machine."""
    name, dst = dst, tmp_path / dst
    to = "meta-train" if dst.suffix == "" else "meta"
    if old and to == "meta-train":  # an earlier write of the same format, to be kept whole
        dst.mkdir()
        (dst / ".metadata").write_text("old metadata")
        (dst / "__0_0.distcp").write_text("old data")
    elif old:
        dst.write_bytes(b"an earlier teacher file, to be kept whole")
    before = snapshot(tmp_path)
    proc = start("convert", str(big), str(dst), "--to", to, *(["--overwrite"] if old else []))
    try:
        frozen_when(proc, lambda: writing(tmp_path, name), f"{name} was being written")
        signal_frozen(proc, signum)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err
    assert (out, err.decode()) == (b"", f"timm-ls: interrupted; nothing was written to {dst}\n")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------ symlinked destinations


@pytest.fixture(params=["folder", "file", "dangling"])
def users(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """What a destination link points to: a folder holding a user's file, a user's file, or nothing at all."""
    linked = tmp_path / "users"
    if request.param == "folder":
        linked.mkdir()
        (linked / "precious.txt").write_text("mine")
    elif request.param == "file":
        linked.write_bytes(b"the user's own file")
    return linked


def held(path: Path) -> object:
    """What `path` holds: a folder's files and their bytes, a file's bytes, or None where nothing is."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in path.iterdir()}
    return path.read_bytes() if path.exists() else None


@pytest.mark.parametrize(("to", "name"), [("native", "out"), ("meta", "out.pth")])
def test_overwrite_replaces_a_link_never_what_it_points_to(
    source: Path, tmp_path: Path, users: Path, capsys, to, name
) -> None:
    """A symlink destination is replaced by what is written; the folder or file it points to is left as it was."""
    dst = tmp_path / name
    dst.symlink_to(users)
    before = held(users)
    code, out, err = run(capsys, "convert", str(source), str(dst), "--to", to, *SMALL)
    assert_refused(code, out, err, f"{dst} exists; pass --overwrite to replace it")
    code, _, err = run(capsys, "convert", str(source), str(dst), "--to", to, "--overwrite", *SMALL)
    assert code == 0, err
    assert not dst.is_symlink() and dst.exists()
    assert held(users) == before


def test_a_symlinked_parent_folder_is_written_into(source: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    code, _, err = run(capsys, "convert", str(source), str(tmp_path / "via" / "out.pth"), "--to", "meta", *SMALL)
    assert code == 0, err
    assert (tmp_path / "real" / "out.pth").is_file() and sorted(p.name for p in (tmp_path / "real").iterdir()) == [
        "out.pth"
    ]
