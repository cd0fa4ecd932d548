"""Native keys -> the keys a model holds: drop what it cannot hold, fold or fill LayerScale, fill what the
file lacks, and refuse anything that does not fit, all planned from shapes.

Loading a checkpoint into a live model and converting a file both run this against the model's state
dict (for a file, a model built on the meta device), so they agree on every rule and message.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...layers import RopeEmbedding, effective_qkv_bias, k_bias_mask
from ..errors import CheckpointError
from .gamma_keys import NATIVE_GAMMA_KEY
from .layer_scale import GammaDecisions, decide_layer_scale, suspicious_gammas
from .plan import PERIODS, Plan, Step, TensorInfo

Tensor = torch.Tensor

# Keys a checkpoint may lack that the model's own fresh value fills, by key ending.
OWN_VALUE_FILLS = {
    "attn.qkv.bias_mask": "qkv bias masks (k masked)",
    PERIODS: "the default RoPE periods",
    "head.weight": "the model's fresh classifier head",
    "head.bias": "the model's fresh classifier head",
}
# Keys a checkpoint may lack that are filled with zeros, by key ending, and what the report calls them.
ZERO_FILLS = {"attn.qkv.bias": "zero qkv biases", "mask_token": "a zero mask_token"}
# Keys a checkpoint may lack that fitting fills, by key ending: a file without them says nothing about which
# model it is (a classifier head aside: the checkpoint's own decides num_classes).
FILLED_KEY_ENDINGS = (*ZERO_FILLS, *(k for k in OWN_VALUE_FILLS if not k.startswith("head.")))
# Keys that only some options create, and the option that creates them.
# `{}` stands for whether the checkpoint holds the key.
OPTION_KEYS = (("cls_norm.", "cls_norm={}"), ("mlp.w1.", "ffn_layer='swiglu'"), ("mlp.fc1.", "ffn_layer='mlp'"))


def fillable(key: str) -> bool:
    """Whether fitting fills `key` when a checkpoint lacks it (a gamma is set to 1)."""
    return key.endswith(FILLED_KEY_ENDINGS) or NATIVE_GAMMA_KEY.match(key) is not None


class ReportLine(str):
    """A line of a load's report, a `str` for callers that print the report, with the log level its cause gives
    it and the message logged at that level (the line without its `WARNING: ` prefix)."""

    level: int
    message: str

    def __new__(cls, text: str, level: int = logging.INFO, message: str | None = None) -> ReportLine:
        line = super().__new__(cls, text)
        line.level, line.message = level, text if message is None else message
        return line


@dataclass
class Fitted:
    format_title: str  # the checkpoint's format as users name its keys: "Meta DINOv3 keys", "timm eva keys"
    plan: Plan  # the model's keys, in its order
    filled: list[str]
    dropped: list[str]
    layer_scale: GammaDecisions
    warnings: list[str]

    @property
    def layout(self) -> str:
        """The old name of `format_title`, still read."""
        return self.format_title

    def report(self, first_line: str | None = None, warnings: bool = True) -> list[ReportLine]:
        """What the fit did, a line each; `warnings=False` leaves the warnings to a caller that prints them."""
        lines = [ReportLine(first_line)] if first_line else []
        if self.filled:
            lines.append(ReportLine("filled " + ", ".join(self.filled)))
        if self.dropped:
            lines.append(ReportLine("dropped " + ", ".join(self.dropped)))
        # Gammas folded, set to 1 or restarted are weights the load changed: the user is told as a warning.
        changed = logging.WARNING if self.layer_scale.changes_gammas else logging.INFO
        lines.append(ReportLine(self.layer_scale.summary(), changed))
        return lines + ([ReportLine(f"WARNING: {w}", logging.WARNING, w) for w in self.warnings] if warnings else [])


def checked_periods(periods: Tensor) -> Tensor:
    """A checkpoint's RoPE periods in fp32, or one line: a NaN, infinite, zero or negative period makes every
    output NaN, so such a file is refused before anything is built from it."""
    values = periods.float()
    bad = ~torch.isfinite(values) | (values <= 0)
    if values.numel() and not bool(bad.any()):
        return values
    found = sorted(
        {"NaN" if v != v else "Inf" if abs(v) == float("inf") else "zero or negative" for v in values[bad].tolist()}
    )
    raise CheckpointError(
        f"{PERIODS} holds {' and '.join(found) or 'no values'} ({int(bad.sum())} of {values.numel()}): the checkpoint "
        f"is broken and RoPE would make every output NaN; convert an unbroken copy, or delete the key to use the "
        f"periods rope_base gives"
    )


def fit_to_model(
    native: Plan,
    expected: Mapping[str, Tensor],
    *,
    format_title: str | None = None,
    model_name: str,
    config=None,
    fill_dtype: torch.dtype = torch.float32,
    reinit_layer_scale: bool = False,
    variant_layer_scale: tuple[str, ...] = (),
    layout: str | None = None,
) -> Fitted:
    """Plans `native` (a checkpoint in native keys) into exactly `expected`'s keys and shapes, or raises.

    `format_title` names the checkpoint's format in the report and errors ("Meta DINOv3 keys"); `layout` is its
    old name, still taken.

    `expected` is a model's state dict, real or on the meta device; fills that need the model's own
    values compute them from `config` when it is on the meta device. `variant_layer_scale` are the branches
    the model's variant has LayerScale on ("attention", "MLP"), which the report names when the checkpoint's
    keys built the model without it.
    """
    format_title = format_title if format_title is not None else layout
    if format_title is None:
        raise TypeError("fit_to_model() missing required keyword argument: 'format_title'")
    infos = {k: native.info(k) for k in native}
    steps: dict[str, Step] = {k: Step((k,), (k,)) for k in infos}
    dropped = _drop_what_the_model_lacks(infos, expected, steps)
    strict = getattr(config, "strict_layer_scale", False)
    layer_scale = decide_layer_scale(
        infos, expected, strict=strict, reinit=reinit_layer_scale, variant_has=variant_layer_scale
    )
    for key in layer_scale.restarted:
        block, branch = NATIVE_GAMMA_KEY.match(key).groups()
        init_value = config.layer_init_values[int(block)][int(branch) - 1]
        steps[key] = _constant(key, torch.full(expected[key].shape, init_value, dtype=fill_dtype))
    for step in layer_scale.fold_steps(set(infos)):
        for key in step.outputs:
            steps[key] = step
        del steps[step.inputs[-1]]
    if PERIODS in infos:
        checked_periods(native[PERIODS])
    file_gammas = {k: native[k] for k in infos if NATIVE_GAMMA_KEY.match(k)}
    warnings = suspicious_gammas(file_gammas, layer_scale.kept, getattr(config, "layer_init_values", []))

    filled = []
    for key, target in expected.items():
        if key in steps and (key not in infos or infos[key].shape == target.shape or not key.startswith("head.")):
            continue  # present, or misshapen: the completeness check reports that
        fill = _fill(key, target, steps, config, fill_dtype)
        if fill is not None:
            steps[key], what = fill
            if what and what not in filled:
                filled.append(what)

    plan = Plan(native, _in_model_order(steps, expected))
    _check_complete(plan, expected, format_title, model_name)
    return Fitted(format_title, plan, filled, list(dict.fromkeys(dropped)), layer_scale, warnings)


def _drop_what_the_model_lacks(
    infos: Mapping[str, TensorInfo], expected: Mapping[str, Tensor], steps: dict
) -> list[str]:
    """Takes out of `steps` the checkpoint's tensors a model built without them may drop (a masked bias is
    folded into its bias instead), and says what they were."""
    dropped = []
    for key in [k for k in infos if k not in expected]:
        if key.startswith("local_cls_norm."):
            dropped.append(
                "local_cls_norm (only used in local-crop pretraining; build with local_cls_norm=True to keep it)"
            )
        elif key.startswith("head."):
            dropped.append("the checkpoint's classifier head (the model has num_classes=0)")
        elif key.endswith("attn.qkv.bias_mask") and key[: -len("_mask")] in expected and key[: -len("_mask")] in infos:
            bias = key[: -len("_mask")]  # the model has no mask: its bias becomes the masked one
            steps[bias] = Step((bias,), (bias, key), lambda b, m: (effective_qkv_bias(b, m),))
        else:
            continue
        del steps[key]
    return dropped


def _fill(
    key: str, target: Tensor, steps: Mapping[str, Step], config, dtype: torch.dtype
) -> tuple[Step, str | None] | None:
    """A step that makes `key` from nothing (or from `norm`), and what to report it as."""
    shape = target.shape
    norm_key = "norm." + key.partition(".")[2]
    zeros = next((v for k, v in ZERO_FILLS.items() if key.endswith(k)), None)
    if zeros is not None:
        return _constant(key, torch.zeros(shape, dtype=dtype)), zeros
    if NATIVE_GAMMA_KEY.match(key):
        return _constant(key, torch.ones(shape, dtype=dtype)), None  # the LayerScale summary reports it
    if key.startswith("local_cls_norm.") and norm_key in steps:
        return Step((key,), (norm_key,), lambda t: (t.clone(),)), "local_cls_norm from norm"
    what = next((v for k, v in OWN_VALUE_FILLS.items() if key.endswith(k)), None)
    if what is None:
        return None
    value = own_value(key, target, config)
    return _constant(key, value if key.endswith("periods") else value.to(dtype)), what


def _constant(key: str, value: Tensor) -> Step:
    return Step((key,), (), lambda: (value,))


def own_value(key: str, target: Tensor, config) -> Tensor:
    """The model's own fresh value of a buffer or head; computed from `config` for a meta-device model."""
    if target.device.type != "meta":
        return target.detach().clone()
    if key.endswith("attn.qkv.bias_mask"):
        return k_bias_mask(target.shape[0])
    if key.endswith("rope_embed.periods"):
        rope = RopeEmbedding(config.head_dim, base=config.rope_base, round_periods_to_bf16=config.rope_periods_bf16)
        return rope.periods.detach().clone()
    if key == "head.weight":
        return torch.nn.init.trunc_normal_(torch.empty(target.shape), std=0.02)
    return torch.zeros(target.shape)


def _in_model_order(steps: Mapping[str, Step], expected: Mapping[str, Tensor]) -> list[Step]:
    ordered, seen = [], set()
    for key in [*expected, *steps]:  # the model's keys first; extras last, for the check to name
        step = steps.get(key)
        if step is not None and id(step) not in seen:
            seen.add(id(step))
            ordered.append(step)
    return ordered


def _option_hint(key: str, in_checkpoint: bool) -> str:
    for fragment, option in OPTION_KEYS:
        if fragment in key:
            return f"the model with {option.format(in_checkpoint)} to match the checkpoint"
    return "the variant and options the checkpoint was made for"


def _check_complete(plan: Plan, expected: Mapping[str, Tensor], title: str, name: str) -> None:
    for key, target in expected.items():
        if key not in plan:
            raise CheckpointError(
                f"the checkpoint ({title}) lacks {key} {list(target.shape)} that {name} needs; build "
                f"{_option_hint(key, False)}"
            )
        if plan.info(key).shape != target.shape:
            raise CheckpointError(
                f"the checkpoint ({title}) does not fit {name}: {key} is {list(plan.info(key).shape)} in the "
                f"checkpoint but {list(target.shape)} in the model; build the variant the checkpoint was made for"
            )
        stored = plan.info(key).dtype
        if target.dtype.is_floating_point and not stored.is_floating_point:  # a cast would load raw bit patterns
            raise CheckpointError(
                f"the checkpoint ({title}) stores {key} as {str(stored).removeprefix('torch.')}, but {name} holds "
                f"it in floating point ({str(target.dtype).removeprefix('torch.')}); save the weights as F32, BF16 "
                f"or F16"
            )
    extra = [k for k in plan if k not in expected]
    if extra:
        shape = list(plan.info(extra[0]).shape)
        raise CheckpointError(
            f"the checkpoint ({title}) has {extra[0]} {shape} that {name} does not hold"
            f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; build {_option_hint(extra[0], True)}"
        )
