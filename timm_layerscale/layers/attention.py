import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import nn

from .rope import apply_rope, apply_rope_low_precision


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


def k_bias_mask(out_features: int) -> torch.Tensor:
    """A fresh qkv bias mask: ones, with the k third zero (DINOv3 never adds a k bias it did not load)."""
    mask = torch.ones(out_features)
    third = out_features // 3
    mask[third : 2 * third] = 0.0
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
        self.bias_mask.copy_(k_bias_mask(self.out_features))

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
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        if qkv_bias and mask_k_bias:
            self.qkv = KMaskedBiasLinear(dim, dim * 3)
        else:
            self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
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
