"""LayerScale on load: gammas are kept, folded into the projection before them, or set to 1, never dropped.

Folding uses `layers.fold_gamma`, the same rule `fold_layer_scale` applies to a live model: the branch output is
unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...layers import fold_gamma
from ..errors import CheckpointError
from .gamma_keys import NATIVE_GAMMA_KEY
from .plan import Step, TensorInfo

# Values LayerScale is commonly initialised to: a gamma vector equal to one of them was never trained.
COMMON_INIT_VALUES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1)
BRANCH_WORDS = ("attention", "MLP")  # LayerScale's branches (`families.BRANCHES`), as the report names them


def branches_with_layer_scale(layer_init_values: Sequence[tuple[float | None, float | None]]) -> tuple[str, ...]:
    """The branches ("attention", "MLP") on which some block of a config's `layer_init_values` has LayerScale."""
    return tuple(name for i, name in enumerate(BRANCH_WORDS) if any(values[i] for values in layer_init_values))


def branch_output_projection(keys: Mapping[str, Any] | set[str], block: int, branch: str) -> str | None:
    """The linear layer whose output a LayerScale scales: attn.proj, mlp.fc2 or SwiGLU's mlp.w3."""
    candidates = ["attn.proj"] if branch == "1" else ["mlp.fc2", "mlp.w3"]
    for name in candidates:
        if f"blocks.{block}.{name}.weight" in keys:
            return f"blocks.{block}.{name}"
    return None


def _fold(weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor, **_):
    return fold_gamma(weight, bias, gamma)


@dataclass
class GammaDecisions:
    """What loading does with each gamma: keep it, fold it into `proj` before it, set it to 1, or restart it
    at its `init_values` (`reinit_layer_scale` on a pretrained load). `variant_has` are the branches the
    variant named for the model has LayerScale on, where the checkpoint's keys built it without."""

    kept: list[str]
    folded: list[tuple[str, str]]  # (gamma key, projection prefix)
    missing: list[str]
    restarted: list[str]
    variant_has: tuple[str, ...] = field(default=())

    def fold_steps(self, present: set[str]) -> list[Step]:
        steps = []
        for gamma, proj in self.folded:
            bias = f"{proj}.bias" if f"{proj}.bias" in present else None
            steps.append(Step((f"{proj}.weight", f"{proj}.bias"), (f"{proj}.weight", bias, gamma), _fold))
        return steps

    @property
    def changes_gammas(self) -> bool:
        """Whether the load gives the model gammas other than the checkpoint's (folded, set to 1, restarted)."""
        return bool(self.folded or self.missing or self.restarted)

    def summary(self) -> str:
        parts = []
        if self.restarted:
            parts.append(f"re-initialised {len(self.restarted)} gammas to init_values (reinit_layer_scale=True)")
        if self.kept:
            parts.append(f"kept {len(self.kept)} gammas from the checkpoint")
        if self.folded:
            parts.append(
                f"folded {len(self.folded)} gammas into the projections before them (the model has LayerScale "
                f"off; outputs are unchanged)"
            )
        if self.missing:
            parts.append(
                f"set {len(self.missing)} gammas to 1 because the checkpoint has none (outputs equal the source "
                f"model's)"
            )
        if not parts and self.variant_has:
            return (
                f"LayerScale: none in the checkpoint, so the model is built with it off (its variant has it on "
                f"{' and '.join(self.variant_has)}); its outputs are the checkpoint's"
            )
        return "LayerScale: " + ("; ".join(parts) if parts else "off in both checkpoint and model")


def decide_layer_scale(
    infos: Mapping[str, TensorInfo],
    expected: Mapping[str, Any],
    strict: bool = False,
    reinit: bool = False,
    variant_has: tuple[str, ...] = (),
) -> GammaDecisions:
    """Matches the checkpoint's gammas (native keys) to the model's LayerScale setting; nothing is read.

    `reinit` restarts every gamma the model holds at its init value instead (LayerScale's muted start on a
    pretrained trunk); gammas the model has no LayerScale for are still folded. `variant_has` names the
    branches the model's variant has LayerScale on, for the report of a model built without it.
    """
    file_gammas = {k for k in infos if NATIVE_GAMMA_KEY.match(k)}
    model_gammas = {k for k in expected if NATIVE_GAMMA_KEY.match(k)}
    folded = []
    for key in sorted(file_gammas - model_gammas, key=_block_order):
        block, branch = NATIVE_GAMMA_KEY.match(key).groups()
        proj = branch_output_projection(infos, int(block), branch)
        shape = infos[key].shape
        if proj is None or shape != infos[f"{proj}.weight"].shape[:1]:
            raise CheckpointError(
                f"cannot fold LayerScale {key} {list(shape)} into the layer before it; build the model "
                f"with init_values set (e.g. init_values=1e-5) so the checkpoint's gammas load as they are"
            )
        folded.append((key, proj))
    kept = sorted(file_gammas & model_gammas, key=_block_order)
    missing = sorted(model_gammas - file_gammas, key=_block_order)
    if reinit:
        return GammaDecisions([], folded, [], sorted(kept + missing, key=_block_order), variant_has)
    if missing and strict:
        raise CheckpointError(
            f"the checkpoint has no LayerScale gammas ({missing[0]} and {len(missing) - 1} more) but the model "
            f"has LayerScale on; build it with init_values=0 to match the checkpoint, or leave "
            f"strict_layer_scale off to set the gammas to 1"
        )
    return GammaDecisions(kept, folded, missing, [], variant_has)


def _block_order(key: str) -> tuple[int, int]:
    block, branch = NATIVE_GAMMA_KEY.match(key).groups()
    return int(block), int(branch)


def suspicious_gammas(
    gammas: Mapping[str, torch.Tensor], kept: list[str], init_values: list[tuple[float | None, float | None]]
) -> list[str]:
    """Warnings for gammas that are NaN or Inf (any of `gammas`), or, among `kept`, all equal to an init value."""
    non_finite, untrained = [], []
    for key in sorted(gammas, key=_block_order):
        gamma = gammas[key].float()
        block, branch = _block_order(key)
        name = f"{block}.{'attn' if branch == 1 else 'mlp'}"
        if not torch.isfinite(gamma).all():
            non_finite.append(name)
            continue
        if key not in kept:
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
