"""train.py's `--torchscript`: a scripted model trains, then validates under `torch.inference_mode()`.

TorchScript's profiling executor specialises the graph after a few runs; a model that trained a few SGD
steps then evaluated under inference_mode failed inside the interpreter ("Inference tensors cannot be saved
for backward") before the RoPE was built without lists of tensors. timm's eva passes the same test.
"""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from support import EVA, TINY, assert_fp32_close, move_off_init_

# Every option that changes the scripted code path: SwiGLU, untied norms, RoPE augmentation, sample drop.
FULL = dict(
    ffn_layer="swiglu", cls_norm=True, rope_rescale_coords=2.0, drop_path_rate=0.2, stochastic_depth="sample_drop"
)
SIZES = [(4, 3, 32, 48), (2, 3, 48, 16)]


def scripted(model: torch.nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated in torch, still supported
        return torch.jit.script(model)


def images(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


def train_steps(model: torch.nn.Module, steps: int) -> None:
    """SGD steps as train.py takes them (the profiling executor optimises the graph after the first runs)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for step in range(steps):
        x = images(SIZES[step % 2])
        F.cross_entropy(model(x), torch.arange(len(x)) % 5).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("options", [{}, FULL], ids=["default", "full"])
def test_scripted_model_validates_under_inference_mode_after_training(options):
    torch.manual_seed(0)
    eager = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=5, **TINY, **options))
    script = scripted(eager)
    train_steps(script, 6)
    eager.load_state_dict(script.state_dict())
    eager.eval()
    with torch.inference_mode():
        for shape in SIZES:
            assert_fp32_close(script(images(shape)), eager(images(shape)), what=str(shape))


def test_timm_eva_passes_the_same_check():
    """The anchor: the same steps and check on timm's eva (so the test asks nothing TorchScript cannot give)."""
    torch.manual_seed(0)
    eva = move_off_init_(timm.create_model(EVA["mlp"], num_classes=5, global_pool="token", **TINY))
    script = scripted(eva)
    train_steps(script, 6)
    with torch.inference_mode():
        assert script(images(SIZES[0])).shape == (4, 5)


@torch.no_grad()
def test_scripted_equals_eager_on_the_same_weights():
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=5, **TINY, **FULL)).eval()
    script = scripted(model)
    for shape in SIZES:
        assert torch.equal(script(images(shape)), model(images(shape)))
        assert torch.equal(script.forward_features(images(shape)), model.forward_features(images(shape)))
