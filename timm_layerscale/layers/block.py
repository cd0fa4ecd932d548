from collections.abc import Callable

import torch
from timm.layers import DropPath, Mlp, register_notrace_function
from torch import nn

from .attention import Attention
from .layer_scale import add_scaled, layer_scale_or_identity

Rope = tuple[torch.Tensor, torch.Tensor] | None

# torch.fx.wrap patches the name in the module that calls it: one call in every FX graph here too.
torch.fx.wrap("add_scaled")


@torch.fx.wrap  # one call in every FX graph (timm's tracer reads its own list): the subset size is a number
@register_notrace_function
def random_subset(x: torch.Tensor, drop_rate: float) -> tuple[torch.Tensor, float]:
    """Random sample indices that keep `1 - drop_rate` of the batch (at least one), and batch / kept."""
    batch = x.shape[0]
    kept = max(int(batch * (1 - drop_rate)), 1)
    return torch.randperm(batch, device=x.device)[:kept], batch / kept


@torch.fx.wrap  # one call in every FX graph, as `random_subset`: it tells a shared RoPE from a per-image one
@register_notrace_function
def subset_rope_and_mask(
    index: torch.Tensor, rope: Rope, attn_mask: torch.Tensor | None
) -> tuple[Rope, torch.Tensor | None]:
    """The RoPE and attention mask of the samples at `index`: a NaFlex batch's per-image RoPE and mask are
    taken at those rows; one grid's RoPE, shared by all samples, is kept as it is."""
    if rope is not None and rope[0].dim() == 3:
        rope = (rope[0][index], rope[1][index])
    if attn_mask is not None:
        attn_mask = attn_mask[index]
    return rope, attn_mask


class Block(nn.Module):
    """Pre-norm transformer block: `x + ls1(attn(norm1(x)))`, then `x + ls2(mlp(norm2(x)))`.

    Stochastic depth comes in two kinds. "drop_path" zeroes a branch for random samples (timm's
    DropPath). "sample_drop" runs the branch on a random subset of the batch only and adds it back
    scaled by batch / subset, which saves the compute of the dropped samples.

    `mlp_layer(dim, mlp_hidden, bias=, drop=)` makes the feed-forward (timm's `Mlp`, or `SwiGLU`);
    `norm_layer(dim)` the norms, and the per-head qk-norm when `qk_norm`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_hidden: int | None = None,
        mlp_layer: Callable[..., nn.Module] = Mlp,
        qkv_bias: bool = True,
        mask_k_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        init_values: tuple[float | None, float | None] = (1e-5, 1e-5),
        norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        stochastic_depth: str = "drop_path",
        num_kv_heads: int | None = None,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(
            dim,
            num_heads,
            qkv_bias,
            mask_k_bias,
            proj_bias,
            attn_drop,
            proj_drop,
            num_kv_heads=num_kv_heads,
            qk_norm=norm_layer if qk_norm else None,
        )
        self.ls1 = layer_scale_or_identity(dim, init_values[0])
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(dim, mlp_hidden or 4 * dim, bias=ffn_bias, drop=proj_drop)
        self.ls2 = layer_scale_or_identity(dim, init_values[1])
        self.sample_drop_rate = drop_path if stochastic_depth == "sample_drop" else 0.0
        self.drops_path = stochastic_depth == "drop_path" and drop_path > 0
        self.drop_path = DropPath(drop_path) if self.drops_path else nn.Identity()

    def _attn(self, x: torch.Tensor, rope: Rope, attn_mask: torch.Tensor | None) -> torch.Tensor:
        return self.attn(self.norm1(x), rope, attn_mask)

    def _attn_branch(self, x: torch.Tensor, rope: Rope, attn_mask: torch.Tensor | None) -> torch.Tensor:
        return self.ls1(self._attn(x, rope, attn_mask))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm2(x))

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.ls2(self._mlp(x))

    def forward(self, x: torch.Tensor, rope: Rope = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training and self.sample_drop_rate > 0:
            index, scale = random_subset(x, self.sample_drop_rate)
            sub_rope, sub_mask = subset_rope_and_mask(index, rope, attn_mask)
            x = torch.index_add(x, 0, index, self._attn_branch(x[index], sub_rope, sub_mask).to(x.dtype), alpha=scale)
            index, scale = random_subset(x, self.sample_drop_rate)
            return torch.index_add(x, 0, index, self._mlp_branch(x[index]).to(x.dtype), alpha=scale)
        if self.training and self.drops_path:
            x = x + self.drop_path(self._attn_branch(x, rope, attn_mask))
            return x + self.drop_path(self._mlp_branch(x))
        # Without a drop path LayerScale joins the residual add (`add_scaled`); a folded or switched-off one (no
        # gamma) is a plain sum. `hasattr` is settled when traced or scripted. No branch output is kept in a
        # local: the attention's is freed before the MLP's peak.
        if hasattr(self.ls1, "gamma"):
            x = add_scaled(x, self._attn(x, rope, attn_mask), self.ls1.gamma)
        else:
            x = x + self._attn_branch(x, rope, attn_mask)
        if hasattr(self.ls2, "gamma"):
            return add_scaled(x, self._mlp(x), self.ls2.gamma)
        return x + self._mlp_branch(x)
