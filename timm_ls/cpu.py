"""The CPU this runs on and its bf16 matrix units, read from /proc/cpuinfo without torch: `timm-ls features`
says in its plan line whether bf16 runs on them, and the benchmarks name the CPU they measured."""

from __future__ import annotations

import platform

CPUINFO = "/proc/cpuinfo"


def cpu_model(cpuinfo_path: str = CPUINFO) -> str:
    """`model name` from /proc/cpuinfo, else what the platform says."""
    model = platform.processor() or platform.machine()
    try:
        with open(cpuinfo_path) as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return model


# flag: the bf16 matrix path it gives oneDNN, fastest first
BF16_MATRIX_FLAGS = {
    "amx_bf16": "AMX-BF16 tiles",
    "avx512_bf16": "AVX-512 BF16 dot products (vdpbf16ps)",
}
REPORTED_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def cpu_flags(cpuinfo_path: str = CPUINFO) -> set[str]:
    """The `flags` of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        with open(cpuinfo_path) as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        return set()


def bf16_units(flags: set[str]) -> str | None:
    """The fastest bf16 matrix units these flags offer, None where there are none."""
    return next((path for flag, path in BF16_MATRIX_FLAGS.items() if flag in flags), None)


def bf16_matrix_path(flags: set[str]) -> str:
    """The fastest bf16 GEMM path these flags offer, or that there is none."""
    return bf16_units(flags) or "none: no amx_bf16 or avx512_bf16, so bf16 GEMMs widen to fp32 in software"


# class: the flags that make it, the most capable first; benchmarks quote their figures per class
CPU_CLASSES = (
    ("AMX", ("amx_bf16", "amx_int8")),
    ("AVX-512 BF16", ("avx512_bf16",)),
    ("AVX-512", ("avx512f",)),
    ("AVX2", ("avx2",)),
)


def cpu_class(flags: set[str]) -> str:
    """The CPU class these flags make ("AMX", "AVX-512 BF16", "AVX-512", "AVX2"), or "older than AVX2"."""
    return next((name for name, needed in CPU_CLASSES if all(f in flags for f in needed)), "older than AVX2")
