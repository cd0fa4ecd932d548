"""The exported graph: one input `pixel_values`, named outputs, sides checked in the graph, half precision with
its norms in fp32, dynamic batch and sides, and the metadata that says how to feed it."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from timm_ls.layer_sets import FEATURE_LAYER_NAMES, feature_layers

from ..config import VitLsConfig
from ..model import VisionTransformerLS
from .errors import ExportError

INPUT_NAME = "pixel_values"
MAX_PATCHES = 1024  # per side, the most a dynamic export promises (16384 px at patch 16)
MAX_BATCH = 1 << 16
SIDE_CHECK_NODE = "pixel_values_sides_must_be_multiples_of_the_patch_size"


def parse_outputs(outputs: str | Sequence[int] | None, depth: int) -> tuple[str, list[int]]:
    """`pooled`, `tokens` or `features:I,J,...` (negative block indices count from the end, or names of
    `timm_ls.layer_sets`: `features:four_even`)."""
    spec = (outputs or "pooled").strip()
    kind, _, indices = spec.partition(":")
    if kind in ("pooled", "tokens") and not indices:
        return kind, []
    if kind == "features":
        try:
            blocks = [b for i in indices.split(",") if i.strip() for b in _blocks(i.strip(), depth)]
        except ValueError:
            blocks = []
        blocks = [b + depth if b < 0 else b for b in blocks]
        if blocks and all(0 <= b < depth for b in blocks) and len(set(blocks)) == len(blocks):
            return kind, sorted(blocks)
        raise ExportError(
            f"--outputs {spec}: name distinct blocks 0 to {depth - 1} (or -1 for the last) or one of "
            f"{', '.join(FEATURE_LAYER_NAMES)}, e.g. features:{depth - 1} or features:four_even"
        )
    raise ExportError(f"--outputs: got {spec!r}; pass pooled, tokens or features:I,J,... (block indices)")


def _blocks(item: str, depth: int) -> list[int]:
    """One item of `features:...`: an index, or a name's blocks."""
    return feature_layers(item, depth) if item.lower() in FEATURE_LAYER_NAMES else [int(item)]


def output_names(kind: str, blocks: Sequence[int], with_tokens: bool = False) -> list[str]:
    names = [f"features_{b}" for b in blocks] if kind == "features" else [kind]
    return [*names, "tokens"] if with_tokens and kind != "tokens" else names


class ExportedForward(nn.Module):
    """The graph's one input and named outputs; the sides checked in the graph itself.

    ONNX has no assert: the input is reshaped to `[N, C, H/p, p, W/p, p]` and back, a Reshape that
    ONNX Runtime (and any runtime) refuses when a side is not a multiple of p, where the patch
    embedding's convolution would silently drop the remainder. `with_tokens` adds the last block's normed
    tokens as a last output (an int8 export's fidelity is read from them), computed once with the others.
    """

    def __init__(self, model: VisionTransformerLS, kind: str, blocks: Sequence[int], with_tokens: bool = False) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        self.blocks = list(blocks)
        self.with_tokens = with_tokens and kind != "tokens"
        self.check_sides = not model.patch_embed.dynamic_img_pad

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x = pixel_values
        if self.check_sides:
            batch, chans, height, width = x.shape
            p = self.model.patch_size
            x = x.reshape(batch, chans, height // p, p, width // p, p).reshape(batch, chans, height, width)
        if self.kind == "tokens":
            return self.model.forward_features(x)
        if self.kind == "pooled":
            if not self.with_tokens:
                return self.model(x)
            tokens = self.model.forward_features(x)
            return self.model.forward_head(tokens), tokens
        if not self.with_tokens:
            return tuple(self.model.forward_intermediates(x, indices=self.blocks, intermediates_only=True))
        tokens, features = self.model.forward_intermediates(x, indices=self.blocks)
        return (*features, tokens)


class Fp32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 in a half-precision graph, as the mixed-precision model runs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


def norms_in_fp32(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if type(module) is nn.LayerNorm:
            module.__class__ = Fp32LayerNorm  # the same parameters and keys, another forward
            module.float()
    return model


def example_and_shapes(
    config: VitLsConfig, dtype: torch.dtype, batch: int | None, size: tuple[int, int] | None, device: str
) -> tuple[torch.Tensor, dict[str, Any]]:
    p = config.patch_size
    n = batch or 2
    height, width = size or (2 * p, 3 * p)
    example = torch.zeros(n, config.in_chans, height, width, dtype=dtype, device=device)
    dims: dict[int, Any] = {}
    if batch is None:
        dims[0] = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    if size is None:
        if config.dynamic_img_pad:  # any side: the graph pads it up
            dims[2] = torch.export.Dim("height", min=1, max=MAX_PATCHES * p)
            dims[3] = torch.export.Dim("width", min=1, max=MAX_PATCHES * p)
        else:  # sides in whole patches: the traced graph holds no remainder
            dims[2] = p * torch.export.Dim("patches_h", min=1, max=MAX_PATCHES)
            dims[3] = p * torch.export.Dim("patches_w", min=1, max=MAX_PATCHES)
    return example, {"pixel_values": dims}


def export_program(
    forward: ExportedForward,
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
    bf16_arithmetic_in_fp32(graph)
    for node in graph:  # the side check's Reshape, named so the runtime's error says why
        if node.op_type == "Reshape" and node.inputs and node.inputs[0] is graph.inputs[0]:
            node.name = SIDE_CHECK_NODE
            break
    return program


# Ops ONNX Runtime's CPU provider has no bf16 kernel for, met in a bf16-RoPE graph (its tables and rotation), and
# which of their inputs carry the data type (every one where not named; the others are int64 shapes and pads).
BF16_UNRUNNABLE = {"Add": None, "Sub": None, "Mul": None, "Div": None, "Neg": None, "Pad": (0, 2), "Expand": (0,)}


def bf16_arithmetic_in_fp32(graph: Any) -> int:
    """Each bf16 `BF16_UNRUNNABLE` node computed in fp32 between casts: the same bf16 result, bit for bit (a
    bf16 value is exact in fp32, and an fp32 sum, difference, product or quotient of two rounded once more to
    bf16 is the correctly rounded bf16 one: 24 bits hold more than 2 x 8 + 2), in ops the CPU provider runs.
    Returns how many nodes it rewrote."""
    import onnx_ir as ir  # the `export` extra, imported on use

    rewritten = 0
    for node in list(graph):
        if node.op_type not in BF16_UNRUNNABLE or len(node.outputs) != 1:
            continue
        typed = [i for i in BF16_UNRUNNABLE[node.op_type] or range(len(node.inputs)) if i < len(node.inputs)]
        if not any(node.inputs[i] is not None and node.inputs[i].dtype == ir.DataType.BFLOAT16 for i in typed):
            continue
        # a typed input of unknown dtype (an unoptimised graph's constant) is bf16 too: T binds them all
        bf16 = [i in typed and v is not None and v.dtype != ir.DataType.FLOAT for i, v in enumerate(node.inputs)]
        inputs = []
        for i, (value, cast) in enumerate(zip(node.inputs, bf16, strict=True)):
            if cast:
                widened = ir.node("Cast", [value], attributes={"to": ir.DataType.FLOAT}, name=f"{node.name}_in{i}_fp32")
                widened.outputs[0].type, widened.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), value.shape
                graph.insert_before(node, widened)
                value = widened.outputs[0]
            inputs.append(value)
        wide = ir.node(node.op_type, inputs, attributes=dict(node.attributes), name=f"{node.name}_fp32")
        result = node.outputs[0]
        wide.outputs[0].type, wide.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), result.shape
        narrow = ir.node("Cast", wide.outputs, attributes={"to": ir.DataType.BFLOAT16}, name=node.name)
        narrow.outputs[0].type, narrow.outputs[0].shape = result.type, result.shape
        graph.insert_before(node, [wide, narrow])
        name = result.name
        ir.convenience.replace_all_uses_with(result, narrow.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        narrow.outputs[0].name = name
        rewritten += 1
    return rewritten


def metadata(
    src: Any,
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
