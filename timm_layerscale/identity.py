"""Which variant and arguments a checkpoint's weights are: one rule for convert, export and inspect
(`identify_checkpoint`).

The variant is, first to last: the one the caller names (`--model`), the one the checkpoint records (the
`architecture` of a config.json beside it, or the `arch` timm's train.py saves in it), the registered one of
its family whose shapes are nearest the weights'. Its arguments are then the variant's (and its tag's), what
the weights' keys decide (biases, norms, head, LayerScale per branch, RoPE periods), what the checkpoint
records (widths, heads, RoPE base, data config), and last the caller's `--model-kwargs`, which complete the
arguments and never change the name. The result must build a model whose every key fits the weights, or the
one error line names the variant, the first key that differs and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from timm.models import get_pretrained_cfg

from timm_ls.names import is_variant_file

from .checkpoints.errors import CheckpointError
from .checkpoints.formats import CONFIG_FILE, Format, SourceConfig, recognise, source_config
from .checkpoints.mapping.fit import checked_periods, fillable
from .checkpoints.mapping.gamma_keys import native_gamma_key
from .checkpoints.mapping.keys import block_count
from .checkpoints.mapping.plan import PERIODS, Plan, TensorInfo
from .checkpoints.read.reader import LazyCheckpoint
from .config import VitLsConfig, resolve_init_values
from .families import family_record, layout_of_keys
from .layer_options import options_in_keys, shown_args
from .model import VisionTransformerLS
from .variants import VARIANTS, Variant, VariantNameError, builtin_architecture, find_variant, load_variant

__all__ = ["IdentifiedCheckpoint", "IdentifiedModel", "expected_state", "identify", "identify_checkpoint", "key_args"]

# The layer options a checkpoint's keys decide over the variant's (`layer_options` signatures).
KEYED_OPTIONS = ("norm_layer", "qk_norm")
MAX_LISTED = 80  # characters of model arguments a reason lists; `IdentifiedModel.config` has them all
# What makes a released DINOv3's shape: equal in these, a model has the shapes Meta trained.
SHAPE_FIELDS = ("embed_dim", "depth", "num_heads", "patch_size", "ffn_layer", "ffn_ratio", "swiglu_align_to")


@dataclass
class IdentifiedModel:
    """The model a checkpoint holds: its variant, full config, and why that variant."""

    name: str
    tag: str | None
    config: VitLsConfig
    reason: str
    pretrained_cfg: dict[str, Any] = field(default_factory=dict)

    @property
    def full_name(self) -> str:
        return f"{self.name}.{self.tag}" if self.tag else self.name

    @property
    def architecture(self) -> str:
        """The shipped variant a saved config names for this model (its own, its YAML's base, or the nearest)."""
        return builtin_architecture(self.name, self.config)

    @property
    def released(self) -> bool:
        """Whether the model has the shapes of a released DINOv3: a registered variant's, unchanged."""
        variant = VARIANTS.get(self.name)
        return variant is not None and all(
            getattr(variant.config, name) == getattr(self.config, name) for name in SHAPE_FIELDS
        )


@functools.lru_cache(maxsize=32)
def _expected(config_json: str) -> dict[str, torch.Tensor]:
    return VisionTransformerLS(VitLsConfig.from_dict(json.loads(config_json)), device="meta").state_dict()


def expected_state(config: VitLsConfig) -> dict[str, torch.Tensor]:
    """The state dict of the model `config` builds, on the meta device (nothing allocated)."""
    return _expected(json.dumps(config.to_dict(), sort_keys=True))


def key_args(
    native: Mapping[str, torch.Tensor], base: Mapping[str, Any], unheld: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The model args a checkpoint's keys decide over the variant's `base` args: biases, norms, head,
    LayerScale per branch, periods. An arg in `unheld` is one the weights' format has no place for (timm's
    plain eva files leave out all-zero qkv biases and the local-crop norm): a key it lacks then says nothing,
    and the variant's value stands (the model fills zero biases, as Meta's released files hold them, and the
    local-crop norm from the norm)."""
    keys = set(native)
    depth = block_count(keys)

    def has(arg: str, *names: str) -> bool:
        return bool(set(names) & keys) or (arg in unheld and bool(base.get(arg, VitLsConfig.default(arg))))

    args: dict[str, Any] = {
        "qkv_bias": has("qkv_bias", "blocks.0.attn.qkv.bias"),
        "proj_bias": "blocks.0.attn.proj.bias" in keys,
        "cls_norm": "cls_norm.weight" in keys,
        "local_cls_norm": has("local_cls_norm", "local_cls_norm.weight"),
        "num_classes": native.info("head.weight").shape[0] if "head.weight" in keys else 0,
        "init_values": _layer_scale(keys, depth, _first_init_value(base)),
        "mask_token": has("mask_token", "mask_token"),
        **shown_args(keys),  # what the layer options' keys show (an FFN's bias)
    }
    # The norm and the attention's switches by their options' signatures (the FFN's kind is the variant's shape).
    args.update({k: v for k, v in options_in_keys(keys).items() if k in KEYED_OPTIONS})
    kv_heads = _kv_heads(native, depth)
    if kv_heads is not None:
        args["num_kv_heads"] = kv_heads
    if PERIODS in keys:  # exact in bf16: Meta's rounding; the loaded periods win either way
        periods = checked_periods(native[PERIODS])
        args["rope_periods_bf16"] = bool(torch.equal(periods, periods.bfloat16().float()))
    else:  # formats without periods compute them in fp32, unrounded, and RoPE in fp32 (timm's, transformers')
        args["rope_periods_bf16"] = False
        args["rope_dtype"] = "fp32"
    return args


def _kv_heads(native: Mapping[str, torch.Tensor], depth: int) -> list[int] | None:
    """Each block's k/v heads from its qkv rows, when any block's are fewer than its q rows (grouped-query
    attention; the head width comes from the q-norm, which every grouped family has), else None."""
    if "blocks.0.attn.q_norm.weight" not in native:
        return None
    q_norm = native.info("blocks.0.attn.q_norm.weight").shape
    if len(q_norm) != 1 or q_norm[0] == 0:
        raise CheckpointError(
            f"blocks.0.attn.q_norm.weight is {list(q_norm)}: a q-norm has one weight per channel of a head; "
            f"the checkpoint is broken, convert an unbroken copy"
        )
    head_dim = q_norm[0]
    heads = []
    for i in range(depth):
        qkv = native.info(f"blocks.{i}.attn.qkv.weight") if f"blocks.{i}.attn.qkv.weight" in native else None
        if qkv is None or len(qkv.shape) != 2:
            found = "has no" if qkv is None else f"has a {list(qkv.shape)}"
            raise CheckpointError(
                f"block {i} of {depth} {found} attention projection (attn.qkv, or its q, k and v parts together): "
                f"the checkpoint is incomplete or its blocks are not numbered 0 to {depth - 1}"
            )
        rows, dim = qkv.shape
        heads.append((rows - dim) // 2 // head_dim)
    full = native.info("blocks.0.attn.qkv.weight").shape[1] // head_dim
    return heads if any(h != full for h in heads) else None


def _layer_scale(keys: set[str], depth: int, init_value: float) -> Any:
    branches = [(native_gamma_key(i, 1) in keys, native_gamma_key(i, 2) in keys) for i in range(depth)]
    if not any(a or m for a, m in branches):
        return 0
    if len(set(branches)) == 1 and not all(branches[0]):  # one branch in every block (Sapiens2: attention)
        attn, mlp = branches[0]
        return {"attn": init_value if attn else 0, "mlp": init_value if mlp else 0}
    if not all(a and m for a, m in branches):
        return [{"attn": init_value if a else 0, "mlp": init_value if m else 0} for a, m in branches]
    return init_value


def _first_init_value(args: Mapping[str, Any]) -> float:
    try:
        resolved = resolve_init_values(args.get("init_values", 1e-5), int(args.get("depth", 1)))
    except (ValueError, TypeError):
        return 1e-5
    return next((v for pair in resolved for v in pair if v), 1e-5)


def differences(
    infos: Mapping[str, TensorInfo], expected: Mapping[str, torch.Tensor], name: str
) -> tuple[list[str], float]:
    """The keys whose shapes differ between a checkpoint and a model, and how far apart the two are."""
    found, distance = [], 0.0
    for key, target in expected.items():
        if key in infos and infos[key].shape != target.shape:
            found.append(f"{key} is {list(infos[key].shape)} in the checkpoint but {list(target.shape)} in {name}")
            distance += abs(math.log(max(infos[key].shape.numel(), 1) / max(target.shape.numel(), 1)))
        elif key not in infos and not fillable(key):
            found.append(f"{name} has {key} {list(target.shape)} and the checkpoint does not")
            distance += 1
    for key in infos:
        if key not in expected and not key.startswith(("local_cls_norm.", "head.")) and not fillable(key):
            found.append(f"the checkpoint has {key} {list(infos[key].shape)} and {name} does not")
            distance += 1
    return found, distance


# What the line says of a variant named by the checkpoint (recorded, or nearest) that its weights do not fit.
RECORDED_MISFIT = "the checkpoint records {name}, whose shapes differ"
NEAREST_MISFIT = "the checkpoint's shapes match no registered variant; the nearest is {name}"


def _candidates(
    model: str | None, recorded: SourceConfig | None
) -> tuple[dict[str, Variant], str | None, str, str | None]:
    """The variants to choose among, the tag asked for, why, and the line for weights that do not fit the one
    named (None for a variant the caller gives: the load's own checks name the option that differs): the
    caller's `model`, else the variant the checkpoint records, else every variant, ranked by shape."""
    if model and is_variant_file(model):
        variant = load_variant(model)  # not registered: the written config names a shipped architecture
        return {variant.name: variant}, None, f"from {model}", None
    if model:
        try:
            variant, tag = find_variant(model)
        except VariantNameError as exc:
            raise CheckpointError(str(exc)) from None
        return {variant.name: variant}, tag, "given", None
    if recorded is not None and recorded.architecture in VARIANTS:
        named = {recorded.architecture: VARIANTS[recorded.architecture]}
        return named, None, f"recorded in {recorded.origin}", RECORDED_MISFIT
    return dict(sorted(VARIANTS.items())), None, "from the shapes", NEAREST_MISFIT


@dataclass(frozen=True)
class _Weights:
    """The weights being identified: in native keys, the model args their format has no place for, and the family
    their format's keys say they are (None: the family records' rules read it from the native keys)."""

    native: Plan
    unheld: frozenset[str]
    fuse: bool
    family: str | None = None


def _config(
    variant: Variant, tag: str | None, weights: _Weights, overrides: Mapping[str, Any], source: str = ""
) -> VitLsConfig:
    base = {**variant.model_args, **variant.tag_model_args(tag)}
    record = family_record(overrides.get("family") or base.get("family") or VitLsConfig.default("family"))
    keyed = {k: v for k, v in key_args(weights.native, base, weights.unheld).items() if k in record.keyed}
    args = {**base, **keyed, **overrides}
    kv = args.get("num_kv_heads")
    if isinstance(kv, list) and len(kv) != args.get("depth", VitLsConfig.default("depth")):
        args["num_kv_heads"] = overrides.get("num_kv_heads", base.get("num_kv_heads"))  # another depth: its shapes
    if weights.fuse:  # every gamma folds: the model has LayerScale off
        args["init_values"] = 0
    return VitLsConfig.from_dict(args, source=source or f"the args of {variant.name}")


def _nearest(variants: Mapping[str, Variant], weights: _Weights, asked: Mapping[str, Any]) -> str:
    """The variant whose shapes, with what the keys decide and the caller `asked`, are nearest the weights': the
    fewest differing keys, then the smallest difference in size; among variants the caller's arguments make
    equally near (`embed_dim=64 depth=2 num_heads=4` makes every variant that shape), the one nearest the
    weights without them, so the arguments complete the variant the weights are and do not pick another."""
    infos = {k: weights.native.info(k) for k in weights.native}
    ranks, refusals = {}, []
    # Only variants of the weights' layout are ranked: their format's family's, else the records' rules'.
    layout = family_record(weights.family).layout if weights.family else layout_of_keys(weights.native)
    variants = {n: v for n, v in variants.items() if family_record(v.config.family).layout == layout} or variants
    for name, variant in variants.items():
        try:
            config = _config(variant, None, weights, asked, source="the model args")
        except ValueError as exc:
            refusals.append(exc)
            continue
        found, distance = differences(infos, expected_state(config), name)
        _, alone = differences(infos, expected_state(_config(variant, None, weights, {})), name)
        ranks[name] = (bool(found), distance, alone, name)
    if not ranks:
        raise refusals[0]  # a bad argument: its line names what is allowed
    return min(ranks, key=ranks.get)


def identify(
    native: Plan,
    model: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    source_config: SourceConfig | None = None,
    fuse_layerscale: bool = False,
    unheld: frozenset[str] = frozenset(),
    family: str | None = None,
) -> IdentifiedModel:
    """The variant and full config of a checkpoint in native keys. The variant is, first to last: `model` (a
    name, `NAME.TAG` or a YAML file), the variant the checkpoint records (`source_config.architecture`), the
    nearest by shape (among the variants of `family`'s layout, the family the weights' format says they are, where it
    says). `source_config`'s args, then `model_kwargs`, complete its arguments. Raises
    `CheckpointError` naming the variant and the first key that differs when the weights do not fit it."""
    variants, tag, reason, misfit = _candidates(model, source_config)
    weights = _Weights(native, unheld, fuse_layerscale, family)
    asked = dict(model_kwargs or {})
    name = _nearest(variants, weights, asked) if len(variants) > 1 else next(iter(variants))
    completing = dict(source_config.args) if source_config else {}
    overrides = {**completing, **asked}
    config = _config(variants[name], tag, weights, overrides)
    if misfit is not None:
        _refuse_misfit(native, config, name, misfit.format(name=name))
    if completing and len(variants) > 1:
        reason += f" and {source_config.origin}"
    listed = " ".join(f"{k}={v}" for k, v in overrides.items())
    if overrides:  # a config.json's every argument would make the summary line a paragraph: counted instead
        reason += f", with {listed}" if len(listed) <= MAX_LISTED else f", with {len(overrides)} model arguments"
    pretrained = (source_config.pretrained_cfg if source_config else None) or _pretrained_cfg(name, tag)
    return IdentifiedModel(name, tag, config, reason, pretrained)


def _refuse_misfit(native: Plan, config: VitLsConfig, name: str, said: str) -> None:
    infos = {k: native.info(k) for k in native}
    found, _ = differences(infos, expected_state(config), name)
    if found:
        more = f" ({len(found) - 1} more keys differ)" if len(found) > 1 else ""
        raise CheckpointError(
            f"{said}: {found[0]}{more}; pass --model NAME and --model-kwargs for what differs (e.g. "
            f"embed_dim=... depth=... num_heads=...)"
        )


def _pretrained_cfg(name: str, tag: str | None) -> dict[str, Any]:
    cfg = get_pretrained_cfg(f"{name}.{tag}" if tag else name)
    values = cfg.to_dict() if cfg is not None else {}
    if not tag:
        values.pop("tag", None)
    return values


@dataclass
class IdentifiedCheckpoint:
    """A checkpoint identified: its format, its weights in native keys, and the model they are."""

    format: Format
    native: Plan
    model: IdentifiedModel


def identify_checkpoint(
    ckpt: LazyCheckpoint,
    model: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    fuse_layerscale: bool = False,
    prepare: Callable[[Plan], Plan] | None = None,
) -> IdentifiedCheckpoint:
    """Recognises a checkpoint's format, maps its keys to native ones (then `prepare`s them, e.g. fewer blocks)
    and names the model they are by `identify`'s precedence, with what the checkpoint records of itself."""
    source_format = recognise(ckpt)
    native = source_format.table.to_native(ckpt)
    if prepare is not None:
        native = prepare(native)
    recorded = recorded_config(ckpt)
    family = source_format.family_of_keys(list(ckpt))  # the format that read the keys knows whose they are
    found = identify(native, model, model_kwargs, recorded, fuse_layerscale, source_format.unheld_args, family)
    return IdentifiedCheckpoint(source_format, native, found)


def recorded_config(ckpt: LazyCheckpoint) -> SourceConfig | None:
    """What a checkpoint records of its model: its folder's config.json, else what train.py saved in it."""
    try:
        if ckpt.hub_config:
            return source_config(ckpt.hub_config, str(ckpt.path / CONFIG_FILE))
        found = source_config(ckpt.recorded, f"{ckpt.path} (train.py's args)") if ckpt.recorded else None
    except ValueError as exc:  # a value of the wrong type or beyond any machine: named with its file
        raise CheckpointError(f"{exc}; fix or remove the value") from None
    return dataclasses.replace(found, origin="the checkpoint (train.py's args)") if found else None
