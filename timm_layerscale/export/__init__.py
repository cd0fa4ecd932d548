"""model/checkpoint -> ONNX: `export_onnx`, one input `pixel_values`, checked in ONNX Runtime.

A model in memory (a name without weights, a YAML variant, a module) is exported by torch's exporter as it
is. Weights in a file (a checkpoint, a folder, a tag's pretrained file) never make a model: the graph is
exported from a model on the meta device (no initializers, the exporter's graph optimisation off) and each
tensor is then read from the checkpoint, fitted and cast as a load would, and written into the file, so a
7B exports in fp16 with little memory. Above protobuf's 2 GB the weights go into external data beside the
file. The file and its external data are staged beside the destination and put in place together.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from timm_ls.destinations import destination_problem
from timm_ls.names import EXPORT_DTYPES
from timm_ls.paths import install_hint

from ..checkpoints.dtypes import cast_dtype
from ..checkpoints.write.writers import atomic_destination
from ..config import VitLsConfig
from ..fold import fold_layer_scale
from ..model import VisionTransformerLS
from .check import TOLERANCE, check_onnx, verdict
from .errors import CheckRow, ExportError, OnnxCheckError
from .graph import (
    INPUT_NAME,
    ExportedForward,
    example_and_shapes,
    export_program,
    metadata,
    norms_in_fp32,
    output_names,
    parse_outputs,
)
from .sources import Source, resolve_source
from .weights import (
    EXTERNAL_DATA_BYTES,
    external_data_path,
    fp32_bytes,
    physical_memory,
    reference_from_checkpoint,
    set_metadata,
    write_streamed,
)

__all__ = ["CheckRow", "ExportError", "OnnxCheckError", "OnnxExport", "check_onnx", "export_onnx", "require_onnx"]

REQUIRED = ("onnx", "onnxscript", "onnxruntime")


@dataclass
class OnnxExport:
    """What `export_onnx` wrote; `summary()` is the line the command prints."""

    path: Path
    external_data: Path | None
    variant: str
    weights: str
    outputs: list[str]
    dtype: str
    opset: int
    metadata: dict[str, str]
    check: list[CheckRow] = field(default_factory=list)
    tolerance: float | None = None

    def summary(self) -> str:
        data = f" + {self.external_data.name}" if self.external_data else ""
        checked = ""
        if self.check:
            worst = max(r.max_rel for r in self.check)
            checked = f"; ONNX Runtime matches PyTorch fp32 (max rel {worst:.1e} <= {self.tolerance:g})"
        return (
            f"exported {self.variant} ({self.weights}) to {self.path}{data}: {self.dtype}, opset {self.opset}, "
            f"input {INPUT_NAME} {self.metadata['input_shape']}, outputs {', '.join(self.outputs)}{checked}"
        )


@dataclass(frozen=True)
class _Graph:
    """What the graph is: its config, outputs, dtype and input shape (None for dynamic)."""

    config: VitLsConfig
    kind: str
    blocks: list[int]
    dtype: str
    batch: int | None
    size: tuple[int, int] | None
    fuse: bool
    opset: int | None

    @property
    def names(self) -> list[str]:
        return output_names(self.kind, self.blocks)

    @property
    def cast(self) -> torch.dtype:
        return cast_dtype(self.dtype)

    @property
    def folded(self) -> bool:
        return self.fuse or not any(v for pair in self.config.layer_init_values for v in pair)


def require_onnx() -> None:
    """One line naming what to install when the export extra is missing."""
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(
            f"exporting to ONNX needs {', '.join(missing)}: {install_hint('export')} (onnx, onnxscript, onnxruntime)"
        )


def export_onnx(
    model_or_source: str | Path | nn.Module,
    dst: str | Path,
    *,
    model: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    pretrained: bool = False,
    dtype: str = "fp32",
    batch: int | str | None = "dynamic",
    size: tuple[int, int] | str | None = "dynamic",
    outputs: str = "pooled",
    fuse_layerscale: bool = False,
    opset: int | None = None,
    check: bool = False,
    overwrite: bool = False,
    external_data: bool | None = None,
    check_sizes: Sequence[tuple[int, int]] | None = None,
) -> OnnxExport:
    """Exports a model to ONNX at `dst` with one input, `pixel_values` `[N, 3, H, W]`.

    `model_or_source`: a `VisionTransformerLS`, a registered `NAME[.TAG]` (random init, or its Hub weights
    with `pretrained`), a YAML variant file, or any checkpoint file or folder the package reads (`model`
    then names its variant, else its shapes do; `model_kwargs` `depth=N` exports its first N blocks).
    `outputs`: "pooled" (what `forward` returns), "tokens" (the normed tokens of the last block) or
    "features:I,J,..." (those blocks' patch tokens as `[N, C, H/p, W/p]`, as `forward_intermediates` gives
    them). `batch` and `size` ("dynamic", or an int and `(H, W)`) fix or free the input's shape.
    `fuse_layerscale` folds every gamma into the projection before it. `check` runs ONNX Runtime against
    PyTorch fp32 (square, wide, tall) and raises `OnnxCheckError` above `TOLERANCE[dtype]`, leaving nothing
    written. `external_data` forces (True) or forbids (False) weights beside the file; by default they go
    there above protobuf's 2 GB. `dst` must sit in an existing folder; an existing one (and its `.data`) is
    replaced only with `overwrite`.
    """
    require_onnx()
    dst = Path(dst)
    _check_request(dst, dtype, overwrite)
    batch = _parse_batch(batch)
    src = resolve_source(model_or_source, model, dict(model_kwargs or {}), pretrained)
    size = _parse_size(size, src.config)
    kind, blocks = parse_outputs(outputs, src.config.depth)
    config = src.config.replace(init_values=0) if fuse_layerscale else src.config
    graph = _Graph(config, kind, blocks, dtype, batch, size, fuse_layerscale, opset)
    if check and src.model is None:
        _refuse_a_check_beyond_memory(src.config)
    with atomic_destination(dst, overwrite, what="export", companions=[external_data_path(dst).name]) as staged:
        opset_used, external = _write(staged, src, graph, external_data)
        info = metadata(src, config, kind, graph.names, dtype, batch, size, graph.folded, opset_used)
        set_metadata(staged, info)
        data = external_data_path(dst) if external else None
        result = OnnxExport(dst, data, src.name, src.weights, graph.names, dtype, opset_used, info)
        if check:
            reference = src.model if src.model is not None else reference_from_checkpoint(src)
            result.check = check_onnx(staged, reference, kind, blocks, dtype, batch, size, check_sizes)
            result.tolerance = TOLERANCE[dtype]
            verdict(result.check, dtype)
    return result


def _check_request(dst: Path, dtype: str, overwrite: bool) -> None:
    """What can be known before any download or long step."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; pass --dtype one of {', '.join(EXPORT_DTYPES)}")
    problem = destination_problem(
        dst,
        folder=False,
        what="export",
        overwrite=overwrite,
        overwrite_hint="--overwrite (overwrite=True)",
        suffixes=(".onnx",),
        companions=[external_data_path(dst)],
    )
    if problem:
        raise ExportError(problem)


def _write(staged: Path, src: Source, graph: _Graph, external_data: bool | None) -> tuple[int, bool]:
    """The graph and its weights at `staged`: the opset used, and whether the weights went into external data."""
    if src.model is not None:
        exported = copy.deepcopy(src.model).eval().to(dtype=graph.cast)
        if graph.fuse:
            fold_layer_scale(exported)
        if graph.cast != torch.float32:
            norms_in_fp32(exported)
        example, shapes = example_and_shapes(graph.config, graph.cast, graph.batch, graph.size, "cpu")
        forward = ExportedForward(exported, graph.kind, graph.blocks).eval()
        program = export_program(forward, example, shapes, graph.names, graph.opset, True)
        nbytes = sum(t.numel() * t.element_size() for t in exported.state_dict().values())
        external = nbytes > EXTERNAL_DATA_BYTES if external_data is None else external_data
        program.save(staged, external_data=external)
    else:
        meta_model = VisionTransformerLS(graph.config, device="meta", dtype=graph.cast).eval()
        if graph.cast != torch.float32:
            norms_in_fp32(meta_model)
        example, shapes = example_and_shapes(graph.config, graph.cast, graph.batch, graph.size, "meta")
        forward = ExportedForward(meta_model, graph.kind, graph.blocks)
        program = export_program(forward, example, shapes, graph.names, graph.opset, False)
        external = write_streamed(staged, program, src, meta_model, external_data)
    return program.model.opset_imports.get("", graph.opset or 0), external


def _refuse_a_check_beyond_memory(config: VitLsConfig) -> None:
    fp32, memory = fp32_bytes(config), physical_memory()
    if fp32 > memory // 2:
        raise ExportError(
            f"--check compares with the PyTorch model in fp32 ({fp32 / 1e9:.1f} GB), more than half this machine's "
            f"memory ({memory / 1e9:.1f} GB): export without --check, and check its graph at a reduced depth "
            f"(add --model-kwargs depth=1 --check)"
        )


def _parse_batch(batch: int | str | None) -> int | None:
    if batch in (None, "dynamic"):
        return None
    try:
        value = int(batch)
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise ExportError(f"--batch: got {batch!r}; pass a positive number or dynamic")
    return value


def _parse_size(size: tuple[int, int] | str | None, config: VitLsConfig) -> tuple[int, int] | None:
    if size in (None, "dynamic"):
        return None
    try:
        height, width = (int(v) for v in (size.lower().split("x") if isinstance(size, str) else size))
    except (TypeError, ValueError):
        raise ExportError(f"--size: got {size!r}; pass HxW (e.g. 224x224) or dynamic") from None
    p = config.patch_size
    if height < 1 or width < 1:
        raise ExportError(f"--size: got {size!r}; both sides must be positive")
    if not config.dynamic_img_pad and (height % p or width % p):
        raise ExportError(
            f"--size {height}x{width} is not a multiple of the patch size {p}: pass "
            f"{max(height // p, 1) * p}x{max(width // p, 1) * p}, or build the model with dynamic_img_pad=True"
        )
    return height, width
