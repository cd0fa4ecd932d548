"""The norms a config names: LayerNorm or RMSNorm, for blocks, outputs and
qk-norm. RMSNorm is timm's (torch's own needs torch >= 2.4)."""

from collections.abc import Callable
from functools import partial

from timm.layers import RmsNorm
from torch import nn

NORMS = (nn.LayerNorm, RmsNorm)


def make_norm(kind: str, eps: float) -> Callable[[int], nn.Module]:
    """`norm_layer(dim)` for a config's `norm_layer` ("layernorm" or "rmsnorm") and `norm_eps`."""
    return partial(RmsNorm if kind == "rmsnorm" else nn.LayerNorm, eps=eps)
