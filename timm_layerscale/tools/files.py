"""Results are written whole or not at all: staged beside the target, then renamed (the package's one helper)."""

from __future__ import annotations

from pathlib import Path

from ..checkpoints.write.writers import atomic_destination


def write_atomically(path: Path, data: bytes | str) -> None:
    """Writes `data` to `path`, replacing what is there only once the new file is complete."""
    with atomic_destination(Path(path), overwrite=True) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
