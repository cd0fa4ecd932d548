"""One rule for every destination a command or writer is given, checked before any work is done.

A destination must sit in a folder that exists (nothing creates parent folders), be named as what is written
(a folder has no file suffix, a file has one of its format's suffixes), not be a folder where a file is
written or a file where a folder is, and not exist unless it may be replaced. A folder is replaced only
while every file in it is one its format writes, and no destination may be or hold the current folder or the
source. The command checks it before torch loads, the package's writers again before they write: both with
`destination_problem`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path

from .names import FILE_OR_FOLDER, FILE_SUFFIXES, OWN_BY_CONTENT, FormatSpec, suffix_of

# Where a writer stages `NAME` (beside it, hidden) and, inside that, keeps the file it replaces.
STAGING, KEPT = ".{name}.tmp-{token}", ".old-{name}"
STAGING_PATTERN = STAGING.format(name="*", token="?" * 8)


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
    """Whether the entry `name` of a destination folder is one a writer of the files `ours` replaces: a file
    with one of their names (patterns), or a staging file or folder an interrupted writer left."""
    return fnmatchcase(name, STAGING_PATTERN) or (not folder and any(fnmatchcase(name, p) for p in ours))


def foreign_entries(folder: Path, ours: Sequence[str]) -> list[str]:
    """The entries of an existing `folder` that are not `ours`, files first, then subfolders (named with a
    trailing `/`). A link to a folder is replaced, never looked into: nothing under it counts."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    with os.scandir(folder) as entries:
        found = sorted((e.is_dir(follow_symlinks=False), e.name) for e in entries)
    return [
        name + "/" * is_dir
        for is_dir, name in found
        if not is_ours(name, ours, is_dir) or (name in OWN_BY_CONTENT and not _marked(folder / name, name))
    ]


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
