"""file -> layout -> mapping -> load: every checkpoint layout becomes this model's own state dict.

`convert_state_dict` is the one place that does it. timm's `pretrained_filter_fn` calls it, and so does
a `load_state_dict` pre-hook on every model, because `timm.models.load_checkpoint`, `checkpoint_path=`,
train.py's `--initial-checkpoint` and validate.py's `--checkpoint` load without any filter.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError
from .layer_scale import fold_layer_scale, reconcile_layer_scale
from .layouts import CONVERTERS, StateDict, detect_layout, strip_wrappers

__all__ = [
    "CheckpointError",
    "checkpoint_filter_fn",
    "convert_state_dict",
    "fold_layer_scale",
    "install_load_hook",
]

_logger = logging.getLogger("timm_layerscale")
NESTED_KEYS = ("teacher", "model", "state_dict", "model_ema", "state_dict_ema")


def unwrap_checkpoint(checkpoint: Any) -> StateDict:
    """The tensors of a checkpoint that may nest them under `teacher`/`model`/`state_dict`."""
    while isinstance(checkpoint, dict) and not any(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        inner = next((checkpoint[k] for k in NESTED_KEYS if isinstance(checkpoint.get(k), dict)), None)
        if inner is None:
            break
        checkpoint = inner
    if not isinstance(checkpoint, dict) or not checkpoint:
        raise CheckpointError(
            f"the checkpoint holds no state dict (got {type(checkpoint).__name__}"
            f"{' with keys ' + ', '.join(map(str, list(checkpoint)[:5])) if isinstance(checkpoint, dict) else ''}); "
            f"pass a file of model weights (.safetensors or a torch state dict)"
        )
    return {k: v for k, v in checkpoint.items() if isinstance(v, torch.Tensor)}


# Keys a layout may lack that the model's own fresh value fills, by key ending.
OWN_VALUE_FILLS = {
    "attn.qkv.bias_mask": "qkv bias masks (k masked)",
    "rope_embed.periods": "the default RoPE periods",
    "head.weight": "the model's fresh classifier head",
    "head.bias": "the model's fresh classifier head",
}


def _fill_missing(sd: StateDict, expected: StateDict) -> list[str]:
    """Fills what a layout does not carry; returns what it filled. A misshapen head is replaced too."""
    filled = []
    for key, target in expected.items():
        if key in sd and (sd[key].shape == target.shape or not key.startswith("head.")):
            continue  # present, or misshapen: the completeness check reports that
        norm_key = "norm." + key.partition(".")[2]
        if key.endswith("attn.qkv.bias"):
            sd[key], what = torch.zeros(target.shape), "zero qkv biases"
        elif key == "mask_token":
            sd[key], what = torch.zeros(target.shape), "a zero mask_token"
        elif key.startswith("local_cls_norm.") and norm_key in sd:
            sd[key], what = sd[norm_key].clone(), "local_cls_norm from norm"
        elif what := next((v for k, v in OWN_VALUE_FILLS.items() if key.endswith(k)), None):
            sd[key] = target.clone()
        else:
            continue
        if what not in filled:
            filled.append(what)
    return filled


# Keys that only some options create, and the option that creates them.
# `{}` stands for whether the checkpoint holds the key.
OPTION_KEYS = (("cls_norm.", "cls_norm={}"), ("mlp.w1.", "ffn_layer='swiglu'"), ("mlp.fc1.", "ffn_layer='mlp'"))


def _option_hint(key: str, in_checkpoint: bool) -> str:
    for fragment, option in OPTION_KEYS:
        if fragment in key:
            return f"the model with {option.format(in_checkpoint)} to match the checkpoint"
    return "the variant and options the checkpoint was made for"


def _check_complete(sd: StateDict, expected: StateDict, layout: str, model: nn.Module) -> None:
    name = getattr(model, "pretrained_cfg", {}).get("architecture") or type(model).__name__
    for key, target in expected.items():
        if key not in sd:
            raise CheckpointError(
                f"the {layout} checkpoint lacks {key} {list(target.shape)} that {name} needs; build "
                f"{_option_hint(key, False)}"
            )
        if sd[key].shape != target.shape:
            raise CheckpointError(
                f"the {layout} checkpoint does not fit {name}: {key} is {list(sd[key].shape)} in the checkpoint "
                f"but {list(target.shape)} in the model; build the variant the checkpoint was made for"
            )
    extra = [k for k in sd if k not in expected]
    if extra:
        raise CheckpointError(
            f"the {layout} checkpoint has {extra[0]} {list(sd[extra[0]].shape)} that {name} does not hold"
            f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; build {_option_hint(extra[0], True)}"
        )


def convert_state_dict(checkpoint: Any, model: nn.Module, pretrained: bool = False) -> tuple[StateDict, list[str]]:
    """Converts any supported checkpoint to `model`'s own keys, complete, or raises `CheckpointError`.

    Returns the state dict and the report lines (layout, what was filled or dropped, LayerScale).
    `pretrained` marks a pretrained load, the only kind that `reinit_layer_scale` re-initialises.
    """
    sd = strip_wrappers(unwrap_checkpoint(checkpoint))
    layout = detect_layout(set(sd))
    if layout is None:
        raise CheckpointError(
            f"unrecognised checkpoint layout (first keys: {', '.join(list(sd)[:4])}); expected Meta DINOv3, "
            f"transformers DINOv3ViT or timm eva DINOv3 weights"
        )
    sd = CONVERTERS[layout](sd)
    expected = dict(model.state_dict())
    dropped = []
    for key in [k for k in sd if k not in expected]:
        if key.startswith("local_cls_norm."):
            dropped.append(
                "local_cls_norm (only used in local-crop pretraining; build with local_cls_norm=True to keep it)"
            )
        elif key.startswith("head."):
            dropped.append("the checkpoint's classifier head (the model has num_classes=0)")
        else:
            continue
        del sd[key]
    config = getattr(model, "config", None)
    ls_summary, warnings = reconcile_layer_scale(
        sd,
        expected,
        getattr(config, "layer_init_values", []),
        strict=getattr(config, "strict_layer_scale", False),
        reinit=pretrained and getattr(config, "reinit_layer_scale", False),
    )
    filled = _fill_missing(sd, expected)
    _check_complete(sd, expected, layout, model)
    lines = [f"loaded a {layout} checkpoint"]
    if filled:
        lines.append("filled " + ", ".join(filled))
    if dropped:
        lines.append("dropped " + ", ".join(dict.fromkeys(dropped)))
    lines.append(ls_summary)
    return {k: sd[k] for k in expected}, lines + [f"WARNING: {w}" for w in warnings]


def _log(lines: list[str]) -> None:
    for line in lines:
        if line.startswith("WARNING: "):
            _logger.warning(line[len("WARNING: ") :])
        elif any(word in line for word in ("folded", "set ", "re-initialised")):
            _logger.warning(line)
        else:
            _logger.info(line)


def checkpoint_filter_fn(state_dict: Any, model: nn.Module) -> StateDict:
    """timm's `pretrained_filter_fn`: converts before timm adapts input channels or the classifier.

    Only pretrained loads (`pretrained=True`, train.py's `--pretrained`) pass through here; resuming and
    `--initial-checkpoint` reach the load hook alone, so `reinit_layer_scale` never touches their gammas.
    """
    converted, lines = convert_state_dict(state_dict, model, pretrained=True)
    model._pending_load_report = lines
    return converted


def _load_pre_hook(module: nn.Module, state_dict, prefix: str, *args) -> None:
    ours = {k[len(prefix) :]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    converted, lines = convert_state_dict(ours, module)
    state_dict.update({prefix + k: v for k, v in converted.items()})
    # After the filter the same load reaches this hook with converted keys: report only once.
    _log(module.__dict__.pop("_pending_load_report", None) or lines)


def install_load_hook(model: nn.Module) -> None:
    model._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)
