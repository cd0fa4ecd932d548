"""Meta's DINOv3 losses, head and masks on seeded tensors (tests/fixtures/meta_pretrain.*), and the tolerance."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# fp32; the same ops in the same order as Meta's, so most values agree to the bit.
ATOL = 1e-6


@functools.cache
def tensors() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "meta_pretrain.safetensors")


@functools.cache
def record() -> dict:
    return json.loads((FIXTURES / "meta_pretrain.json").read_text())


def meta(key: str) -> torch.Tensor:
    return tensors()[key].clone()


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return (ours.double() - theirs.double()).abs().max().item() if ours.numel() else 0.0


def assert_meta(ours: torch.Tensor, key: str) -> float:
    diff = max_diff(ours.detach(), meta(key))
    assert diff <= ATOL, f"{key}: {diff:.3g}"
    return diff
