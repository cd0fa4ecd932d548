from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import nn

from .rope import apply_rope, apply_rope_bf16, apply_rope_low_precision


# One call in every FX graph (torch.fx.wrap for any tracer, timm's list for timm's): the path depends on the
# dtype, and it adds into views in place.
@torch.fx.wrap
@register_notrace_function
def rotate_queries_keys(qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on the stacked q/k slice of qkv `[batch, tokens, 2, heads, head_dim]`, q and k in one pass.

    `rope` is one grid's `[tokens, head_dim]` pair, or a NaFlex batch's `[batch, tokens, head_dim]` (one
    grid per image). fp32 takes `apply_rope`, exact to Meta's; bf16 and fp16 take its fewer-pass form, which
    without autograd writes the result back into qkv: a third copy of q and k would otherwise make RoPE the
    forward's peak.
    """
    sin, cos = rope
    rope = (sin.unsqueeze(-2).unsqueeze(-2), cos.unsqueeze(-2).unsqueeze(-2))
    if qk.dtype == torch.bfloat16 or qk.dtype == torch.float16:
        return apply_rope_low_precision(qk, rope, out=None if torch.is_grad_enabled() else qk)
    return apply_rope(qk, rope)


# One call in every FX graph, as `rotate_queries_keys`: the path depends on the dtype and the RoPE precision.
@torch.fx.wrap
@register_notrace_function
def rotate_heads(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bf16: bool) -> torch.Tensor:
    """RoPE on q or k `[batch, tokens, heads, head_dim]` apart (grouped-query attention, qk-norm): fp32 as
    `apply_rope`, or in bf16 throughout as Sapiens2's released code (`bf16`, with bf16 tables)."""
    sin, cos = rope
    rope = (sin.unsqueeze(-2), cos.unsqueeze(-2))
    if bf16:
        return apply_rope_bf16(x, rope)
    if x.dtype == torch.bfloat16 or x.dtype == torch.float16:
        return apply_rope_low_precision(x, rope)
    return apply_rope(x, rope)


def qkv_sizes(out_features: int, dim: int) -> list[int]:
    """The q, k and v rows of a fused qkv projection from `dim` channels: `dim`, then two equal k/v parts
    (smaller than `dim` under grouped-query attention)."""
    kv = (out_features - dim) // 2
    return [dim, kv, kv]


def split_qkv(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """A fused qkv weight or bias as its q, k and v rows (`dim`: the model's width)."""
    return t.split(qkv_sizes(t.shape[0], dim))


def k_bias_mask(out_features: int, dim: int | None = None) -> torch.Tensor:
    """A fresh qkv bias mask: ones, with the k rows zero (DINOv3 never adds a k bias it did not load)."""
    mask = torch.ones(out_features)
    q, k, _ = qkv_sizes(out_features, out_features // 3 if dim is None else dim)
    mask[q : q + k] = 0.0
    return mask


def effective_qkv_bias(bias: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """What the forward adds: the qkv bias times its (loaded) mask, or the bias itself without one."""
    return bias if mask is None else bias * mask.to(bias.dtype)


class KMaskedBiasLinear(nn.Linear):
    """The qkv projection whose bias is multiplied by `bias_mask` (DINOv3's k-bias masking).

    The mask is a buffer loaded from checkpoints: fresh models zero the k third, and the released files
    carry an all-zero mask, so loading must keep the file's mask rather than regenerate it.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=True)
        self.register_buffer("bias_mask", torch.empty(out_features))
        self.reset_bias_mask()

    def reset_bias_mask(self) -> None:
        self.bias_mask.copy_(k_bias_mask(self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, effective_qkv_bias(self.bias, self.bias_mask))


class Attention(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        mask_k_bias: bool = True,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        num_kv_heads: int | None = None,
        qk_norm: Callable[[int], nn.Module] | None = None,
        rope_dtype: str = "fp32",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = dim // num_heads
        # One fused projection whatever the k/v heads: rows [q (dim), k, v] (`qkv_sizes`).
        out = dim + 2 * self.num_kv_heads * self.head_dim
        if qkv_bias and mask_k_bias:
            self.qkv = KMaskedBiasLinear(dim, out)
        else:
            self.qkv = nn.Linear(dim, out, bias=qkv_bias)
        self.q_norm = qk_norm(self.head_dim) if qk_norm is not None else nn.Identity()
        self.k_norm = qk_norm(self.head_dim) if qk_norm is not None else nn.Identity()
        self.rope_bf16 = rope_dtype == "bf16"
        # DINOv3's attention rotates q and k stacked in one pass; the other families take them apart.
        self.separate_qk = self.num_kv_heads != num_heads or qk_norm is not None or self.rope_bf16
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`attn_mask`: None (every token attends to every token), or the keys each query may attend to,
        boolean `[batch, 1, 1, tokens]` (a NaFlex batch's padding is no key)."""
        if self.separate_qk:
            return self._forward_separate(x, rope, attn_mask)
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim)
        qk, v = qkv[:, :, :2], qkv[:, :, 2]
        if rope is not None:
            qk = rotate_queries_keys(qk, rope)
        q, k = qk.unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop if self.training else 0.0
        )
        x = x.transpose(1, 2).reshape(batch, tokens, dim)
        return self.proj_drop(self.proj(x))

    def _forward_separate(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Sapiens2's order: per-head qk-norm, RoPE, then each k/v head shared by its group of q heads."""
        batch, tokens, dim = x.shape
        kv = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([dim, kv, kv], dim=-1)
        q = self.q_norm(q.reshape(batch, tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(batch, tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(batch, tokens, self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = rotate_heads(q, rope, self.rope_bf16), rotate_heads(k, rope, self.rope_bf16)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop if self.training else 0.0
        )
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(batch, tokens, dim)))
