"""Meta's DINOv3 losses, head and masks on seeded tensors (tests/fixtures/meta_pretrain.*), and the tolerance."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# fp32; the same ops in the same order as Meta's, so most values agree to the bit. Past 1 the
# tolerance grows with the value: fp32 spacing at 17 is 1.9e-6, and CPUs differ in summation order.
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
    """The largest difference, divided by Meta's largest magnitude where that is past 1."""
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    if not ours.numel():
        return 0.0
    scale = max(1.0, theirs.double().abs().max().item())
    return (ours.double() - theirs.double()).abs().max().item() / scale


def assert_meta(ours: torch.Tensor, key: str) -> float:
    diff = max_diff(ours.detach(), meta(key))
    assert diff <= ATOL, f"{key}: {diff:.3g}"
    return diff
