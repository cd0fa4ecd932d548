"""What a file is, from its first bytes: checked before any parser sees it, so a wrong file gets one clear line.

`sniff` tells safetensors, torch zip and legacy torch files apart from each other and from what users pass by
mistake (images, archives, plain pickles, text files such as a README, YAML, JSON or notes).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from ..errors import CheckpointError

HEAD_BYTES = 4096
CONFIG_MAX_BYTES = 1 << 20
# safetensors refuses headers above 100 MB; a length this small has zero high bytes, which text never has.
SAFETENSORS_MAX_HEADER = 100_000_000
# torch.save's legacy (non-zip) format: pickle protocol 2, then its magic number as a 10-byte LONG1.
LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
OTHER_FORMATS = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"%PDF-", "a PDF document"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"\x28\xb5\x2f\xfd", "a zstd archive"),
    (b"\xfd7zXZ\x00", "an xz archive"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras .h5?)"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
)
TEXT_KINDS = {
    ".json": "a JSON file",
    ".yaml": "a YAML file",
    ".yml": "a YAML file",
    ".md": "a Markdown file",
    ".rst": "a reStructuredText file",
    ".txt": "a text file",
    ".py": "a Python source file",
    ".csv": "a CSV file",
    ".html": "an HTML file",
}
# Control bytes that text files hold: tab, newline, vertical tab, form feed, carriage return, escape.
TEXT_CONTROLS = frozenset(b"\t\n\x0b\x0c\r\x1b")
PASS_WEIGHTS = "pass a weights file (.safetensors, .pth, .bin) or a checkpoint folder"


def sniff(path: Path) -> str:
    """What `path` holds, by content: "safetensors", "torch zip" or "legacy torch"; anything else raises
    `CheckpointError` naming what the file is."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(
            f"{path} is empty (0 bytes): its save or download did not finish; save or download it again"
        )
    with path.open("rb") as f:
        head = f.read(HEAD_BYTES)
    if path.suffix == ".distcp":
        raise CheckpointError(
            f"{path} is one data file of a distributed checkpoint (torch.distributed.checkpoint); pass its folder "
            f"{path.parent}"
        )
    if head.startswith(ZIP_MAGIC):
        return _torch_zip(path)
    if _is_safetensors(head, size, path):
        return "safetensors"
    if head.startswith(LEGACY_TORCH_MAGIC):
        return "legacy torch"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise CheckpointError(
            f"refused to read {path}: it is a Python pickle, not a torch or safetensors checkpoint, and unpickling "
            f"it could run code (nothing was run); save the weights with torch.save or safetensors instead"
        )
    for magic, what in OTHER_FORMATS:
        if head.startswith(magic):
            raise CheckpointError(f"{path} is {what}, not a checkpoint; {PASS_WEIGHTS}")
    if head[257:262] == b"ustar":
        raise CheckpointError(f"{path} is a tar archive, not a checkpoint; unpack it and pass the weights file inside")
    text = _text_kind(path, head)
    if text:
        raise CheckpointError(f"{path} is {text}, not a checkpoint; {PASS_WEIGHTS}{_config_hint(path)}")
    raise CheckpointError(
        f"{path} is not a checkpoint: it is neither safetensors nor a torch file (it starts with bytes "
        f"{head[:8].hex(' ')}); {PASS_WEIGHTS}, or download it again if it should be one"
    )


def _is_safetensors(head: bytes, size: int, path: Path) -> bool:
    """8-byte little-endian header length, then the JSON header. A header cut short is a truncated file."""
    length = int.from_bytes(head[:8], "little")
    if head[8:9] != b"{" or length > SAFETENSORS_MAX_HEADER:
        return False
    if 8 + length > size:
        raise CheckpointError(
            f"{path} is a truncated safetensors file: its header needs {8 + length} bytes but the file has {size}; "
            f"save or download it again"
        )
    return True


def _torch_zip(path: Path) -> str:
    """torch.save's zip files hold `<name>/data.pkl`; other zip archives are named as such."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is a truncated or corrupt zip file ({exc}): a torch checkpoint cut short? save or download "
            f"it again"
        ) from exc
    if any(name.endswith("/data.pkl") or name == "data.pkl" for name in names):
        return "torch zip"
    if names and all(name.endswith(".npy") for name in names):
        raise CheckpointError(f"{path} is a NumPy .npz archive, not a torch checkpoint; {PASS_WEIGHTS}")
    raise CheckpointError(
        f"{path} is a zip archive but not a torch checkpoint (it holds {', '.join(names[:3]) or 'nothing'}"
        f"{', ...' if len(names) > 3 else ''}); unpack it and pass the weights file inside"
    )


def _text_kind(path: Path, head: bytes) -> str | None:
    """A name for a text file (by suffix, else by content), or None for binary content."""
    if b"\x00" in head:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not just a character cut in half at the end of the sample
            return None
        text = head[: exc.start].decode("utf-8")
    controls = sum(1 for b in head if b < 0x20 and b not in TEXT_CONTROLS)
    if controls > len(head) // 100:
        return None
    kind = TEXT_KINDS.get(path.suffix.lower())
    if kind:
        return kind
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        return "a JSON file"
    if stripped.startswith("#"):
        return "a text file (Markdown or a script?)"
    return "a text file"


def _config_hint(path: Path) -> str:
    """A model config beside its weights: the folder is what to pass."""
    try:
        config = json.loads(path.read_text()) if path.stat().st_size < CONFIG_MAX_BYTES else None
    except (ValueError, OSError):
        return ""
    if isinstance(config, dict) and ("model_type" in config or "architecture" in config):
        return f" ({path.name} is a model config: pass its folder {path.parent} to read the weights beside it)"
    return ""
