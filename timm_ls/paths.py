"""Where the package's shipped files are, how to install it into this Python, and the image files a
command is given, found without importing the package (its import loads torch and timm)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

DISTRIBUTION = "timm-layerscale"
# The project's name in a pyproject.toml, read by a pattern: tomllib is Python 3.11+, the package runs on 3.10.
PROJECT_NAME = re.compile(rf"^name\s*=\s*[\"']{DISTRIBUTION}[\"']\s*$", re.MULTILINE)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def image_files(sources: list[str]) -> list[Path]:
    """The images named: each file as given, each folder's image files (by suffix) in name order."""
    found = []
    for source in map(Path, sources):
        if source.is_dir():
            found += sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        else:
            found.append(source)
    return found


def package_dir() -> Path:
    spec = importlib.util.find_spec("timm_layerscale")  # a top-level name: found, not imported
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"timm_layerscale is not installed; {install_hint(None)}")
    return Path(spec.origin).parent


def config_dir() -> Path:
    """The shipped YAML files: inside the installed package, or at the top of a source checkout."""
    installed = package_dir() / "configs"
    return installed if installed.is_dir() else package_dir().parent / "configs"


def experiments_dir() -> Path:
    """The experiments the commands train (`demo.yaml`, the main job; `ablate.yaml`)."""
    return config_dir() / "experiments"


def assets_dir() -> Path:
    """The images the main job runs through a model with weights."""
    return package_dir() / "assets"


def _is_our_project(folder: Path) -> bool:
    try:
        text = (folder / "pyproject.toml").read_text()
    except OSError:
        return False
    project = text.partition("[project]")[2].partition("\n[")[0]
    return PROJECT_NAME.search(project) is not None


def source_checkout(package: Path) -> tuple[Path, bool] | None:
    """The source checkout the package at `package` (its `timm_layerscale` folder) came from, and whether it
    runs from there (an editable install or `PYTHONPATH`); None for an install from an index.

    A checkout is a pyproject.toml of timm-layerscale beside the package folder, or a local folder that the
    installed distribution's direct_url.json names (`pip install /path/to/checkout`)."""
    if _is_our_project(package.parent):
        return package.parent, True
    for info in sorted(package.parent.glob("timm_layerscale-*.dist-info")):
        try:
            direct = json.loads((info / "direct_url.json").read_text())
        except (OSError, ValueError):
            continue
        url = urlparse(str(direct.get("url", "")))
        folder = Path(unquote(url.path))
        if url.scheme == "file" and "dir_info" in direct and _is_our_project(folder):
            return folder, bool(direct["dir_info"].get("editable"))
    return None


def install_hint(extra: str | None, package: Path | None = None, cwd: Path | None = None) -> str:
    """The command that installs the package with `extra` into the Python that runs this one.

    From a source checkout it installs that checkout (`-e` where the package runs from it; `.` when `cwd` is
    the checkout), else the release from the index. `package` is the package folder (default: the one
    importable here); `cwd` defaults to the current folder."""
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    if package is None:
        spec = importlib.util.find_spec("timm_layerscale")
        package = Path(spec.origin).parent if spec is not None and spec.origin else None
    found = source_checkout(package) if package is not None else None
    suffix = f"[{extra}]" if extra else ""
    if found is None:
        return f"{pip} {shlex.quote(DISTRIBUTION + suffix)}"
    checkout, editable = found
    here = (cwd or Path.cwd()).resolve() == checkout.resolve()
    return f"{pip} {'-e ' if editable else ''}{shlex.quote(('.' if here else str(checkout)) + suffix)}"


DEMO_FOLDER = "timm-ls-demo"


def user_cache() -> Path:
    """The user's cache folder: $XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def inside_this_repository(folder: Path) -> Path | None:
    """The git checkout of timm-layerscale that `folder` is in (it or a folder above holds .git and the
    project's pyproject.toml), or None."""
    for candidate in (folder, *folder.parents):
        if (candidate / ".git").exists():
            return candidate if _is_our_project(candidate) else None
    return None


def demo_out(out: str | Path | None, cwd: Path | None = None) -> Path:
    """Where the main job writes its picture and its model: `out` when given; else `./timm-ls-demo`, unless the
    current folder is inside a git checkout of this repository, where nothing is written unasked: then
    `<user cache>/timm-layerscale/demo`."""
    if out is not None:
        return Path(out)
    here = (cwd or Path.cwd()).resolve()
    if inside_this_repository(here) is not None:
        return user_cache() / DISTRIBUTION / "demo"
    return here / DEMO_FOLDER
