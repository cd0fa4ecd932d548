"""Pretrained loading streams into a model built on the meta device, and ends where timm's own loader does."""

import inspect
import subprocess
import sys

import pytest
import timm
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file
from support import FIXTURES, TINY, assert_fp32_close, build_from_meta_file, eva_reference, max_diff, move_off_init_
from support.hub_server import LocalHub, hub_env
from timm.models import adapt_input_conv, build_model_with_cfg, save_for_hf
from torch.utils._python_dispatch import TorchDispatchMode

import timm_layerscale.loading
from timm_layerscale import VisionTransformerLS, checkpoint_filter_fn

NAME = "vit_ls_small_patch16_dinov3"
RANDOM_OPS = ("normal_", "uniform_", "random_", "bernoulli_", "exponential_", "erfinv_")


def source_model(**kwargs):
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(NAME, **{**TINY, **kwargs})).eval()


def overlay(path, **cfg):
    return dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(path), **cfg))


def timm_loaded(path, cfg=None, **kwargs):
    """What timm's own builder and loader make of the same file (with this package's key conversion)."""
    torch.manual_seed(1)
    return build_model_with_cfg(
        VisionTransformerLS,
        NAME,
        pretrained=True,
        pretrained_cfg=timm.models.get_pretrained_cfg(NAME + ".lvd1689m").to_dict(),
        pretrained_cfg_overlay=dict(file=str(path), **(cfg or {})),
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(feature_cls="getter", out_indices=min(4, kwargs.get("depth", TINY["depth"]))),
        **{**TINY, **kwargs},
    )


class Allocations(TorchDispatchMode):
    """Counts the elements that random fills write and the bytes of the real (not meta) tensors ops create."""

    def __init__(self):
        super().__init__()
        self.random_numel = 0
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in RANDOM_OPS and not args[0].is_meta:  # meta tensors cost nothing
            self.random_numel += args[0].numel()
        elif isinstance(out, torch.Tensor) and not out.is_meta and not func.is_view and not name.endswith("_"):
            self.nbytes += out.numel() * out.element_size()
        return out


def weights_nbytes(model):
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@torch.no_grad()
def test_no_parameter_is_initialised_or_copied_twice(tmp_path):
    source = source_model()
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    with Allocations() as loading:
        model = timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), **TINY)
    assert loading.random_numel == 0
    # One copy of the weights: each tensor read from the mapped file once into the model's own memory.
    assert 0.98 * weights_nbytes(model) <= loading.nbytes <= 1.02 * weights_nbytes(model)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
    # A load that builds a real model first (timm's way) initialises every parameter: this counts them.
    with Allocations() as building:
        timm_loaded(tmp_path / "w.safetensors")
    assert building.random_numel > 0.9 * sum(p.numel() for p in model.parameters())


@torch.no_grad()
def test_only_a_new_head_is_initialised(tmp_path):
    save_file(source_model().state_dict(), tmp_path / "w.safetensors")
    with Allocations() as loading:
        model = timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), num_classes=5, **TINY)
    assert 0 < loading.random_numel <= 2 * 5 * 64  # the head's trunc_normal_ (a draw, then a fix-up), nothing else
    assert model.head.weight.shape == (5, 64) and 0 < model.head.weight.std() < 0.03
    assert torch.equal(model.head.bias, torch.zeros(5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_dtype_is_applied_per_tensor(dtype, tmp_path):
    source = source_model()
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    with Allocations() as loading:
        model = timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), dtype=dtype, **TINY)
    assert loading.nbytes <= 1.02 * weights_nbytes(model)  # never the fp32 model
    for key, value in model.state_dict().items():
        expected = source.state_dict()[key]
        if key.endswith("rope_embed.periods"):  # kept fp32, as model.to(dtype) keeps it
            assert value.dtype == torch.float32 and torch.equal(value, expected)
        else:
            assert value.dtype == dtype and torch.equal(value, expected.to(dtype)), key
    assert model.blocks[0].ls1.gamma.requires_grad
    frozen = timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), freeze_layer_scale=True, **TINY)
    assert not frozen.blocks[0].ls1.gamma.requires_grad and frozen.blocks[0].attn.qkv.weight.requires_grad


@torch.no_grad()
def test_the_weights_are_the_models_own_memory_not_the_files(tmp_path):
    source = source_model()
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    model = timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), **TINY)
    save_file({k: torch.zeros_like(v) for k, v in source.state_dict().items()}, tmp_path / "w.safetensors")
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_state_dict_overlay_wins_over_a_file_as_in_timm(tmp_path):
    source = source_model()
    save_file(move_off_init_(timm.create_model(NAME, **TINY), seed=5).state_dict(), tmp_path / "other.safetensors")
    cfg = dict(state_dict=source.state_dict(), file=str(tmp_path / "other.safetensors"))
    model = timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=cfg, **TINY)
    assert torch.equal(model.cls_token, source.cls_token)


def test_state_dict_sources_are_copied_not_shared():
    source = source_model()
    model = timm.create_model(
        NAME, pretrained=True, pretrained_cfg_overlay=dict(state_dict=source.state_dict()), **TINY
    )
    with torch.no_grad():
        model.cls_token.add_(1.0)
    assert not torch.equal(model.cls_token, source.cls_token)


@pytest.mark.parametrize(
    ("kwargs", "cfg"),
    [
        (dict(num_classes=10), {}),  # a new head
        (dict(num_classes=7), dict(num_classes=7)),  # the file's head, since the pretrained cfg has 7 classes
        (dict(num_classes=10), dict(num_classes=7)),  # a new head: the file's does not fit
        (dict(num_classes=7), dict(num_classes=-1)),  # train.py's --pretrained-path: always a new head
    ],
)
@torch.no_grad()
def test_the_head_follows_timms_loader(kwargs, cfg, tmp_path):
    source = source_model(num_classes=7)
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    model = timm.create_model(NAME, **overlay(tmp_path / "w.safetensors", **cfg), **kwargs, **TINY)
    reference = timm_loaded(tmp_path / "w.safetensors", cfg, **kwargs)
    assert list(model.state_dict()) == list(reference.state_dict())
    new_head = kwargs["num_classes"] != cfg.get("num_classes")
    for key, value in model.state_dict().items():
        if key.startswith("head.") and new_head:
            assert value.shape == reference.state_dict()[key].shape
            assert not torch.equal(value[:7], source.state_dict()[key][: len(value)])
        else:
            assert torch.equal(value, reference.state_dict()[key]), key


@pytest.mark.parametrize(("in_chans", "base_chans"), [(1, 3), (5, 3), (2, 3), (3, 2), (4, 4)])
@torch.no_grad()
def test_input_channels_are_adapted_as_timm_does(in_chans, base_chans, tmp_path, images):
    takes_base = "base_chans" in inspect.signature(adapt_input_conv).parameters
    if base_chans != 3 and not takes_base:
        pytest.skip("this timm adapts from 3 channels only")
    source = source_model(in_chans=base_chans)
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    cfg = dict(input_size=(base_chans, 224, 224))
    model = timm.create_model(NAME, **overlay(tmp_path / "w.safetensors", **cfg), in_chans=in_chans, **TINY)
    weight = source.patch_embed.proj.weight
    expected = adapt_input_conv(in_chans, weight, **({"base_chans": base_chans} if takes_base else {}))
    assert model.patch_embed.proj.weight.shape == (64, in_chans, 16, 16)
    assert torch.equal(model.patch_embed.proj.weight, expected)
    for key, value in model.state_dict().items():
        if key != "patch_embed.proj.weight":
            assert torch.equal(value, source.state_dict()[key]), key
    x = torch.randn(2, in_chans, 32, 48)
    assert model(x).shape == (2, 64)


def test_input_channels_that_cannot_be_adapted_name_the_fix(tmp_path):
    save_file(source_model(in_chans=4).state_dict(), tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match=r"takes 4 input channels and the pretrained cfg says 3: .*in_chans=5; build"):
        timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), in_chans=5, **TINY)


@torch.no_grad()
def test_features_only_after_a_streaming_load(tmp_path, images):
    source = source_model(depth=3)
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    features = timm.create_model(
        NAME, **overlay(tmp_path / "w.safetensors"), features_only=True, **{**TINY, "depth": 3}
    )
    reference = timm_loaded(tmp_path / "w.safetensors", features_only=True, depth=3)
    assert type(features) is type(reference)
    assert features.feature_info.out_indices == reference.feature_info.out_indices == (0, 1, 2)
    for ours, theirs in zip(features(images), reference(images)):
        assert ours.shape == (2, 64, 3, 5) and torch.equal(ours, theirs)
    assert "num_classes" not in features.pretrained_cfg


def test_meta_device_with_pretrained_is_an_error():
    """Raised before any download: the 7B on the meta device never reaches the Hub."""
    with pytest.raises(ValueError, match=r"^pretrained=True loads weights, which a model on the meta device cannot"):
        timm.create_model("vit_ls_7b_patch16_dinov3.lvd1689m", pretrained=True, device="meta")
    model = timm.create_model("vit_ls_7b_patch16_dinov3.lvd1689m", device="meta")
    assert sum(p.numel() for p in model.parameters()) == 6_716_035_072 + 4096 * 2  # + local_cls_norm


@torch.no_grad()
def test_meta_fixture_streams_in_float64():
    model = build_from_meta_file("meta_mlp", dtype=torch.float64)
    stored = load_file(FIXTURES / "meta_mlp.safetensors")
    for key, value in model.state_dict().items():
        expected = stored[key] * stored[f"{key}_mask"] if key.endswith("attn.qkv.bias") else stored[key]  # folded
        assert torch.equal(value, expected if key.endswith("periods") else expected.double()), key


@torch.no_grad()
def test_eva_file_in_bf16_matches_eva(tmp_path):
    eva = eva_reference("mlp")
    save_file(eva.state_dict(), tmp_path / "eva.safetensors")
    model = timm.create_model(
        NAME, **overlay(tmp_path / "eva.safetensors"), dtype=torch.bfloat16, rope_periods_bf16=False, **TINY
    )
    assert torch.equal(model.blocks[1].ls2.gamma, eva.blocks[1].gamma_2.to(torch.bfloat16))
    assert torch.equal(model.blocks[0].attn.qkv.weight, eva.blocks[0].attn.qkv.weight.to(torch.bfloat16))
    x = torch.randn(1, 3, 32, 32)
    assert max_diff(model.float().forward_features(x), eva.forward_features(x)) < 0.1  # bf16 weights


def test_the_progress_bar_shows_only_for_slow_loads(tmp_path, capsys, monkeypatch):
    save_file(source_model().state_dict(), tmp_path / "w.safetensors")
    timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), **TINY)
    assert "loading" not in capsys.readouterr().err
    monkeypatch.setattr(timm_layerscale.loading, "PROGRESS_DELAY_S", 0)
    timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), **TINY)
    assert "loading" in capsys.readouterr().err


HUB_LOADS = """
import sys, timm, timm_layerscale, torch
from safetensors.torch import save_file
x = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))
out = {}
for name in sys.argv[2:]:
    model = timm.create_model(name, pretrained=True, depth=2, rope_periods_bf16=False)
    with torch.no_grad():
        out[name] = model.eval().forward_features(x)
save_file(out, sys.argv[1])
"""


@torch.no_grad()
def test_sharded_tag_and_hf_hub_folders_through_the_hub(tmp_path):
    """A tag whose repo is sharded (index + shards) and an `hf-hub:` repo, through huggingface_hub's client."""
    root = tmp_path / "hub"
    eva = timm.create_model("vit_small_patch16_dinov3_qkvb", depth=2, global_pool="token").eval()
    move_off_init_(eva)
    sharded = root / "timm" / "vit_small_patch16_dinov3_qkvb.lvd1689m"
    sharded.mkdir(parents=True)
    save_torch_state_dict(eva.state_dict(), sharded, max_shard_size=300_000)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    ours = source_model(embed_dim=384, num_heads=6, rope_periods_bf16=False)  # timm 1.0.26 records no model args
    save_for_hf(ours, root / "someone" / "vit-ls-tiny", safe_serialization=True)
    names = ["vit_ls_small_patch16_dinov3.lvd1689m", "hf-hub:someone/vit-ls-tiny"]
    with LocalHub(root) as hub:
        args = [sys.executable, "-c", HUB_LOADS, str(tmp_path / "out.safetensors"), *names]
        result = subprocess.run(args, env=hub_env(hub, tmp_path / "hf_home"), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sum("model-0000" in r and r.startswith("GET") for r in hub.requests) > 1
    out = load_file(tmp_path / "out.safetensors")
    x = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    assert_fp32_close(out[names[0]], eva.forward_features(x))
    # Another process may split the matmuls over other threads: the weights are equal, the sums nearly.
    assert_fp32_close(out[names[1]], ours.forward_features(x))


def test_streamed_parameters_keep_the_models_requires_grad(tmp_path):
    """Parameters the model makes frozen (LayerScale with freeze_layer_scale, the local-crop CLS norm) stay
    frozen when pretrained weights stream in, and every other one stays trainable."""
    save_file(source_model(local_cls_norm=True).state_dict(), tmp_path / "w.safetensors")
    kwargs = dict(TINY, freeze_layer_scale=True, local_cls_norm=True)
    expected = {name: p.requires_grad for name, p in timm.create_model(NAME, **kwargs).named_parameters()}
    assert not expected["blocks.0.ls1.gamma"] and not expected["local_cls_norm.weight"] and expected["cls_token"]
    model = timm.create_model(NAME, **overlay(tmp_path / "w.safetensors"), **kwargs)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == expected
    assert torch.equal(model.blocks[0].ls1.gamma, source_model(local_cls_norm=True).blocks[0].ls1.gamma)
