import argparse
import dataclasses
import math

import pytest
import timm
import torch
from timm.utils.misc import ParseKwargs

import timm_layerscale
from timm_layerscale import VisionTransformerLS, VitLsConfig, cait_init_value, resolve_init_values
from timm_layerscale.layers import LayerScale
from timm_layerscale.variants import VariantNameError, find_variant


def gammas(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.endswith(".gamma")}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1e-6, (1e-6, 1e-6)),
        ("1e-6", (1e-6, 1e-6)),
        (0, (None, None)),
        (False, (None, None)),
        ("off", (None, None)),
        (None, (None, None)),
        ({"attn": 1e-4, "mlp": "off"}, (1e-4, None)),
    ],
)
def test_init_value_forms(value, expected):
    assert resolve_init_values(value, depth=3) == [expected] * 3


def test_per_block_list_and_auto():
    assert resolve_init_values([0.1, "off", {"attn": 1e-5, "mlp": 1e-6}], depth=3) == [
        (0.1, 0.1),
        (None, None),
        (1e-5, 1e-6),
    ]
    assert [cait_init_value(d) for d in (12, 18, 24, 40)] == [0.1, 0.1, 1e-5, 1e-6]
    assert resolve_init_values("auto", depth=40) == [(1e-6, 1e-6)] * 40


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1.0, "init_values: got -1.0"),
        (math.nan, "init_values: got nan"),
        ("loud", "init_values: got 'loud'"),
        (True, "init_values: got True"),
        ([1e-5], "init_values: got a list of 1 entries; allowed: exactly depth=2"),
        ({"attn": 1e-5}, "init_values: got keys ['attn']; allowed: exactly ['attn', 'mlp']"),
        ([1e-5, {"attn": -2, "mlp": 1}], "init_values[1].attn: got -2"),
    ],
)
def test_bad_init_values_name_key_value_and_allowed(value, message):
    with pytest.raises(ValueError, match="allowed") as info:
        VitLsConfig(depth=2, embed_dim=64, num_heads=4, init_values=value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ffn_layer": "geglu"}, "ffn_layer: got 'geglu'; allowed: one of"),
        ({"num_heads": 5}, "num_heads: got 5; allowed: a divisor of embed_dim=64"),
        ({"depth": "abc"}, "depth: got 'abc'; allowed: an integer in [1, 1024]"),
        # Beyond any machine: refused by name with the range, before anything is built
        ({"depth": 1025}, "depth: got 1025; allowed: an integer in [1, 1024]"),
        ({"depth": 10**9}, "depth: got 1000000000; allowed: an integer in [1, 1024]"),
        ({"embed_dim": 65537, "num_heads": 1}, "embed_dim: got 65537; allowed: an integer in [1, 65536]"),
        ({"embed_dim": 4e9}, "embed_dim: got 4000000000.0; allowed: an integer in [1, 65536]"),
        ({"num_heads": 2048}, "num_heads: got 2048; allowed: an integer in [1, 1024]"),
        ({"num_classes": 10**12}, "num_classes: got 1000000000000; allowed: an integer in [0, 1048576]"),
        ({"num_storage_tokens": 1025}, "num_storage_tokens: got 1025; allowed: an integer in [0, 1024]"),
        ({"ffn_ratio": 65.0}, "ffn_ratio: got 65.0; allowed: a number in [0.0625, 64]"),
        ({"ffn_ratio": 1e-300}, "ffn_ratio: got 1e-300; allowed: a number in [0.0625, 64]"),
        # Inside the types but where no model lives: NaN outputs, infinite periods or zero features otherwise
        ({"rope_base": 1e-300}, "rope_base: got 1e-300; allowed: a number in [1, 1e+06]"),
        ({"rope_base": 1e308}, "rope_base: got 1e+308; allowed: a number in [1, 1e+06]"),
        ({"norm_eps": 1e308}, "norm_eps: got 1e+308; allowed: a number in [1e-12, 0.1]"),
        ({"norm_eps": 0.0}, "norm_eps: got 0.0; allowed: a number in [1e-12, 0.1]"),
        ({"rope_shift_coords": 1e308}, "rope_shift_coords: got 1e+308; allowed: null or a number in [0, 16]"),
        ({"rope_jitter_coords": 1e9}, "rope_jitter_coords: got 1000000000.0; allowed: null or a number in [1, 16]"),
        # A finite number is required: NaN and infinities are refused by name
        ({"norm_eps": float("nan")}, "norm_eps: got nan"),
        ({"rope_base": float("inf")}, "rope_base: got inf"),
        ({"ffn_ratio": float("nan")}, "ffn_ratio: got nan"),
        ({"rope_rescale_coords": float("inf")}, "rope_rescale_coords: got inf"),
        ({"drop_path_rate": float("nan")}, "drop_path_rate: got nan"),
        # k/v heads: each positive, each a divisor of num_heads, one per block, a bounded list
        ({"num_kv_heads": 0}, "num_kv_heads: got 0; allowed: null (every head), an integer in [1, 1024]"),
        ({"num_kv_heads": [4, 0]}, "num_kv_heads: got [4, 0]; allowed: null (every head)"),
        ({"num_kv_heads": 3}, "num_kv_heads: got 3; allowed: divisors of num_heads=4"),
        ({"num_kv_heads": [4, 3]}, "num_kv_heads: got [4, 3]; allowed: divisors of num_heads=4"),
        ({"num_kv_heads": [4, 2, 1]}, "allowed: a list of exactly depth=2 entries, one per block"),
        ({"num_kv_heads": [2] * 1025}, "allowed: null (every head), an integer in [1, 1024], or a list"),
        ({"rope_dtype": "bf16", "rope_periods_bf16": False}, "rope_dtype: got 'bf16'; allowed: 'fp32' with"),
        # Choices are matched as written
        ({"ffn_layer": "MLP"}, "ffn_layer: got 'MLP'; allowed: one of"),
        ({"norm_layer": "LayerNorm"}, "norm_layer: got 'LayerNorm'; allowed: one of"),
        ({"rope_dtype": "BF16"}, "rope_dtype: got 'BF16'; allowed: one of"),
        ({"ffn_ratio": 10**400}, "ffn_ratio: got 1000"),
        ({"img_size": 10**6}, "img_size: got 1000000; allowed: an integer in [1, 65536] or a pair"),
        ({"patch_size": 4096}, "patch_size: got 4096; allowed: an integer in [1, 1024]"),
        # A number spelled as text, or a bool, is not an integer: refused, not converted
        ({"depth": "2"}, "depth: got '2'; allowed: an integer"),
        ({"depth": True}, "depth: got True; allowed: an integer"),
        ({"embed_dim": "x" * 500}, "embed_dim: got 'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx'"),
        ({"drop_path_rate": 1.5}, "drop_path_rate: got 1.5"),
        ({"global_pool": "mean"}, "global_pool: got 'mean'"),
        ({"stochastic_depth": "layer"}, "stochastic_depth: got 'layer'"),
        ({"rope_rescale_coords": 0.5}, "rope_rescale_coords: got 0.5"),
        ({"freeze_layer_scale": "sometimes"}, "freeze_layer_scale: got 'sometimes'; allowed: true or false"),
        ({"reinit_layer_scale": 2}, "reinit_layer_scale: got 2; allowed: true or false"),
        # The family: a registered one, whose record the config is checked against
        ({"family": "dinov2"}, "family: got 'dinov2'; allowed: a registered family: dinov3, lingbot, sapiens2"),
        ({"family": "sapiens2"}, "family=sapiens2: norm_layer: got 'layernorm'; a sapiens2 model has 'rmsnorm'"),
    ],
)
def test_bad_config_values(overrides, message):
    with pytest.raises(ValueError) as info:
        timm.create_model("vit_ls_small_patch16_dinov3", **{"embed_dim": 64, "num_heads": 4, "depth": 2, **overrides})
    assert message in str(info.value)


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match=r"unknown config key\(s\) 'layerscale'; allowed: family, img_size"):
        timm.create_model("vit_ls_small_patch16_dinov3", layerscale=1e-6)


def test_unknown_argument_is_a_type_error_like_every_timm_model():
    with pytest.raises(TypeError, match=r"unknown config key\(s\) 'not_a_model_arg'") as info:
        timm.create_model("vit_ls_small_patch16_dinov3", device="meta", not_a_model_arg=1)
    assert isinstance(info.value, timm_layerscale.UnknownConfigKeyError)
    assert isinstance(info.value, ValueError)  # what config errors raise, and what the CLI catches
    with pytest.raises(TypeError):
        VisionTransformerLS(depth=1, not_a_model_arg=1)
    with pytest.raises(ValueError) as bad_value:
        VisionTransformerLS(depth=0)
    assert not isinstance(bad_value.value, TypeError)  # a bad value stays a plain ValueError


@pytest.mark.parametrize(
    ("img_size", "suggestion"),
    [(200, "e.g. 192,"), (8, "e.g. 16,"), ((224, 8), "e.g. (224, 16),"), ([240, 250], "e.g. (240, 240),")],
)
def test_img_size_must_fit_the_patch_size_unless_padded(img_size, suggestion):
    with pytest.raises(ValueError) as info:
        timm.create_model("vit_ls_small_patch16_dinov3", img_size=img_size, device="meta")
    assert str(info.value).startswith(f"img_size: got {img_size!r}; allowed: a multiple of patch_size=16 per side")
    assert suggestion in str(info.value) and "dynamic_img_pad=True" in str(info.value)
    padded = timm.create_model("vit_ls_small_patch16_dinov3", img_size=img_size, dynamic_img_pad=True, device="meta")
    assert padded.config.img_size == img_size
    assert timm.create_model("vit_ls_small_patch16_dinov3", img_size=(224, 160), patch_size=32, device="meta")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1e-6, [1e-6] * 6),
        ("auto", [0.1] * 6),  # depth 3: CaiT's shallow value
        ({"attn": 1e-4, "mlp": 1e-6}, [1e-4, 1e-6] * 3),
        ([0.5, 1e-3, {"attn": 2.0, "mlp": 1e-6}], [0.5, 0.5, 1e-3, 1e-3, 2.0, 1e-6]),
    ],
)
def test_every_init_form_gives_exact_fresh_gammas(value, expected):
    model = timm.create_model("vit_ls_small_patch16_dinov3", init_values=value, embed_dim=64, num_heads=4, depth=3)
    found = list(gammas(model).values())
    assert len(found) == len(expected)
    assert all(torch.equal(g, torch.full((64,), v)) for g, v in zip(found, expected))


def test_fresh_gammas_equal_init_values_per_branch_and_block():
    per_block = [0.1, {"attn": 1e-4, "mlp": 1e-6}, "off"]
    model = timm.create_model("vit_ls_small_patch16_dinov3", init_values=per_block, embed_dim=64, num_heads=4, depth=3)
    expected = {
        "blocks.0.ls1.gamma": 0.1,
        "blocks.0.ls2.gamma": 0.1,
        "blocks.1.ls1.gamma": 1e-4,
        "blocks.1.ls2.gamma": 1e-6,
    }
    found = gammas(model)
    assert set(found) == set(expected)
    for key, value in expected.items():
        assert torch.equal(found[key], torch.full((64,), value)), key


def test_gammas_survive_reset_and_model_init():
    model = timm.create_model("vit_ls_small_patch16_dinov3", init_values={"attn": 1e-4, "mlp": 1e-6}, depth=2)
    with torch.no_grad():
        for g in gammas(model).values():
            g.fill_(3.0)
    for module in model.modules():
        if isinstance(module, LayerScale):
            module.reset_parameters()
    assert all(torch.equal(g, torch.full_like(g, v)) for g, v in zip(gammas(model).values(), [1e-4, 1e-6] * 2))
    with torch.no_grad():
        for g in gammas(model).values():
            g.fill_(3.0)
    model.init_weights()
    assert all(torch.equal(g, torch.full_like(g, v)) for g, v in zip(gammas(model).values(), [1e-4, 1e-6] * 2))


@pytest.mark.parametrize("off", [0, False, "off", "0"])
def test_layer_scale_off_removes_gammas(off):
    model = timm.create_model("vit_ls_small_patch16_dinov3", init_values=off, depth=2)
    assert not gammas(model)
    assert all(isinstance(b.ls1, torch.nn.Identity) and isinstance(b.ls2, torch.nn.Identity) for b in model.blocks)


def test_create_model_drops_none_so_variant_default_stays():
    """timm.create_model prunes None kwargs: init_values=None cannot switch LayerScale off (use 0 or 'off')."""
    model = timm.create_model("vit_ls_small_patch16_dinov3", init_values=None, depth=2)
    assert model.config.init_values == 1e-5
    assert len(gammas(model)) == 4


def test_train_py_model_kwargs_strings_are_parsed():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs)
    for text, expected in [("init_values=1e-6", 1e-6), ("init_values=off", None), ("init_values=0", None)]:
        kwargs = parser.parse_args(["--model-kwargs", text, "depth=2"]).model_kwargs
        model = timm.create_model("vit_ls_small_patch16_dinov3", **kwargs)
        assert model.config.layer_init_values == [(expected, expected)] * 2
    kwargs = parser.parse_args(["--model-kwargs", "init_values={'attn':1e-6,'mlp':'off'}", "depth=2"]).model_kwargs
    assert timm.create_model("vit_ls_small_patch16_dinov3", **kwargs).config.layer_init_values == [(1e-6, None)] * 2
    args = ["--model-kwargs", "freeze_layer_scale=True", "reinit_layer_scale=true", "depth=2"]
    model = timm.create_model("vit_ls_small_patch16_dinov3", **parser.parse_args(args).model_kwargs)
    assert model.config.freeze_layer_scale is model.config.reinit_layer_scale is True
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"blocks.{i}.ls{j}.gamma" for i in range(2) for j in (1, 2)}


def test_user_yaml_registers_a_new_variant(tmp_path):
    path = tmp_path / "my_vit_ls_tiny_deep.yaml"
    path.write_text(
        "description: a tiny test variant\n"
        "base: vit_ls_small_patch16_dinov3\n"
        "model:\n  embed_dim: 64\n  num_heads: 4\n  depth: 20\n  init_values: auto\n"
    )
    name = timm_layerscale.register_variant(path)
    assert name == "my_vit_ls_tiny_deep" and name in timm.list_models("my_vit_ls_*")
    model = timm.create_model(name)
    assert model.config.layer_init_values == [(1e-5, 1e-5)] * 20
    assert timm.create_model(name, init_values=0.5).config.layer_init_values[0] == (0.5, 0.5)
    assert "my_vit_ls_tiny_deep.lvd1689m" in timm.list_pretrained("my_vit_ls_*")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modle:\n  depth: 2\n", "unknown key(s) ['modle']"),
        ("model:\n  depth: -2\n", "depth: got -2"),
        ("model:\n  init_values: lots\n", "init_values: got 'lots'"),
        ("pretrained:\n  x:\n    hub: a/b\n", "pretrained.x: unknown key(s) ['hub']"),
    ],
)
def test_bad_yaml_is_refused_at_registration(tmp_path, text, message):
    path = tmp_path / "broken_variant.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        timm_layerscale.register_variant(path)
    assert message in str(info.value) and str(path) in str(info.value)
    assert "broken_variant" not in timm.list_models("broken_*")


def test_shipped_yaml_is_the_single_source_of_truth():
    shipped = {p.stem for p in timm_layerscale.config_dir().glob("*.yaml")}
    families = {"dinov3": 8, "lingbot": 4, "sapiens2": 5}  # DINOv3's seven shapes and EUPE's ViT-T
    assert {f: sum(n.endswith(f"_{f}") for n in shipped) for f in families} == families
    assert len(shipped) == sum(families.values())
    for name in sorted(shipped):  # what other tests registered on the way is not shipped
        variant = timm_layerscale.VARIANTS[name]
        assert variant.source.endswith(f"{name}.yaml")
        model = timm.create_model(name, device="meta")
        for key, value in variant.model_args.items():
            assert getattr(model.config, key) == value, (name, key)


def test_a_variant_name_resolves_to_its_variant_and_tag_or_one_line():
    variant, tag = find_variant("vit_ls_small_patch16_dinov3.lvd1689m")
    assert (variant.name, tag) == ("vit_ls_small_patch16_dinov3", "lvd1689m")
    assert find_variant("vit_ls_small_patch16_dinov3")[1] is None
    with pytest.raises(
        VariantNameError, match=r"^vit_ls_small_patch16_dinov3 has no pretrained tag 'nope'; its tags: "
    ):
        find_variant("vit_ls_small_patch16_dinov3.nope")
    with pytest.raises(VariantNameError, match=r"^unknown variant 'vit_ls_smal'; did you mean vit_ls_small_"):
        find_variant("vit_ls_smal", what="variant")


def test_every_config_field_names_its_rule_beside_its_default():
    """A field added without a rule would take any value: each init field carries one."""
    missing = [f.name for f in dataclasses.fields(VitLsConfig) if f.init and "rule" not in f.metadata]
    assert missing == []


@pytest.mark.parametrize("name", ["embed_dim", "depth", "num_heads", "num_classes", "num_storage_tokens"])
def test_a_bool_is_not_an_integer_in_any_model_value(name):
    with pytest.raises(ValueError, match=f"{name}: got True; allowed: "):
        VitLsConfig(**{name: True})
