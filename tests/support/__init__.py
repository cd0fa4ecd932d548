"""What the tests share: small shapes, reference models, weights moved off their inits, relative tolerances."""

from __future__ import annotations

import copy
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.models import _registry as timm_registry  # its private tables: forget_timm_model
from torch import nn
from transformers import DINOv3ViTConfig, DINOv3ViTModel

import timm_layerscale  # registers the variants; its FORMATS name where tests write
from timm_layerscale.layers import swiglu_hidden_features
from timm_ls.names import FOLDER

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
SUPPORT = Path(__file__).resolve().parent
# Small widths and depths built by the same variant rules as the released shapes.
TINY = dict(embed_dim=64, num_heads=4, depth=2)
VARIANT = {"mlp": "vit_ls_small_patch16_dinov3", "swiglu": "vit_ls_small_plus_patch16_dinov3"}
EVA = {"mlp": "vit_small_patch16_dinov3_qkvb", "swiglu": "vit_small_plus_patch16_dinov3_qkvb"}
# fp32 results differ in their last bits between GEMM kernels (CPU vendor, ISA level, thread count), so outputs
# are compared relative to their scale. Across the kernels tried (AMD and Intel, ATEN_CPU_CAPABILITY=default,
# 1 and 2 threads) the tiny models stay within 1.5e-6 of the largest value; a swapped gamma or a dropped bias
# moves them by 7e-2 or more (`assert_catches_swapped_gammas_and_dropped_biases`).
FP32_RTOL = 1e-5


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
    # Biases written by hand: ours add a qkv bias as it stands in eval, so its masked rows are zeroed as
    # loading and init do (other models have no such mask: unchanged).
    return timm_layerscale.fold_bias_masks_(model)


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


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def relative_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| over max|expected|: the error relative to the tensor's scale (over 1 if all 0)."""
    expected = expected.double()
    scale = expected.abs().max().item()
    return (actual.double() - expected).abs().max().item() / (scale or 1.0)


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = FP32_RTOL, what: str = "") -> None:
    """fp32 parity that holds on any CPU: max|actual - expected| <= rtol * max|expected|."""
    where = f"{what}: " if what else ""
    assert actual.shape == expected.shape, f"{where}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = relative_diff(actual, expected)
    scale = expected.abs().max().item()
    assert diff <= rtol, (
        f"{where}max|actual - expected| is {diff:.3g} of max|expected| = {scale:.3g} (allowed {rtol:g})"
    )


def assert_compiled_matches_eager(model: nn.Module, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """train.py's `--torchcompile`: one graph (`fullgraph`), the same loss and gradients as eager, the random
    draws (DropPath) the same under one seed. Returns eager's gradients by parameter name."""
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    results = []
    for run in (model, compiled):
        torch.manual_seed(0)
        loss = run(images).logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad()
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert_fp32_close(compiled_loss, eager_loss)
    assert eager_grads.keys() == compiled_grads.keys()
    for name, grad in eager_grads.items():
        assert_fp32_close(compiled_grads[name], grad, what=name)
    return eager_grads


def swapped_gammas_and_dropped_biases(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Copies of one of our models with one bug each: a block's ls1/ls2 gammas swapped, or one block bias zeroed."""
    for i, block in enumerate(model.blocks):
        if hasattr(block.ls1, "gamma") and hasattr(block.ls2, "gamma"):
            broken = copy.deepcopy(model)
            ls1, ls2 = broken.blocks[i].ls1.gamma, broken.blocks[i].ls2.gamma
            with torch.no_grad():
                ls1_values = ls1.clone()
                ls1.copy_(ls2)
                ls2.copy_(ls1_values)
            yield f"blocks.{i} gammas swapped", broken
    for name, _ in model.named_parameters():
        if name.startswith("blocks.") and name.endswith("bias"):
            broken = copy.deepcopy(model)
            with torch.no_grad():
                broken.get_parameter(name).zero_()
            yield f"{name} dropped", broken


def assert_catches_swapped_gammas_and_dropped_biases(
    model: nn.Module, outputs: Callable[[nn.Module], torch.Tensor], expected: torch.Tensor
) -> None:
    """The parity check `assert_fp32_close(outputs(model), expected)` passes, and fails on each of the bugs."""
    with torch.no_grad():
        assert_fp32_close(outputs(model), expected)
        bugs = list(swapped_gammas_and_dropped_biases(model))
        assert any("swapped" in bug for bug, _ in bugs) and any("bias" in bug for bug, _ in bugs)
        for bug, broken in bugs:
            with pytest.raises(AssertionError, match="allowed"):
                assert_fp32_close(outputs(broken), expected)
            assert relative_diff(outputs(broken), expected) > 100 * FP32_RTOL, bug  # and not by a hair


def eva_reference(ffn: str) -> torch.nn.Module:
    """timm's own eva DINOv3 (q/v biases) at TINY size, moved off its init, pooling the class token as ours does."""
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(EVA[ffn], global_pool="token", **TINY)).eval()


META_CONFIGS = json.loads((FIXTURES / "meta_configs.json").read_text())["models"]


def build_from_meta_file(name: str, **kwargs) -> nn.Module:
    """Ours, loaded from one of the Meta fixtures, with the constructor arguments Meta's model was made with."""
    meta = META_CONFIGS[name]
    variant = VARIANT["swiglu"] if meta["ffn_layer"] == "swiglu" else VARIANT["mlp"]
    return timm.create_model(
        variant,
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(FIXTURES / f"{name}.safetensors")),
        embed_dim=meta["embed_dim"],
        depth=meta["depth"],
        num_heads=meta["num_heads"],
        ffn_ratio=meta["ffn_ratio"],
        qkv_bias=meta["qkv_bias"],
        cls_norm=meta["untie_cls_and_patch_norms"],
        local_cls_norm=meta["untie_global_and_local_cls_norm"],
        **kwargs,
    ).eval()


def format_destination(name: str, parent: Path) -> Path:
    """Where a test writes format `name` under `parent`: a folder, or a file with the format's first suffix (from
    its registered `FormatSpec`, so a format added to the registry needs no row here)."""
    spec = timm_layerscale.FORMATS[name].spec
    return parent / (name if spec.writes == FOLDER else f"{name}{spec.suffixes[0]}")


def forget_timm_model(name: str) -> None:
    """Drops a model a test registered from timm's registry, its tags too (timm has no public way to), so that
    later tests see only the shipped variants."""
    registry = timm_registry
    registry._model_entrypoints.pop(name, None)
    module = registry._model_to_module.pop(name, None)
    if module is not None:
        registry._module_to_models[module].discard(name)
    registry._model_has_pretrained.discard(name)
    registry._model_default_cfgs.pop(name, None)
    registry._model_with_tags.pop(name, None)
    for key in [k for k in registry._model_pretrained_cfgs if k.partition(".")[0] == name]:
        del registry._model_pretrained_cfgs[key]


def image_folder(root: Path, n: int = 6, size: int = 40) -> list[Path]:
    """`n` seeded noise PNGs in `root`, each 4 pixels wider than the last (the unlabeled images of a run)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    files = []
    for i in range(n):
        pixels = rng.integers(0, 256, (size, size + 4 * i, 3), dtype=np.uint8)
        files.append(root / f"img_{i}.png")
        Image.fromarray(pixels).save(files[-1])
    return files
