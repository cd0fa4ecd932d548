from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import timm_layerscale  # noqa: F401  (registers the variants)

FIXTURES = Path(__file__).parent / "fixtures"
# Small widths and depths built by the same variant rules as the released shapes.
TINY = dict(embed_dim=64, num_heads=4, depth=2)


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
