"""`export --int8`: the fp32 graph quantized by ONNX Runtime, and how far the int8 file stays from PyTorch fp32.

Both modes quantize the MatMul and Gemm ops whose weight is a constant (every Linear layer: qkv, proj, the
MLP's or SwiGLU's, a head) with int8 weights per output channel; the attention's two activation-by-activation
MatMuls, the patch embedding's Conv, the norms and RoPE stay fp32. `dynamic` (`quantize_dynamic`) quantizes
each Linear's input at run time (uint8, its own range per call: DynamicQuantizeLinear + MatMulInteger).
`static` (`quantize_static`, QDQ format) fixes each Linear input's int8 scale from the calibration images'
min/max range (MinMax), so a runtime can fuse QuantizeLinear/DequantizeLinear pairs into int8 kernels.

The file also outputs `tokens`, the last block's normed tokens: the fidelity report reads the patches from
them and pools them with the fp32 model's own head (its pooling has no weights), so it measures the file
whatever its other outputs are; a pooled output of a model with a head gives the logits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm.data
import torch
import torch.nn.functional as F
from torch import nn

from timm_ls.int8_request import image_folder_files, int8_problem, parse_min_cosine
from timm_ls.logs import quieted

from ..fidelity import Fidelity, Outputs, compare, model_outputs, rendered_images
from ..tools.dense import read_image
from .errors import ExportError
from .graph import INPUT_NAME

QUANTIZED_OPS = ("MatMul", "Gemm")
BATCH = 8  # images per ONNX Runtime run where the graph's batch is dynamic
RENDERED = 8  # images drawn for the report when none are given
OPTIONS = {
    "dynamic": "int8 weights per channel, uint8 activations quantized at run time by MatMulInteger",
    "static": "QDQ, int8 weights per channel, int8 activations calibrated by MinMax",
}


class FidelityError(ExportError):
    """The int8 file falls below `--min-cosine`; nothing was written."""

    def __init__(self, message: str, fidelity: Fidelity) -> None:
        super().__init__(message)
        self.fidelity = fidelity


@dataclass(frozen=True)
class Int8Request:
    """What an int8 export runs: the mode, the images it calibrates and measures on, and the bar."""

    mode: str
    images: torch.Tensor  # [N, 3, H, W], normalised as the model's pretrained config says
    described: str  # where the images came from, for the summary
    min_cosine: float | None
    skipped: list[str] = field(default_factory=list)  # the unreadable files' lines


def check_int8_request(
    int8: str | None, dtype: str, calibrate: str | Path | None, images: str | Path | None, min_cosine: object
) -> float | None:
    """What can be known of the int8 options before a model is read: `min_cosine` as a number, or one line."""
    try:
        bar = parse_min_cosine(min_cosine)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    problem = int8_problem(int8, dtype, calibrate, images, min_cosine)
    if problem:
        raise ExportError(problem)
    return bar


def int8_request(
    int8: str | None,
    dtype: str,
    calibrate: str | Path | None,
    images: str | Path | None,
    min_cosine: float | str | None,
    pretrained_cfg: dict,
    size: tuple[int, int] | None,
) -> Int8Request | None:
    """The int8 options checked, their images read: before anything is exported or written."""
    bar = check_int8_request(int8, dtype, calibrate, images, min_cosine)
    if int8 is None:
        return None
    cfg = timm.data.resolve_data_config({}, pretrained_cfg=dict(pretrained_cfg))
    if size is not None:
        cfg["input_size"] = (cfg["input_size"][0], *size)
    folder, flag = (calibrate, "--calibrate") if calibrate is not None else (images, "--images")
    if folder is None:
        side = cfg["input_size"][-1]
        drawn = rendered_images(RENDERED, side)
        if drawn.shape[-2:] != cfg["input_size"][1:]:
            drawn = F.interpolate(drawn, size=cfg["input_size"][1:], mode="bilinear", align_corners=False)
        return Int8Request(int8, drawn, f"{RENDERED} rendered images", bar)
    tensors, skipped = _read_folder(Path(folder), flag, cfg)
    return Int8Request(int8, torch.stack(tensors), f"{len(tensors)} images of {folder}", bar, skipped)


def _read_folder(folder: Path, flag: str, cfg: dict) -> tuple[list[torch.Tensor], list[str]]:
    """The folder's readable images through timm's eval transform; an unreadable one is skipped, a folder
    without any readable is refused."""
    transform = timm.data.create_transform(**cfg, is_training=False)
    tensors, skipped = [], []
    try:
        files = image_folder_files(folder, flag)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    for path in files:
        try:
            tensors.append(transform(read_image(path)))
        except ValueError as exc:
            skipped.append(str(exc))
    if not tensors:
        raise ExportError(f"{flag} {folder} holds no readable image (the first: {skipped[0]})")
    return tensors, skipped


def quantize(fp32: Path, out: Path, request: Int8Request, batch: int | None, external: bool) -> int:
    """`fp32` quantized into `out` as `OPTIONS[request.mode]` says; returns how many Linear ops it quantized."""
    # the `export` extra, imported on use: the package imports without it
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    proto = onnx.load(str(fp32))
    linears = weight_matmuls(proto.graph)
    common = dict(
        op_types_to_quantize=list(QUANTIZED_OPS),
        nodes_to_quantize=linears,  # the Linear layers; not attention's q @ k and attn @ v
        per_channel=True,
        weight_type=QuantType.QInt8,
        use_external_data_format=external,
        extra_options={"MatMulConstBOnly": True},
    )
    # ONNX Runtime's quantizer logs a pre-processing hint through the root logger, on every call
    with quieted():
        if request.mode == "dynamic":
            quantize_dynamic(proto, out, **common)
        else:
            reader = _CalibrationReader([chunk for chunk, _ in _batches(request.images, batch)])
            quantize_static(
                proto,
                out,
                reader,
                quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
                **common,
            )
    return len(linears)


def weight_matmuls(graph: Any) -> list[str]:
    """The names of the MatMul and Gemm nodes that multiply by a stored weight, each `Transpose` of a weight
    before one (a graph exported from the meta device holds them, unfolded) folded into the weight."""
    from onnx import numpy_helper  # the `export` extra, imported on use: the package imports without it

    weights = {i.name: i for i in graph.initializer}
    consumers = Counter(name for node in graph.node for name in node.input)
    for node in list(graph.node):
        if node.op_type == "Transpose" and node.input[0] in weights and consumers[node.input[0]] == 1:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            weight = weights.pop(node.input[0])
            folded = numpy_helper.from_array(numpy_helper.to_array(weight).transpose(perm), node.output[0])
            graph.initializer.remove(weight)
            graph.initializer.append(folded)
            weights[folded.name] = folded
            graph.node.remove(node)
    found = []
    for i, node in enumerate(graph.node):
        if node.op_type in QUANTIZED_OPS and len(node.input) > 1 and node.input[1] in weights:
            node.name = node.name or f"linear_{i}"
            found.append(node.name)
    return found


class _CalibrationReader:
    """ONNX Runtime's `CalibrationDataReader` protocol (`get_next`, None at the end) over batches."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self._batches = iter(batches)

    def get_next(self) -> dict | None:
        chunk = next(self._batches, None)
        return None if chunk is None else {INPUT_NAME: chunk.numpy()}


def _batches(images: torch.Tensor, batch: int | None) -> list[tuple[torch.Tensor, int]]:
    """Runs of `batch` images (BATCH where it is dynamic) and how many of each are real: a static batch's last
    run is filled up with the first images."""
    size = batch or BATCH
    runs = []
    for start in range(0, len(images), size):
        chunk = images[start : start + size]
        real = len(chunk)
        if batch is not None and real < size:
            chunk = torch.cat([chunk, images.repeat(size // len(images) + 1, 1, 1, 1)[: size - real]])
        runs.append((chunk, real))
    return runs


def measure(path: Path, reference: nn.Module, names: list[str], images: torch.Tensor, batch: int | None) -> Fidelity:
    """The int8 file against `reference` (PyTorch fp32, run in eval mode) on `images`."""
    was_training = reference.training
    reference.eval()
    try:
        return compare(model_outputs(reference, images), file_outputs(path, reference, names, images, batch))
    finally:
        reference.train(was_training)


def file_outputs(
    path: Path, reference: nn.Module, names: list[str], images: torch.Tensor, batch: int | None
) -> Outputs:
    """What the file at `path` gives for `images`, as `fidelity.model_outputs` reads a model: the patches of
    its `tokens` output, those tokens pooled by `reference`'s head and, with a head, the logits (the file's
    own where its `pooled` output holds them)."""
    import onnxruntime as ort  # the `export` extra, imported on use: the package imports without it

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    tokens, logits = [], []
    head = reference.num_classes > 0
    for chunk, real in _batches(images, batch):
        got = dict(zip(names, session.run(None, {INPUT_NAME: chunk.numpy()}), strict=True))
        tokens.append(torch.from_numpy(got["tokens"][:real]).float())
        if head and "pooled" in got:
            logits.append(torch.from_numpy(got["pooled"][:real]).float())
    all_tokens = torch.cat(tokens)
    with torch.inference_mode():
        pooled = reference.forward_head(all_tokens, pre_logits=True).float()
        if head and not logits:
            logits.append(reference.forward_head(all_tokens).float())
    patches = all_tokens[:, reference.num_prefix_tokens :]
    return Outputs(pooled=pooled, patches=patches, logits=torch.cat(logits) if head else None)


def refuse_below(fidelity: Fidelity, request: Int8Request) -> None:
    """Raises `FidelityError` when the file falls below `--min-cosine`, naming the fix."""
    if request.min_cosine is None:
        return
    short = fidelity.below(request.min_cosine)
    if short is None:
        return
    fix = (
        "try --int8 static --calibrate DATA (images like the ones it will see)"
        if request.mode == "dynamic"
        else "calibrate on more images like the ones it will see"
    )
    raise FidelityError(
        f"{short} The int8 file was not written: {fix}, or export fp32 (or --dtype fp16) without --int8.",
        fidelity,
    )
