"""One rule for every destination a command or writer is given, checked before any work is done.

A destination must sit in a folder that exists (nothing creates parent folders), be named as what is written
(a folder has no file suffix, a file has one of its format's suffixes), not be a folder where a file is
written or a file where a folder is, and not exist unless it may be replaced. A folder is replaced only
while every file in it is one its format writes, and no destination may be or hold the current folder or the
source. The command checks it before torch loads, the package's writers again before they write: both with
`destination_problem`.

A writer stages its files in a folder beside the destination (`STAGING`), made with a marker file locked for the
write's life (`hold_staging`); the next write of the same destination removes a staging folder whose marker
it can lock, one that a killed write left (`remove_stale_staging`).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from contextlib import suppress
from fnmatch import fnmatchcase
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows has no flock: staging is then never found stale, and is left as before
    fcntl = None

from .names import FILE_OR_FOLDER, FILE_SUFFIXES, OWN_BY_CONTENT, FormatSpec, suffix_of

# Where a writer stages `NAME` (beside it, hidden) and, inside that, keeps the file it replaces.
STAGING, KEPT = ".{name}.tmp-{token}", ".old-{name}"
STAGING_PATTERN = STAGING.format(name="*", token="?" * 8)
TOKEN_CHARS = frozenset("0123456789abcdef")
# Made first in every staging folder, holding MARK, and locked (flock) while the write runs: the kernel drops
# the lock when the writer ends, however it ends (SIGKILL, a crash, a power cut), so a marked folder whose lock
# can be taken is one a killed write left. The writer's pid and start time in it are for people to read.
MARKER, MARK = ".timm-ls-write", "timm-layerscale staging folder"


def destination_problem(
    dst: str | Path,
    *,
    folder: bool,
    what: str,
    overwrite: bool,
    overwrite_hint: str = "--overwrite",
    suffixes: Sequence[str] = (),
    companions: Sequence[str | Path] = (),
    or_folder: bool = False,
    ours: Sequence[str] = (),
    sources: Sequence[str | Path] = (),
    into: bool = False,
) -> str | None:
    """Why `dst` cannot be written, in one line naming the fix, or None when it can.

    `folder` says whether a folder is written there, `what` names the writer in the message ("--to native"),
    `suffixes` are a file's allowed suffixes (any when empty), `companions` other paths written with it (an
    ONNX file's external data), which may not exist either unless `overwrite`; `overwrite_hint` is how the
    caller spells replacing ("--overwrite" on the command line, "overwrite=True" in Python); `or_folder` says
    that a name without a suffix would be written as a folder; `ours` are the names (`fnmatch` patterns) of
    the files written in a folder, the only ones an existing folder may hold to be replaced; `sources` are
    paths read, which `dst` may neither be nor hold. `into` says that files are written into the folder
    `dst`, which is not replaced (`ablate --out`): it may hold anything, the current folder included.
    """
    dst = Path(dst)
    problem = None if into else held_problem(dst, sources)
    if problem:
        return problem
    parent = dst.parent
    if not parent.is_dir():
        if parent.exists():
            return f"{parent} is a file, not a folder; choose a destination inside a folder"
        return f"the folder {parent} does not exist; create it first (mkdir -p {parent}) or choose another destination"
    suffix = suffix_of(dst.name)
    if folder and suffix in FILE_SUFFIXES:
        return (
            f"{what} writes a folder, and {dst.name} is named like a file; give the folder a name without "
            f"{suffix} (e.g. {dst.with_suffix('').name})"
        )
    if not folder and suffixes and suffix not in suffixes:
        alternative = " or give a folder name without a suffix" if or_folder else ""
        return f"{what} writes one file: name it {_either(suffixes)}{alternative} (got {dst.name})"
    if dst.is_dir() and not dst.is_symlink() and not folder:
        return (
            f"{dst} is a folder and {what} writes a file; name a file (e.g. {dst / ('model' + (suffixes or ('',))[0])})"
        )
    if dst.exists() and not dst.is_dir() and not dst.is_symlink() and folder:
        return f"{dst} is a file and {what} writes a folder; name a folder (e.g. {dst.with_suffix('').name}-folder)"
    if not overwrite:
        for path in (dst, *map(Path, companions)):
            if path.exists() or path.is_symlink():
                return f"{path} exists; pass {overwrite_hint} to replace it, or choose another path"
    return None if into or not folder else foreign_problem(dst, ours, what, overwrite_hint)


def held_problem(dst: Path, sources: Sequence[str | Path] = ()) -> str | None:
    """Why replacing `dst` would remove the current folder or a source (`dst` is one or holds one), or None."""
    target, cwd = dst.resolve(), Path.cwd()
    if cwd.resolve().is_relative_to(target):
        return f"{dst} is or holds the current folder ({cwd}); choose another destination"
    for source in map(Path, sources):
        if source.resolve().is_relative_to(target):
            kind = "folder" if source.is_dir() else "file"
            return f"{dst} would replace the source {kind} {source}; choose another destination"
    return None


def is_ours(name: str, ours: Sequence[str], folder: bool = False) -> bool:
    """Whether the entry `name` of a destination folder is named as one a writer of the files `ours` replaces:
    a file with one of their names (patterns), or a staging folder (which is ours only when a killed write of
    this package left it: `foreign_entries` looks inside)."""
    if fnmatchcase(name, STAGING_PATTERN):
        return folder
    return not folder and any(fnmatchcase(name, p) for p in ours)


def foreign_entries(folder: Path, ours: Sequence[str]) -> list[str]:
    """The entries of an existing `folder` that are not `ours`, files first, then subfolders (named with a
    trailing `/`). A link to a folder is replaced, never looked into: nothing under it counts. A staging
    folder is ours only when its marker shows that a killed write of this package left it."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    with os.scandir(folder) as entries:
        found = sorted((e.is_dir(follow_symlinks=False), e.name) for e in entries)
    return [name + "/" * is_dir for is_dir, name in found if not _ours_by_content(folder, name, ours, is_dir)]


def _ours_by_content(folder: Path, name: str, ours: Sequence[str], is_dir: bool) -> bool:
    if not is_ours(name, ours, is_dir):
        return False
    if is_dir:
        return is_stale_staging(folder / name)
    return name not in OWN_BY_CONTENT or _marked(folder / name, name)


def _marked(path: Path, name: str, head: int = 4096) -> bool:
    """Whether the file at `path` is one this package wrote: its first bytes hold the mark of `name`."""
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as file:
        return OWN_BY_CONTENT[name].encode() in file.read(head)


def foreign_problem(folder: Path, ours: Sequence[str], what: str, overwrite_hint: str = "--overwrite") -> str | None:
    """Why `folder` may not be replaced by a writer of `ours` (`what`): it holds something else, or None."""
    foreign = foreign_entries(folder, ours)
    if not foreign:
        return None
    others = f" and {len(foreign) - 1} other{'s' * (len(foreign) > 2)}" if len(foreign) > 1 else ""
    return (
        f"{folder} holds {foreign[0]}{others}, which {what} does not write and {overwrite_hint} would delete; "
        f"choose another folder or remove {'them' if others else 'it'}"
    )


def _either(suffixes: Sequence[str]) -> str:
    return suffixes[0] if len(suffixes) == 1 else f"{', '.join(suffixes[:-1])} or {suffixes[-1]}"


def format_destination_problem(
    spec: FormatSpec,
    dst: str | Path,
    *,
    overwrite: bool,
    overwrite_hint: str = "--overwrite",
    sources: Sequence[str | Path] = (),
) -> str | None:
    """The rule above for what the format `spec` writes at `dst` (`--to NAME`), read from `sources`."""
    return destination_problem(
        dst,
        folder=spec.writes_folder(Path(dst).name),
        what=f"--to {spec.name}",
        overwrite=overwrite,
        overwrite_hint=overwrite_hint,
        suffixes=spec.suffixes,
        or_folder=spec.writes == FILE_OR_FOLDER,
        ours=spec.files,
        sources=sources,
    )


# ------------------------------------------------------------------------------------------------ staging


def staging_of(name: str, entry: str) -> bool:
    """Whether `entry` is named as a staging folder of a write of `name` (`.NAME.tmp-` and 8 hex digits)."""
    prefix = f".{name}.tmp-"
    token = entry[len(prefix) :]
    return entry.startswith(prefix) and len(token) == 8 and set(token) <= TOKEN_CHARS


def hold_staging(stage: Path) -> int:
    """Makes the staging folder `stage` and its marker, locked until the returned descriptor is closed or the
    process ends: while it is held, no other write takes the folder for stale. The marker gets its name only
    once locked, so a folder is never seen marked and unlocked while its write runs."""
    stage.mkdir()
    unnamed = stage / f"{MARKER}.new"
    fd = None
    try:
        fd = os.open(unnamed, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        if fcntl is not None:
            with suppress(OSError):  # a filesystem without locks: the folder can then never be taken for stale
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{MARK}\npid {os.getpid()}\nstarted {_start_time(os.getpid())}\n".encode())
        os.rename(unnamed, stage / MARKER)  # a new name in a new folder: nothing to replace
    except BaseException:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return fd


def _start_time(pid: int) -> str:
    """The process's start time (clock ticks after boot, /proc/PID/stat's 22nd field), which a reused pid lacks."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return "unknown"
    return f"{fields[19]} ticks after boot"


def _stale_marker(stage: Path) -> int | None:
    """The marker of `stage`, open and locked, when this package made the folder and no running write holds
    it; else None (not ours, a live write's, or a filesystem that cannot tell)."""
    try:
        fd = os.open(stage / MARKER, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if fcntl is not None and os.read(fd, len(MARK)) == MARK.encode():
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink:  # not removed by its writer, which was finishing as we looked
                return fd
    except OSError:  # held by a running write (BlockingIOError), or no locks here
        pass
    os.close(fd)
    return None


def is_stale_staging(stage: Path) -> bool:
    """Whether the folder `stage` is staging a killed write of this package left: marked, and unlocked."""
    if stage.is_symlink() or not stage.is_dir():
        return False
    fd = _stale_marker(stage)
    if fd is not None:
        os.close(fd)
    return fd is not None


def _say(line: str) -> None:
    print(f"timm-ls: {line}", file=sys.stderr)


def remove_stale_staging(dst: str | Path, say: Callable[[str], object] = _say) -> list[str]:
    """Removes the staging folders beside `dst` that killed writes of `dst` left, each said in one line (on
    stderr by default). What such a write had set aside (`.old-NAME`) and left no NAME in place of is put back
    first, as its own clean-up would have done; returns those names. A folder named as staging that was not
    made by this package, or that a running write holds, is left as it is."""
    dst = Path(dst)
    restored = []
    with os.scandir(dst.parent) as entries:
        found = sorted(e.name for e in entries if staging_of(dst.name, e.name) and e.is_dir(follow_symlinks=False))
    for name in found:
        stage = dst.parent / name
        fd = _stale_marker(stage)
        if fd is None:
            continue
        try:
            size = _tree_size(stage)
            back = _put_back(stage, dst.parent)
            shutil.rmtree(stage)
        finally:
            os.close(fd)
        restored += back
        again = f"; put back {', '.join(back)}, which it had set aside" if back else ""
        say(f"removed stale staging {name} ({_size(size)}) left by a write that was killed{again}")
    return restored


def _put_back(stage: Path, parent: Path) -> list[str]:
    """Moves each `.old-NAME` in `stage` back to `parent / NAME` where nothing is there; the names moved."""
    prefix = KEPT.format(name="")
    back = []
    for kept in sorted(stage.iterdir()):
        target = parent / kept.name[len(prefix) :]
        if kept.name.startswith(prefix) and not (target.exists() or target.is_symlink()):
            os.replace(kept, target)
            back.append(target.name)
    return back


def _tree_size(folder: Path) -> int:
    return sum(os.lstat(os.path.join(root, name)).st_size for root, _, names in os.walk(folder) for name in names)


def _size(nbytes: int) -> str:
    if nbytes >= 10**9:
        return f"{nbytes / 10**9:.1f} GB"
    return f"{nbytes / 10**6:.0f} MB" if nbytes >= 10**6 else f"{nbytes / 10**3:.0f} kB"
