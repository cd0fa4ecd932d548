"""Where the package's shipped files are, found without importing it (its import loads torch and timm), and
the image files a command is given."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
        raise ModuleNotFoundError("timm_layerscale is not installed; pip install timm-layerscale")
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
