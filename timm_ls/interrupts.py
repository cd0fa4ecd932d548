"""Ctrl-C (SIGINT) and SIGTERM end a command the same way: an exception raised where it runs, so that every
writer's clean-up (`finally`, `except`) runs before the process ends, as it does for an error.

Python turns SIGINT into `KeyboardInterrupt` by itself; SIGTERM's default ends the process at once, leaving
a writer's staging folder behind. `timm-ls` raises `Interrupted` (a `KeyboardInterrupt`) for both while a
command runs; a writer defers both across the few renames that must not be cut halfway.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A signal that ends the command; `exit_status` is the shell's for it (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


_ARRIVED: list[int] = []  # the signals `_raise` turned into `Interrupted` since `interruptible` began


def _raise(signum: int, frame: FrameType | None) -> None:
    _ARRIVED.append(signum)
    raise Interrupted(signum)


def arrived() -> int | None:
    """The first signal that interrupted the command, also where the library code it landed in turned the
    `Interrupted` into an error of its own (torch's loaders do); None if none came."""
    return _ARRIVED[0] if _ARRIVED else None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # only it may set handlers


@contextmanager
def interruptible() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM raise `Interrupted`; a signal the process was started ignoring
    (`nohup`, a background job) or that another handler already takes is left alone."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    _ARRIVED.clear()
    old = {}
    if _in_main_thread():
        old = {sig: signal.signal(sig, _raise) for sig in HANDLED if signal.getsignal(sig) is defaults[sig]}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """SIGINT and SIGTERM arriving while the block runs take effect (their own handlers) once it ends."""
    if not _in_main_thread():
        yield
        return
    arrived: list[int] = []
    handled = [sig for sig in HANDLED if signal.getsignal(sig) not in (signal.SIG_IGN, None)]
    old = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)
