from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import DINOv3ViTConfig, DINOv3ViTModel

import timm_layerscale  # noqa: F401  (registers the variants)
from timm_layerscale.layers import swiglu_hidden_features

FIXTURES = Path(__file__).parent / "fixtures"
# Small widths and depths built by the same variant rules as the released shapes.
TINY = dict(embed_dim=64, num_heads=4, depth=2)
VARIANT = {"mlp": "vit_ls_small_patch16_dinov3", "swiglu": "vit_ls_small_plus_patch16_dinov3"}
EVA = {"mlp": "vit_small_patch16_dinov3_qkvb", "swiglu": "vit_small_plus_patch16_dinov3_qkvb"}


@torch.no_grad()
def move_off_init_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Gammas, biases and norms far from their inits, linear weights at unit-ish gain: every branch matters."""
    generator = torch.Generator().manual_seed(seed)

    def rand(shape, low, high):
        return torch.rand(shape, generator=generator) * (high - low) + low

    for name, param in model.named_parameters():
        if any(tag in name for tag in ("gamma", "lambda1")):
            param.copy_(rand(param.shape, 0.5, 1.5) * torch.where(rand(param.shape, 0, 1) > 0.2, 1.0, -1.0))
        elif name.endswith("bias") or "q_bias" in name or "v_bias" in name:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        elif param.ndim == 1:
            param.copy_(rand(param.shape, 0.5, 1.5))
        elif param.ndim == 2 and name.endswith("weight"):
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[1] ** -0.5)
        else:
            param.copy_(torch.randn(param.shape, generator=generator))
    return model


def transformers_reference(ffn: str = "mlp") -> DINOv3ViTModel:
    """transformers' own DINOv3 at TINY size, MLP or SwiGLU, moved off its init."""
    gated = ffn == "swiglu"
    dim = TINY["embed_dim"]
    config = DINOv3ViTConfig(
        hidden_size=dim,
        num_attention_heads=TINY["num_heads"],
        num_hidden_layers=TINY["depth"],
        intermediate_size=swiglu_hidden_features(dim, 6, 8) if gated else dim * 4,
        use_gated_mlp=gated,
        hidden_act="silu" if gated else "gelu",
        num_register_tokens=4,
        layerscale_value=1e-5,
    )
    torch.manual_seed(0)
    return move_off_init_(DINOv3ViTModel(config)).eval()


@pytest.fixture
def images() -> torch.Tensor:
    """A non-square batch (3x5 patches)."""
    return torch.randn(2, 3, 48, 80, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def ls_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="timm_layerscale")
    return caplog


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def mapped_ranges(path) -> list[range]:
    """Address ranges at which this process maps `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        if name.strip() == str(path):
            start, end = (int(a, 16) for a in span.split("-"))
            ranges.append(range(start, end))
    return ranges


class Exploit:
    """Unpickling this creates the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))
