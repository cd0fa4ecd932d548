"""Every architecture knob of the family, named once with its default, and the rules that check them.

A variant's YAML file under `configs/` sets only what differs from these defaults; keyword arguments
given to `timm.create_model` (or train.py's `--model-kwargs`) override the YAML.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Layer sets by name live beside the command's checks (torch-free); `config.feature_layers` stays public.
from timm_ls.layer_sets import FEATURE_LAYER_NAMES as FEATURE_LAYER_NAMES
from timm_ls.layer_sets import feature_layers as feature_layers
from timm_ls.plain_yaml import load_text

from .families import BRANCHES, FAMILIES, family_problem, is_family
from .layer_options import option_values

ROPE_DTYPES = ("fp32", "bf16")
NORMALIZE_COORDS = ("separate", "min", "max")
STOCHASTIC_DEPTH = ("drop_path", "sample_drop")
GLOBAL_POOLS = ("token", "avg", "avgmax", "max", "cls_avg", "")
LAYER_SCALE_OFF = ("off", "none", "false", "0")
# Switches that act once, on the model being fine-tuned: never part of what a saved model passes on.
TRAINING_SWITCHES = ("freeze_layer_scale", "reinit_layer_scale")

BranchInit = tuple[float | None, float | None]


class UnknownConfigKeyError(TypeError, ValueError):
    """A key that is not a config field: a `TypeError` like any unknown keyword argument to a timm model, and
    a `ValueError` like every other config error, so callers catching either see it."""


@dataclass(frozen=True)
class Rule:
    """What a field allows: the check and the words of the one-line error naming it (`words`, or a function giving
    them when the error is made, for what a registry allows)."""

    check: Callable[[Any], bool]
    words: str | Callable[[], str]

    @property
    def allowed(self) -> str:
        return self.words() if callable(self.words) else self.words


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if _is_int(value):  # exact at any size (math.isfinite overflows on an int beyond a float)
        return True
    return isinstance(value, float) and math.isfinite(value)


# The largest values a config may have: far above DINOv3's 7B (4096 wide, 40 deep, 32 heads, 4 storage tokens)
# and any model a machine could hold, so that no value given (a file, a YAML, --model-kwargs, a block index in
# a key) makes the process build or allocate in proportion to it before it is refused.
MAX_DEPTH = 1024
MAX_WIDTH = 65536
MAX_HEADS = 1024
MAX_TOKENS = 1024  # storage tokens
MAX_CLASSES = 1 << 20
MAX_RATIO = 64.0  # FFN hidden width per embed_dim
MAX_SIDE = 65536  # pixels of an image side
MAX_PATCH = 1024
MAX_CHANNELS = 1024


def int_in(low: int, high: int) -> Rule:
    """An integer (never a bool) in [low, high]."""
    return Rule(lambda v: _is_int(v) and low <= v <= high, f"an integer in [{low}, {high}]")


def number_in(low: float, high: float, low_open: bool = True, why: str = "", optional: bool = False) -> Rule:
    """A finite number (never a bool) above `low` (or at it, with `low_open=False`) and at most `high`; `why`
    says where real models lie, `optional` also allows null."""
    bracket = "(" if low_open else "["

    def check(v: Any) -> bool:
        if v is None:
            return optional
        return _is_number(v) and (v > low if low_open else v >= low) and v <= high

    words = f"a number in {bracket}{low:g}, {high:g}]" + (f" ({why})" if why else "")
    return Rule(check, f"null or {words}" if optional else words)


def _is_size(value: Any) -> bool:
    if _is_int(value):
        return 0 < value <= MAX_SIDE
    return isinstance(value, Sequence) and len(value) == 2 and all(_is_int(s) and 0 < s <= MAX_SIDE for s in value)


# Ranges of the float fields: where released models lie, with a wide margin, and no further, since a value
# beyond them gives NaN, infinite RoPE periods or all-zero features without an error.
NORM_EPS = number_in(1e-12, 0.1, low_open=False, why="released models use 1e-6 or 1e-5")
ROPE_BASE = number_in(1, 1e6, low_open=False, why="RoPE's largest period; released models use 100")
FFN_RATIO = number_in(1 / 16, MAX_RATIO, low_open=False, why="released models use 4 to 6")
COORDS_SHIFT = number_in(0, 16, low_open=False, why="a shift of patch coordinates in [-1, 1]", optional=True)
COORDS_SCALE = number_in(1, 16, low_open=False, why="a log-uniform factor; Meta's pretraining uses 2", optional=True)
RATE = Rule(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)")
SWITCH = Rule(lambda v: isinstance(v, bool), "true or false")
SIZE = Rule(_is_size, f"an integer in [1, {MAX_SIDE}] or a pair of them")
_INIT_VALUES_ALLOWED = (
    "a positive number, 0 / 'off' / false / null (LayerScale off), 'auto' (CaiT's depth rule), "
    "a mapping {attn: ..., mlp: ...} of those, or a list with one such entry per block"
)
# Its shape as given: scalars, {attn, mlp} mappings of them, or a list of those no longer than the deepest
# model (its length against depth, and each value, are checked when resolved).
INIT_VALUES = Rule(lambda v: _is_init_values(v), _INIT_VALUES_ALLOWED)


def _is_heads_per_block(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) <= MAX_DEPTH
        and all(_is_int(h) and 0 < h <= MAX_HEADS for h in value)
    )


HEADS_PER_BLOCK = Rule(_is_heads_per_block, f"a list with one integer in [1, {MAX_HEADS}] per block")
KV_HEADS = Rule(
    lambda v: v is None or (_is_int(v) and 0 < v <= MAX_HEADS) or _is_heads_per_block(v),
    f"null (every head), an integer in [1, {MAX_HEADS}], or a list with one such integer per block",
)


FAMILY = Rule(is_family, lambda: f"a registered family: {', '.join(FAMILIES)}, or one added by register_family")


def one_of(choices: tuple[str, ...]) -> Rule:
    return Rule(lambda v: v in choices, f"one of {choices}")


def registered(field_name: str) -> Rule:
    """One of the values the layers register for a field (`layer_options`), read when a value is checked."""
    return Rule(
        lambda v: v in option_values(field_name),
        lambda: f"one of {option_values(field_name)} (or one added by register_option)",
    )


def knob(default: Any, rule: Rule) -> Any:
    """A config field: its default and its rule, named together."""
    return field(default=default, metadata={"rule": rule})


@dataclass
class VitLsConfig:
    # The family the model is (`families`): its record says what it allows and which formats hold it
    family: str = knob("dinov3", FAMILY)
    # Input and tokens
    img_size: int | tuple[int, int] = knob(224, SIZE)
    patch_size: int = knob(16, int_in(1, MAX_PATCH))
    in_chans: int = knob(3, int_in(1, MAX_CHANNELS))
    num_storage_tokens: int = knob(4, int_in(0, MAX_TOKENS))
    mask_token: bool = knob(True, SWITCH)  # the token masked patches take (DINOv3's iBOT); Sapiens2 has none
    dynamic_img_size: bool = knob(True, SWITCH)
    dynamic_img_pad: bool = knob(False, SWITCH)  # False: a side that is not a multiple of patch_size is an error
    # NaFlex (timm's --naflex-loader): batches of patches at each image's own aspect ratio, as dicts
    use_naflex: bool = knob(True, SWITCH)  # the forward also takes NaFlex dicts; False takes images only, as eva
    patchify_channels_last: bool = knob(True, SWITCH)  # (P, P, C); False: (C, P, P), --naflex-patchify-channels-first
    enable_patch_interpolator: bool = knob(True, SWITCH)  # patches of another size resample the embedding (FlexiViT)
    # Trunk
    embed_dim: int = knob(768, int_in(1, MAX_WIDTH))
    depth: int = knob(12, int_in(1, MAX_DEPTH))
    num_heads: int = knob(12, int_in(1, MAX_HEADS))
    # Grouped-query attention: k/v heads per block (null: num_heads), one int for all or one per block (as eva)
    num_kv_heads: int | list[int] | None = knob(None, KV_HEADS)
    qk_norm: bool = knob(False, SWITCH)  # a norm (norm_layer) over each head's q and k, before RoPE (Sapiens2)
    norm_layer: str = knob("layernorm", registered("norm_layer"))  # block norms, output norms and qk_norm
    ffn_layer: str = knob("mlp", registered("ffn_layer"))  # "mlp" (GELU) or "swiglu"
    ffn_ratio: float = knob(4.0, FFN_RATIO)
    swiglu_align_to: int = knob(8, int_in(1, MAX_WIDTH))
    qkv_bias: bool = knob(True, SWITCH)
    mask_k_bias: bool = knob(True, SWITCH)  # the k third of the qkv bias is multiplied by a (loaded) mask
    proj_bias: bool = knob(True, SWITCH)
    ffn_bias: bool = knob(True, SWITCH)
    norm_eps: float = knob(1e-5, NORM_EPS)
    # LayerScale: float, 0/"off"/None, "auto", {attn, mlp}, or a per-block list of those
    init_values: Any = knob(1e-5, INIT_VALUES)
    # Rotary position embedding
    rope_base: float = knob(100.0, ROPE_BASE)
    rope_normalize_coords: str = knob("separate", one_of(NORMALIZE_COORDS))
    rope_periods_bf16: bool = knob(True, SWITCH)  # released checkpoints store bf16-rounded periods
    # What RoPE's tables and rotation compute in: fp32 (Meta's DINOv3, LingBot) or bf16 (Sapiens2's code as released)
    rope_dtype: str = knob("fp32", one_of(ROPE_DTYPES))
    rope_shift_coords: float | None = knob(None, COORDS_SHIFT)
    rope_jitter_coords: float | None = knob(None, COORDS_SCALE)
    rope_rescale_coords: float | None = knob(None, COORDS_SCALE)  # Meta's pretraining used 2
    # Output norms
    cls_norm: bool = knob(False, SWITCH)  # untied norms: `cls_norm` for cls + storage tokens, `norm` for patches
    local_cls_norm: bool = knob(False, SWITCH)  # carried by SAT-L and 7B checkpoints; unused outside local crops
    # Head and regularisation
    num_classes: int = knob(1000, int_in(0, MAX_CLASSES))
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
        problem = family_problem(self)  # after the rules: the record reads resolved values
        if problem:
            raise ValueError(problem)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def default(cls, name: str) -> Any:
        """A field's default value."""
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> VitLsConfig:
        unknown = sorted(map(str, set(values) - set(cls.field_names())))
        if unknown:
            raise UnknownConfigKeyError(
                f"{source}: unknown config key(s) {', '.join(map(shown, unknown))}; "
                f"allowed: {', '.join(cls.field_names())}"
            )
        try:
            return cls(**{k: parse_word(v) for k, v in values.items()})
        except ValueError as error:
            if source == "config":
                raise
            raise ValueError(f"{source}: {error}") from None

    @classmethod
    def check_value(cls, name: str, value: Any, source: str = "config", named: str = "") -> None:
        """One value a file gives for field `name`, checked by the field's rule as it is (a width written as
        text is refused, not converted), before anything is computed or built from it."""
        rule = next((f.metadata.get("rule") for f in dataclasses.fields(cls) if f.name == name), None)
        if rule is not None and not rule.check(value):
            raise ValueError(f"{source}: {named or name}: got {shown(value)}; allowed: {rule.allowed}")

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


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 3, 60, 40, 60


def shown(value: Any) -> str:
    """A value as an error line shows it: bounded, however long or deep it is."""
    return _SHOWN.repr(value)


def _require(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}: got {shown(value)}; allowed: {allowed}")


def parse_word(value: Any) -> Any:
    """The words a command line spells booleans and null with (`--model-kwargs qkv_bias=false`, as timm's train.py
    passes them on) as those; a number spelled as text stays text, for its field's rule to refuse by name."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "none", "null"):
        return parse_scalar(value)
    return value


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
    raise ValueError(f"{where}: got {shown(value)}; allowed: {_INIT_VALUES_ALLOWED}")


def _resolve_branches(value: Any, depth: int, where: str) -> BranchInit:
    if isinstance(value, Mapping):
        if set(value) != set(BRANCHES):
            raise ValueError(f"{where}: got keys {shown(sorted(map(str, value)))}; allowed: exactly {list(BRANCHES)}")
        return tuple(_resolve_scalar(value[b], depth, f"{where}.{b}") for b in BRANCHES)
    scalar = _resolve_scalar(value, depth, where)
    return scalar, scalar


def _is_init_values(value: Any) -> bool:
    if isinstance(value, str) and value.strip().startswith("["):
        return True  # a list spelled as text: parsed and checked when resolved
    entries = value if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    scalars = (str, int, float, type(None))
    return len(entries) <= MAX_DEPTH and all(
        isinstance(e, scalars) or (isinstance(e, Mapping) and all(isinstance(v, scalars) for v in e.values()))
        for e in entries
    )  # the values themselves are checked when resolved, each named by its block and branch


def resolve_init_values(value: Any, depth: int) -> list[BranchInit]:
    """One (attn, mlp) pair of LayerScale init values per block; `None` means no LayerScale there."""
    if isinstance(value, str) and value.strip().startswith("["):  # a list spelled as text (train.py's --model-kwargs)
        value = load_text(value, "init_values")
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != depth:
            raise ValueError(
                f"init_values: got a list of {len(value)} entries; allowed: exactly depth={depth} entries, "
                f"one per block"
            )
        return [_resolve_branches(v, depth, f"init_values[{i}]") for i, v in enumerate(value)]
    return [_resolve_branches(value, depth, "init_values")] * depth
