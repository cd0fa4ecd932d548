"""A write killed outright (SIGKILL, a power cut) runs no clean-up: its staging folder stays beside the
destination. The next write of the same destination removes it, in one line, when its marker shows that a
write of this package made it and no running write holds it; anything else named like it is left alone."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import timm
from safetensors.torch import save_file
from support import TINY, move_off_init_
from support.writes import frozen_when, held_staging, killed_staging, stages, start, vit_b, writing

from timm_layerscale import open_checkpoint
from timm_ls.destinations import MARKER
from timm_ls.main import main

NAME = "vit_ls_small_patch16_dinov3"
SMALL = ["--model", NAME, "--model-kwargs", *(f"{k}={v}" for k, v in TINY.items())]
REMOVED = re.compile(r"timm-ls: removed stale staging (\.\S+) \((\d+ [kM]B)\) left by a write that was killed\n")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("killed")
    model = move_off_init_(timm.create_model(NAME, num_classes=0, **TINY))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "small.safetensors")
    return root / "small.safetensors"


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vit_b(tmp_path_factory.mktemp("big"))


def size_of(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if not p.is_dir())


def said_size(nbytes: int) -> str:
    """Sizes as the line gives them, in whole kB under a megabyte, in whole MB up to a gigabyte."""
    return f"{nbytes / 10**6:.0f} MB" if nbytes >= 10**6 else f"{nbytes / 10**3:.0f} kB"


def convert(capsys, source: Path, dst: Path, to: str, *extra: str) -> tuple[int, str]:
    code = main(["convert", str(source), str(dst), "--to", to, *SMALL, *extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("to", "name"),
    [("meta", "teacher.pth"), ("meta", "teacher.safetensors"), ("native", "native"), ("meta-train", "dcp")],
)
def test_the_next_write_removes_what_a_killed_write_left(big: Path, source: Path, tmp_path: Path, capsys, to, name):
    dst = tmp_path / name
    proc = start("convert", str(big), str(dst), "--to", to)
    try:
        frozen_when(proc, lambda: writing(tmp_path, name), f"{name} was being written")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    [left] = stages(tmp_path, name)
    size = size_of(left)
    assert size > 0 and (left / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [left.name]  # the destination never appeared

    code, err = convert(capsys, source, dst, to)
    assert code == 0, err
    assert REMOVED.fullmatch(err) and REMOVED.fullmatch(err).groups() == (left.name, said_size(size)), err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    with open_checkpoint(dst) as written:  # whole: every tensor reads
        assert len(written) > 30 and all(written[key].numel() for key in written)
    code, err = convert(capsys, source, dst, to, "--overwrite")
    assert (code, err) == (0, "")  # said once: nothing is left to remove


def test_a_staging_folder_a_running_write_holds_is_left_alone(source: Path, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "teacher.pth"
    writer = held_staging(tmp_path / ".teacher.pth.tmp-0123abcd")
    try:
        code, err = convert(capsys, source, dst, "meta")
        assert (code, err) == (0, "")
        assert sorted(p.name for p in tmp_path.iterdir()) == [".teacher.pth.tmp-0123abcd", "teacher.pth"]
        assert (tmp_path / ".teacher.pth.tmp-0123abcd" / "teacher.pth").stat().st_size == 4096
    finally:
        writer.communicate("")  # the writer ends without its clean-up: what it holds is now a killed write's
    code, err = convert(capsys, source, dst, "meta", "--overwrite")
    assert code == 0 and REMOVED.fullmatch(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher.pth"]


def test_what_this_package_did_not_leave_is_left_alone(source: Path, tmp_path: Path, capsys) -> None:
    """No marker, a marker that is not ours, a file, another destination's staging, a link to it, another
    token's spelling."""
    unmarked = tmp_path / ".teacher.pth.tmp-0123abcd"
    unmarked.mkdir()
    (unmarked / "teacher.pth").write_bytes(b"someone's")
    foreign = tmp_path / ".teacher.pth.tmp-4567cdef"
    foreign.mkdir()
    (foreign / MARKER).write_text("a marker of some other program\n")
    (tmp_path / ".teacher.pth.tmp-89abcdef").write_text("a file, not a folder")
    killed_staging(tmp_path / ".other.pth.tmp-0123abcd")
    (tmp_path / ".teacher.pth.tmp-fedcba98").symlink_to(tmp_path / ".other.pth.tmp-0123abcd")  # a link to one
    killed_staging(tmp_path / ".teacher.pth.tmp-0123ABCD")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, err = convert(capsys, source, tmp_path / "teacher.pth", "meta")
    assert (code, err) == (0, "")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == sorted([*before, Path("teacher.pth")])


def test_what_a_killed_write_had_set_aside_is_put_back(source: Path, tmp_path: Path, capsys) -> None:
    """Killed between moving the old file aside and the new one in: the old one is put back, as the write's own
    clean-up would have done, and without --overwrite it is then kept."""
    dst = tmp_path / "teacher.pth"
    stage = killed_staging(tmp_path / ".teacher.pth.tmp-0123abcd")
    (stage / ".old-teacher.pth").write_bytes(b"an earlier teacher file")  # where the swap sets it aside
    code, err = convert(capsys, source, dst, "meta")
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith("timm-ls: removed stale staging .teacher.pth.tmp-0123abcd (")
    assert lines[0].endswith("left by a write that was killed; put back teacher.pth, which it had set aside")
    assert lines[1] == f"timm-ls: error: {dst} exists; pass overwrite=True to replace it, or choose another path"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher.pth"]
    assert dst.read_bytes() == b"an earlier teacher file"
