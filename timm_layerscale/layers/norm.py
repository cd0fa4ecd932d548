"""The norms a config names, for blocks, outputs and qk-norm, each declared once (`layer_options`): LayerNorm or
RMSNorm (timm's: torch's own needs torch >= 2.4). A norm is told apart in a checkpoint by its output norm's keys:
LayerNorm has a weight and a bias, RMSNorm a weight only."""

from collections.abc import Callable
from functools import partial

from timm.layers import RmsNorm
from torch import nn

from ..layer_options import LayerOption, layer_option, option_values, register_option

NORM_FIELD = "norm_layer"

register_option(LayerOption(NORM_FIELD, "layernorm", nn.LayerNorm, signature=("norm.weight", "norm.bias")))
register_option(LayerOption(NORM_FIELD, "rmsnorm", RmsNorm, signature=("norm.weight",)))


def norm_classes() -> tuple[type[nn.Module], ...]:
    """Every registered norm's class (what the model's init resets)."""
    return tuple(layer_option(NORM_FIELD, value).layer for value in option_values(NORM_FIELD))


def make_norm(kind: str, eps: float) -> Callable[[int], nn.Module]:
    """`norm_layer(dim)` for a config's `norm_layer` (a registered norm: its class takes `eps`) and `norm_eps`."""
    return partial(layer_option(NORM_FIELD, kind).layer, eps=eps)
