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
from types import SimpleNamespace

import pytest
import timm
import torch
from safetensors.torch import save_file
from support import assert_fp32_close, format_destination, move_off_init_
from torch import nn

from timm_layerscale import CheckpointError, FamilyRecord, Holding, convert_checkpoint, register_family
from timm_layerscale.checkpoints.formats import FORMATS
from timm_layerscale.families import FAMILIES, fixed_words
from timm_layerscale.identity import key_args
from timm_layerscale.layer_options import OPTIONS, LayerOption, option_values, register_option
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
    model.init_weights()  # the model's init resets it as it resets every registered norm
    assert all(float(n.alpha) == 0.5 and torch.equal(n.weight, torch.ones(model.embed_dim)) for n in norms)


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


# ------------------------------------------------------------------------ what the declarations decide


@pytest.mark.parametrize("ffn_bias", [True, False])
@pytest.mark.parametrize("ffn", option_values("ffn_layer"))
@torch.no_grad()
def test_the_keys_of_every_registered_option_give_it_back(dyt, ffn, ffn_bias):
    """Every registered norm (DyT too) and FFN, with and without its bias, read back from a model's keys alone."""
    for norm in option_values("norm_layer"):
        args = dict(embed_dim=64, num_heads=4, depth=2, num_classes=0, norm_layer=norm, ffn_layer=ffn)
        state = timm.create_model("vit_ls_small_patch16_dinov3", **args, ffn_bias=ffn_bias).state_dict()
        decided = key_args(state, {})
        assert (decided["norm_layer"], decided["ffn_bias"], decided["qk_norm"]) == (norm, ffn_bias, False), norm


class _Config(SimpleNamespace):
    """A config as the records and formats read it: by field names."""


PLAIN = FamilyRecord("plainvit", "a family no format fixes anything of", {"native": Holding(), "meta": Holding()})


@pytest.fixture
def plain_family():
    register_family(PLAIN)
    yield PLAIN
    del FAMILIES["plainvit"]


def test_a_format_the_option_does_not_name_is_refused_where_no_record_fixes_the_field(dyt, plain_family):
    config = _Config(family="plainvit", norm_layer="dyt", ffn_layer="mlp", qk_norm=False)
    assert plain_family.holders(config) == ["native"]  # meta fixes nothing, but the norm's declaration names native
    with pytest.raises(CheckpointError) as refused:
        FORMATS["meta"].holding(config)
    assert str(refused.value) == (
        "Meta DINOv3 keys have no place for norm_layer='dyt': --to meta cannot hold it; convert --to native instead"
    )
    assert FORMATS["native"].holding(config) == Holding()


def test_a_fix_may_be_a_set_and_its_refusal_names_each_value():
    meta = FAMILIES["dinov3"].formats["meta"]
    assert meta.differences(_Config(norm_layer="rmsnorm", qk_norm=False, grouped_attention=False)) == []
    assert meta.differences(_Config(norm_layer="dyt", qk_norm=False, grouped_attention=False)) == [
        ("norm_layer", {"layernorm", "rmsnorm"}, "dyt")
    ]
    assert fixed_words("norm_layer", {"rmsnorm", "layernorm"}) == "norm_layer='layernorm' or 'rmsnorm'"
    assert fixed_words("qk_norm", False) == "qk_norm=False"
