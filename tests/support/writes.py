"""Writes caught in the act: a command run as a process, stopped (SIGSTOP) at a moment of its write seen while
it is stopped, then signalled. What the test saw is still so when the signal arrives: no race with the write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import timm

from timm_layerscale import save_native

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def vit_b(folder: Path) -> Path:
    """ViT-B/16 (width 768, depth 12) with random weights as a native folder: its writes take a second or more,
    long enough to be caught in the middle by `frozen_when`."""
    return save_native(timm.create_model("vit_ls_base_patch16_dinov3", num_classes=0), folder / "vitb")


def start(*args: str) -> subprocess.Popen:
    """`timm-ls ARGS` as a process of its own, its output kept."""
    return subprocess.Popen(
        [sys.executable, "-m", "timm_ls", *args], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def stages(parent: Path, name: str) -> list[Path]:
    """The staging folders of writes of `name` in `parent`."""
    return sorted(parent.glob(f".{name}.tmp-*"))


def writing(parent: Path, name: str) -> bool:
    """Whether a write of `name` is under way: its staging holds `name` with bytes in it (a file) or files (a
    folder). For a .pth, once torch.save has begun, after the tensors were streamed beside it."""
    staged = [stage / name for stage in stages(parent, name)]
    return any((p.is_file() and p.stat().st_size > 0) or (p.is_dir() and any(p.iterdir())) for p in staged)


def frozen_when(proc: subprocess.Popen, condition: Callable[[], bool], what: str) -> None:
    """Stops `proc` at a moment `condition()` holds and leaves it stopped: `condition` is looked at only while
    the process is stopped, so a signal sent next arrives before it takes another step. Polls for an event of
    the write, never for a time."""
    while True:
        os.kill(proc.pid, signal.SIGSTOP)
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):  # it ended first: the write was never seen under way
            proc.returncode = os.waitstatus_to_exitcode(status)
            raise AssertionError(f"the process ended before {what}: {proc.returncode}, {proc.communicate()}")
        if condition():
            return
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.005)  # a polling step, so the write runs between looks


def signal_frozen(proc: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to the stopped `proc`, then lets it run: the signal is the first thing it meets."""
    os.kill(proc.pid, signum)
    os.kill(proc.pid, signal.SIGCONT)


# A writer's staging made by the package's own code, in a process of its own: `sys.argv[1]` is the folder.
HOLD = (
    "import os, signal, sys; from pathlib import Path; from timm_ls.destinations import hold_staging; "
    "stage = Path(sys.argv[1]); hold_staging(stage); "
    "(stage / stage.name.split('.tmp-')[0][1:]).write_bytes(b'x' * 4096)"
)


def killed_staging(stage: Path) -> Path:
    """The staging folder `stage` as a write killed by SIGKILL leaves it: marked, a partial file in it, unlocked."""
    proc = subprocess.run(
        [sys.executable, "-c", HOLD + "; os.kill(os.getpid(), signal.SIGKILL)", str(stage)], env=ENV, check=False
    )
    assert proc.returncode == -signal.SIGKILL and stage.is_dir(), proc
    return stage


def held_staging(stage: Path) -> subprocess.Popen:
    """A running writer holding the staging folder `stage` until its stdin is closed: made and locked once
    `held` is read back from it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD + "; print('held', flush=True); sys.stdin.read()", str(stage)],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "held\n", proc.communicate()
    return proc
