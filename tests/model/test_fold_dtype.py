"""Folding LayerScale into low-precision weights rounds once: the product `gamma * W` is made in fp32 and cast to
the weight's dtype, so a bf16 model folded equals the fp32 fold rounded to bf16, bit for bit. Checked on a live
model (fold_layer_scale) and through the command (`convert --fuse-layerscale`), with fp32 gammas beside bf16
weights as mixed-precision training keeps them, and with a whole fp32 file cast to bf16 on the way.
"""

import copy
import io
from contextlib import redirect_stderr, redirect_stdout

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from support import TINY, move_off_init_, relative_diff

from timm_layerscale import fold_layer_scale
from timm_ls.main import main

VARIANT = "vit_ls_small_patch16_dinov3"
IMAGES = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(1))
# The projections each block's gammas fold into: ls1 into attn.proj, ls2 into mlp.fc2.
FOLDS = [
    (f"blocks.{i}.ls{n}.gamma", f"blocks.{i}.{proj}")
    for i in range(2)
    for n, proj in ((1, "attn.proj"), (2, "mlp.fc2"))
]


def source_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(VARIANT, num_classes=0, **TINY)).eval()


def bf16_with_fp32_gammas(model: torch.nn.Module) -> torch.nn.Module:
    """The model in bf16, its gammas kept in fp32 (as mixed-precision training keeps small parameters)."""
    mixed = copy.deepcopy(model).to(torch.bfloat16)
    for name, param in model.named_parameters():
        if name.endswith(".gamma"):
            mixed.get_parameter(name).data = param.data.clone()
    return mixed


def fp32_fold_rounded_once(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each folded projection as the fp32 product `gamma * W` (and `gamma * b`), then rounded once to `dtype`."""
    folded = {}
    for gamma_key, proj in FOLDS:
        gamma = state[gamma_key].float()
        folded[f"{proj}.weight"] = (state[f"{proj}.weight"].float() * gamma[:, None]).to(dtype)
        folded[f"{proj}.bias"] = (state[f"{proj}.bias"].float() * gamma).to(dtype)
    return folded


def assert_rounded_once(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), f"{key}: {relative_diff(actual[key], value):.3g} off the fp32 fold"


def test_the_check_tells_one_rounding_from_two():
    """A gamma rounded to bf16 before the product lands elsewhere: the checks below can fail."""
    state = bf16_with_fp32_gammas(source_model()).state_dict()
    gamma, weight = state["blocks.0.ls1.gamma"], state["blocks.0.attn.proj.weight"]
    twice = weight * gamma.to(torch.bfloat16)[:, None]
    assert not torch.equal(twice, fp32_fold_rounded_once(state, torch.bfloat16)["blocks.0.attn.proj.weight"])


@torch.no_grad()
def test_a_bf16_model_folds_as_the_fp32_fold_rounded_once():
    model = source_model()
    mixed = bf16_with_fp32_gammas(model)
    expected = fp32_fold_rounded_once(mixed.state_dict(), torch.bfloat16)
    folded = fold_layer_scale(mixed)
    assert not any("gamma" in k for k in folded.state_dict())
    assert_rounded_once(folded.state_dict(), expected)
    # The same weights as the fp32 model folded then cast: the same outputs, and bf16's distance from fp32's.
    reference = fold_layer_scale(copy.deepcopy(model)).to(torch.bfloat16)
    reference.load_state_dict({**reference.state_dict(), **expected})
    images = IMAGES.to(torch.bfloat16)
    assert torch.equal(folded(images), reference(images))
    assert relative_diff(folded(images), model(IMAGES)) < 5e-2


def cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


MODEL_ARGS = ("--model", VARIANT, "--model-kwargs", *(f"{k}={v}" for k, v in TINY.items()))


@pytest.mark.parametrize("source", ["bf16_fp32_gammas", "fp32"])
def test_convert_fuse_layerscale_rounds_once(source, tmp_path):
    """`convert --fuse-layerscale` of a bf16 file with fp32 gammas (kept bf16), or of an fp32 file with
    `--dtype bf16`: every folded projection is the fp32 fold rounded once to bf16."""
    model = source_model()
    state = bf16_with_fp32_gammas(model).state_dict() if source != "fp32" else model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "src.safetensors")
    cast = ("--dtype", "bf16") if source == "fp32" else ()
    code, err = cli(
        "convert",
        str(tmp_path / "src.safetensors"),
        str(tmp_path / "out"),
        "--to",
        "native",
        "--fuse-layerscale",
        *cast,
        *MODEL_ARGS,
    )
    assert code == 0, err
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert not any("gamma" in k for k in written)
    assert_rounded_once(written, fp32_fold_rounded_once(state, torch.bfloat16))
