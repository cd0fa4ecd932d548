"""Tensor dtypes by their safetensors names: the one table that the reader and the writers share."""

from __future__ import annotations

import torch

# Every dtype the safetensors format names, with torch's name for it.
_TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
# The ones this torch has (older releases lack the wide unsigned and some float8 types).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: dtype for name, attr in _TORCH_NAMES.items() if isinstance(dtype := getattr(torch, attr, None), torch.dtype)
}
# Named by the format, with no torch dtype (sub-byte floats that torch packs differently or not at all).
_WITHOUT_TORCH_DTYPE = ("F4", "F6_E2M3", "F6_E3M2")
_NAMES_BY_DTYPE = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name, or None where there is none (here)."""
    return SAFETENSORS_DTYPES.get(name)


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype, or None where the format has none (complex128, quantised types)."""
    return _NAMES_BY_DTYPE.get(dtype)


def unknown_name_reason(name: str) -> str:
    """Why a safetensors dtype name has no torch dtype: a newer format or an older torch."""
    if name in _TORCH_NAMES:
        return f"{name}, which this torch {torch.__version__} has no dtype for (upgrade torch)"
    if name in _WITHOUT_TORCH_DTYPE:
        return f"{name}, which has no torch dtype here"
    return f"{name}, which is no safetensors dtype this package knows"


# The dtypes a conversion or export casts to, by the names the command takes (`timm_ls.names.CAST_DTYPES`).
_CAST_NAMES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


def cast_dtype(name: str) -> torch.dtype:
    """torch's dtype for `fp32`, `bf16` or `fp16`."""
    return SAFETENSORS_DTYPES[_CAST_NAMES[name]]
