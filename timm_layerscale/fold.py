"""fold_layer_scale: a live model's LayerScale fused into the projections before it, for inference."""

from dataclasses import dataclass

import torch
from timm.layers import LayerScale as TimmLayerScale
from timm.layers import LayerScale2d
from torch import nn

from .layers import LayerScale, fold_gamma

# Where each family keeps its gammas: a block's attribute, and the projections (first found) whose output it
# scales. ls1/ls2 are LayerScale modules: ours, timm's ViT (DeiT-III, DINOv2 and its registers too).
# gamma_1/gamma_2 are raw parameters: timm's CaiT (its class-attention blocks too) and eva (DINOv3 included;
# eva's SwiGLU and GluMlp end in fc2).
SITES = (
    ("ls1", ("attn.proj",)),
    ("ls2", ("mlp.fc2", "mlp.w3")),
    ("gamma_1", ("attn.proj",)),
    ("gamma_2", ("mlp.fc2",)),
)
LAYER_SCALES = (LayerScale, TimmLayerScale, LayerScale2d)
# A module goes (the block builds without it: recorded as init_values=0, which ours and timm's ViT read as off).
# A raw parameter stays at 1: CaiT always has one, and eva cannot be rebuilt without, as timm's create_model
# drops the None that would switch it off.
OFF, ONE = 0, 1.0


@dataclass(frozen=True)
class _Fold:
    block: nn.Module
    site: str
    gamma: torch.Tensor
    proj: nn.Linear
    stays: bool  # a raw parameter, set to 1; a LayerScale module is replaced by nn.Identity


@torch.no_grad()
def fold_layer_scale(model: nn.Module) -> nn.Module:
    """Fuses every LayerScale of a model into the projection before it, then removes it, or sets it to 1 where
    the architecture always has one.

    Covers this package's models (MLP and SwiGLU), timm's ViT with LayerScale (`init_values`, DeiT-III, DINOv2
    with or without registers), CaiT (class-attention blocks included) and eva (DINOv3 included). LayerScale
    modules become `nn.Identity`; CaiT's and eva's `gamma_1`/`gamma_2` parameters become 1. Outputs stay the
    same up to float rounding, and what the model records for rebuilding (`model.config`, timm's
    `model._model_args`) says so: `init_values=0` (off) for ours and timm's ViT, `init_values=1.0` for CaiT and
    eva, so `timm.create_model(name, **model._model_args)` loads the folded state dict with `strict=True`.

    A model with no LayerScale is returned unchanged, nothing recorded. A gamma that cannot be folded (no linear
    projection of its size before it, or a LayerScale where no family keeps one) raises `ValueError` before
    anything is changed.
    """
    folds = _folds_of(model)
    if not folds:
        return model
    for fold in folds:
        _apply(fold)
    _record(model, ONE if any(fold.stays for fold in folds) else OFF)
    return model


def _folds_of(model: nn.Module) -> list[_Fold]:
    """Every fold to make, or a ValueError naming the first gamma that cannot be folded."""
    folds, planned = [], set()
    for name, block in model.named_modules():
        for site, proj_names in SITES:
            found = getattr(block, site, None)
            gamma = found.gamma if isinstance(found, (LayerScale, TimmLayerScale)) else found
            if not isinstance(gamma, nn.Parameter):
                continue
            where = f"{name}.{site}" if name else site
            proj = _projection(block, proj_names, gamma, where)
            folds.append(_Fold(block, site, gamma, proj, stays=gamma is found))
            planned.add(where)
    for where in _all_gammas(model):
        if where not in planned:
            raise ValueError(
                f"fold_layer_scale: cannot fold {where}: no known projection feeds it; nothing was changed "
                f"(covered: this package's models, timm's ViT / DeiT-III / DINOv2, CaiT and eva)"
            )
    return folds


def _projection(block: nn.Module, names: tuple[str, ...], gamma: torch.Tensor, where: str) -> nn.Linear:
    proj = next((p for name in names if isinstance(p := _get(block, name), nn.Linear)), None)
    if proj is None:
        raise ValueError(
            f"fold_layer_scale: cannot fold {where}: no nn.Linear at {' or '.join(names)} before it; "
            f"nothing was changed"
        )
    if gamma.shape != (proj.out_features,):
        raise ValueError(
            f"fold_layer_scale: cannot fold {where}: gamma of shape {tuple(gamma.shape)} after a projection "
            f"of {proj.out_features} outputs; nothing was changed"
        )
    return proj


def _all_gammas(model: nn.Module) -> list[str]:
    """Every LayerScale module and raw gamma parameter, by its name in the model."""
    modules = [name for name, module in model.named_modules() if isinstance(module, LAYER_SCALES)]
    params = [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] in ("gamma_1", "gamma_2")]
    return modules + params


def _apply(fold: _Fold) -> None:
    weight, bias = fold_gamma(fold.proj.weight, fold.proj.bias, fold.gamma)
    fold.proj.weight.copy_(weight)
    if bias is not None:
        fold.proj.bias.copy_(bias)
    if fold.stays:
        fold.gamma.fill_(1.0)
    else:
        setattr(fold.block, fold.site, nn.Identity())


def _record(model: nn.Module, init_values: float) -> None:
    """What a later save writes, so the folded model rebuilds with the state dict it now has."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "replace"):
        model.config = config.replace(init_values=init_values)
    recorded = getattr(model, "_model_args", None)
    if isinstance(recorded, dict):  # what timm's own save_for_hf records; assigned, as it may be a property
        model._model_args = {**recorded, "init_values": init_values}


def _get(module: nn.Module, dotted: str) -> nn.Module | None:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
