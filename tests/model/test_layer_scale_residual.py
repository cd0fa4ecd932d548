"""LayerScale in the residual add: `x + branch * gamma` as two operations in fp32, bit for bit what Meta's
`x + ls(branch)` computes, and as one pass in bf16, computed in fp32 and rounded once, which costs no kernel
beside the add a block without LayerScale makes."""

import warnings

import pytest
import timm
import torch
from support import TINY, move_off_init_
from support.op_count import count_ops

from timm_layerscale import fold_layer_scale
from timm_layerscale.layers import add_scaled

SHAPE = (2, 3, 48, 64)  # 3x4 patches


def model(dtype: torch.dtype, **kwargs) -> torch.nn.Module:
    built = timm.create_model("vit_ls_small_patch16_dinov3", num_classes=0, **TINY, **kwargs)
    return move_off_init_(built).to(dtype).eval()


def blocks_and_inputs(dtype: torch.dtype):
    """The model, each block's input tokens and the shared RoPE tables."""
    m = model(dtype)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)
    rope = m.rope_embed(SHAPE[2] // 16, SHAPE[3] // 16)
    tokens = m.prepare_tokens(x)
    inputs = []
    for block in m.blocks:
        inputs.append(tokens)
        tokens = block(tokens, rope)
    return m, inputs, rope


def branches(block, x, rope):
    """The attention branch at `x`, and a function of the residual that gives the MLP branch."""
    return block.attn(block.norm1(x), rope), lambda r: block.mlp(block.norm2(r))


@torch.inference_mode()
def test_fp32_block_is_meta_two_step_sum_bit_for_bit():
    m, inputs, rope = blocks_and_inputs(torch.float32)
    for block, x in zip(m.blocks, inputs, strict=True):
        attn, mlp = branches(block, x, rope)
        expected = x + block.ls1(attn)
        expected = expected + block.ls2(mlp(expected))
        assert torch.equal(block(x, rope), expected)


@torch.inference_mode()
def test_bf16_block_rounds_each_residual_once():
    m, inputs, rope = blocks_and_inputs(torch.bfloat16)
    differs_from_two_roundings = False
    for block, x in zip(m.blocks, inputs, strict=True):
        attn, mlp = branches(block, x, rope)
        once = (x.float() + attn.float() * block.ls1.gamma.float()).to(torch.bfloat16)
        once = (once.float() + mlp(once).float() * block.ls2.gamma.float()).to(torch.bfloat16)
        out = block(x, rope)
        # fp32's own fused multiply-add may round the sum once more than the reference: at most one bf16 unit
        # on an element of thousands
        assert (out != once).float().mean() < 1e-3
        twice = x + attn * block.ls1.gamma
        twice = twice + mlp(twice) * block.ls2.gamma
        differs_from_two_roundings |= bool((out != twice).any())
    assert differs_from_two_roundings, "the bf16 residual rounded the product and the sum each"


def test_add_scaled_keeps_fp32_two_operations_and_fuses_narrower_dtypes():
    generator = torch.Generator().manual_seed(1)
    x, branch = torch.randn(2, 2, 4, 201, 384, generator=generator).unbind(0)
    gamma = torch.randn(384, generator=generator)
    assert torch.equal(add_scaled(x[0], branch[0], gamma), x[0] + branch[0] * gamma)
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype) for t in (x[1], branch[1], gamma)]
        once = (low[0].float() + low[1].float() * low[2].float()).to(dtype)
        assert (add_scaled(*low) != once).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_scale_costs_no_kernel_beyond_the_residual_add_in_bf16(dtype):
    x = torch.randn(1, 3, 48, 64).to(dtype)
    # a drop path that trained the model is none in eval
    with_ls = count_ops(model(dtype, drop_path_rate=0.2), x).in_blocks
    without = count_ops(model(dtype, init_values="off"), x).in_blocks
    added = {op: with_ls[op] - without[op] for op in set(with_ls) | set(without) if with_ls[op] != without[op]}
    depth = TINY["depth"]
    if dtype == torch.bfloat16:  # each residual add became an addcmul
        assert added == {"addcmul": 2 * depth, "add": -2 * depth}
    else:  # a product beside each add, as Meta's
        assert added == {"mul": 2 * depth}


@torch.inference_mode()
def test_graphs_keep_the_residual_rule_of_their_dtype():
    """FX keeps `add_scaled` as one call (its path is the input's dtype, unknown when tracing); TorchScript
    and a folded model (no gamma left) give the eager outputs."""
    for dtype in (torch.float32, torch.bfloat16):
        m = model(dtype)
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).to(dtype)
        traced = torch.fx.symbolic_trace(m)
        calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is add_scaled]
        assert len(calls) == 2 * TINY["depth"]
        assert torch.equal(traced(x), m(x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated in torch, still supported
            assert torch.equal(torch.jit.script(m)(x), m(x))
    folded = fold_layer_scale(model(torch.float32))
    assert not any(hasattr(b.ls1, "gamma") or hasattr(b.ls2, "gamma") for b in folded.blocks)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.fx.symbolic_trace(folded)(x), folded(x))
