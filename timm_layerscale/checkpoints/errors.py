"""The one error type of reading and converting checkpoints, and how torch's load failures become it."""

from __future__ import annotations

import re


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the problem and the fix in one line."""


def torch_load_error(
    source: object, exc: BaseException, what: str = "torch checkpoint", fix: str = "save or download it again"
) -> CheckpointError:
    """A `torch.load(weights_only=True)` failure as one line: a refused pickle, naming what it asked for, or a
    damaged file (cut short or overwritten; weights_only reports stray bytes as an unsupported operand)."""
    message = str(exc)
    damaged = re.search(r"Unsupported operand \S+", message)
    if "weights only" in message.lower() and not damaged:
        wanted = re.search(r"GLOBAL ([\w.]+)", message)
        needs = f" ({wanted.group(1)})" if wanted else ""
        return CheckpointError(
            f"refused to load {source}: it is a pickle that needs objects other than tensors{needs}, which could "
            f"run code (nothing was run); use a file you trust saved as a plain state dict or .safetensors"
        )
    detail = damaged.group(0) if damaged else reason(exc)
    return CheckpointError(f"{source} is a truncated or corrupt {what} ({detail}); {fix}")


def reason(exc: BaseException) -> str:
    """The first sentence of an exception's message, on one line."""
    first = " ".join(str(exc).split()).split(". ")[0]
    return (first[:200] + ("..." if len(first) > 200 else "")) or type(exc).__name__
