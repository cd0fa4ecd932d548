"""A model computing RoPE in bf16 (Sapiens2 as released) exports to a graph ONNX Runtime's CPU provider runs, with
bf16's own results: its bf16 arithmetic computed in fp32 between casts (exactly rounded the same), and the
constants torch keeps unrounded (2 pi, the grid's sides) unrounded in the graph too."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import timm
import torch
from safetensors.torch import save_file
from support import move_off_init_, relative_diff

from timm_ls.main import main

SAPIENS2 = "vit_ls_base_patch16_sapiens2"
SHAPE = dict(embed_dim=64, num_heads=4, depth=2)
# (height, width) in pixels at patch 16: small, wide, and one side of 257 patches (a side bf16 cannot hold)
SIZES = [(64, 48), (224, 320), (16, 257 * 16)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Upstream-shaped weights in a file, exported by the command without --check."""
    tmp = tmp_path_factory.mktemp("bf16_rope")
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model(SAPIENS2, **SHAPE, num_kv_heads=[4, 2], num_classes=0)).eval()
    assert model.config.rope_dtype == "bf16"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / "w.safetensors")
    size = [f"{k}={v}" for k, v in SHAPE.items()]
    code = main(
        ["export", str(tmp / "w.safetensors"), str(tmp / "m.onnx"), "--model", SAPIENS2, "--model-kwargs", *size]
    )
    assert code == 0
    return tmp, model


def test_onnx_runtimes_cpu_provider_loads_it(exported):
    tmp, _ = exported
    ort.InferenceSession(str(tmp / "m.onnx"), providers=["CPUExecutionProvider"])
    graph = onnx.load(str(tmp / "m.onnx")).graph
    assert any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.BFLOAT16 for n in graph.node)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@torch.no_grad()
def test_its_outputs_are_bf16_ropes_not_fp32_ropes(exported, size):
    tmp, model = exported
    session = ort.InferenceSession(str(tmp / "m.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    got = torch.from_numpy(session.run(None, {"pixel_values": x.numpy()})[0])
    assert relative_diff(got, model(x)) < 2e-5  # measured 6e-6 at most; a bf16 2 pi or side moves it 2e-4
    in_fp32 = timm.create_model(SAPIENS2, **SHAPE, num_kv_heads=[4, 2], num_classes=0, rope_dtype="fp32").eval()
    in_fp32.load_state_dict(model.state_dict())
    assert relative_diff(got, in_fp32(x)) > 5e-5  # the graph is not RoPE computed in fp32


def test_the_command_checks_it_in_onnx_runtime(exported, capsys):
    tmp, _ = exported
    size = [f"{k}={v}" for k, v in SHAPE.items()]
    argv = ["export", str(tmp / "w.safetensors"), str(tmp / "c.onnx"), "--model", SAPIENS2, "--check"]
    assert main([*argv, "--model-kwargs", *size]) == 0
    assert "ONNX Runtime matches PyTorch fp32" in capsys.readouterr().out
