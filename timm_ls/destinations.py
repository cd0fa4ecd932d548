"""One rule for every destination a command or writer is given, checked before any work is done.

A destination must sit in a folder that exists (nothing creates parent folders), be named as what is written
(a folder has no file suffix, a file has one of its format's suffixes), not be a folder where a file is
written or a file where a folder is, and not exist unless it may be replaced. The command checks it before
torch loads, the package's writers again before they write: both with `destination_problem`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .names import FILE_OR_FOLDER, FILE_SUFFIXES, FormatSpec, suffix_of


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
) -> str | None:
    """Why `dst` cannot be written, in one line naming the fix, or None when it can.

    `folder` says whether a folder is written there, `what` names the writer in the message ("--to native"),
    `suffixes` are a file's allowed suffixes (any when empty), `companions` other paths written with it (an
    ONNX file's external data), which may not exist either unless `overwrite`; `overwrite_hint` is how the
    caller spells replacing ("--overwrite" on the command line, "overwrite=True" in Python); `or_folder` says
    that a name without a suffix would be written as a folder.
    """
    dst = Path(dst)
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
    if dst.exists() and not dst.is_dir() and folder:
        return f"{dst} is a file and {what} writes a folder; name a folder (e.g. {dst.with_suffix('').name}-folder)"
    if not overwrite:
        for path in (dst, *map(Path, companions)):
            if path.exists() or path.is_symlink():
                return f"{path} exists; pass {overwrite_hint} to replace it, or choose another path"
    return None


def _either(suffixes: Sequence[str]) -> str:
    return suffixes[0] if len(suffixes) == 1 else f"{', '.join(suffixes[:-1])} or {suffixes[-1]}"


def format_destination_problem(
    spec: FormatSpec, dst: str | Path, *, overwrite: bool, overwrite_hint: str = "--overwrite"
) -> str | None:
    """The rule above for what the format `spec` writes at `dst` (`--to NAME`)."""
    return destination_problem(
        dst,
        folder=spec.writes_folder(Path(dst).name),
        what=f"--to {spec.name}",
        overwrite=overwrite,
        overwrite_hint=overwrite_hint,
        suffixes=spec.suffixes,
        or_folder=spec.writes == FILE_OR_FOLDER,
    )
