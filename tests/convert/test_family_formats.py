"""Conversions of the new families, each checked by the library that owns the layout: transformers' Sapiens2Model
and timm's eva load what we write and give the source's outputs; Sapiens2's own keys make the round trip lossless.
"""

import json

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from support import assert_fp32_close, move_off_init_
from support.families import EVA_HAS_FAMILIES, SAPIENS2_KV, eva_family
from transformers import DINOv3ViTModel, Sapiens2Config, Sapiens2Model

from timm_layerscale import convert_checkpoint
from timm_layerscale.checkpoints.errors import CheckpointError

IMAGES = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(0))


def sapiens2_reference() -> Sapiens2Model:
    """transformers' own Sapiens2 at test width, the real depth pattern of grouped blocks, moved off its init."""
    config = Sapiens2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=18,
        intermediate_size=256,
        num_key_value_heads_per_layer=SAPIENS2_KV,
        image_size=64,
    )
    torch.manual_seed(0)
    return move_off_init_(Sapiens2Model(config)).eval()


def ours(folder) -> torch.nn.Module:
    return timm.create_model(f"local-dir:{folder}", pretrained=True).eval()


@torch.no_grad()
def test_transformers_sapiens2_round_trips_through_every_layout(tmp_path):
    """transformers -> native -> sapiens2 -> native -> hf, each step with the source's outputs."""
    ref = sapiens2_reference()
    ref.save_pretrained(tmp_path / "hf_src")
    expected = ref(pixel_values=IMAGES).last_hidden_state
    result = convert_checkpoint(tmp_path / "hf_src", tmp_path / "native", to="native")
    assert result.variant.endswith("_sapiens2")
    model = ours(tmp_path / "native")
    assert model.config.rope_dtype == "fp32" and model.config.num_kv_heads == SAPIENS2_KV
    assert_fp32_close(model.forward_features(IMAGES), expected)

    convert_checkpoint(tmp_path / "native", tmp_path / "own.safetensors", to="sapiens2")
    own = load_file(tmp_path / "own.safetensors")
    assert "blocks.8.attn.wk.weight" in own and own["blocks.8.attn.wk.weight"].shape == (32, 64)
    assert "blocks.0.attn.gamma.weight" in own and "mask_token" not in own and "ln1.weight" in own
    convert_checkpoint(
        tmp_path / "own.safetensors",
        tmp_path / "back",
        to="native",
        model=result.variant,
        model_kwargs=dict(embed_dim=64, num_heads=4, depth=18, rope_dtype="fp32"),
    )
    back = load_file(tmp_path / "back" / "model.safetensors")
    first = load_file(tmp_path / "native" / "model.safetensors")
    assert back.keys() == first.keys() and all(torch.equal(back[k], first[k]) for k in first)

    convert_checkpoint(tmp_path / "back", tmp_path / "hf", to="hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Sapiens2Model"] and config["num_key_value_heads_per_layer"] == SAPIENS2_KV
    again = Sapiens2Model.from_pretrained(tmp_path / "hf").eval()
    assert_fp32_close(again(pixel_values=IMAGES).last_hidden_state, expected)


@pytest.mark.skipif(not EVA_HAS_FAMILIES, reason="this timm's eva has none of these families (1.0.31 has)")
@pytest.mark.parametrize("name", ["sapiens2", "lingbot_small", "lingbot_giant", "eupe_tiny"])
@torch.no_grad()
def test_each_family_to_timm_loads_in_timms_eva(name, tmp_path):
    ref = eva_family(name)
    save_file(ref.state_dict(), tmp_path / "src.safetensors")
    arch = {
        "sapiens2": "vit_ls_base_patch16_sapiens2",
        "lingbot_small": "vit_ls_small_patch16_lingbot",
        "lingbot_giant": "vit_ls_giant_patch16_lingbot",
        "eupe_tiny": "vit_ls_tiny_patch16_dinov3",
    }[name]
    kwargs = dict(embed_dim=ref.embed_dim, depth=len(ref.blocks), num_heads=ref.blocks[0].attn.num_heads)
    if name == "sapiens2":
        kwargs["num_kv_heads"] = SAPIENS2_KV
    convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "eva", to="timm", model=arch, model_kwargs=kwargs)
    again = timm.create_model(f"local-dir:{tmp_path / 'eva'}", pretrained=True).eval()
    assert type(again).__name__ == "Eva"
    assert_fp32_close(again.forward_features(IMAGES), ref.forward_features(IMAGES))
    if name.startswith("lingbot"):  # LingBot to transformers' DINOv3ViTModel too
        convert_checkpoint(tmp_path / "eva", tmp_path / "hf", to="hf")
        hf = DINOv3ViTModel.from_pretrained(tmp_path / "hf").eval()
        assert_fp32_close(hf(pixel_values=IMAGES).last_hidden_state, ref.forward_features(IMAGES))


def test_meta_formats_and_sapiens2_extras_refuse_in_one_line(tmp_path):
    sapiens2_reference().save_pretrained(tmp_path / "hf_src")
    for to, dst in (("meta", "out.pth"), ("meta-train", "train.pth")):
        with pytest.raises(CheckpointError, match="cannot hold a sapiens2 model"):
            convert_checkpoint(tmp_path / "hf_src", tmp_path / dst, to=to)
        assert not (tmp_path / dst).exists()
    convert_checkpoint(tmp_path / "hf_src", tmp_path / "own.pth", to="sapiens2")
    state = torch.load(tmp_path / "own.pth")
    save_file({**state, "tokenizer.w_cls": torch.zeros(1, 1, 64)}, tmp_path / "tok.safetensors")
    with pytest.raises(CheckpointError, match="tokenizer"):
        convert_checkpoint(tmp_path / "tok.safetensors", tmp_path / "x", to="native")
