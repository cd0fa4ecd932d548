"""Adding a norm is its module and one registration (`register_option`), from this file alone: a DyT
(`weight * tanh(alpha * x) + bias`, Zhu et al. 2025, per-channel weight and bias, one scalar alpha) builds, saves,
is read back from its weights alone (no config beside them) as a DyT by its keys' signature, never as Meta's
LayerNorm, gives its outputs, is refused by every format its declaration does not name in one line naming the one
that does, and `timm-ls inspect` reports its gammas and the model its keys are.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest
import timm
import torch
from safetensors.torch import save_file
from support import assert_fp32_close, format_destination, move_off_init_
from torch import nn

from timm_layerscale import convert_checkpoint
from timm_layerscale.checkpoints.formats import FORMATS
from timm_layerscale.families import FAMILIES
from timm_layerscale.layer_options import OPTIONS, LayerOption, register_option
from timm_layerscale.publish import save_native
from timm_ls.main import main

VARIANT = "vit_ls_tiny_patch16_dinov3"  # at its shipped shape, so its weights alone name it
SHAPE = dict(num_classes=0, norm_layer="dyt")
IMAGES = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))


class DyT(nn.Module):
    """Dynamic tanh in place of a norm: `weight * tanh(alpha * x) + bias` over the last dim."""

    def __init__(self, dim: int, eps: float = 0.0, alpha_init: float = 0.5) -> None:
        super().__init__()  # eps: the config's norm_eps, which a tanh has no use for
        self.alpha_init = alpha_init
        self.alpha = nn.Parameter(torch.empty(1))
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.alpha_init)
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x) * self.weight + self.bias


@pytest.fixture(scope="module")
def dyt():
    option = register_option(
        LayerOption("norm_layer", "dyt", DyT, signature=("norm.alpha", "norm.weight", "norm.bias"), formats={"native"})
    )
    yield option
    del OPTIONS["norm_layer"]["dyt"]


@torch.no_grad()
def dyt_model() -> nn.Module:
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(VARIANT, **SHAPE)).eval()


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@torch.no_grad()
def test_it_builds_its_class_everywhere_a_norm_is_and_computes_dyt(dyt):
    model = dyt_model()
    norms = [model.norm, model.blocks[0].norm1, model.blocks[1].norm2]
    assert all(type(n) is DyT for n in norms) and not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    x = torch.randn(2, 5, model.embed_dim)
    norm = model.norm
    assert float(norm.alpha) != 0.5  # moved off its init, so alpha counts
    assert_fp32_close(norm(x), torch.tanh(norm.alpha * x) * norm.weight + norm.bias)
    fresh = timm.create_model(VARIANT, **SHAPE)  # the model's init resets it as a norm
    assert float(fresh.norm.alpha) == 0.5 and torch.equal(fresh.norm.weight, torch.ones(model.embed_dim))


@torch.no_grad()
def test_its_weights_alone_are_read_back_as_dyt_not_metas_layernorm(dyt, tmp_path):
    model = dyt_model()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "weights.safetensors")
    result = convert_checkpoint(tmp_path / "weights.safetensors", tmp_path / "native", to="native")
    assert result.variant == VARIANT, result.variant
    config = json.loads((tmp_path / "native" / "config.json").read_text())["model_args"]
    assert config["norm_layer"] == "dyt", config
    again = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    assert type(again.norm) is DyT
    assert_fp32_close(again.forward_features(IMAGES), model.forward_features(IMAGES))


@pytest.mark.parametrize("to", sorted(set(FORMATS) - {"native"}))
def test_every_format_its_declaration_does_not_name_refuses_it_naming_native(dyt, to, tmp_path):
    save_native(dyt_model(), tmp_path / "src")
    dst = format_destination(to, tmp_path / "out")
    dst.parent.mkdir()
    code, out, err = cli("convert", tmp_path / "src", dst, "--to", to)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert err.strip().endswith("convert --to native instead"), err  # never another format that cannot either
    if to in FAMILIES["dinov3"].formats:  # a format that holds its family: refused for the norm, by name
        assert "norm_layer" in err and "'dyt'" in err, err
    assert not list(dst.parent.iterdir()), "a refusal wrote a file"


@torch.no_grad()
def test_inspect_reports_its_gammas_and_the_model_its_keys_are(dyt, tmp_path):
    model = dyt_model()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "weights.safetensors")
    code, out, err = cli("inspect", tmp_path / "weights.safetensors", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["gammas_read"] == 2 * model.config.depth and report["model"].startswith(VARIANT), report
    expected = model.blocks[1].ls2.gamma.abs().double().mean().item()
    assert report["blocks"][1]["mlp"]["mean"] == pytest.approx(expected, rel=1e-6)
