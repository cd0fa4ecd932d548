"""Meta's layer sets by name (BackboneLayersSet in dinov3/eval/segmentation/models/__init__.py): the numbers
Meta's docstring and code give, and every place that picks blocks taking the names."""

from __future__ import annotations

import pytest
import timm
import torch
from support import TINY, move_off_init_

from timm_layerscale.config import feature_layers
from timm_layerscale.export.errors import ExportError
from timm_layerscale.export.graph import parse_outputs

NAME = "vit_ls_small_patch16_dinov3"


@pytest.mark.parametrize(
    ("name", "depth", "blocks"),
    [
        ("four_even", 12, [2, 5, 8, 11]),
        ("FOUR_EVEN_INTERVALS", 12, [2, 5, 8, 11]),
        ("four_even_intervals", 40, [9, 19, 29, 39]),
        ("four_even", 24, [4, 11, 17, 23]),  # the paper's, not the formula's 5, 11, 17, 23
        ("four_even", 32, [7, 15, 23, 31]),
        ("four_even", 5, [0, 1, 2, 3]),
        ("four_even", 3, [0, 1, 2]),
        ("four_even", 1, [0]),
        ("last_four", 12, [8, 9, 10, 11]),
        ("FOUR_LAST", 24, [20, 21, 22, 23]),
        ("last_four", 2, [0, 1]),
        ("last", 12, [11]),
        ("LAST", 1, [0]),
    ],
)
def test_names_give_meta_s_blocks(name, depth, blocks):
    assert feature_layers(name, depth) == blocks


def test_numbers_pass_through_and_an_unknown_name_is_one_line():
    assert feature_layers([1, 3], 12) == [1, 3] and feature_layers(4, 12) == 4 and feature_layers(None, 12) is None
    with pytest.raises(ValueError, match="got 'even'; allowed: block indices or one of last, last_four"):
        feature_layers("even", 12)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(NAME, **{**TINY, "depth": 12})).eval()


@pytest.mark.parametrize(
    ("name", "blocks"), [("four_even", [2, 5, 8, 11]), ("last", [11]), ("four_last", [8, 9, 10, 11])]
)
def test_every_entry_point_takes_the_names(model, name, blocks, images):
    with torch.no_grad():
        named = model.forward_intermediates(images, indices=name, intermediates_only=True)
        numbered = model.forward_intermediates(images, indices=blocks, intermediates_only=True)
        assert len(named) == len(blocks) and all(torch.equal(a, b) for a, b in zip(named, numbered))
        layers = model.get_intermediate_layers(images, n=name)
        assert all(torch.equal(a, b) for a, b in zip(layers, model.get_intermediate_layers(images, n=blocks)))
    assert parse_outputs(f"features:{name}", 12) == ("features", blocks)


def test_features_only_lists_the_named_blocks(model, images):
    features = timm.create_model(NAME, features_only=True, out_indices="four_even_intervals", **{**TINY, "depth": 12})
    assert features.feature_info.out_indices == (2, 5, 8, 11)
    kept = features.model.state_dict()  # the getter wraps the model as .model, its final norm pruned
    features.model.load_state_dict({k: v for k, v in model.state_dict().items() if k in kept})
    with torch.no_grad():
        got = features(images)
        expected = model.forward_intermediates(images, indices=[2, 5, 8, 11], intermediates_only=True)
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, expected))
    default = timm.create_model(NAME, features_only=True, **{**TINY, "depth": 12})
    named = timm.create_model(NAME, features_only=True, out_indices="last_four", **{**TINY, "depth": 12})
    assert default.feature_info.out_indices == named.feature_info.out_indices == (8, 9, 10, 11)
    shallow = timm.create_model(NAME, features_only=True, out_indices="four_even", **TINY)
    assert shallow.feature_info.out_indices == (0, 1)
    # timm's hook wrapper reads out_indices as numbers: only the entry point's resolution makes a name work there
    hooks = timm.create_model(NAME, features_only=True, feature_cls="hook", out_indices="four_even", **TINY)
    assert hooks.feature_info.out_indices == (0, 1) and len(hooks(images)) == 2


def test_export_takes_names_beside_indices_and_refuses_an_unknown_one():
    assert parse_outputs("features:last,2", 12) == ("features", [2, 11])
    with pytest.raises(ExportError, match="or one of last, last_four"):
        parse_outputs("features:middle", 12)
    with pytest.raises(ExportError):
        parse_outputs("features:last,11", 12)  # the same block twice
