"""Tensor dtypes and layouts by name: the one table that the readers and the writers share.

Names read from a file are looked up here and nowhere else: never with `getattr(torch, name)`, which runs
torch's module `__getattr__` (deprecation warnings, lazy imports of submodules) for names it lacks.
"""

from __future__ import annotations

import torch

# Every dtype the package reads: torch's name for it, and the safetensors name (None where the format has none).
_DTYPE_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "complex128": None,
    "complex64": "C64",
    "complex32": None,
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
# The ones this torch has (older releases lack the wide unsigned and some float8 types), by torch's name: what a
# pickle names as the global `torch.<name>` (torch pickles a dtype by its canonical name, never an alias).
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dtype for name in _DTYPE_NAMES if isinstance(dtype := vars(torch).get(name), torch.dtype)
}
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    short: TORCH_DTYPES[name] for name, short in _DTYPE_NAMES.items() if short is not None and name in TORCH_DTYPES
}
_SAFETENSORS_NAMES = {short for short in _DTYPE_NAMES.values() if short is not None}
# Named by the format, with no torch dtype (sub-byte floats that torch packs differently or not at all).
_WITHOUT_TORCH_DTYPE = ("F4", "F6_E2M3", "F6_E3M2")
_NAMES_BY_DTYPE = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

# Tensor layouts by the name torch pickles them under (`torch.serialization._get_layout("torch.strided")`):
# DCP stores dense tensors only.
TORCH_LAYOUTS: dict[str, torch.layout] = {"torch.strided": torch.strided}


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name, or None where there is none (here)."""
    return SAFETENSORS_DTYPES.get(name)


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype of torch's own name for it (`float32`), or None for any other name."""
    return TORCH_DTYPES.get(name)


def layout_named(name: str) -> torch.layout | None:
    """The torch layout of the name torch pickles it under (`torch.strided`), or None for any other name."""
    return TORCH_LAYOUTS.get(name)


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype, or None where the format has none (complex128, quantised types)."""
    return _NAMES_BY_DTYPE.get(dtype)


def unknown_name_reason(name: str) -> str:
    """Why a safetensors dtype name has no torch dtype: a newer format or an older torch."""
    if name in _SAFETENSORS_NAMES:
        return f"{name}, which this torch {torch.__version__} has no dtype for (upgrade torch)"
    if name in _WITHOUT_TORCH_DTYPE:
        return f"{name}, which has no torch dtype here"
    return f"{name}, which is no safetensors dtype this package knows"


# The dtypes a conversion or export casts to, by the names the command takes (`timm_ls.names.CAST_DTYPES`).
_CAST_NAMES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


def cast_dtype(name: str) -> torch.dtype:
    """torch's dtype for `fp32`, `bf16` or `fp16`."""
    return SAFETENSORS_DTYPES[_CAST_NAMES[name]]
