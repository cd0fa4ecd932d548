"""Every architecture knob of the family, named once with its default, and the rules that check them.

A variant's YAML file under `configs/` sets only what differs from these defaults; keyword arguments
given to `timm.create_model` (or train.py's `--model-kwargs`) override the YAML.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FFN_LAYERS = ("mlp", "swiglu")
NORM_LAYERS = ("layernorm", "rmsnorm")
ROPE_DTYPES = ("fp32", "bf16")
NORMALIZE_COORDS = ("separate", "min", "max")
STOCHASTIC_DEPTH = ("drop_path", "sample_drop")
GLOBAL_POOLS = ("token", "avg", "avgmax", "max", "cls_avg", "")
LAYER_SCALE_OFF = ("off", "none", "false", "0")
# Switches that act once, on the model being fine-tuned: never part of what a saved model passes on.
TRAINING_SWITCHES = ("freeze_layer_scale", "reinit_layer_scale")
BRANCHES = ("attn", "mlp")

BranchInit = tuple[float | None, float | None]


class UnknownConfigKeyError(TypeError, ValueError):
    """A key that is not a config field: a `TypeError` like any unknown keyword argument to a timm model, and
    a `ValueError` like every other config error, so callers catching either see it."""


@dataclass(frozen=True)
class Rule:
    """What a field allows: the check and the words of the one-line error naming it."""

    check: Callable[[Any], bool]
    allowed: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_size(value: Any) -> bool:
    if _is_int(value):
        return value > 0
    return isinstance(value, Sequence) and len(value) == 2 and all(_is_int(s) and s > 0 for s in value)


POSITIVE_INT = Rule(lambda v: _is_int(v) and v > 0, "a positive integer")
COUNT = Rule(lambda v: _is_int(v) and v >= 0, "an integer >= 0")
POSITIVE = Rule(lambda v: _is_number(v) and v > 0, "a positive number")
RATE = Rule(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)")
SWITCH = Rule(lambda v: isinstance(v, bool), "true or false")
SIZE = Rule(_is_size, "a positive integer or a pair of them")
SHIFT = Rule(lambda v: v is None or (_is_number(v) and v >= 0), "null or a number >= 0")
SCALE = Rule(lambda v: v is None or (_is_number(v) and v >= 1), "null or a number >= 1")
ANY = Rule(lambda v: True, "")  # checked by its own resolver (init_values)
KV_HEADS = Rule(
    lambda v: (
        v is None
        or (_is_int(v) and v > 0)
        or (isinstance(v, Sequence) and not isinstance(v, str) and all(_is_int(h) and h > 0 for h in v))
    ),
    "null (every head), a positive integer, or a list with one positive integer per block",
)


def one_of(choices: tuple[str, ...]) -> Rule:
    return Rule(lambda v: v in choices, f"one of {choices}")


def knob(default: Any, rule: Rule) -> Any:
    """A config field: its default and its rule, named together."""
    return field(default=default, metadata={"rule": rule})


@dataclass
class VitLsConfig:
    # Input and tokens
    img_size: int | tuple[int, int] = knob(224, SIZE)
    patch_size: int = knob(16, POSITIVE_INT)
    in_chans: int = knob(3, POSITIVE_INT)
    num_storage_tokens: int = knob(4, COUNT)
    mask_token: bool = knob(True, SWITCH)  # the token masked patches take (DINOv3's iBOT); Sapiens2 has none
    dynamic_img_size: bool = knob(True, SWITCH)
    dynamic_img_pad: bool = knob(False, SWITCH)  # False: a side that is not a multiple of patch_size is an error
    # NaFlex (timm's --naflex-loader): batches of patches at each image's own aspect ratio, as dicts
    use_naflex: bool = knob(True, SWITCH)  # the forward also takes NaFlex dicts; False takes images only, as eva
    patchify_channels_last: bool = knob(True, SWITCH)  # (P, P, C); False: (C, P, P), --naflex-patchify-channels-first
    enable_patch_interpolator: bool = knob(True, SWITCH)  # patches of another size resample the embedding (FlexiViT)
    # Trunk
    embed_dim: int = knob(768, POSITIVE_INT)
    depth: int = knob(12, POSITIVE_INT)
    num_heads: int = knob(12, POSITIVE_INT)
    # Grouped-query attention: k/v heads per block (null: num_heads), one int for all or one per block (as eva)
    num_kv_heads: int | list[int] | None = knob(None, KV_HEADS)
    qk_norm: bool = knob(False, SWITCH)  # a norm (norm_layer) over each head's q and k, before RoPE (Sapiens2)
    norm_layer: str = knob("layernorm", one_of(NORM_LAYERS))  # block norms, output norms and qk_norm
    ffn_layer: str = knob("mlp", one_of(FFN_LAYERS))  # "mlp" (GELU) or "swiglu"
    ffn_ratio: float = knob(4.0, POSITIVE)
    swiglu_align_to: int = knob(8, POSITIVE_INT)
    qkv_bias: bool = knob(True, SWITCH)
    mask_k_bias: bool = knob(True, SWITCH)  # the k third of the qkv bias is multiplied by a (loaded) mask
    proj_bias: bool = knob(True, SWITCH)
    ffn_bias: bool = knob(True, SWITCH)
    norm_eps: float = knob(1e-5, POSITIVE)
    # LayerScale: float, 0/"off"/None, "auto", {attn, mlp}, or a per-block list of those
    init_values: Any = knob(1e-5, ANY)
    # Rotary position embedding
    rope_base: float = knob(100.0, POSITIVE)
    rope_normalize_coords: str = knob("separate", one_of(NORMALIZE_COORDS))
    rope_periods_bf16: bool = knob(True, SWITCH)  # released checkpoints store bf16-rounded periods
    # What RoPE's tables and rotation compute in: fp32 (Meta's DINOv3, LingBot) or bf16 (Sapiens2's code as released)
    rope_dtype: str = knob("fp32", one_of(ROPE_DTYPES))
    rope_shift_coords: float | None = knob(None, SHIFT)
    rope_jitter_coords: float | None = knob(None, SCALE)
    rope_rescale_coords: float | None = knob(None, SCALE)  # Meta's pretraining used 2
    # Output norms
    cls_norm: bool = knob(False, SWITCH)  # untied norms: `cls_norm` for cls + storage tokens, `norm` for patches
    local_cls_norm: bool = knob(False, SWITCH)  # carried by SAT-L and 7B checkpoints; unused outside local crops
    # Head and regularisation
    num_classes: int = knob(1000, COUNT)
    global_pool: str = knob("token", one_of(GLOBAL_POOLS))
    drop_rate: float = knob(0.0, RATE)
    proj_drop_rate: float = knob(0.0, RATE)
    attn_drop_rate: float = knob(0.0, RATE)
    drop_path_rate: float = knob(0.0, RATE)
    # timm per-sample DropPath, or DINOv3's batch-subset sample drop
    stochastic_depth: str = knob("drop_path", one_of(STOCHASTIC_DEPTH))
    # Loading: refuse a checkpoint without gammas instead of setting them to 1
    strict_layer_scale: bool = knob(False, SWITCH)
    # Fine-tuning: gammas get no gradient (timm's optimiser factory leaves them out)
    freeze_layer_scale: bool = knob(False, SWITCH)
    # Fine-tuning: after a pretrained load (never a resume or --initial-checkpoint), gammas restart at init_values
    reinit_layer_scale: bool = knob(False, SWITCH)
    layer_init_values: list[BranchInit] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()
        self.layer_init_values = resolve_init_values(self.init_values, self.depth)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def default(cls, name: str) -> Any:
        """A field's default value."""
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> VitLsConfig:
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise UnknownConfigKeyError(
                f"{source}: unknown config key(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(cls.field_names())}"
            )
        try:
            return cls(**{k: parse_scalar(v) for k, v in values.items()})
        except ValueError as error:
            if source == "config":
                raise
            raise ValueError(f"{source}: {error}") from None

    def replace(self, **overrides: Any) -> VitLsConfig:
        values = {name: getattr(self, name) for name in self.field_names()}
        values.update(overrides)
        return self.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}

    def rebuild_args(self) -> dict[str, Any]:
        """Every field as a saved config's `model_args`, but the training switches, which act once on the model
        being fine-tuned (a saved model loaded with `reinit_layer_scale` would restart its trained gammas).
        LayerScale off is written as 0, because timm drops keyword arguments whose value is None."""
        args = {k: v for k, v in self.to_dict().items() if k not in TRAINING_SWITCHES}
        if args["init_values"] is None:
            args["init_values"] = 0
        return args

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def layer_kv_heads(self) -> list[int]:
        """The k/v heads of each block (`num_heads` where attention is not grouped)."""
        heads = self.num_kv_heads
        if heads is None or _is_int(heads):
            return [heads or self.num_heads] * self.depth
        return list(heads)

    @property
    def grouped_attention(self) -> bool:
        return any(h != self.num_heads for h in self.layer_kv_heads)

    @property
    def num_prefix_tokens(self) -> int:
        return 1 + self.num_storage_tokens

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            rule = f.metadata.get("rule")
            if rule is not None:
                _require(f.name, getattr(self, f.name), rule.check(getattr(self, f.name)), rule.allowed)
        _require(
            "num_heads",
            self.num_heads,
            self.embed_dim % self.num_heads == 0,
            f"a divisor of embed_dim={self.embed_dim}",
        )
        _require(
            "num_heads",
            self.num_heads,
            self.head_dim % 4 == 0,
            f"such that embed_dim / num_heads is a multiple of 4 for RoPE (embed_dim={self.embed_dim})",
        )
        kv = self.num_kv_heads
        _require(
            "num_kv_heads",
            kv,
            kv is None or _is_int(kv) or len(kv) == self.depth,
            f"a list of exactly depth={self.depth} entries, one per block",
        )
        _require(
            "num_kv_heads",
            kv,
            all(self.num_heads % h == 0 for h in self.layer_kv_heads),
            f"divisors of num_heads={self.num_heads}",
        )
        _require(
            "rope_dtype",
            self.rope_dtype,
            self.rope_dtype == "fp32" or self.rope_periods_bf16,
            "'fp32' with rope_periods_bf16=false (bf16 RoPE holds its periods in bf16)",
        )
        p = self.patch_size
        sides = (self.img_size,) if isinstance(self.img_size, int) else tuple(self.img_size)
        _require(
            "img_size",
            self.img_size,
            self.dynamic_img_pad or all(side % p == 0 for side in sides),
            f"a multiple of patch_size={p} per side, e.g. {_multiples_below(self.img_size, p)}, or any size "
            f"with dynamic_img_pad=True",
        )


def _multiples_below(size: int | Sequence[int], multiple: int) -> int | tuple[int, ...]:
    if isinstance(size, int):
        return max(size // multiple, 1) * multiple
    return tuple(max(side // multiple, 1) * multiple for side in size)


def _require(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}: got {value!r}; allowed: {allowed}")


def parse_scalar(value: Any) -> Any:
    """Strings from the command line (`--model-kwargs init_values=1e-6`) become numbers or booleans."""
    if not isinstance(value, str):
        return value
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return int(lowered)
    except ValueError:
        pass
    try:
        return float(lowered)
    except ValueError:
        return value


def cait_init_value(depth: int) -> float:
    """CaiT's rule (Touvron et al. 2021): deeper networks start closer to identity."""
    if depth <= 18:
        return 0.1
    if depth <= 24:
        return 1e-5
    return 1e-6


_INIT_VALUES_ALLOWED = (
    "a positive number, 0 / 'off' / false / null (LayerScale off), 'auto' (CaiT's depth rule), "
    "a mapping {attn: ..., mlp: ...} of those, or a list with one such entry per block"
)


def _resolve_scalar(value: Any, depth: int, where: str) -> float | None:
    value = parse_scalar(value)
    if value is None or value is False:
        return None
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in LAYER_SCALE_OFF:
            return None
        if lowered == "auto":
            return cait_init_value(depth)
    elif _is_number(value) and value >= 0:
        return None if value == 0 else float(value)
    raise ValueError(f"{where}: got {value!r}; allowed: {_INIT_VALUES_ALLOWED}")


def _resolve_branches(value: Any, depth: int, where: str) -> BranchInit:
    if isinstance(value, Mapping):
        if set(value) != set(BRANCHES):
            raise ValueError(f"{where}: got keys {sorted(value)}; allowed: exactly {list(BRANCHES)}")
        return tuple(_resolve_scalar(value[b], depth, f"{where}.{b}") for b in BRANCHES)
    scalar = _resolve_scalar(value, depth, where)
    return scalar, scalar


def resolve_init_values(value: Any, depth: int) -> list[BranchInit]:
    """One (attn, mlp) pair of LayerScale init values per block; `None` means no LayerScale there."""
    if isinstance(value, str) and value.strip().startswith("["):
        import yaml  # only for a list spelled as text (train.py's --model-kwargs)

        value = yaml.safe_load(value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != depth:
            raise ValueError(
                f"init_values: got a list of {len(value)} entries; allowed: exactly depth={depth} entries, "
                f"one per block"
            )
        return [_resolve_branches(v, depth, f"init_values[{i}]") for i, v in enumerate(value)]
    return [_resolve_branches(value, depth, "init_values")] * depth


# ------------------------------------------------------------------------------------ feature blocks by name

# Meta's names for the blocks a dense head reads (dinov3/eval/segmentation/models/__init__.py,
# BackboneLayersSet): LAST for the linear and depth heads, FOUR_LAST, and FOUR_EVEN_INTERVALS for Mask2Former.
FEATURE_LAYER_NAMES = {
    "last": "last",
    "last_four": "last_four",
    "four_last": "last_four",
    "four_even": "four_even",
    "four_even_intervals": "four_even",
}
PAPER_FOUR_EVEN = {24: [4, 11, 17, 23]}  # Meta keeps the paper's ViT-L blocks for 24, not 5, 11, 17, 23


def feature_layers(indices: Any, depth: int) -> Any:
    """Block indices for a name (Meta's spelling or ours, any case), anything else as it is.

    `last`: the last block. `last_four` (`four_last`): the last four, in order. `four_even`
    (`four_even_intervals`): Meta's `i * (depth // 4) - 1` for i = 1..4 (2, 5, 8, 11 of 12 blocks; 9, 19, 29,
    39 of 40), except 24 blocks, which get the paper's 4, 11, 17, 23. Under 4 blocks both four-block names
    give every block, in order (Meta's formula would name block -1 four times).
    """
    if not isinstance(indices, str):
        return indices
    name = FEATURE_LAYER_NAMES.get(indices.strip().lower())
    if name is None:
        raise ValueError(
            f"feature blocks: got {indices!r}; allowed: block indices or one of {', '.join(FEATURE_LAYER_NAMES)}"
        )
    if name == "last":
        return [depth - 1]
    if depth < 4:
        return list(range(depth))
    if name == "last_four":
        return list(range(depth - 4, depth))
    return PAPER_FOUR_EVEN.get(depth, [i * (depth // 4) - 1 for i in range(1, 5)])
