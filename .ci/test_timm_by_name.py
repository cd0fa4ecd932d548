"""timm's forward_intermediates and pruning contract tests, run on the vit_ls variants by name.

timm's tests/test_models.py picks the models for these tests by the timm module that defines them, so a
plug-in's models never reach them. This file calls the same test functions on ours. TIMM_TEST_MODELS is the
path of tests/test_models.py from the source distribution of the timm version under test.
"""

import importlib.util
import inspect
import os

import pytest
import timm

import timm_layerscale  # noqa: F401  (registers the variants)

VARIANTS = (
    "vit_ls_small_patch16_dinov3",
    "vit_ls_small_plus_patch16_dinov3",
    "vit_ls_tiny_patch16_dinov3",
    "vit_ls_small_patch16_lingbot",
    "vit_ls_base_patch16_sapiens2",
)
TESTS = (
    "test_model_forward_intermediates_features",
    "test_model_forward_intermediates",
    "test_prune_intermediate_layers_contract",  # timm 1.0.27 and newer
)


def load_timm_tests():
    spec = importlib.util.spec_from_file_location("timm_test_models", os.environ["TIMM_TEST_MODELS"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


timm_tests = load_timm_tests()


@pytest.mark.parametrize("model_name", VARIANTS)
@pytest.mark.parametrize("test_name", TESTS)
def test_timm_contract(test_name, model_name):
    test = getattr(timm_tests, test_name, None)
    if test is None:
        pytest.skip(f"the tests of timm {timm.__version__} have no {test_name}")
    batch = {"batch_size": 1} if "batch_size" in inspect.signature(test).parameters else {}
    test(model_name, **batch)
