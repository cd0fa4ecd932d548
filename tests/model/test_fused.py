"""The fewer-pass RoPE of bf16/fp16 activations against the plain path it replaces (Meta's formula), and
the dispatch that keeps fp32 on the plain path, exact to Meta."""

import warnings

import pytest
import timm
import torch
from support import TINY, move_off_init_

from timm_layerscale.layers import RopeEmbedding, apply_rope
from timm_layerscale.layers import attention as attention_module
from timm_layerscale.layers.attention import rotate_queries_keys
from timm_layerscale.layers.rope import apply_rope_low_precision

LOW = [torch.bfloat16, torch.float16]
PREFIX, GRID, HEADS, HEAD_DIM = 5, (6, 7), 3, 16


def qkv_and_rope(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A qkv output `[batch, tokens, 3, heads, head_dim]` at activation scale, and the fp32 (sin, cos)."""
    rope = RopeEmbedding(HEAD_DIM, num_prefix_tokens=PREFIX, round_periods_to_bf16=False)(*GRID)
    tokens = PREFIX + GRID[0] * GRID[1]
    qkv = torch.randn(4, tokens, 3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)) * 4
    return qkv.to(dtype), rope


def meta_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Meta's rope_apply: upcast to the rope's dtype, `x * cos + rotate_half(x) * sin`, cast back."""
    x32 = x.to(sin.dtype)
    x1, x2 = x32.chunk(2, dim=-1)
    sin = sin[..., HEAD_DIM // 2 :].repeat(*([1] * (sin.ndim - 1)), 2)  # undo the sign folded into our sin
    return (x32 * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def broadcast(rope):
    sin, cos = rope
    return sin[:, None, None], cos[:, None, None]


def test_plain_rope_on_the_strided_qk_slice_is_metas_exactly():
    qkv, rope = qkv_and_rope(torch.float32)
    qk = qkv[:, :, :2]
    assert not qk.is_contiguous()
    assert torch.equal(apply_rope(qk, broadcast(rope)), meta_rope(qk, *broadcast(rope)))


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_rope_is_the_plain_value_or_one_unit_off(dtype):
    qkv, rope = qkv_and_rope(dtype)
    qk = qkv[:, :, :2]
    plain, fused = apply_rope(qk, broadcast(rope)), apply_rope_low_precision(qk, broadcast(rope))
    assert fused.dtype == dtype and fused.shape == qk.shape
    assert torch.equal(plain, meta_rope(qk, *broadcast(rope)))
    spacing = torch.finfo(dtype).eps * plain.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((fused.float() - plain.float()).abs() <= spacing).all()
    assert (fused != plain).float().mean() < 0.01  # rare last-unit differences, never a wrong rotation
    assert torch.equal(fused[:, :PREFIX], qk[:, :PREFIX])  # prefix tokens are not rotated


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_rope_is_as_close_to_the_exact_rotation(dtype):
    qkv, rope = qkv_and_rope(dtype, seed=1)
    qk = qkv[:, :, :2]
    sin, cos = broadcast(rope)
    exact = meta_rope(qk.double(), sin.double(), cos.double())
    errors = [(f(qk, (sin, cos)).double() - exact).norm() for f in (apply_rope, apply_rope_low_precision)]
    assert errors[1] <= errors[0] * 1.01


def test_dispatch_keeps_fp32_on_metas_path_and_low_precision_on_the_fused_one(monkeypatch):
    qkv, rope = qkv_and_rope(torch.float32)
    qk = qkv[:, :, :2]
    # On CPUs that fuse multiply-adds the fused form differs from Meta's in fp32: the dispatch must not take it.
    assert torch.equal(rotate_queries_keys(qk, rope), meta_rope(qk, *broadcast(rope)))
    taken = []
    for name in ("apply_rope", "apply_rope_low_precision"):
        original = getattr(attention_module, name)
        monkeypatch.setattr(
            attention_module, name, lambda x, r, f=original, n=name, **kw: taken.append(n) or f(x, r, **kw)
        )
    for dtype in (torch.float32, *LOW):
        qkv, rope = qkv_and_rope(dtype, seed=2)
        assert rotate_queries_keys(qkv[:, :, :2], rope).dtype == dtype
    assert taken == ["apply_rope", "apply_rope_low_precision", "apply_rope_low_precision"]


@pytest.mark.parametrize("dtype", LOW)
def test_inference_writes_the_rotation_back_into_qkv_and_training_does_not(dtype):
    qkv, rope = qkv_and_rope(dtype, seed=7)
    expected = apply_rope_low_precision(qkv[:, :, :2], broadcast(rope))
    v = qkv[:, :, 2].clone()
    with torch.no_grad():
        rotated = rotate_queries_keys(qkv[:, :, :2], rope)
    assert rotated.data_ptr() == qkv.data_ptr() and torch.equal(rotated, expected)
    assert torch.equal(qkv[:, :, :2], expected) and torch.equal(qkv[:, :, 2], v)

    qkv, rope = qkv_and_rope(dtype, seed=7)
    before = qkv.clone()
    leaf = qkv.requires_grad_()
    rotated = rotate_queries_keys(leaf[:, :, :2], rope)
    assert torch.equal(rotated, expected) and torch.equal(qkv.detach(), before)
    rotated.float().sum().backward()
    assert leaf.grad is not None


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_rope_trains_like_the_plain_path(dtype):
    qkv, rope = qkv_and_rope(dtype, seed=3)
    weights = torch.randn(qkv[:, :, :2].shape, generator=torch.Generator().manual_seed(4))
    grads = []
    for rotate in (apply_rope, apply_rope_low_precision):
        leaf = qkv.clone().requires_grad_()
        (rotate(leaf[:, :, :2], broadcast(rope)).float() * weights).sum().backward()
        grads.append(leaf.grad.float())
    assert not grads[0][:, :, 2].any() and not grads[1][:, :, 2].any()  # v gets no gradient from RoPE
    scale = grads[0].abs().max()
    assert (grads[1] - grads[0]).abs().max() <= 2 * torch.finfo(dtype).eps * scale
    assert grads[0][:, PREFIX:].abs().max() > 0


def test_bf16_model_rotates_through_the_fused_path(monkeypatch):
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=0, **TINY)).eval()
    x = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model(x)
        model.to(torch.bfloat16)
        calls = []

        def counted(qk, rope, out=None):
            calls.append(qk.dtype)
            return apply_rope_low_precision(qk, rope, out=out)

        monkeypatch.setattr(attention_module, "apply_rope_low_precision", counted)
        fused = model(x.to(torch.bfloat16)).float()
        monkeypatch.setattr(
            attention_module, "apply_rope_low_precision", lambda qk, rope, out=None: apply_rope(qk, rope)
        )
        plain = model(x.to(torch.bfloat16)).float()
    assert calls == [torch.bfloat16] * TINY["depth"]
    scale = reference.abs().max()
    assert (fused - reference).abs().max() <= 0.05 * scale
    assert (fused - plain).abs().max() <= 0.02 * scale


def test_bf16_fused_path_is_captured_by_torchscript_and_torch_compile():
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=0, **TINY)).eval()
    model.to(torch.bfloat16)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated in torch, still supported
            scripted = torch.jit.script(model)
        assert torch.equal(scripted(x), eager)
        assert torch.equal(torch.compile(model, backend="eager", fullgraph=True)(x), eager)
