"""model/checkpoint -> ONNX: `export_onnx`, one input `pixel_values`, checked in ONNX Runtime.

A model in memory (a name without weights, a YAML variant, a module) is exported by torch's exporter as it
is. Weights in a file (a checkpoint, a folder, a tag's pretrained file) never make a model: the graph is
exported from a model on the meta device (no initializers, the exporter's graph optimisation off) and each
tensor is then read from the checkpoint, fitted and cast as a load would, and written into the file, so a
7B exports in fp16 with little memory. Above protobuf's 2 GB the weights go into external data beside the
file. The file and its external data are staged beside the destination and put in place together.

With `int8`, the fp32 graph is staged (and checked), quantized by ONNX Runtime into the staged file and measured
against PyTorch fp32 (`export.int8`); a file below `min_cosine` is never put in place.
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
from ..fidelity import Fidelity
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
from .int8 import (
    OPTIONS,
    FidelityError,
    Int8Request,
    check_int8_request,
    int8_request,
    measure,
    quantize,
    refuse_below,
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

__all__ = [
    "CheckRow",
    "ExportError",
    "FidelityError",
    "OnnxCheckError",
    "OnnxExport",
    "check_onnx",
    "export_onnx",
    "require_onnx",
]

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
    int8: str | None = None  # "dynamic" or "static"
    fidelity: Fidelity | None = None  # the int8 file against PyTorch fp32
    fidelity_images: str = ""  # what the fidelity was measured on
    skipped: list[str] = field(default_factory=list)  # unreadable images left out of calibration and fidelity

    def summary(self) -> str:
        data = f" + {self.external_data.name}" if self.external_data else ""
        checked = ""
        if self.check:
            worst = max(r.max_rel for r in self.check)
            what = "the fp32 graph" if self.int8 else "ONNX Runtime"
            checked = f"; {what} matches PyTorch fp32 (max rel {worst:.1e} <= {self.tolerance:g})"
        dtype = f"int8 {self.int8} ({OPTIONS[self.int8]})" if self.int8 else self.dtype
        if self.fidelity is not None:
            checked += (
                f"; int8 vs fp32 on {self.fidelity_images}: pooled cosine min {self.fidelity.pooled_cosine_min:.5f}, "
                f"patch cosine min {self.fidelity.patch_cosine_min:.4f}"
            )
        return (
            f"exported {self.variant} ({self.weights}) to {self.path}{data}: {dtype}, opset {self.opset}, "
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
    with_tokens: bool = False  # an int8 export's: the tokens its fidelity is read from

    @property
    def names(self) -> list[str]:
        return output_names(self.kind, self.blocks, self.with_tokens)

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
    int8: str | None = None,
    calibrate: str | Path | None = None,
    images: str | Path | None = None,
    min_cosine: float | None = None,
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

    `int8` ("dynamic" or "static", from the fp32 graph; `export.int8` says how) adds a `tokens` output,
    calibrates static on the folder `calibrate`, and measures the file against PyTorch fp32 on those images,
    `images`' or rendered ones (`fidelity`); below `min_cosine` it raises `FidelityError`, writing nothing.
    """
    require_onnx()
    dst = Path(dst)
    _check_request(dst, dtype, overwrite)
    check_int8_request(int8, dtype, calibrate, images, min_cosine)
    batch = _parse_batch(batch)
    src = resolve_source(model_or_source, model, dict(model_kwargs or {}), pretrained)
    size = _parse_size(size, src.config)
    kind, blocks = parse_outputs(outputs, src.config.depth)
    config = src.config.replace(init_values=0) if fuse_layerscale else src.config
    quant = int8_request(int8, dtype, calibrate, images, min_cosine, src.pretrained_cfg, size)
    graph = _Graph(config, kind, blocks, dtype, batch, size, fuse_layerscale, opset, quant is not None)
    if (check or quant) and src.model is None:
        _refuse_a_check_beyond_memory(src.config)
    with atomic_destination(dst, overwrite, what="export", companions=[external_data_path(dst).name]) as staged:
        return _stage(staged, dst, src, graph, external_data, (check_sizes or []) if check else None, quant)


def _stage(
    staged: Path,
    dst: Path,
    src: Source,
    graph: _Graph,
    external_data: bool | None,
    check_sizes: Sequence[tuple[int, int]] | None,
    quant: Int8Request | None,
) -> OnnxExport:
    """The file at `staged`: the graph (fp32 beside it first with `quant`), checked where `check_sizes` is not
    None (an empty list: the default sizes), quantized and measured with `quant`."""
    fp32 = staged.with_name(f"fp32-{staged.name}") if quant else staged
    opset, external = _write(fp32, src, graph, external_data)
    info = metadata(
        src, graph.config, graph.kind, graph.names, graph.dtype, graph.batch, graph.size, graph.folded, opset
    )
    set_metadata(fp32, info)
    result = OnnxExport(dst, None, src.name, src.weights, graph.names, graph.dtype, opset, info)
    reference = None
    if check_sizes is not None or quant:
        reference = src.model if src.model is not None else reference_from_checkpoint(src)
    if check_sizes is not None:
        result.check = check_onnx(
            fp32,
            reference,
            graph.kind,
            graph.blocks,
            graph.dtype,
            graph.batch,
            graph.size,
            check_sizes or None,
            with_tokens=graph.with_tokens,
        )
        result.tolerance = TOLERANCE[graph.dtype]
        verdict(result.check, graph.dtype)
    if quant:
        external = _int8(fp32, staged, quant, graph, reference, result, external_data)
    result.external_data = external_data_path(dst) if external else None
    return result


def _int8(
    fp32: Path,
    staged: Path,
    quant: Int8Request,
    graph: _Graph,
    reference: nn.Module,
    result: OnnxExport,
    external_data: bool | None,
) -> bool:
    """The staged fp32 file quantized into `staged` and measured; raises `FidelityError` below the bar.
    Returns whether the int8 weights went into external data."""
    external = fp32_bytes(graph.config) // 4 > EXTERNAL_DATA_BYTES if external_data is None else external_data
    quantize(fp32, staged, quant, graph.batch, external)
    fp32.unlink()  # the staging folder goes when the export ends; its space is needed now
    external_data_path(fp32).unlink(missing_ok=True)
    fidelity = measure(staged, reference, graph.names, quant.images, graph.batch)
    result.int8, result.fidelity = quant.mode, fidelity
    result.fidelity_images, result.skipped = quant.described, quant.skipped
    result.metadata = {**result.metadata, "int8": quant.mode, "int8_options": OPTIONS[quant.mode]}
    result.metadata["int8_fidelity"] = f"{fidelity.line()} ({quant.described})"
    set_metadata(staged, result.metadata)
    refuse_below(fidelity, quant)
    return external


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
        forward = ExportedForward(exported, graph.kind, graph.blocks, graph.with_tokens).eval()
        program = export_program(forward, example, shapes, graph.names, graph.opset, True)
        nbytes = sum(t.numel() * t.element_size() for t in exported.state_dict().values())
        external = nbytes > EXTERNAL_DATA_BYTES if external_data is None else external_data
        program.save(staged, external_data=external)
    else:
        meta_model = VisionTransformerLS(graph.config, device="meta", dtype=graph.cast).eval()
        if graph.cast != torch.float32:
            norms_in_fp32(meta_model)
        example, shapes = example_and_shapes(graph.config, graph.cast, graph.batch, graph.size, "meta")
        forward = ExportedForward(meta_model, graph.kind, graph.blocks, graph.with_tokens)
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
