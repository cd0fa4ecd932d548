"""Fixtures for every test; the shared helpers are in `support` (tests/support/)."""

from __future__ import annotations

import logging

import pytest
import torch
from support.dcp import save_meta_run, save_tiny_model

import timm_layerscale  # noqa: F401  (registers the variants)


@pytest.fixture
def images() -> torch.Tensor:
    """A non-square batch (3x5 patches)."""
    return torch.randn(2, 3, 48, 80, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def ls_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="timm_layerscale")
    return caplog


@pytest.fixture(scope="session")
def meta_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A DINOv3 training output folder saved on two ranks (support/dcp.py): `ckpt/199/` and
    `eval/training_199/`; tests copy a folder before changing it."""
    return save_meta_run(tmp_path_factory.mktemp("meta_run"))


@pytest.fixture(scope="session")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory):
    """A DCP folder saved in one process (support/dcp.py): a tiny model and the iteration; copy it to change it."""
    return save_tiny_model(tmp_path_factory.mktemp("dcp") / "ckpt")
