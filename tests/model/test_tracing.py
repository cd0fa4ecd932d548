"""The forward under every graph capture timm users reach for: FX, TorchScript, torch.compile, torch.export.

FX as users call it: `torch.fx.symbolic_trace(model)` and torchvision's `create_feature_extractor(model,
return_nodes=...)` with no extra arguments, and timm's own feature extractor. Each captured graph must give
the eager outputs exactly, also at image sizes it was not captured with (FX graphs are symbolic: no size is
fixed when tracing), and raise the eager size errors.
"""

import io
import warnings

import pytest
import timm
import torch
from support import TINY, VARIANT, max_diff, move_off_init_
from torch.export import Dim, export
from torchvision.models.feature_extraction import create_feature_extractor

# Every option that changes the forward's code path: SwiGLU, untied norms, RoPE augmentation, sample drop.
FULL = dict(
    ffn_layer="swiglu", cls_norm=True, rope_rescale_coords=2.0, drop_path_rate=0.5, stochastic_depth="sample_drop"
)
SIZES = [(2, 3, 48, 80), (3, 3, 32, 16)]


def tiny(ffn="mlp", **kwargs):
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(VARIANT[ffn], num_classes=5, **{**TINY, **kwargs})).eval()


def inputs(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


def fx_trace(model):
    return create_feature_extractor(model, return_nodes=["head"])  # torchvision's, as users call it


def size_error(forward, shape):
    with pytest.raises(ValueError) as caught:
        forward(torch.randn(shape))
    return str(caught.value)


@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
@pytest.mark.parametrize("normalize_coords", ["separate", "max", "min"])
@torch.no_grad()
def test_plain_symbolic_trace_works_at_any_size(ffn, normalize_coords):
    model = tiny(ffn, rope_normalize_coords=normalize_coords)
    traced = torch.fx.symbolic_trace(model)
    for shape in SIZES:
        assert max_diff(traced(inputs(shape)), model(inputs(shape))) == 0
    for shape in [(1, 3, 40, 20), (1, 3, 8, 32)]:  # not a multiple; below one patch
        assert size_error(traced, shape) == size_error(model, shape)
    assert "resize or crop it to 32x16" in size_error(model, (1, 3, 40, 20))
    assert "resize it to at least 16x16" in size_error(model, (1, 3, 8, 32))


@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
@torch.no_grad()
def test_torchvision_feature_extractor_without_arguments(ffn):
    model = tiny(ffn, rope_normalize_coords="min")
    extractor = create_feature_extractor(model, return_nodes=["blocks.1", "norm", "head"])
    for shape in SIZES:
        out = extractor(inputs(shape))
        assert max_diff(out["norm"], model.forward_features(inputs(shape))) == 0
        assert max_diff(out["head"], model(inputs(shape))) == 0
        _, (block,) = model.forward_intermediates(inputs(shape), indices=[1], output_fmt="NLC")
        assert max_diff(out["blocks.1"][:, model.num_prefix_tokens :], block) == 0
    with pytest.raises(ValueError, match="resize or crop it to 32x16"):
        extractor(torch.randn(1, 3, 40, 20))


@torch.no_grad()
def test_timm_feature_extractor_and_a_fixed_size_graph():
    model = tiny(dynamic_img_size=False, img_size=(48, 80))
    extractor = timm.models.create_feature_extractor(model, return_nodes=["norm"])
    assert max_diff(extractor(inputs(SIZES[0]))["norm"], model.forward_features(inputs(SIZES[0]))) == 0
    traced = torch.fx.symbolic_trace(model)
    assert max_diff(traced(inputs(SIZES[0])), model(inputs(SIZES[0]))) == 0
    with pytest.raises(AssertionError, match=r"doesn't match model \(48\)"):
        traced(inputs(SIZES[1]))


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode:UserWarning")
@pytest.mark.parametrize("capture", ["symbolic_trace", "torchvision"])
def test_fx_graph_trains_with_sample_drop_and_rope_augmentation(capture):  # the train graph has more nodes
    model = tiny(**FULL).train()
    traced = torch.fx.symbolic_trace(model) if capture == "symbolic_trace" else fx_trace(model)
    assert not [n.target for n in traced.graph.nodes if n.op == "get_attr" and "constant" in n.target]  # none frozen
    for shape in SIZES:
        torch.manual_seed(0)
        out = traced(inputs(shape))
        out = out if capture == "symbolic_trace" else out["head"]
        torch.manual_seed(0)
        assert max_diff(out, model(inputs(shape))) == 0  # the same random draws, in the same order
    out.sum().backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None


def test_torchscript_matches_eager_and_round_trips():
    model = tiny(**FULL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated in torch, still supported
        scripted = torch.jit.script(model)
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
    with torch.no_grad():
        for shape in SIZES:
            assert max_diff(loaded(inputs(shape)), model(inputs(shape))) == 0
    loaded.train()
    loaded(inputs(SIZES[0])).sum().backward()  # sample drop and per-block RoPE draws run scripted too


def test_torch_compile_captures_one_graph_in_eval_and_train():
    model = tiny(**FULL)
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)  # a graph break raises
    with torch.no_grad():
        for shape in SIZES:
            assert max_diff(compiled(inputs(shape)), model(inputs(shape))) == 0
    model.train()
    compiled(inputs(SIZES[0])).sum().backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None


@torch.no_grad()
def test_torch_export_with_dynamic_batch_and_sides():
    model = tiny(**FULL)
    dynamic = {"x": {0: Dim("batch"), 2: 16 * Dim("height"), 3: 16 * Dim("width")}}
    exported = export(model, (inputs(SIZES[0]),), dynamic_shapes=dynamic).module()
    for shape in [(2, 3, 48, 80), (1, 3, 64, 160), (3, 3, 32, 48)]:  # sides of one patch are specialised away
        assert max_diff(exported(inputs(shape)), model(inputs(shape))) == 0
