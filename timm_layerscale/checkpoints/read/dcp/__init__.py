"""torch.distributed.checkpoint folders, read without trusting them: `.metadata` through a bounded,
allow-listed unpickler (`unpickler`), checked against a schema (`schema`), then per-key tensor reads (`reader`).
"""

from .reader import METADATA_FILE, read_metadata, stored_files, tensor_items, tensor_reader
from .schema import LIMITS

__all__ = ["LIMITS", "METADATA_FILE", "read_metadata", "stored_files", "tensor_items", "tensor_reader"]
