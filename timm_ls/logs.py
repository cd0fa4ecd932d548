"""Libraries' log lines kept off the terminal while a command prints its own one line."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quieted(logger_name: str | None = None) -> Iterator[None]:
    """Only errors from `logger_name` (the root logger when None) until the block ends."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
