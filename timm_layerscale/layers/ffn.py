"""The feed-forward layers a config names, each declared once (`layer_options`): timm's Mlp (GELU) or SwiGLU,
told apart in a checkpoint by their first projection's key."""

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from ..layer_options import LayerOption, register_option


def swiglu_hidden_features(dim: int, ffn_ratio: float, align_to: int) -> int:
    """Two thirds of the MLP width (parameter parity), rounded up to `align_to`."""
    hidden = int(int(dim * ffn_ratio) * 2 / 3)
    return hidden + (-hidden % align_to)


def ffn_hidden_features(dim: int, ffn_layer: str, ffn_ratio: float, swiglu_align_to: int) -> int:
    """The FFN's hidden width: `dim * ffn_ratio` for the MLP, two thirds of it aligned for "swiglu"."""
    if ffn_layer == "swiglu":
        return swiglu_hidden_features(dim, ffn_ratio, swiglu_align_to)
    return int(dim * ffn_ratio)


class SwiGLU(nn.Module):
    """`w3(silu(w1 x) * w2 x)`, with the parameter names released checkpoints use (w1, w2, w3)."""

    def __init__(self, dim: int, hidden_features: int, bias: bool = True, drop: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_features, bias=bias)
        self.w2 = nn.Linear(dim, hidden_features, bias=bias)
        self.w3 = nn.Linear(hidden_features, dim, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w3(F.silu(self.w1(x)) * self.w2(x)))


register_option(
    LayerOption(
        "ffn_layer", "mlp", Mlp, signature=("blocks.0.mlp.fc1.weight",), shows={"ffn_bias": "blocks.0.mlp.fc1.bias"}
    )
)
register_option(
    LayerOption(
        "ffn_layer", "swiglu", SwiGLU, signature=("blocks.0.mlp.w1.weight",), shows={"ffn_bias": "blocks.0.mlp.w1.bias"}
    )
)
