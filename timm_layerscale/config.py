"""Every architecture knob of the family, named once with its default, and the rules that check them.

A variant's YAML file under `configs/` sets only what differs from these defaults; keyword arguments
given to `timm.create_model` (or train.py's `--model-kwargs`) override the YAML.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FFN_LAYERS = ("mlp", "swiglu")
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


@dataclass
class VitLsConfig:
    # Input and tokens
    img_size: int | tuple[int, int] = 224
    patch_size: int = 16
    in_chans: int = 3
    num_storage_tokens: int = 4
    dynamic_img_size: bool = True
    dynamic_img_pad: bool = False  # False: a side that is not a multiple of patch_size is an error
    # NaFlex (timm's --naflex-loader): batches of patches at each image's own aspect ratio, as dicts
    use_naflex: bool = True  # the forward also takes NaFlex dicts; False takes images only, as timm's eva
    patchify_channels_last: bool = True  # patches as (P, P, C); False: (C, P, P), --naflex-patchify-channels-first
    enable_patch_interpolator: bool = True  # patches of another size resample the patch embedding (FlexiViT)
    # Trunk
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    ffn_layer: str = "mlp"  # "mlp" (GELU) or "swiglu"
    ffn_ratio: float = 4.0
    swiglu_align_to: int = 8
    qkv_bias: bool = True
    mask_k_bias: bool = True  # the k third of the qkv bias is multiplied by a (loaded) mask
    proj_bias: bool = True
    ffn_bias: bool = True
    norm_eps: float = 1e-5
    # LayerScale: float, 0/"off"/None, "auto", {attn, mlp}, or a per-block list of those
    init_values: Any = 1e-5
    # Rotary position embedding
    rope_base: float = 100.0
    rope_normalize_coords: str = "separate"
    rope_periods_bf16: bool = True  # released checkpoints store bf16-rounded periods
    rope_shift_coords: float | None = None
    rope_jitter_coords: float | None = None
    rope_rescale_coords: float | None = None  # Meta's pretraining used 2
    # Output norms
    cls_norm: bool = False  # untied norms: `cls_norm` for cls + storage tokens, `norm` for patches
    local_cls_norm: bool = False  # carried by SAT-L and 7B checkpoints; unused outside local-crop training
    # Head and regularisation
    num_classes: int = 1000
    global_pool: str = "token"
    drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    stochastic_depth: str = "drop_path"  # timm per-sample DropPath, or DINOv3's batch-subset sample drop
    # Loading: refuse a checkpoint without gammas instead of setting them to 1
    strict_layer_scale: bool = False
    # Fine-tuning: gammas get no gradient (timm's optimiser factory leaves them out)
    freeze_layer_scale: bool = False
    # Fine-tuning: after a pretrained load (never a resume or --initial-checkpoint), gammas restart at init_values
    reinit_layer_scale: bool = False
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
    def num_prefix_tokens(self) -> int:
        return 1 + self.num_storage_tokens

    def validate(self) -> None:
        for names, ok, allowed in _FIELD_RULES:
            for name in names:
                _require(name, getattr(self, name), ok(getattr(self, name)), allowed)
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
        for name, allowed in (
            ("ffn_layer", FFN_LAYERS),
            ("rope_normalize_coords", NORMALIZE_COORDS),
            ("stochastic_depth", STOCHASTIC_DEPTH),
            ("global_pool", GLOBAL_POOLS),
        ):
            _require(name, getattr(self, name), getattr(self, name) in allowed, f"one of {allowed}")
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}: got {value!r}; allowed: {allowed}")


def _is_size(value: Any) -> bool:
    if isinstance(value, int):
        return value > 0
    return isinstance(value, Sequence) and len(value) == 2 and all(isinstance(s, int) and s > 0 for s in value)


# (fields, check, what is allowed), applied to every field named.
_FIELD_RULES = (
    (
        ("patch_size", "in_chans", "embed_dim", "depth", "num_heads", "swiglu_align_to"),
        lambda v: isinstance(v, int) and v > 0,
        "a positive integer",
    ),
    (("num_storage_tokens", "num_classes"), lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    (("ffn_ratio", "rope_base", "norm_eps"), lambda v: _is_number(v) and v > 0, "a positive number"),
    (
        ("drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate"),
        lambda v: _is_number(v) and 0 <= v < 1,
        "a number in [0, 1)",
    ),
    (("rope_shift_coords",), lambda v: v is None or (_is_number(v) and v >= 0), "null or a number >= 0"),
    (
        ("rope_jitter_coords", "rope_rescale_coords"),
        lambda v: v is None or (_is_number(v) and v >= 1),
        "null or a number >= 1",
    ),
    (
        (
            "dynamic_img_size",
            "dynamic_img_pad",
            "use_naflex",
            "patchify_channels_last",
            "enable_patch_interpolator",
            "qkv_bias",
            "mask_k_bias",
            "proj_bias",
            "ffn_bias",
            "rope_periods_bf16",
            "cls_norm",
            "local_cls_norm",
            "strict_layer_scale",
            "freeze_layer_scale",
            "reinit_layer_scale",
        ),
        lambda v: isinstance(v, bool),
        "true or false",
    ),
    (("img_size",), _is_size, "a positive integer or a pair of them"),
)


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
