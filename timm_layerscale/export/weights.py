"""Weights into the ONNX file: streamed from a checkpoint, each tensor read, fitted, cast and written (inside the
file, or aligned in external data above protobuf's 2 GB), and the fp32 PyTorch reference a check compares with."""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..checkpoints.mapping.plan import Plan
from ..layers import effective_qkv_bias
from ..model import VisionTransformerLS
from .sources import Source

# protobuf cannot hold a message over 2 GiB: above this many bytes of weights they go into external data.
EXTERNAL_DATA_BYTES = (2 << 30) - (64 << 20)
ALIGNMENT = mmap.ALLOCATIONGRANULARITY  # external tensors start here, so a runtime can map each one


def external_data_path(graph_path: Path) -> Path:
    return graph_path.parent / (graph_path.name + ".data")  # `.` has no name to add to


def write_streamed(
    graph_path: Path, program: Any, src: Source, meta_model: VisionTransformerLS, external: bool | None
) -> bool:
    """The graph without initializers, then each weight read from the checkpoint, fitted, cast, written; returns
    whether the weights went into external data."""
    import onnx  # the `export` extra, imported on use: the package imports without it

    targets = meta_model.state_dict()
    names = list(program.model.graph.initializers)
    program.save(graph_path, include_initializers=False)
    proto = onnx.load(str(graph_path), load_external_data=False)
    total = sum(targets[k].numel() * targets[k].element_size() for k in names)
    external = total > EXTERNAL_DATA_BYTES if external is None else external
    with src.weights_for(meta_model) as fitted:
        tensors = (
            (key, _as_the_model_holds(fitted.plan, key).to(dtype=targets[key].dtype).contiguous()) for key in names
        )
        if external:
            with external_data_path(graph_path).open("wb") as data:
                proto.graph.initializer.extend(_external(tensors, data, external_data_path(graph_path).name))
                data.flush()
                os.fsync(data.fileno())
        else:
            proto.graph.initializer.extend(onnx.numpy_helper.from_array(t.numpy(), name=k) for k, t in tensors)
    onnx.save(proto, str(graph_path))
    return external


def _as_the_model_holds(plan: Plan, key: str) -> torch.Tensor:
    """A planned weight as a loaded model holds it: a qkv bias times its mask (the graph adds the bias alone,
    as the eval forward does), any other as planned."""
    mask = f"{key}_mask"
    if key.endswith("attn.qkv.bias") and mask in plan:
        return effective_qkv_bias(plan[key], plan[mask])
    return plan[key]


def _external(tensors: Any, data: BinaryIO, location: str) -> list[Any]:
    """Each tensor's bytes at the next aligned offset of `data`, and the initializer that points there."""
    import onnx  # the `export` extra, imported on use
    from onnx.external_data_helper import set_external_data

    initializers, offset = [], 0
    for key, tensor in tensors:
        array = tensor.numpy()  # fp32 or fp16, which numpy holds
        offset += -offset % ALIGNMENT
        data.seek(offset)
        data.write(memoryview(array.reshape(-1)).cast("B"))
        proto = onnx.TensorProto(
            name=key, dims=list(array.shape), data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
        )
        proto.raw_data = b""  # the helper asks for the field it moves out, then it is cleared
        set_external_data(proto, location=location, offset=offset, length=array.nbytes)
        proto.data_location = onnx.TensorProto.EXTERNAL
        proto.ClearField("raw_data")
        initializers.append(proto)
        offset += array.nbytes
    return initializers


def set_metadata(path: Path, metadata: Mapping[str, str]) -> None:
    import onnx  # the `export` extra, imported on use

    proto = onnx.load(str(path), load_external_data=False)
    onnx.helper.set_model_props(proto, dict(metadata))
    onnx.save(proto, str(path))


def reference_from_checkpoint(src: Source) -> VisionTransformerLS:
    """The checkpoint in a PyTorch fp32 model, fitted as the export was."""
    reference = VisionTransformerLS(src.config, device="meta").eval()
    targets = reference.state_dict()
    with src.weights_for(reference) as fitted:
        state = {key: tensor.to(targets[key].dtype) for key, tensor in fitted.plan.items()}
    reference.load_state_dict(state, assign=True, strict=True)
    return reference


def fp32_bytes(config: Any) -> int:
    return sum(t.numel() for t in VisionTransformerLS(config, device="meta").state_dict().values()) * 4


def physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
