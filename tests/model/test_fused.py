"""RoPE rotates q and k in the dtype of its tables: against the reference rotations (q and k cast to the tables'
dtype, `x * cos + rotate_half(x) * sin`, cast back), the in-place form bf16/fp16 inference takes, and the path
a bf16 model takes through scripting and compiling."""

import warnings

import pytest
import timm
import torch
from support import TINY, move_off_init_

from timm_layerscale.layers import RopeEmbedding, apply_rope
from timm_layerscale.layers.attention import rotate_heads
from timm_layerscale.layers.rope import apply_rope_into

LOW = [torch.bfloat16, torch.float16]
PREFIX, GRID, HEADS, HEAD_DIM = 5, (6, 7), 3, 16


def qkv_and_rope(dtype: torch.dtype, seed: int = 0, table: str = "fp32"):
    """A qkv output `[batch, tokens, 3 * heads, head_dim]` at activation scale, and the (signed sin, cos)."""
    rope = RopeEmbedding(HEAD_DIM, num_prefix_tokens=PREFIX, round_periods_to_bf16=False, dtype=table)(*GRID)
    tokens = PREFIX + GRID[0] * GRID[1]
    qkv = torch.randn(4, tokens, 3 * HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)) * 4
    return qkv.to(dtype), rope


def reference_rope(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """The reference rotation: cast to the tables' dtype, `x * cos + rotate_half(x) * sin`, cast back."""
    y = x.to(sin.dtype)
    y1, y2 = y.chunk(2, dim=-1)
    sin = sin[..., HEAD_DIM // 2 :].repeat(*([1] * (sin.ndim - 1)), 2)  # undo the sign folded into our sin
    return (y * cos + torch.cat([-y2, y1], dim=-1) * sin).to(x.dtype)


def heads(rope):
    sin, cos = rope
    return sin[:, None], cos[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("table", ["fp32", "bf16"])
def test_rotation_on_the_strided_qk_slice_is_the_reference_in_the_tables_dtype(dtype, table):
    qkv, rope = qkv_and_rope(dtype, table=table)
    qk = qkv[:, :, : 2 * HEADS]
    assert not qk.is_contiguous()
    rotated = apply_rope(qk, heads(rope))
    assert rotated.dtype == dtype
    assert torch.equal(rotated, reference_rope(qk, *heads(rope)))
    in_tables = qk[:, :PREFIX].to(rope[1].dtype).to(dtype)
    assert torch.equal(rotated[:, :PREFIX], in_tables)  # prefix tokens are not rotated, only cast
    with torch.no_grad():  # the dispatch: exact unless `x` is narrower than the tables
        if table == "bf16" or dtype == torch.float32:
            assert torch.equal(rotate_heads(qk.clone(), rope), rotated)


def test_bf16_tables_round_every_step_where_fp32_tables_do_not():
    qkv, rope32 = qkv_and_rope(torch.float32, seed=3)
    _, rope16 = qkv_and_rope(torch.float32, seed=3, table="bf16")
    qk = qkv[:, :, : 2 * HEADS]
    in_bf16 = apply_rope(qk, heads(rope16))
    assert torch.equal(in_bf16, in_bf16.to(torch.bfloat16).float())  # bf16 values
    assert not torch.equal(in_bf16, apply_rope(qk, heads(rope32)))


@pytest.mark.parametrize("dtype", LOW)
def test_in_place_rotation_is_the_exact_value_or_one_unit_off(dtype):
    qkv, rope = qkv_and_rope(dtype)
    qk = qkv[:, :, : 2 * HEADS]
    exact = apply_rope(qk, heads(rope))
    fused = apply_rope_into(qk.clone(), heads(rope))
    assert fused.dtype == dtype and fused.shape == qk.shape
    spacing = torch.finfo(dtype).eps * exact.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((fused.float() - exact.float()).abs() <= spacing).all()
    assert (fused != exact).float().mean() < 0.01  # rare last-unit differences, never a wrong rotation
    assert torch.equal(fused[:, :PREFIX], qk[:, :PREFIX])


@pytest.mark.parametrize("dtype", LOW)
def test_in_place_rotation_is_as_close_to_the_exact_rotation(dtype):
    qkv, rope = qkv_and_rope(dtype, seed=1)
    qk = qkv[:, :, : 2 * HEADS]
    sin, cos = heads(rope)
    exact = reference_rope(qk.double(), sin.double(), cos.double())
    errors = [(f(qk.clone(), (sin, cos)).double() - exact).norm() for f in (apply_rope, apply_rope_into)]
    assert errors[1] <= errors[0] * 1.01


@pytest.mark.parametrize("dtype", LOW)
def test_inference_writes_the_rotation_back_into_qkv_and_training_does_not(dtype):
    qkv, rope = qkv_and_rope(dtype, seed=7)
    expected = apply_rope_into(qkv[:, :, : 2 * HEADS].clone(), heads(rope))
    v = qkv[:, :, 2 * HEADS :].clone()
    with torch.no_grad():
        rotated = rotate_heads(qkv[:, :, : 2 * HEADS], rope)
    assert rotated.data_ptr() == qkv.data_ptr() and torch.equal(rotated, expected)
    assert torch.equal(qkv[:, :, : 2 * HEADS], expected) and torch.equal(qkv[:, :, 2 * HEADS :], v)

    qkv, rope = qkv_and_rope(dtype, seed=7)
    before = qkv.clone()
    leaf = qkv.requires_grad_()
    rotated = rotate_heads(leaf[:, :, : 2 * HEADS], rope)
    assert torch.equal(rotated, reference_rope(before[:, :, : 2 * HEADS], *heads(rope)))
    assert torch.equal(qkv.detach(), before)
    rotated.float().sum().backward()
    assert leaf.grad is not None and not leaf.grad[:, :, 2 * HEADS :].any()  # v gets no gradient from RoPE


def test_bf16_model_in_inference_is_within_rounding_of_the_model_with_autograd():
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=0, **TINY)).eval()
    x = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model(x)
        model.to(torch.bfloat16)
        in_place = model(x.to(torch.bfloat16)).float()
    exact = model(x.to(torch.bfloat16)).detach().float()  # autograd on: the exact rotation, nothing in place
    scale = reference.abs().max()
    assert (in_place - reference).abs().max() <= 0.05 * scale
    assert (in_place - exact).abs().max() <= 0.02 * scale
    assert not torch.equal(in_place, reference)


def test_bf16_in_place_path_is_captured_by_torchscript_and_compiled_out_of_place():
    """TorchScript keeps the in-place rotation; torch.compile takes the out-of-place one (which inductor fuses),
    so a compiled model computes what the model with autograd does."""
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=0, **TINY)).eval()
    model.to(torch.bfloat16)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with_autograd = model(x).detach()
    with torch.no_grad():
        eager = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated in torch, still supported
            scripted = torch.jit.script(model)
        assert torch.equal(scripted(x), eager)
        assert torch.equal(torch.compile(model, backend="eager", fullgraph=True)(x), with_autograd)


@pytest.mark.parametrize("dtype", LOW)
def test_a_compiled_rotation_writes_nothing_back_into_qkv(dtype):
    qkv, rope = qkv_and_rope(dtype, seed=4)
    before = qkv.clone()
    rotate = torch.compile(lambda t: rotate_heads(t[:, :, : 2 * HEADS], rope), backend="eager", fullgraph=True)
    with torch.no_grad():
        rotated = rotate(qkv)
    assert torch.equal(qkv, before)
    assert torch.equal(rotated, apply_rope(before[:, :, : 2 * HEADS], heads(rope)))


@pytest.mark.parametrize("dtype", LOW)
def test_a_batch_rotated_image_by_image_is_the_whole_batch_rotated(dtype):
    """Eager on a CPU the in-place rotation goes one image at a time: the same bits as one image alone, with
    one grid's tables or a NaFlex batch's own tables per image."""
    qkv, rope = qkv_and_rope(dtype, seed=3)
    qk = qkv[:, :, : 2 * HEADS]
    shared = heads(rope)
    batch = apply_rope_into(qk.clone(), shared)
    for i in range(qk.shape[0]):
        assert torch.equal(batch[i : i + 1], apply_rope_into(qk[i : i + 1].clone(), shared))
    # one grid per image: the tables of a second grid for every other image
    other = RopeEmbedding(HEAD_DIM, num_prefix_tokens=PREFIX, round_periods_to_bf16=False)(*reversed(GRID))
    per_image = [torch.stack([t, u, t, u]) for t, u in zip(shared, heads(other), strict=True)]
    batch = apply_rope_into(qk.clone(), tuple(per_image))
    for i, tables in enumerate((shared, heads(other)) * 2):
        assert torch.equal(batch[i : i + 1], apply_rope_into(qk[i : i + 1].clone(), tables))
    assert not torch.equal(batch[1:2], apply_rope_into(qk[1:2].clone(), shared))


def test_a_bf16_model_traced_at_one_batch_runs_at_another():
    """`torch.jit.trace` records one rotation for the whole batch, not the eager path's loop over its images."""
    model = move_off_init_(timm.create_model("vit_ls_small_patch16_dinov3", num_classes=0, **TINY))
    model = model.to(torch.bfloat16).eval()
    x2, x3 = (torch.randn(n, 3, 32, 48, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16) for n in (2, 3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings on Python values it records as constants
        traced = torch.jit.trace(model, x2)
        assert torch.equal(traced(x3), model(x3))
