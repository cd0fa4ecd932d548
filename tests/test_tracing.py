"""The forward under every graph capture timm users reach for: FX, TorchScript, torch.compile, torch.export.

Each captured graph must give the eager outputs exactly, also at image sizes it was not captured with.
"""

import io
import warnings

import pytest
import timm
import torch
from conftest import TINY, max_diff, move_off_init_
from timm.models import get_notrace_functions, get_notrace_modules
from torch.export import Dim, export
from torchvision.models.feature_extraction import create_feature_extractor

# Every option that changes the forward's code path: SwiGLU, untied norms, RoPE augmentation, sample drop.
FULL = dict(
    ffn_layer="swiglu", cls_norm=True, rope_rescale_coords=2.0, drop_path_rate=0.5, stochastic_depth="sample_drop"
)
SIZES = [(2, 3, 48, 80), (3, 3, 32, 16)]


def tiny(**kwargs):
    torch.manual_seed(0)
    return move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=5, **{**TINY, **kwargs})).eval()


def inputs(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


def fx_trace(model):
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
    return create_feature_extractor(model, return_nodes=["head"], tracer_kwargs=tracer_kwargs)


@pytest.mark.parametrize("normalize_coords", ["separate", "max"])
@torch.no_grad()
def test_fx_graph_works_at_any_size(normalize_coords):
    model = tiny(rope_normalize_coords=normalize_coords)
    traced = fx_trace(model)
    for shape in SIZES:
        assert max_diff(traced(inputs(shape))["head"], model(inputs(shape))) == 0
    with pytest.raises(ValueError, match="resize or crop it to 32x16"):
        traced(torch.randn(1, 3, 40, 20))


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode:UserWarning")
def test_fx_graph_trains_with_sample_drop_and_rope_augmentation():  # the train graph has more nodes: expected
    model = tiny(**FULL).train()
    traced = fx_trace(model)
    torch.manual_seed(0)
    out = traced(inputs(SIZES[0]))["head"]
    torch.manual_seed(0)
    assert max_diff(out, model(inputs(SIZES[0]))) == 0  # the same random draws, in the same order
    out.sum().backward()


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
