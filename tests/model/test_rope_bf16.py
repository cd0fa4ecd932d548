"""RoPE in bf16 (`rope_dtype: bf16`), as Sapiens2's released code computes it, through the config: the periods a
fresh model makes at each released Sapiens2 head width, and the bf16 rotation whichever attention path a block
takes (full heads without qk-norm rotate q and k stacked in DINOv3's path, unless RoPE is bf16).
"""

import pytest
import timm
import torch
from support import move_off_init_, relative_diff

from timm_layerscale.variants import VARIANTS

SAPIENS2 = sorted(name for name in VARIANTS if name.endswith("_sapiens2"))


def head_dim(variant: str) -> int:
    config = VARIANTS[variant].config
    return config.embed_dim // config.num_heads


def upstream_periods(head: int, dtype: torch.dtype) -> torch.Tensor:
    """`RopePositionEmbedding._init_weights` of facebookresearch/sapiens2 (sapiens/backbones/standalone/sapiens2.py)
    with base 100, in the dtype it is built with: bf16 as released, every step rounded in it."""
    return (100.0 ** (2 * torch.arange(head // 4, dtype=dtype) / (head // 2))).float()


def test_released_head_widths_include_ones_whose_steps_round_in_bf16():
    """The 0.8B (80) and 5B (76) head widths make steps (k / 20, k / 19) that bf16 rounds before the power: a
    model computing them in fp32 gets other periods, so the test below tells the two apart there."""
    widths = {head_dim(variant) for variant in SAPIENS2}
    assert {64, 76, 80} <= widths
    for head in (76, 80):
        fp32_steps = (100.0 ** (2 * torch.arange(head // 4, dtype=torch.float32) / (head // 2))).bfloat16().float()
        assert not torch.equal(upstream_periods(head, torch.bfloat16), fp32_steps)


@pytest.mark.parametrize("variant", SAPIENS2)
def test_a_fresh_bf16_rope_model_has_upstreams_bf16_periods(variant):
    """The periods a bf16-RoPE model builds (no checkpoint) at the variant's own head width are upstream's, in
    bf16 exactly: the values its released files carry."""
    head = head_dim(variant)
    model = timm.create_model(variant, embed_dim=2 * head, num_heads=2, depth=1, num_kv_heads=[2])
    assert model.config.rope_dtype == "bf16"
    periods = model.rope_embed.periods
    assert periods.dtype == torch.float32 and torch.equal(periods, periods.bfloat16().float())
    assert torch.equal(periods, upstream_periods(head, torch.bfloat16))


# Four heads, no qk-norm: full attention takes DINOv3's stacked q/k path unless RoPE is bf16.
SHAPE = dict(embed_dim=64, num_heads=4, depth=2, qk_norm=False, init_values={"attn": 1.0, "mlp": None}, num_classes=0)


def sapiens2(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_ls_base_patch16_sapiens2", **{**SHAPE, **kwargs})
    return move_off_init_(model).eval()


@torch.no_grad()
def repeated_kv_heads(grouped: torch.nn.Module, full: torch.nn.Module) -> None:
    """`full`'s weights set to `grouped`'s with each k/v head repeated for its group of q heads: the same model."""
    state = grouped.state_dict()
    for i, block in enumerate(grouped.blocks):
        attn = block.attn
        dim, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        group = attn.num_heads // attn.num_kv_heads
        for name in ("weight", "bias"):
            q, k, v = state[f"blocks.{i}.attn.qkv.{name}"].split([dim, kv, kv])
            k, v = (t.unflatten(0, (attn.num_kv_heads, -1)).repeat_interleave(group, 0).flatten(0, 1) for t in (k, v))
            state[f"blocks.{i}.attn.qkv.{name}"] = torch.cat([q, k, v])
    full.load_state_dict(state)


@pytest.mark.parametrize("rope_dtype", ["bf16", "fp32"])
@torch.no_grad()
def test_full_attention_equals_grouped_attention_with_repeated_kv_heads(rope_dtype):
    """A block of full heads without qk-norm and a grouped block whose k/v heads it repeats are one model: the
    same outputs, in bf16 RoPE as in fp32, whichever path each takes."""
    grouped = sapiens2(num_kv_heads=[2, 2], rope_dtype=rope_dtype)
    full = sapiens2(rope_dtype=rope_dtype)
    repeated_kv_heads(grouped, full)
    images = torch.randn(2, 3, 48, 32, generator=torch.Generator().manual_seed(1))
    expected = grouped(images)
    assert relative_diff(full(images), expected) < 1e-6
    if rope_dtype == "bf16":  # bf16 RoPE moves the outputs by far more than the tolerance above
        fp32 = sapiens2(rope_dtype="fp32")
        fp32.load_state_dict(full.state_dict())
        assert relative_diff(fp32(images), expected) > 1e-4
