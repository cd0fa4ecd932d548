"""LayerScale: a learnable per-channel gain on a residual branch (Touvron et al., CaiT, 2021).

It folds into the linear layer before it: `gamma * (W x + b) == (gamma[:, None] * W) x + gamma * b`.
"""

import torch
from timm.layers import register_notrace_function
from torch import nn


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.empty(dim, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.gamma, self.init_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma

    def extra_repr(self) -> str:
        return f"{self.gamma.shape[0]}, init_values={self.init_values:g}"


# One call in every FX graph (torch.fx.wrap for any tracer, timm's list for timm's): the path depends on the dtype.
@torch.fx.wrap
@register_notrace_function
def add_scaled(x: torch.Tensor, branch: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The residual add of a LayerScale branch, `x + branch * gamma`.

    Narrower than fp32, one pass (`addcmul`): computed in fp32 and rounded once, where the product and the sum
    would each be rounded and each read and write the tokens. In fp32 the product and the sum stay two
    operations, bit for bit Meta's: `addcmul` may fuse them into one rounding.
    """
    if x.dtype == torch.bfloat16 or x.dtype == torch.float16:
        return torch.addcmul(x, branch, gamma)
    return x + branch * gamma


def layer_scale_or_identity(dim: int, init_values: float | None) -> nn.Module:
    """`None` switches LayerScale off: an Identity leaves no `gamma` in the state dict."""
    return nn.Identity() if init_values is None else LayerScale(dim, init_values)


def fold_gamma(weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor):
    """`gamma * (W x + b)` as one linear layer, computed in fp32 (or wider) and returned in the weight's dtype."""
    gamma = gamma.to(torch.promote_types(weight.dtype, torch.float32))
    folded = (weight * gamma[:, None]).to(weight.dtype)
    return folded, None if bias is None else (bias * gamma).to(bias.dtype)
