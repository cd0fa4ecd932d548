"""setuptools' build backend, plus the start-up files that register the variants whenever timm is imported.

setuptools installs no extra `.pth` file from a package, and its editable wheels (every mode) leave such
files out, so both the wheel and the editable wheel get them added here, with their RECORD lines:

- `timm_layerscale-autoregister.pth`: an import line, run by `site` at start-up (Python < 3.15). Its name
  sorts after setuptools' `__editable__*.pth`, whose finder an editable install needs to import the hook.
- `timm_layerscale-autoregister.start`: the same hook as a PEP 829 entry point. Python 3.15+ runs it and then
  skips the import line of the `.pth` file of the same name.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every other hook is setuptools' own)

HOOK = "_timm_layerscale_autoregister"
STARTUP_FILES = {
    "timm_layerscale-autoregister.pth": f"import {HOOK}; {HOOK}.install()\n",
    "timm_layerscale-autoregister.start": f"{HOOK}:install\n",
}


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_startup_files(Path(wheel_directory) / name)
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_startup_files(Path(wheel_directory) / name)
    return name


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def add_startup_files(wheel: Path) -> None:
    """Rewrites `wheel` with STARTUP_FILES at its root, each listed in its RECORD."""
    added = {name: text.encode() for name, text in STARTUP_FILES.items()}
    with zipfile.ZipFile(wheel) as source:
        entries = [(info, source.read(info)) for info in source.infolist() if info.filename not in added]
    record_info, record = next(entry for entry in entries if entry[0].filename.endswith(".dist-info/RECORD"))
    entries.remove((record_info, record))
    own_line = f"{record_info.filename},,"
    lines = [line for line in record.decode().splitlines() if line.split(",")[0] not in added and line != own_line]
    lines += [_record_line(name, data) for name, data in added.items()] + [own_line]
    partial = wheel.with_name(wheel.name + ".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as target:
        for info, data in entries:
            target.writestr(info, data)
        for name, data in added.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            target.writestr(info, data, zipfile.ZIP_DEFLATED)
        target.writestr(record_info, "\n".join(lines) + "\n")  # RECORD last, as in every wheel
    os.replace(partial, wheel)
