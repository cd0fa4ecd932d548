"""Copies and dtype conversions in one bf16 inference forward: ours against a plain timm ViT of the same width,
depth, norm and MLP (learned position embedding, no RoPE, no storage tokens), as a user casts both
(`model.to(torch.bfloat16).eval()`, bf16 input, `torch.inference_mode()`).

The ops are counted at kernel level (support/op_count.py): `copy_`, `clone`, `_to_copy`, and the ops whose
floating operands differ in dtype (each converts one of them inside the kernel). In its blocks, ours may
add at most `PER_BLOCK` of them per block to what the plain ViT's blocks run; what runs once per forward
(patch embedding, RoPE tables, final norm) is counted and reported beside them, not bounded.
"""

import pytest
import timm
import torch
from support import move_off_init_
from support.op_count import MIXED_DTYPE, MOVES, count_ops
from timm.layers import SwiGLU
from torch import nn

PER_BLOCK = 2
DEPTH = 3
IMAGE = (48, 64)  # 3x4 patches
SMALL = dict(embed_dim=64, num_heads=4, depth=DEPTH)
PLAIN_MLP: dict = {}
PLAIN_SAPIENS2 = dict(norm_layer="rmsnorm", qk_norm=True, mlp_layer=SwiGLU, act_layer=nn.SiLU, mlp_ratio=6)
# name -> (our variant, its arguments at test size, the plain ViT's arguments beyond width and depth)
CASES = {
    "dinov3_small": ("vit_ls_small_patch16_dinov3", {}, PLAIN_MLP),
    "eupe_tiny": ("vit_ls_tiny_patch16_dinov3", {}, PLAIN_MLP),
    "lingbot_small": ("vit_ls_small_patch16_lingbot", {}, PLAIN_MLP),
    # grouped k/v in the middle block, qk-norm, RMSNorm, SwiGLU, RoPE tables in bf16
    "sapiens2": ("vit_ls_base_patch16_sapiens2", dict(num_kv_heads=[4, 2, 4], rope_dtype="bf16"), PLAIN_SAPIENS2),
}


def bf16(model: nn.Module) -> nn.Module:
    return move_off_init_(model).to(torch.bfloat16).eval()


def describe(counter) -> str:
    sources = [f"    {n}x {op}: {site}" for op, by_site in counter.sources.items() for site, n in by_site.items()]
    return f"in the blocks {counter.moves(in_blocks=True)}, whole forward {counter.moves()}\n" + "\n".join(sources)


@pytest.mark.parametrize("name", CASES)
def test_ours_adds_at_most_two_copies_or_conversions_per_block_to_a_plain_vit(name):
    variant, extra, plain_extra = CASES[name]
    ours = bf16(timm.create_model(variant, num_classes=0, **SMALL, **extra))
    plain = bf16(timm.create_model("vit_small_patch16_224", num_classes=0, img_size=IMAGE, **SMALL, **plain_extra))
    x = torch.randn(1, 3, *IMAGE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ours_ops, plain_ops = count_ops(ours, x, where=MOVES), count_ops(plain, x, where=MOVES)
    assert ours_ops.in_blocks["addmm"] + ours_ops.in_blocks["mm"] >= 4 * DEPTH, "the counter missed the linears"
    ours_moves, plain_moves = sum(ours_ops.moves(True).values()), sum(plain_ops.moves(True).values())
    assert ours_moves <= plain_moves + PER_BLOCK * DEPTH, (
        f"{name}, {DEPTH} blocks: ours {ours_moves} copies/conversions in its blocks, plain ViT {plain_moves} "
        f"(allowed {plain_moves + PER_BLOCK * DEPTH})\nours {describe(ours_ops)}\nplain {describe(plain_ops)}"
    )


def test_the_counter_sees_copies_and_conversions_and_not_what_returns_its_input():
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    table = torch.randn(4, 6)

    def forward(t: torch.Tensor) -> torch.Tensor:
        same = t.to(torch.bfloat16).contiguous()  # both return their input: no copy
        moved = t.t().contiguous()  # clone
        wide = t.float()  # _to_copy
        mixed = t * table  # bf16 times fp32: a conversion inside the kernel
        return same, moved, wide, mixed

    class Forward(nn.Module):
        def forward(self, t):
            return forward(t)

    assert count_ops(Forward(), x).moves() == {"copy_": 0, "clone": 1, "_to_copy": 1, MIXED_DTYPE: 1}
