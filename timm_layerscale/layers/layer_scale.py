"""LayerScale: a learnable per-channel gain on a residual branch (Touvron et al., CaiT, 2021)."""

import torch
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


def layer_scale_or_identity(dim: int, init_values: float | None) -> nn.Module:
    """`None` switches LayerScale off: an Identity leaves no `gamma` in the state dict."""
    return nn.Identity() if init_values is None else LayerScale(dim, init_values)
