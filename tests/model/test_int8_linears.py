"""Every linear of every family is a plain `nn.Linear`, so `quantize_dynamic` (which matches exact types) takes
them all, as it takes all of timm's eva; the qkv's k-bias mask is folded into its bias, exactly in fp32.

The mask's life: fresh init and every load fold it into the bias, conversion between layouts does not (files keep
their raw bias and mask), and training multiplies by it again so that masked rows get no gradient.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support import TINY, move_off_init_
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
from torch.ao.quantization import quantize_dynamic

from timm_layerscale import FAMILIES, VARIANTS, convert_checkpoint, fold_bias_masks_
from timm_layerscale.layers import k_bias_mask, k_masked_linear

SMALL = "vit_ls_small_patch16_dinov3"
IMAGES = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(3))


def tiny(name: str = SMALL, **kwargs) -> nn.Module:
    """A registered variant at TINY width and depth (grouped variants keep a grouped block)."""
    args = dict(TINY, num_classes=0)
    if VARIANTS[name].config.num_kv_heads is not None:
        args["num_kv_heads"] = [4, 2]
    torch.manual_seed(0)
    return timm.create_model(name, **{**args, **kwargs})


def linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantized_linears(model: nn.Module) -> list[str]:
    quantized = quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    return [name for name, m in quantized.named_modules() if isinstance(m, DynamicLinear)]


def test_the_variants_cover_every_family():
    assert {v.config.family for v in VARIANTS.values()} == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_quantize_dynamic_takes_every_linear_of_every_variant(name):
    model = tiny(name, num_classes=3)
    found = linears(model)
    assert all(type(model.get_submodule(n)) is nn.Linear for n in found)  # no subclass: exact-type matching
    per_block = 2 + {"mlp": 2, "swiglu": 3}[VARIANTS[name].config.ffn_layer]  # qkv, proj and the FFN's
    assert len(found) == per_block * TINY["depth"] + 1  # and the head
    assert quantized_linears(model) == found


def test_as_many_linears_are_quantized_as_in_timms_eva():
    eva = timm.create_model("vit_small_patch16_dinov3", pretrained=False, num_classes=0, **TINY)
    ours = tiny()
    assert len(quantized_linears(eva)) == len(linears(eva)) == 4 * TINY["depth"]
    assert len(quantized_linears(ours)) == len(linears(ours)) == len(linears(eva))


def mixed_masks_(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """A raw (unfolded) state dict: non-zero biases everywhere, qkv masks of mixed ones and zeros."""
    move_off_init_(model, seed)
    generator = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(len(model.blocks)):
        bias = state[f"blocks.{i}.attn.qkv.bias"]
        bias.copy_(torch.randn(bias.shape, generator=generator) * 0.5 + 1.0)
        mask = (torch.rand(bias.shape, generator=generator) > 0.5).float()
        mask[:2], mask[2:4] = 1.0, 0.0  # both kinds, whatever the draw
        state[f"blocks.{i}.attn.qkv.bias_mask"] = mask
    return state


class MaskedQkv(nn.Module):
    """The reference: the raw bias multiplied by the mask in every forward (Meta's LinearKMaskedBias)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias, self.mask = weight, bias, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias * self.mask)


def reference_model(model: nn.Module, raw: dict[str, torch.Tensor]) -> nn.Module:
    reference = copy.deepcopy(model)
    for i, block in enumerate(reference.blocks):
        key = f"blocks.{i}.attn.qkv"
        block.attn.qkv = MaskedQkv(raw[f"{key}.weight"], raw[f"{key}.bias"], raw[f"{key}.bias_mask"])
    return reference


@torch.no_grad()
def test_a_loaded_model_adds_bias_times_mask_bit_for_bit():
    model = tiny()
    raw = mixed_masks_(model)
    model.load_state_dict(raw)
    reference = reference_model(model, raw).eval()
    model.eval()
    x = torch.randn(2, 7, TINY["embed_dim"])
    for i, block in enumerate(model.blocks):
        key = f"blocks.{i}.attn.qkv"
        assert torch.equal(block.attn.qkv.bias, raw[f"{key}.bias"] * raw[f"{key}.bias_mask"])
        assert torch.equal(block.attn.qkv(x), reference.blocks[i].attn.qkv(x))
    assert torch.equal(model(IMAGES), reference(IMAGES))
    assert torch.equal(model.forward_features(IMAGES), reference.forward_features(IMAGES))


@torch.no_grad()
def test_training_adds_the_masked_bias_even_unfolded():
    """Written by hand and not folded, a bias still counts only through its mask in training."""
    model = tiny()
    raw = mixed_masks_(model)
    for i, block in enumerate(model.blocks):
        block.attn.qkv.bias.copy_(raw[f"blocks.{i}.attn.qkv.bias"])
        block.attn.qkv.bias_mask.copy_(raw[f"blocks.{i}.attn.qkv.bias_mask"])
    expected = reference_model(model, raw).eval()(IMAGES)
    assert torch.equal(model.train()(IMAGES), expected)
    assert not torch.equal(model.eval()(IMAGES), expected)  # eval adds the bias as it stands...
    assert torch.equal(fold_bias_masks_(model)(IMAGES), expected)  # ...folded, the same
    assert torch.equal(fold_bias_masks_(model)(IMAGES), expected)  # folding twice changes nothing


def test_masked_bias_rows_get_no_gradient():
    model = tiny()
    model.load_state_dict(mixed_masks_(model))
    model.train()(IMAGES).square().mean().backward()
    for block in model.blocks:
        grad, mask = block.attn.qkv.bias.grad, block.attn.qkv.bias_mask.bool()
        assert not grad[~mask].any()
        assert grad[mask].ne(0).all()


@torch.no_grad()
def test_fresh_init_resets_the_mask_and_folds_the_bias():
    model = tiny()
    dim = TINY["embed_dim"]
    for block in model.blocks:
        assert torch.equal(block.attn.qkv.bias_mask, k_bias_mask(3 * dim, dim))
        assert not block.attn.qkv.bias.any()
        block.attn.qkv.bias.fill_(1.0)
        block.attn.qkv.bias_mask.fill_(1.0)
    model.init_weights()
    for block in model.blocks:
        assert torch.equal(block.attn.qkv.bias_mask, k_bias_mask(3 * dim, dim))
        assert not block.attn.qkv.bias.any()


def test_a_fresh_qkv_bias_is_folded_before_init_weights():
    """nn.Linear's own init draws a bias: the factory folds it, so even an un-initialised qkv masks k."""
    dim = TINY["embed_dim"]
    qkv = k_masked_linear(dim, 3 * dim)
    assert type(qkv) is nn.Linear and torch.equal(qkv.bias_mask, k_bias_mask(3 * dim, dim))
    assert not qkv.bias[dim : 2 * dim].any() and qkv.bias[:dim].all() and qkv.bias[2 * dim :].all()
    with torch.no_grad():
        qkv.reset_parameters()  # nn.Linear's draw again, k rows included
    assert qkv.bias[dim : 2 * dim].all()
    model = nn.Sequential(nn.Linear(dim, dim), qkv)
    unmasked = model[0].bias.clone()
    assert fold_bias_masks_(model) is model
    assert not qkv.bias[dim : 2 * dim].any() and qkv.bias[:dim].all()
    assert torch.equal(model[0].bias, unmasked)  # a linear without a mask is left alone


def meta_file_with_a_raw_k_bias(path) -> dict[str, torch.Tensor]:
    """A Meta-layout file whose qkv biases have non-zero k rows under Meta's k-zero mask."""
    model = move_off_init_(tiny())
    generator = torch.Generator().manual_seed(2)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    for i in range(len(model.blocks)):
        bias = state[f"blocks.{i}.attn.qkv.bias"]
        bias.copy_(torch.randn(bias.shape, generator=generator) * 0.5 + 1.0)
        assert torch.equal(state[f"blocks.{i}.attn.qkv.bias_mask"], k_bias_mask(bias.shape[0]))
    save_file(state, path)
    return state


@pytest.mark.parametrize("how", ["pretrained", "load_state_dict", "load_checkpoint"])
@torch.no_grad()
def test_loading_folds_the_files_mask_into_the_bias(how, tmp_path):
    path = tmp_path / "meta.safetensors"
    raw = meta_file_with_a_raw_k_bias(path)
    if how == "pretrained":  # streamed into a meta-device model (loading.load_pretrained)
        model = tiny(pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    elif how == "load_state_dict":
        model = tiny()
        model.load_state_dict(load_file(path))
    else:
        model = tiny()
        timm.models.load_checkpoint(model, str(path))
    dim = TINY["embed_dim"]
    for i, block in enumerate(model.blocks):
        bias, stored = block.attn.qkv.bias, raw[f"blocks.{i}.attn.qkv.bias"]
        assert not bias[dim : 2 * dim].any()
        assert torch.equal(bias[:dim], stored[:dim]) and torch.equal(bias[2 * dim :], stored[2 * dim :])
    model.eval()
    assert torch.equal(model(IMAGES), reference_model(model, raw).eval()(IMAGES))


@torch.no_grad()
def test_loading_with_assign_folds_without_writing_into_the_callers_tensors(tmp_path):
    """`assign=True` makes the caller's tensors the model's (a conversion's plan, a file's pages): the fold makes
    a new bias rather than writing into them."""
    raw = meta_file_with_a_raw_k_bias(tmp_path / "meta.safetensors")
    kept = {k: v.clone() for k, v in raw.items()}
    model = tiny()
    model.load_state_dict(raw, assign=True)
    assert all(torch.equal(raw[k], v) for k, v in kept.items())
    dim = TINY["embed_dim"]
    assert not model.blocks[0].attn.qkv.bias[dim : 2 * dim].any() and raw["blocks.0.attn.qkv.bias"][dim:].all()


@pytest.mark.parametrize("to", ["meta", "native"])
def test_conversion_writes_the_files_raw_bias_and_mask(to, tmp_path):
    src = tmp_path / "meta.safetensors"
    raw = meta_file_with_a_raw_k_bias(src)
    dst = tmp_path / ("out.safetensors" if to == "meta" else "out")
    convert_checkpoint(src, dst, to=to, model=SMALL, model_kwargs=dict(TINY))
    written = load_file(dst if to == "meta" else dst / "model.safetensors")
    assert written.keys() == raw.keys()
    for key, value in raw.items():
        assert torch.equal(written[key], value), key
    assert written["blocks.0.attn.qkv.bias"][TINY["embed_dim"] :].ne(0).all()  # the raw k rows, kept
