"""fold_layer_scale: a live model's LayerScale fused into the projections before it, for inference."""

import torch
from torch import nn

from .layers import LayerScale, fold_gamma


@torch.no_grad()
def fold_layer_scale(model: nn.Module) -> nn.Module:
    """Fuses every LayerScale of a model into the projection before it and removes the LayerScale.

    Outputs stay the same (up to float rounding); the model gets a little faster and loses its gammas.
    Works on this package's models and on any model whose blocks use the same names.
    """
    for block in model.modules():
        for ls_name, proj_names in (("ls1", ("attn.proj",)), ("ls2", ("mlp.fc2", "mlp.w3"))):
            layer_scale = getattr(block, ls_name, None)
            if not isinstance(layer_scale, LayerScale):
                continue
            proj = next(p for name in proj_names if (p := _get(block, name)) is not None)
            weight, bias = fold_gamma(proj.weight, proj.bias, layer_scale.gamma)
            proj.weight.copy_(weight)
            if bias is not None:
                proj.bias.copy_(bias)
            setattr(block, ls_name, nn.Identity())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "replace"):
        model.config = config.replace(init_values=0)  # what a later save records
    recorded = getattr(model, "_model_args", None)
    if isinstance(recorded, dict):  # what timm's own save_for_hf records; assigned, as it may be a property
        model._model_args = {**recorded, "init_values": 0}
    return model


def _get(module: nn.Module, dotted: str) -> nn.Module | None:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
