"""Fixtures for every test; the shared helpers are in `support` (tests/support/)."""

from __future__ import annotations

import logging

import pytest
import torch

import timm_layerscale  # noqa: F401  (registers the variants)


@pytest.fixture
def images() -> torch.Tensor:
    """A non-square batch (3x5 patches)."""
    return torch.randn(2, 3, 48, 80, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def ls_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="timm_layerscale")
    return caplog
