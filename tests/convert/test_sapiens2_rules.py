"""The rules by which transformers' Sapiens2 config.json and Sapiens2's own files become our model and back, each
judged by what we did not write: transformers' Sapiens2Config and Sapiens2Model, and the keys of upstream's file
(tests/fixtures). The norm eps, the k/v heads per block (listed, or transformers' default pattern), qk-norm, the
k bias every block of Sapiens2Model has, and the refusals of what the two layouts cannot hold.
"""

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from support import FIXTURES, assert_fp32_close, move_off_init_, relative_diff
from support.families import EVA_HAS_FAMILIES
from transformers import AutoModel, Sapiens2Config, Sapiens2Model

from timm_layerscale import convert_checkpoint
from timm_layerscale.checkpoints.formats import get_format
from timm_layerscale.publish import save_native
from timm_ls.main import main

IMAGES = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
# Four blocks, the first and the last full, the two between grouped: the pattern at its smallest.
SMALL = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_hidden_layers=4,
    intermediate_size=64,
    num_key_value_attention_heads=2,
    num_first_full_attention_layers=1,
    num_last_full_attention_layers=1,
    image_size=32,
)
OURS = dict(embed_dim=32, num_heads=4, depth=4, num_kv_heads=[4, 2, 2, 4], rope_dtype="fp32", rope_periods_bf16=False)
SAPIENS2_VARIANT = "vit_ls_base_patch16_sapiens2"


def transformers_sapiens2(**fields) -> Sapiens2Model:
    torch.manual_seed(0)
    return move_off_init_(Sapiens2Model(Sapiens2Config(**{**SMALL, **fields}))).eval()


def ours(folder: Path) -> torch.nn.Module:
    return timm.create_model(f"local-dir:{folder}", pretrained=True).eval()


def our_sapiens2(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(SAPIENS2_VARIANT, num_classes=0, **{**OURS, **kwargs})).eval()


@torch.no_grad()
def transformers_outputs(model: Sapiens2Model) -> torch.Tensor:
    return model(pixel_values=IMAGES).last_hidden_state


def loaded_by_transformers(folder: Path) -> Sapiens2Model:
    """Sapiens2Model from our folder, as AutoModel picks it, every key of the model in the file and every key of
    the file used."""
    model, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    assert isinstance(model, Sapiens2Model), type(model).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "fields",
    [
        dict(rms_norm_eps=0.1),  # the eps moves the outputs far past fp32 noise at this value
        dict(use_qk_norm=False),
        dict(use_mask_token=True),  # pretraining checkpoints have one
        dict(num_first_full_attention_layers=2, num_last_full_attention_layers=0),
    ],
    ids=lambda f: next(iter(f)),
)
def test_a_sapiens2_config_becomes_our_model_and_back(fields, tmp_path):
    """transformers' folder -> native -> hf: each field read into the model's config, the outputs transformers',
    and what --to hf writes loads into Sapiens2Model key for key with the same outputs."""
    ref = transformers_sapiens2(**fields)
    ref.save_pretrained(tmp_path / "hf_src")
    expected = transformers_outputs(ref)
    convert_checkpoint(tmp_path / "hf_src", tmp_path / "native", to="native")
    model = ours(tmp_path / "native")
    config = model.config
    assert config.norm_eps == ref.config.rms_norm_eps and config.qk_norm == ref.config.use_qk_norm
    assert config.mask_token == ref.config.use_mask_token
    assert config.num_kv_heads == ref.config.num_key_value_heads_per_layer
    assert not config.mask_k_bias and "blocks.0.attn.qkv.bias_mask" not in model.state_dict()
    with torch.no_grad():
        assert_fp32_close(model.forward_features(IMAGES), expected)

    convert_checkpoint(tmp_path / "native", tmp_path / "hf", to="hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["rms_norm_eps"] == ref.config.rms_norm_eps and written["use_qk_norm"] == ref.config.use_qk_norm
    assert written["key_bias"] is True  # Sapiens2Model then has a k bias in every block, and the file holds each
    assert_fp32_close(transformers_outputs(loaded_by_transformers(tmp_path / "hf")), expected)


@pytest.mark.parametrize("variant", ["vit_ls_small_patch16_dinov3", "vit_ls_small_patch16_lingbot"])
def test_a_named_variant_that_masks_the_k_bias_keeps_sapiens2s(variant, tmp_path):
    """--model naming a variant whose blocks mask the k bias (DINOv3's rule): the config.json of Sapiens2Model
    decides, and its k bias, which every block adds, is kept."""
    ref = transformers_sapiens2()
    ref.save_pretrained(tmp_path / "hf_src")
    convert_checkpoint(tmp_path / "hf_src", tmp_path / "native", to="native", model=variant)
    model = ours(tmp_path / "native")
    assert not model.config.mask_k_bias
    with torch.no_grad():
        assert_fp32_close(model.forward_features(IMAGES), transformers_outputs(ref))


def test_the_eps_check_tells_the_two_apart(tmp_path):
    """The eps of the case above, read from the wrong field, moves the outputs past the tolerance: the check is
    of the eps, not of fp32 noise."""
    ref = transformers_sapiens2(rms_norm_eps=0.1)
    other = transformers_sapiens2(rms_norm_eps=1e-6)
    assert relative_diff(transformers_outputs(other), transformers_outputs(ref)) > 100 * 1e-5


PATTERNS = [
    {},  # every field transformers' default: 24 blocks, 16 heads, the middle 8 with 8 k/v heads
    {"num_hidden_layers": 20},
    {"num_attention_heads": 8, "num_key_value_attention_heads": 2},
    {"num_hidden_layers": 7, "num_first_full_attention_layers": 2, "num_last_full_attention_layers": 3},
    {"num_hidden_layers": 6, "num_first_full_attention_layers": 0, "num_last_full_attention_layers": 1},
    {"num_hidden_layers": 6, "num_first_full_attention_layers": 1, "num_last_full_attention_layers": 0},
    {"num_hidden_layers": 5, "num_first_full_attention_layers": 4, "num_last_full_attention_layers": 4},
]


@pytest.mark.parametrize("fields", PATTERNS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "defaults")
def test_a_null_kv_heads_list_is_transformers_default_pattern(fields):
    """`num_key_value_heads_per_layer: null` (or absent) stands for Sapiens2Config's own pattern from the other
    fields, each at transformers' default where the config.json leaves it out."""
    cfg = {"model_type": "sapiens2", "num_key_value_heads_per_layer": None, **fields}
    args = get_format("hf").read_config(cfg).args
    assert args["num_kv_heads"] == Sapiens2Config(**fields).num_key_value_heads_per_layer


def test_a_null_kv_heads_list_converts_as_transformers_builds_it(tmp_path):
    """A folder whose config.json gives the pattern by its fields, not the list, converts to the model
    transformers builds from it: the grouped blocks where transformers puts them."""
    ref = transformers_sapiens2(use_qk_norm=False)  # without qk-norm only the config tells the heads apart
    ref.save_pretrained(tmp_path / "hf_src")
    config_file = tmp_path / "hf_src" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_key_value_heads_per_layer": None}))
    convert_checkpoint(tmp_path / "hf_src", tmp_path / "native", to="native")
    model = ours(tmp_path / "native")
    assert model.config.num_kv_heads == [4, 2, 2, 4]
    with torch.no_grad():
        assert_fp32_close(model.forward_features(IMAGES), transformers_outputs(ref))


@torch.no_grad()
def test_a_zero_k_bias_is_written_for_sapiens2model(tmp_path):
    """Sapiens2Model has a k bias in every block: one that is zero in our model is written as zeros, not left out
    for transformers to fill."""
    model = our_sapiens2()
    for block in model.blocks:
        dim, kv = block.attn.num_heads * block.attn.head_dim, block.attn.num_kv_heads * block.attn.head_dim
        block.attn.qkv.bias[dim : dim + kv] = 0.0
    save_native(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "hf", to="hf")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(not written[f"layer.{i}.attention.k_proj.bias"].any() for i in range(4))
    assert_fp32_close(transformers_outputs(loaded_by_transformers(tmp_path / "hf")), model.forward_features(IMAGES))


def test_a_sapiens2_variant_with_layer_scale_on_the_mlp_branch_is_refused_when_built():
    """Sapiens2 has LayerScale on the attention branch only (its family record): a Sapiens2 variant given it on
    the MLP branch too is no Sapiens2, refused in one line naming the fix and the family that holds it."""
    with pytest.raises(ValueError) as refused:
        our_sapiens2(init_values={"attn": 1.0, "mlp": 1.0})
    line = str(refused.value)
    assert "\n" not in line and line.startswith("family=sapiens2: init_values: LayerScale on the mlp branch"), line
    assert "mlp: off" in line and "family=dinov3" in line, line


@pytest.mark.parametrize(("to", "name"), [("hf", "hf"), ("sapiens2", "own.safetensors"), ("timm", "eva")])
def test_a_sapiens2_shape_with_mlp_layer_scale_is_held_by_no_sapiens2_layout_until_folded(to, name, tmp_path):
    """The same model as the family that holds it (dinov3): no Sapiens2 layout holds it (Sapiens2Model, Sapiens2's
    own code, eva's Sapiens2 have no MLP LayerScale): one line, exit 2, nothing written (`--to timm` once wrote a
    folder timm refused, `Unexpected key(s): blocks.0.gamma_2`). Folded and named a Sapiens2, it is written and
    its own library gives its outputs."""
    if to == "timm" and not EVA_HAS_FAMILIES:
        pytest.skip("this timm's eva has no Sapiens2 (1.0.31 has)")
    model = our_sapiens2(init_values={"attn": 1.0, "mlp": 1.0}, family="dinov3")
    save_native(model, tmp_path / "src")
    code, out, err = cli("convert", str(tmp_path / "src"), str(tmp_path / name), "--to", to)
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and "a dinov3 model" in err and "convert --to native" in err, err
    assert not (tmp_path / name).exists()

    folded = ("--fuse-layerscale", "--model-kwargs", "family=sapiens2")
    code, _, err = cli("convert", str(tmp_path / "src"), str(tmp_path / name), "--to", to, *folded)
    assert code == 0, err
    with torch.no_grad():
        expected = model.forward_features(IMAGES)
        if to == "hf":
            assert_fp32_close(transformers_outputs(loaded_by_transformers(tmp_path / name)), expected)
            return
        if to == "timm":
            eva = timm.create_model(f"local-dir:{tmp_path / name}", pretrained=True).eval()
            assert type(eva).__name__ == "Eva" and not any("gamma_2" in k for k in eva.state_dict())
            assert_fp32_close(eva.forward_features(IMAGES), expected)
            return
        assert not any(".ls2." in k or "ffn.gamma" in k for k in load_file(tmp_path / name))
        convert_checkpoint(tmp_path / name, tmp_path / "back", to="native", model=SAPIENS2_VARIANT, model_kwargs=OURS)
        assert_fp32_close(ours(tmp_path / "back").forward_features(IMAGES), expected)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rope_normalize_coords": "max"}, "rope_normalize_coords"),  # Sapiens2Model normalises per side
        ({"ffn_layer": "mlp"}, "ffn_layer"),  # and, as we write it, SwiGLU
    ],
)
def test_what_sapiens2model_fixes_otherwise_is_refused(change, named, tmp_path):
    """A Sapiens2-family model with a value Sapiens2Model fixes otherwise: one line naming it and where to
    convert instead, exit 2, nothing written."""
    save_native(our_sapiens2(**change), tmp_path / "src")
    code, out, err = cli("convert", str(tmp_path / "src"), str(tmp_path / "hf"), "--to", "hf")
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and named in err and "convert --to native" in err, err
    assert not (tmp_path / "hf").exists()


# Upstream's Sapiens2 backbone as released (tests/fixtures/README.md): its keys are the layout's.
UPSTREAM = FIXTURES / "sapiens2_fixture.safetensors"
UPSTREAM_SHAPE = dict(embed_dim=32, num_heads=4, depth=18, num_kv_heads=[4] * 8 + [2] * 2 + [4] * 8, ffn_ratio=0.75)
UPSTREAM_ARGS = [
    *("--to", "native", "--model", SAPIENS2_VARIANT, "--model-kwargs"),
    *(f"{k}={v}".replace(" ", "") for k, v in UPSTREAM_SHAPE.items()),
]


def test_a_model_without_layer_scale_is_written_with_upstreams_keys_exactly(tmp_path):
    """Upstream's file folded (LayerScale off), then written --to sapiens2: gammas of 1 on the attention branch,
    where upstream's code has its only LayerScale, and nothing else; upstream's keys and shapes exactly."""
    convert_checkpoint(
        UPSTREAM,
        tmp_path / "folded",
        to="native",
        model=SAPIENS2_VARIANT,
        model_kwargs=UPSTREAM_SHAPE,
        fuse_layerscale=True,
    )
    assert not any("gamma" in k for k in load_file(tmp_path / "folded" / "model.safetensors"))
    result = convert_checkpoint(tmp_path / "folded", tmp_path / "own.safetensors", to="sapiens2")
    assert result.not_held == [] and result.warnings == []
    written, upstream = load_file(tmp_path / "own.safetensors"), load_file(UPSTREAM)
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in upstream.items()}
    assert all(torch.equal(written[f"blocks.{i}.attn.gamma.weight"], torch.ones(32)) for i in range(18))


def test_a_mask_token_is_written_as_upstreams_pretraining_files_hold_it(tmp_path):
    """Upstream's pretraining checkpoints hold `mask_token` [1, dim]: written so, and read back the same."""
    model = our_sapiens2(mask_token=True)
    save_native(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "own.safetensors", to="sapiens2")
    written = load_file(tmp_path / "own.safetensors")
    assert torch.equal(written["mask_token"], model.mask_token.detach().reshape(1, -1))
    kwargs = {**OURS, "mask_token": True}
    convert_checkpoint(
        tmp_path / "own.safetensors", tmp_path / "back", to="native", model=SAPIENS2_VARIANT, model_kwargs=kwargs
    )
    assert torch.equal(ours(tmp_path / "back").mask_token, model.mask_token)


def test_a_dinov3_model_is_refused_by_sapiens2s_layout_by_its_family(tmp_path):
    torch.manual_seed(0)
    save_native(timm.create_model("vit_ls_small_patch16_dinov3", embed_dim=32, num_heads=4, depth=2), tmp_path / "src")
    code, out, err = cli("convert", str(tmp_path / "src"), str(tmp_path / "own.pth"), "--to", "sapiens2")
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and "cannot hold a dinov3 model" in err, err
    assert not (tmp_path / "own.pth").exists()


def test_a_task_head_beside_the_backbone_is_refused(tmp_path):
    """upstream's file with a task head's keys (`decode_head.*`): one line naming them and the fix, exit 2,
    nothing written; the backbone alone converts with the same arguments."""
    backbone = load_file(UPSTREAM)
    save_file({**backbone, "decode_head.conv_seg.weight": torch.zeros(17, 32, 1, 1)}, tmp_path / "head.safetensors")
    code, out, err = cli("convert", str(tmp_path / "head.safetensors"), str(tmp_path / "out"), *UPSTREAM_ARGS)
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and "decode_head.*" in err and "backbone alone" in err, err
    assert not (tmp_path / "out").exists()
    code, _, err = cli("convert", str(UPSTREAM), str(tmp_path / "out"), *UPSTREAM_ARGS)
    assert code == 0, err
