"""The CPU a benchmark ran on, read without torch (the subprocess benchmarks keep their parent free of it)."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """`model name` from /proc/cpuinfo, else what the platform says."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return model
