"""model/checkpoint -> ONNX: `export_onnx`, one input `pixel_values`, checked in ONNX Runtime.

A model in memory (a name without weights, a YAML variant, a module) is exported by torch's exporter as it
is. Weights in a file (a checkpoint, a folder, a tag's pretrained file) never make a model: the graph is
exported from a model on the meta device (no initializers, the exporter's graph optimisation off) and each
tensor is then read from the checkpoint, fitted and cast as a load would, and written into the file, so a
7B exports in fp16 with little memory. Above protobuf's 2 GB the weights go into external data beside the
file. Everything is written into a temporary folder beside the destination and renamed when complete.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import mmap
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
from timm.models import get_pretrained_cfg
from torch import nn

from .checkpoints import fold_layer_scale, open_checkpoint, plan_load
from .checkpoints.layouts import detect_layout
from .config import VitLsConfig
from .convert import resolve_model
from .loading import pretrained_source
from .model import VisionTransformerLS
from .variants import VARIANTS, VariantNameError, close_variant_names, find_variant, register_variant

__all__ = ["ExportError", "OnnxCheckError", "OnnxExport", "export_onnx"]

INPUT_NAME = "pixel_values"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# Largest relative error (max |ORT - PyTorch fp32| over max |PyTorch fp32|) a check accepts.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2}
# protobuf cannot hold a message over 2 GiB: above this many bytes of weights they go into external data.
EXTERNAL_DATA_BYTES = (2 << 30) - (64 << 20)
MAX_PATCHES = 1024  # per side, the most a dynamic export promises (16384 px at patch 16)
CHECK_PATCHES = ((14, 14), (12, 18), (18, 12))  # square, wide, tall: 224x224, 192x288, 288x192 at patch 16
CHECK_BATCHES = (1, 2)
SIDE_CHECK_NODE = "pixel_values_sides_must_be_multiples_of_the_patch_size"
REQUIRED = ("onnx", "onnxscript", "onnxruntime")


class ExportError(ValueError):
    """Bad input to an export: one line naming the problem and the fix."""


class OnnxCheckError(ExportError):
    """ONNX Runtime's outputs differ from PyTorch's by more than the tolerance."""

    def __init__(self, message: str, rows: list[CheckRow]) -> None:
        super().__init__(message)
        self.rows = rows


@dataclass
class CheckRow:
    height: int
    width: int
    batch: int
    output: str
    max_abs: float
    max_rel: float

    def line(self) -> str:
        size = f"{self.height}x{self.width}"
        return f"{size:>9} batch {self.batch}  {self.output}: max abs {self.max_abs:.2e}, max rel {self.max_rel:.2e}"


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


def require_onnx() -> None:
    """One line naming what to install when the export extra is missing."""
    missing = []
    for name in REQUIRED:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ExportError(
            f"exporting to ONNX needs {', '.join(missing)}: pip install 'timm-layerscale[export]' "
            f"(onnx, onnxscript, onnxruntime)"
        )


# ------------------------------------------------------------------------------------------ outputs


def parse_outputs(outputs: str | Sequence[int] | None, depth: int) -> tuple[str, list[int]]:
    """`pooled`, `tokens` or `features:I,J,...` (negative block indices count from the end)."""
    spec = (outputs or "pooled").strip()
    kind, _, indices = spec.partition(":")
    if kind in ("pooled", "tokens") and not indices:
        return kind, []
    if kind == "features":
        try:
            blocks = [int(i) for i in indices.split(",") if i.strip()]
        except ValueError:
            blocks = []
        blocks = [b + depth if b < 0 else b for b in blocks]
        if blocks and all(0 <= b < depth for b in blocks) and len(set(blocks)) == len(blocks):
            return kind, sorted(blocks)
        raise ExportError(
            f"--outputs {spec}: name distinct blocks 0 to {depth - 1} (or -1 for the last), e.g. features:{depth - 1}"
        )
    raise ExportError(f"--outputs: got {spec!r}; pass pooled, tokens or features:I,J,... (block indices)")


def output_names(kind: str, blocks: Sequence[int]) -> list[str]:
    return [f"features_{b}" for b in blocks] if kind == "features" else [kind]


class _ExportedForward(nn.Module):
    """The graph's one input and named outputs; the sides checked in the graph itself.

    ONNX has no assert: the input is reshaped to `[N, C, H/p, p, W/p, p]` and back, a Reshape that
    ONNX Runtime (and any runtime) refuses when a side is not a multiple of p, where the patch
    embedding's convolution would silently drop the remainder.
    """

    def __init__(self, model: VisionTransformerLS, kind: str, blocks: Sequence[int]) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        self.blocks = list(blocks)
        self.check_sides = not model.patch_embed.dynamic_img_pad

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x = pixel_values
        if self.check_sides:
            batch, chans, height, width = x.shape
            p = self.model.patch_size
            x = x.reshape(batch, chans, height // p, p, width // p, p).reshape(batch, chans, height, width)
        if self.kind == "pooled":
            return self.model(x)
        if self.kind == "tokens":
            return self.model.forward_features(x)
        return tuple(self.model.forward_intermediates(x, indices=self.blocks, intermediates_only=True))


class _Fp32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 in a half-precision graph, as the mixed-precision model runs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


def _norms_in_fp32(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if type(module) is nn.LayerNorm:
            module.__class__ = _Fp32LayerNorm  # the same parameters and keys, another forward
            module.float()
    return model


# ------------------------------------------------------------------------------------------- sources


@dataclass
class _Source:
    name: str  # NAME or NAME.TAG
    config: VitLsConfig
    pretrained_cfg: dict[str, Any]
    weights: str  # where the weights come from, in words
    model: nn.Module | None = None  # a model in memory, or
    checkpoint: Path | None = None  # a file streamed into the export


def _registered(name: str) -> tuple[str, str | None] | None:
    if name.partition(".")[0] not in VARIANTS:
        return None
    try:
        variant, tag = find_variant(name)
    except VariantNameError as exc:
        raise ExportError(str(exc)) from None
    return variant.name, tag


def _resolve_source(
    source: str | Path | nn.Module, model: str | None, model_kwargs: dict[str, Any], pretrained: bool
) -> _Source:
    if isinstance(source, nn.Module):
        if not isinstance(source, VisionTransformerLS):
            raise ExportError(f"export_onnx exports VisionTransformerLS models, got {type(source).__name__}")
        cfg = dict(getattr(source, "pretrained_cfg", None) or {})
        name = cfg.get("architecture") or "VisionTransformerLS"
        name += f".{cfg['tag']}" if cfg.get("tag") else ""
        return _Source(name, source.config, cfg, "the given model", model=source)
    text = str(source)
    if text.lower().endswith((".yaml", ".yml")) and Path(text).is_file():
        text = register_variant(Path(text))
    found = _registered(text) if not Path(text).exists() else None
    if found is not None:
        base, tag = found
        name = f"{base}.{tag}" if tag else base
        if pretrained:  # the tag's file, streamed like any checkpoint
            tag = tag or next(iter(VARIANTS[base].tags), None)
            cfg = get_pretrained_cfg(f"{base}.{tag}") if tag else None
            if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
                raise ExportError(f"{base} has no pretrained weights; pass a checkpoint file or folder instead")
            path = pretrained_source(cfg.to_dict())
            return _streamed(Path(path), f"{base}.{tag}", model_kwargs, f"pretrained {cfg.hf_hub_id or path}")
        built = timm.create_model(name, **model_kwargs).eval()
        return _Source(name, built.config, dict(built.pretrained_cfg), "random init", model=built)
    if Path(text).exists():
        return _streamed(Path(text), model, model_kwargs, f"checkpoint {text}")
    close = close_variant_names(text.partition(".")[0])
    raise ExportError(
        f"{text} is neither a checkpoint file or folder nor a registered variant; did you mean "
        f"{', '.join(close)}? (`timm-ls list` shows all)"
    )


def _streamed(path: Path, model: str | None, model_kwargs: dict[str, Any], weights: str) -> _Source:
    with open_checkpoint(path) as ckpt:
        native = detect_layout(ckpt).to_native(ckpt)
        resolved = resolve_model(native, model, dict(model_kwargs), ckpt.hub_config)
    name = resolved.name + (f".{resolved.tag}" if resolved.tag else "")
    return _Source(name, resolved.config, resolved.pretrained_cfg, weights, checkpoint=path)


# ------------------------------------------------------------------------------------------ graph


def _example_and_shapes(
    config: VitLsConfig, dtype: torch.dtype, batch: int | None, size: tuple[int, int] | None, device: str
) -> tuple[torch.Tensor, dict[str, Any]]:
    p = config.patch_size
    n = batch or 2
    height, width = size or (2 * p, 3 * p)
    example = torch.zeros(n, config.in_chans, height, width, dtype=dtype, device=device)
    dims: dict[int, Any] = {}
    if batch is None:
        dims[0] = torch.export.Dim("batch", min=1, max=1 << 16)
    if size is None:
        if config.dynamic_img_pad:  # any side: the graph pads it up
            dims[2] = torch.export.Dim("height", min=1, max=MAX_PATCHES * p)
            dims[3] = torch.export.Dim("width", min=1, max=MAX_PATCHES * p)
        else:  # sides in whole patches: the traced graph holds no remainder
            dims[2] = p * torch.export.Dim("patches_h", min=1, max=MAX_PATCHES)
            dims[3] = p * torch.export.Dim("patches_w", min=1, max=MAX_PATCHES)
    return example, {"pixel_values": dims}


def _export_program(
    forward: _ExportedForward,
    example: torch.Tensor,
    shapes: dict[str, Any],
    names: list[str],
    opset: int | None,
    optimize: bool,
):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            forward,
            (example,),
            None,
            dynamo=True,
            input_names=[INPUT_NAME],
            output_names=names,
            dynamic_shapes=shapes,
            opset_version=opset,
            optimize=optimize,
            verbose=False,
        )
    graph = program.model.graph
    for name in list(graph.initializers):  # the model's own state dict keys, without the wrapper's prefix
        value = graph.initializers.pop(name)
        value.name = name.removeprefix("model.")
        graph.initializers[value.name] = value
    for node in graph:  # the side check's Reshape, named so the runtime's error says why
        if node.op_type == "Reshape" and node.inputs and node.inputs[0] is graph.inputs[0]:
            node.name = SIDE_CHECK_NODE
            break
    return program


# ------------------------------------------------------------------------------------------ metadata


def _metadata(
    src: _Source,
    config: VitLsConfig,
    kind: str,
    names: list[str],
    dtype: str,
    batch: int | None,
    size: tuple[int, int] | None,
    folded: bool,
    opset: int,
) -> dict[str, str]:
    cfg = src.pretrained_cfg
    if size is not None:
        input_size = [config.in_chans, *size]
    else:
        input_size = list(cfg.get("input_size") or (config.in_chans, config.img_size, config.img_size))
    licence = cfg.get("license") or "unknown"
    if src.weights == "random init":
        licence = "none (random init)"
    shape = ["N" if batch is None else batch, config.in_chans] + (["H", "W"] if size is None else list(size))

    return {
        "variant": src.name,
        "model_args": json.dumps(config.to_dict(), sort_keys=True),
        "weights": src.weights,
        "weights_license": licence,
        "mean": json.dumps(list(cfg.get("mean") or (0.485, 0.456, 0.406))),
        "std": json.dumps(list(cfg.get("std") or (0.229, 0.224, 0.225))),
        "input_size": json.dumps(input_size),
        "input_shape": json.dumps(shape),
        "interpolation": str(cfg.get("interpolation") or "bicubic"),
        "crop_pct": str(cfg.get("crop_pct", 1.0)),
        "patch_size": str(config.patch_size),
        "num_prefix_tokens": str(config.num_prefix_tokens),
        "dynamic_img_pad": json.dumps(bool(config.dynamic_img_pad)),
        "outputs": json.dumps(names),
        "output_kind": kind,
        "dtype": dtype,
        "layerscale_folded": json.dumps(folded),
        "opset": str(opset),
        "exporter": f"timm-layerscale with torch {torch.__version__}",
    }


# ------------------------------------------------------------------------------------------- writing


@contextmanager
def _staged(dst: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary folder beside `dst`, holding files under their final names; moved into place on success."""
    data = dst.with_name(dst.name + ".data")
    if not overwrite:
        for path in (dst, data):
            if path.exists():
                raise ExportError(f"{path} exists; pass --overwrite (overwrite=True) to replace it, or choose another")
    if not dst.parent.is_dir():
        raise ExportError(f"folder {dst.parent} does not exist; create it or choose another destination")
    stage = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
    stage.mkdir()
    try:
        yield stage / dst.name
        staged_data = stage / data.name
        if staged_data.exists():
            os.replace(staged_data, data)
        elif data.exists():  # an overwritten export that had external data and now has none
            data.unlink()
        os.replace(stage / dst.name, dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _write_streamed(
    graph_path: Path, program, src: _Source, meta_model: VisionTransformerLS, external: bool | None
) -> bool:
    """The graph without initializers, then each weight read from the checkpoint, fitted, cast, written."""
    import onnx  # the `export` extra, imported on use: the package imports without it
    from onnx.external_data_helper import set_external_data

    targets = meta_model.state_dict()
    names = list(program.model.graph.initializers)
    program.save(graph_path, include_initializers=False)
    proto = onnx.load(str(graph_path), load_external_data=False)
    with open_checkpoint(src.checkpoint) as ckpt:
        fitted = plan_load(ckpt, meta_model)
        total = sum(targets[k].numel() * targets[k].element_size() for k in names)
        external = total > EXTERNAL_DATA_BYTES if external is None else external
        data_path = graph_path.with_name(graph_path.name + ".data")
        align = mmap.ALLOCATIONGRANULARITY
        with open(data_path, "wb") if external else _nothing() as data:
            offset = 0
            for key in names:
                target = targets[key]
                tensor = fitted.plan[key].to(dtype=target.dtype).contiguous()
                array = tensor.numpy()  # fp32 or fp16 (DTYPES), which numpy holds
                if external:
                    offset += -offset % align
                    data.seek(offset)
                    data.write(memoryview(array.reshape(-1)).cast("B"))
                    proto_tensor = onnx.TensorProto(
                        name=key, dims=list(array.shape), data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
                    )
                    proto_tensor.raw_data = b""  # the helper asks for the field it moves out, then it is cleared
                    set_external_data(proto_tensor, location=data_path.name, offset=offset, length=array.nbytes)
                    proto_tensor.data_location = onnx.TensorProto.EXTERNAL
                    proto_tensor.ClearField("raw_data")
                    offset += array.nbytes
                else:
                    proto_tensor = onnx.numpy_helper.from_array(array, name=key)
                proto.graph.initializer.append(proto_tensor)
                del tensor, array
            if external:
                data.flush()
                os.fsync(data.fileno())
        fitted.plan.release()
    onnx.save(proto, str(graph_path))
    return external


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def _set_metadata(path: Path, metadata: Mapping[str, str]) -> None:
    import onnx  # the `export` extra, imported on use

    proto = onnx.load(str(path), load_external_data=False)
    onnx.helper.set_model_props(proto, dict(metadata))
    onnx.save(proto, str(path))


# -------------------------------------------------------------------------------------------- check


def check_onnx(
    path: str | Path,
    reference: nn.Module,
    kind: str,
    blocks: Sequence[int],
    dtype: str = "fp32",
    batch: int | None = None,
    size: tuple[int, int] | None = None,
    sizes: Sequence[tuple[int, int]] | None = None,
    seed: int = 0,
) -> list[CheckRow]:
    """ONNX Runtime against `reference` (PyTorch, fp32) on random inputs: square, wide and tall sides (or
    the static size), two batch sizes when the batch is dynamic. Max absolute and relative errors."""
    import onnxruntime as ort  # the `export` extra, imported on use

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    forward = _ExportedForward(reference, kind, blocks).eval()
    p = reference.patch_size
    if size is not None:
        sizes = [size]
    elif sizes is None:
        sizes = [(h * p, w * p) for h, w in CHECK_PATCHES]
    generator = torch.Generator().manual_seed(seed)
    was_training = reference.training
    rows = []
    for batch_size in [batch] if batch else CHECK_BATCHES:
        for height, width in sizes:
            x = torch.randn(batch_size, reference.in_chans, height, width, generator=generator)
            with torch.no_grad():
                expected = forward(x)
            expected = expected if isinstance(expected, tuple) else (expected,)
            got = session.run(None, {INPUT_NAME: x.to(DTYPES[dtype]).numpy()})
            for name, want, have in zip(output_names(kind, blocks), expected, got):
                diff = (torch.from_numpy(have).float() - want.float()).abs().max().item()
                scale = want.float().abs().max().item() or 1.0
                rows.append(CheckRow(height, width, batch_size, name, diff, diff / scale))
    reference.train(was_training)
    return rows


# --------------------------------------------------------------------------------------------- main


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
    then names its variant, else its shapes do). `outputs`: "pooled" (what `forward` returns), "tokens"
    (the normed tokens of the last block) or "features:I,J,..." (those blocks' patch tokens as
    `[N, C, H/p, W/p]`, as `forward_intermediates` gives them). `batch` and `size` ("dynamic", or an int
    and `(H, W)`) fix or free the input's shape. `fuse_layerscale` folds every gamma into the projection
    before it. `check` runs ONNX Runtime against PyTorch fp32 (square, wide, tall) and raises
    `OnnxCheckError` above `TOLERANCE[dtype]`, leaving nothing written. `external_data` forces (True) or
    forbids (False) weights beside the file; by default they go there above protobuf's 2 GB.
    """
    require_onnx()
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; pass --dtype one of {', '.join(DTYPES)}")
    dst = Path(dst)
    if dst.suffix != ".onnx":
        raise ExportError(f"name the destination .onnx (got {dst.name})")
    if not overwrite and dst.exists():  # before any download or long step
        raise ExportError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it, or choose another path")
    batch = _parse_batch(batch)
    src = _resolve_source(model_or_source, model, dict(model_kwargs or {}), pretrained)
    config = src.config
    size = _parse_size(size, config)
    kind, blocks = parse_outputs(outputs, config.depth)
    names = output_names(kind, blocks)
    if check and src.model is None:
        _refuse_a_check_beyond_memory(config)
    cast = DTYPES[dtype]
    folded = fuse_layerscale or not any(v for pair in config.layer_init_values for v in pair)
    if fuse_layerscale:
        config = config.replace(init_values=0)

    with _staged(dst, overwrite) as staged:
        if src.model is not None:
            reference = src.model
            exported = copy.deepcopy(reference).eval().to(dtype=cast)
            if fuse_layerscale:
                fold_layer_scale(exported)
            if cast != torch.float32:
                _norms_in_fp32(exported)
            example, shapes = _example_and_shapes(config, cast, batch, size, "cpu")
            program = _export_program(
                _ExportedForward(exported, kind, blocks).eval(), example, shapes, names, opset, True
            )
            nbytes = sum(t.numel() * t.element_size() for t in exported.state_dict().values())
            external = nbytes > EXTERNAL_DATA_BYTES if external_data is None else external_data
            program.save(staged, external_data=external)
            del exported
        else:
            meta_model = VisionTransformerLS(config, device="meta", dtype=cast).eval()
            if cast != torch.float32:
                _norms_in_fp32(meta_model)
            example, shapes = _example_and_shapes(config, cast, batch, size, "meta")
            program = _export_program(_ExportedForward(meta_model, kind, blocks), example, shapes, names, opset, False)
            external = _write_streamed(staged, program, src, meta_model, external_data)
            reference = None
        opset_used = program.model.opset_imports.get("", opset or 0)
        del program
        metadata = _metadata(src, config, kind, names, dtype, batch, size, folded, opset_used)
        _set_metadata(staged, metadata)
        result = OnnxExport(
            dst,
            dst.with_name(dst.name + ".data") if external else None,
            src.name,
            src.weights,
            names,
            dtype,
            opset_used,
            metadata,
        )
        if check:
            if reference is None:
                reference = _reference_from_checkpoint(src, config)
            rows = check_onnx(staged, reference, kind, blocks, dtype, batch, size, check_sizes)
            result.check, result.tolerance = rows, TOLERANCE[dtype]
            worst = max(rows, key=lambda r: r.max_rel)
            if worst.max_rel > TOLERANCE[dtype]:
                raise OnnxCheckError(
                    f"ONNX Runtime differs from PyTorch fp32 by {worst.max_rel:.2e} relative (tolerance "
                    f"{TOLERANCE[dtype]:g}) at {worst.height}x{worst.width}, batch {worst.batch}, output "
                    f"{worst.output}; nothing was written",
                    rows,
                )
    return result


def _refuse_a_check_beyond_memory(config: VitLsConfig) -> None:
    fp32 = sum(t.numel() for t in VisionTransformerLS(config, device="meta").state_dict().values()) * 4
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if fp32 > memory // 2:
        raise ExportError(
            f"--check compares with the PyTorch model in fp32 ({fp32 / 1e9:.1f} GB), more than half this machine's "
            f"memory ({memory / 1e9:.1f} GB): export without --check, and check its graph at a reduced depth "
            f"(timm-ls export NAME small.onnx --model-kwargs depth=1 --check)"
        )


def _reference_from_checkpoint(src: _Source, config: VitLsConfig) -> VisionTransformerLS:
    """The checkpoint in a PyTorch fp32 model, fitted as the export was."""
    reference = VisionTransformerLS(config, device="meta").eval()
    with open_checkpoint(src.checkpoint) as ckpt:
        fitted = plan_load(ckpt, reference)
        state = {key: tensor.float() if tensor.is_floating_point() else tensor for key, tensor in fitted.plan.items()}
    targets = reference.state_dict()
    reference.load_state_dict({k: v.to(targets[k].dtype) for k, v in state.items()}, assign=True, strict=True)
    return reference


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
