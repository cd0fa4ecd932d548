"""DINOHead: the projection head DINO and iBOT put on the backbone's tokens, with Meta's parameter names, so
the `dino_head.*` and `ibot_head.*` tensors of Meta's training checkpoints load into it as they are."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INIT_STD = 0.02  # Meta's DINOHead.init_weights: truncated normal weights, zero biases


def build_mlp(
    nlayers: int,
    in_dim: int,
    bottleneck_dim: int,
    hidden_dim: int,
    use_bn: bool = False,
    bias: bool = True,
) -> nn.Module:
    """One Linear when `nlayers` is 1; else Linear, [BatchNorm1d], GELU per hidden layer, then the Linear to
    `bottleneck_dim`, in one Sequential (the indices are the checkpoint's: `mlp.0`, `mlp.2`, ...)."""
    if nlayers == 1:
        return nn.Linear(in_dim, bottleneck_dim, bias=bias)
    layers: list[nn.Module] = []
    for layer_in in [in_dim] + [hidden_dim] * (nlayers - 2):
        layers.append(nn.Linear(layer_in, hidden_dim, bias=bias))
        if use_bn:
            layers.append(nn.BatchNorm1d(hidden_dim))
        layers.append(nn.GELU())
    layers.append(nn.Linear(hidden_dim, bottleneck_dim, bias=bias))
    return nn.Sequential(*layers)


class DINOHead(nn.Module):
    """`in_dim` tokens -> an MLP of `nlayers` to `bottleneck_dim`, L2-normalised -> a Linear without bias to
    `out_dim` prototype logits (`last_layer`). Meta's arguments, keys and forward; unlike Meta's, whose trainer
    calls `init_weights` after building on the meta device, the head is initialised when built.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        use_bn: bool = False,
        nlayers: int = 3,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        mlp_bias: bool = True,
    ):
        super().__init__()
        nlayers = max(nlayers, 1)
        self.mlp = build_mlp(nlayers, in_dim, bottleneck_dim, hidden_dim, use_bn=use_bn, bias=mlp_bias)
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def init_weights(self) -> None:
        """Meta's init: every Linear's weight truncated normal (std 0.02), its bias zero."""
        self.apply(_init_linear)

    def forward(self, x: Tensor, no_last_layer: bool = False, only_last_layer: bool = False) -> Tensor:
        """`[..., in_dim]` -> `[..., out_dim]`; `no_last_layer` stops at the normalised bottleneck,
        `only_last_layer` takes bottleneck features and applies `last_layer` alone."""
        if not only_last_layer:
            x = self.mlp(x)
            x = F.normalize(x, dim=-1, p=2, eps=1e-6 if x.dtype == torch.float16 else 1e-12)
        if not no_last_layer:
            x = self.last_layer(x)
        return x


def _init_linear(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
