from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import nn

from ..layer_options import LayerOption, register_option
from .rope import apply_rope, apply_rope_into


# One call in every FX graph (torch.fx.wrap for any tracer, timm's list for timm's): the path depends on the
# dtypes and on autograd, and it writes into views in place.
@torch.fx.wrap
@register_notrace_function
def rotate_heads(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on heads `[batch, tokens, heads, head_dim]`: q's and k's heads side by side, or either alone.

    `rope` is one grid's `[tokens, head_dim]` pair, or a NaFlex batch's `[batch, tokens, head_dim]` (one
    grid per image). Heads are rotated in the tables' dtype (`apply_rope`); heads narrower than the tables
    are rotated in place when there is no autograd and no compiler (`apply_rope_into`), one unit off at most.
    Heads of the tables' dtype are not: out of place, the attention branch stays below the MLP's peak, and a
    hook on qkv keeps what qkv computed.
    """
    sin, cos = rope
    rope = (sin.unsqueeze(-2), cos.unsqueeze(-2))
    narrower = x.dtype != cos.dtype and torch.promote_types(x.dtype, cos.dtype) == cos.dtype
    # A compiler fuses the out-of-place rotation into one kernel; writing into a view of qkv would make it
    # copy qkv whole (functionalisation) and run slower than eager.
    if narrower and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return apply_rope_into(x, rope)
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
    """A fresh qkv bias mask: ones, with the k rows zero (a k bias is never added unless a checkpoint's mask
    loads it)."""
    mask = torch.ones(out_features)
    q, k, _ = qkv_sizes(out_features, out_features // 3 if dim is None else dim)
    mask[q : q + k] = 0.0
    return mask


def effective_qkv_bias(bias: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """What the forward adds: the qkv bias times its (loaded) mask, or the bias itself without one."""
    return bias if mask is None else bias * mask.to(bias.dtype)


class KMaskedBiasLinear(nn.Linear):
    """The qkv projection whose bias is multiplied by `bias_mask` (k-bias masking).

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
    """Self-attention with one fused qkv projection (rows: q, then k and v of `num_kv_heads` heads each),
    optional per-head qk-norm, RoPE in the dtype of its tables, and k/v heads shared by groups of q heads."""

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
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = dim // num_heads
        out = dim + 2 * self.num_kv_heads * self.head_dim
        if qkv_bias and mask_k_bias:
            self.qkv = KMaskedBiasLinear(dim, out)
        else:
            self.qkv = nn.Linear(dim, out, bias=qkv_bias)
        self.normed_qk = qk_norm is not None
        self.q_norm = qk_norm(self.head_dim) if qk_norm is not None else nn.Identity()
        self.k_norm = qk_norm(self.head_dim) if qk_norm is not None else nn.Identity()
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
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).unflatten(-1, (heads + 2 * kv_heads, self.head_dim))
        # Slices, not `split`: views alike, and an exported graph gets Slice (a split of sizes is a sequence op
        # there until an optimiser folds it)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads], qkv[:, :, heads + kv_heads :]
        if self.normed_qk:  # per-head norms make q and k tensors of their own: rotated one by one
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = rotate_heads(q, rope), rotate_heads(k, rope)
        elif rope is not None:  # q's and k's heads side by side in qkv: rotated in one pass
            qk = rotate_heads(qkv[:, :, : heads + kv_heads], rope)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_heads != heads:
            k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop if self.training else 0.0
        )
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(batch, tokens, dim)))


# The attention's switches as checkpoint keys show them: a qk-norm has a q-norm weight (LayerNorm's or RMSNorm's).
register_option(LayerOption("qk_norm", True, Attention, signature=("blocks.0.attn.q_norm.weight",)))
register_option(LayerOption("qk_norm", False, Attention))
