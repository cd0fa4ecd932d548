"""LayerScale on load: gammas are kept, folded into the projection before them, or set to 1, never dropped.

Folding uses `gamma * (W x + b) == (gamma[:, None] * W) x + gamma * b`: the branch output is unchanged,
which is also how LayerScale is fused away for inference (`fold_layer_scale`).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from .errors import CheckpointError

GAMMA_KEY = re.compile(r"^blocks\.(\d+)\.ls([12])\.gamma$")
# Values LayerScale is commonly initialised to: a gamma vector equal to one of them was never trained.
COMMON_INIT_VALUES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1)


def branch_output_projection(keys: set[str] | dict, block: int, branch: str) -> str | None:
    """The linear layer whose output a LayerScale scales: attn.proj, mlp.fc2 or SwiGLU's mlp.w3."""
    candidates = ["attn.proj"] if branch == "1" else ["mlp.fc2", "mlp.w3"]
    for name in candidates:
        if f"blocks.{block}.{name}.weight" in keys:
            return f"blocks.{block}.{name}"
    return None


def fold_gamma(weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor):
    gamma = gamma.to(weight.dtype)
    return weight * gamma[:, None], None if bias is None else bias * gamma


def reconcile_layer_scale(
    state_dict: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    init_values: list[tuple[float | None, float | None]],
    strict: bool,
) -> tuple[str, list[str]]:
    """Makes the file's gammas fit the model's LayerScale setting, in place. Returns (summary, warnings)."""
    file_gammas = {k for k in state_dict if GAMMA_KEY.match(k)}
    model_gammas = {k for k in expected if GAMMA_KEY.match(k)}
    kept = sorted(file_gammas & model_gammas, key=_block_order)
    to_fold = sorted(file_gammas - model_gammas, key=_block_order)
    missing = sorted(model_gammas - file_gammas, key=_block_order)

    for key in to_fold:
        block, branch = GAMMA_KEY.match(key).groups()
        proj = branch_output_projection(state_dict, int(block), branch)
        gamma = state_dict[key]
        if proj is None or gamma.shape != state_dict[f"{proj}.weight"].shape[:1]:
            raise CheckpointError(
                f"cannot fold LayerScale {key} {list(gamma.shape)} into the layer before it; build the model "
                f"with init_values set (e.g. init_values=1e-5) so the checkpoint's gammas load as they are"
            )
        weight, bias = fold_gamma(state_dict[f"{proj}.weight"], state_dict.get(f"{proj}.bias"), gamma)
        state_dict[f"{proj}.weight"] = weight
        if bias is not None:
            state_dict[f"{proj}.bias"] = bias
        del state_dict[key]

    if missing and strict:
        raise CheckpointError(
            f"the checkpoint has no LayerScale gammas ({missing[0]} and {len(missing) - 1} more) but the model "
            f"has LayerScale on; build it with init_values=0 to match the checkpoint, or leave "
            f"strict_layer_scale off to set the gammas to 1"
        )
    for key in missing:
        state_dict[key] = torch.ones(expected[key].shape, dtype=torch.float32)

    warnings = _suspicious_gammas(state_dict, kept, init_values)
    parts = []
    if kept:
        parts.append(f"kept {len(kept)} gammas from the checkpoint")
    if to_fold:
        parts.append(
            f"folded {len(to_fold)} gammas into the projections before them (the model has LayerScale off; "
            f"outputs are unchanged)"
        )
    if missing:
        parts.append(
            f"set {len(missing)} gammas to 1 because the checkpoint has none (outputs equal the source model's)"
        )
    summary = "LayerScale: " + ("; ".join(parts) if parts else "off in both checkpoint and model")
    return summary, warnings


def _block_order(key: str) -> tuple[int, int]:
    block, branch = GAMMA_KEY.match(key).groups()
    return int(block), int(branch)


def _suspicious_gammas(state_dict, kept: list[str], init_values) -> list[str]:
    non_finite, untrained = [], []
    for key in kept:
        gamma = state_dict[key].float()
        block, branch = _block_order(key)
        name = f"{block}.{'attn' if branch == 1 else 'mlp'}"
        if not torch.isfinite(gamma).all():
            non_finite.append(name)
            continue
        value = gamma.flatten()[0].item()
        configured = init_values[block][branch - 1] if block < len(init_values) else None
        inits = (*COMMON_INIT_VALUES, *([configured] if configured else []))
        if bool((gamma == gamma.flatten()[0]).all()) and any(math.isclose(value, v, rel_tol=1e-3) for v in inits):
            untrained.append(name)
    warnings = []
    if non_finite:
        warnings.append(
            f"LayerScale gammas are NaN or Inf in {_branches(non_finite, len(kept))}: the checkpoint is broken"
        )
    if untrained:
        warnings.append(
            f"LayerScale gammas equal an init value in {_branches(untrained, len(kept))}: the checkpoint looks "
            f"saved before training"
        )
    return warnings


def _branches(names: list[str], total: int, shown: int = 4) -> str:
    """`blocks 0.attn, 1.mlp`, or `all 64 branches`, or the first few and how many more: one short line."""
    if len(names) == total and total > 1:
        return f"all {total} branches"
    if len(names) <= shown + 1:
        return f"blocks {', '.join(names)}"
    return f"blocks {', '.join(names[:shown])} and {len(names) - shown} more ({len(names)} of {total} branches)"


@torch.no_grad()
def fold_layer_scale(model: nn.Module) -> nn.Module:
    """Fuses every LayerScale of a model into the projection before it and removes the LayerScale.

    Outputs stay the same (up to float rounding); the model gets a little faster and loses its gammas.
    Works on this package's models and on any model whose blocks use the same names.
    """
    from ..layers import LayerScale

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
        model.config = config.replace(init_values=0)
    return model


def _get(module: nn.Module, dotted: str) -> nn.Module | None:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
