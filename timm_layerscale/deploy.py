"""CPU int8 deployment: a quantized copy of a model, and how close it stays to the fp32 original.

Every projection of every family is a plain `nn.Linear` (the qkv's k-bias mask is folded into its bias), so
`quantize_dynamic`, which matches exact types, quantizes all of them.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.ao.quantization import quantize_dynamic

from .fidelity import Fidelity, compare, model_outputs, rendered_images

__all__ = ["MODES", "quantize"]

MODES = ("dynamic",)  # int8 weights, activations quantized per batch at run time: no calibration images


def _default_images(model: nn.Module) -> torch.Tensor:
    """`rendered_images` at the model's default input size (its pretrained cfg's, else its patch embedding's)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    grid = getattr(getattr(model, "patch_embed", None), "img_size", None) or (224, 224)
    height, width = cfg.get("input_size", grid)[-2:]
    return rendered_images(size=max(height, width))[..., :height, :width]


def _fp32_reference(model: nn.Module) -> nn.Module:
    """`model` itself when it is already what is measured against (fp32, on the CPU, in eval), else such a copy."""
    tensors = [*model.parameters(), *model.buffers()]
    floats = all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())
    if floats and all(t.device.type == "cpu" for t in tensors) and not model.training:
        return model
    return copy.deepcopy(model).float().cpu().eval()


def quantize(model: nn.Module, mode: str = "dynamic", images: torch.Tensor | None = None) -> tuple[nn.Module, Fidelity]:
    """An int8 copy of `model` in eval mode (every `nn.Linear` quantized dynamically to qint8), and its
    fidelity to the fp32 model on `images` (default: `rendered_images` at the model's input size).

    `model` itself is left as it was, its training mode included.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}: choose one of {', '.join(MODES)}")
    reference = _fp32_reference(model)
    # quantize_dynamic quantizes a copy (inplace=False): `reference` may be the caller's model itself.
    quantized = quantize_dynamic(reference, {nn.Linear}, dtype=torch.qint8, inplace=False).eval()
    images = _default_images(reference) if images is None else images.float().cpu()
    return quantized, compare(model_outputs(reference, images), model_outputs(quantized, images))
