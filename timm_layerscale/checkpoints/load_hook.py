"""file -> format -> mapping -> load: every checkpoint format becomes a model's own state dict.

`plan_load` plans every load from shapes, on the formats' key tables (`formats/`) and fitting rules
(`mapping/fit.py`), reading one tensor at a time: pretrained loading streams its plan into a model on the meta
device (`timm_layerscale.loading`), and `convert_state_dict` runs it for a `load_state_dict` pre-hook on
every model, because `timm.models.load_checkpoint`, `checkpoint_path=`,
train.py's `--initial-checkpoint` and validate.py's `--checkpoint` load without any filter (and for
`checkpoint_filter_fn`, for code that calls timm's own `load_pretrained`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .formats import recognise
from .mapping.fit import Fitted, ReportLine, fit_to_model
from .mapping.keys import StateDict
from .mapping.plan import Plan
from .read.reader import LazyCheckpoint, open_checkpoint

__all__ = ["checkpoint_filter_fn", "convert_state_dict", "install_load_hook", "log_report", "plan_load"]

_logger = logging.getLogger("timm_layerscale")


def plan_load(
    checkpoint: Any, model: nn.Module, pretrained: bool = False, prepare: Callable[[Plan], Plan] | None = None
) -> Fitted:
    """Plans loading any supported checkpoint into `model` (live or on the meta device), reading nothing
    but the gammas it checks: `plan_load(...).plan.items()` yields the model's keys and tensors one by one,
    in the model's order. Raises `CheckpointError` for what cannot load.

    `pretrained` marks a pretrained load, the only kind that `reinit_layer_scale` re-initialises. `prepare`
    changes the checkpoint in native keys before it is fitted (pretrained loading adapts head and stem there).
    """
    source = checkpoint if isinstance(checkpoint, LazyCheckpoint) else open_checkpoint(checkpoint)
    checkpoint_format = recognise(source)
    name = getattr(model, "pretrained_cfg", {}).get("architecture") or type(model).__name__
    config = getattr(model, "config", None)
    native = checkpoint_format.table.to_native(source)
    return fit_to_model(
        prepare(native) if prepare else native,
        model.state_dict(),
        format_title=checkpoint_format.title,
        model_name=name,
        config=config,
        reinit_layer_scale=pretrained and getattr(config, "reinit_layer_scale", False),
    )


def convert_state_dict(checkpoint: Any, model: nn.Module, pretrained: bool = False) -> tuple[StateDict, list[str]]:
    """Converts any supported checkpoint to `model`'s own keys, complete, or raises `CheckpointError`.

    Returns the state dict and the report lines (the format title, what was filled or dropped, LayerScale).
    `pretrained` marks a pretrained load, the only kind that `reinit_layer_scale` re-initialises.
    """
    fitted = plan_load(checkpoint, model, pretrained)
    return dict(fitted.plan.items()), fitted.report(f"loaded a checkpoint with {fitted.format_title}")


def log_report(lines: Sequence[str]) -> None:
    """Logs a load's report on the `timm_layerscale` logger, each line at the level that what made it gives it
    (`ReportLine.level`); a plain string is information."""
    for line in lines:
        if isinstance(line, ReportLine):
            _logger.log(line.level, line.message)
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
    if not ours:  # a wrapper loading only its other parts (strict=False): torch reports what is missing
        return
    converted, lines = convert_state_dict(ours, module)
    state_dict.update({prefix + k: v for k, v in converted.items()})
    # After the filter the same load reaches this hook with converted keys: report only once.
    log_report(module.__dict__.pop("_pending_load_report", None) or lines)


def install_load_hook(model: nn.Module) -> None:
    model._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)
