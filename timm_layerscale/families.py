"""The model families, each declared once: what makes it, where it carries LayerScale, which of its arguments
its checkpoint keys decide, and which formats can hold it and what each fixes or holds only approximately.

A config records its family (`VitLsConfig.family`, set by its variant's YAML); the config checks itself against
its family's record when it is built, and the formats and identity ask the record, never the switches. Adding a
family is `register_family(FamilyRecord(...))`, its YAML variants, and a format (`register_format`) only where
its keys are its own.

This module knows no other of the package but the layer options (`layer_options`, which formats hold each): it
reads a config by its field names only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from .layer_options import unheld_option

BRANCHES = ("attn", "mlp")
# What a format does with RoPE: keeps the model's, recomputes it in fp32 (from the base, as transformers, timm's eva
# and Meta's hub builders do), or has its code compute it in bf16 whatever the model does (Meta's trainer).
ROPE_KEPT, ROPE_FP32, ROPE_BF16 = "kept", "fp32", "bf16"
# Switches a record may name that are read from the config, not set: the field that sets each.
SET_BY = {"grouped_attention": "num_kv_heads"}
# The args a checkpoint's keys decide for every family (`identity.key_args`).
KEYED_ARGS = (
    "qkv_bias",
    "proj_bias",
    "ffn_bias",
    "cls_norm",
    "local_cls_norm",
    "num_classes",
    "init_values",
    "mask_token",
    "norm_layer",
    "qk_norm",
    "num_kv_heads",
    "rope_periods_bf16",
    "rope_dtype",
)


def allowed_values(fixed: Any) -> tuple[Any, ...]:
    """The values a format's fix allows: the one value, or each of a set (in a stable order)."""
    return tuple(sorted(fixed, key=repr)) if isinstance(fixed, (set, frozenset)) else (fixed,)


def fixed_words(name: str, fixed: Any) -> str:
    """A fix as a refusal names it: `norm_layer='layernorm'`, or `norm_layer='layernorm' or 'rmsnorm'`."""
    return f"{named(name)}=" + " or ".join(map(repr, allowed_values(fixed)))


@dataclass(frozen=True)
class Holding:
    """What one format holds of a family: the config values its files or its code fix (`fixes`: a value, or a
    set of the values it holds, as Meta's code holds LayerNorm or RMSNorm), the key layout it writes the family in
    where it has several (`layout`), and what its code does with RoPE (`rope`)."""

    fixes: Mapping[str, Any] = field(default_factory=dict)
    rope: str = ROPE_KEPT
    layout: str = ""

    def differences(self, config: Any) -> list[tuple[str, Any, Any]]:
        """(field, fixed value or set, the config's) for each value this format fixes otherwise."""
        return [
            (name, fixed, getattr(config, name))
            for name, fixed in self.fixes.items()
            if getattr(config, name) not in allowed_values(fixed)
        ]


@dataclass(frozen=True)
class FamilyRecord:
    """One family. `switches`: the config fields that make it, each with the values it allows (a field not
    named takes any). `layer_scale`: the branches that may carry LayerScale. `keyed`: the args its checkpoint
    keys decide. `formats`: the formats that can hold it, by name, and what each fixes. `layout`: the family
    whose native key layout it has (its own name unless it shares another's keys, as LingBot shares DINOv3's).
    `recognise`: whether native keys are its own layout's (the rule a checkpoint without a recorded family is
    read by; families sharing a layout leave it to that layout's family)."""

    name: str
    title: str
    formats: Mapping[str, Holding]
    switches: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    layer_scale: tuple[str, ...] = BRANCHES
    keyed: tuple[str, ...] = KEYED_ARGS
    layout: str = ""
    recognise: Callable[[Collection[str]], bool] | None = None

    def __post_init__(self) -> None:
        if not self.layout:
            object.__setattr__(self, "layout", self.name)
        unknown = [b for b in self.layer_scale if b not in BRANCHES]
        if unknown:
            raise ValueError(f"family {self.name}: layer_scale: got {unknown}; allowed: branches of {BRANCHES}")

    def gamma_branches(self) -> tuple[int, ...]:
        """The branches (1: attention, 2: MLP) where this family's layouts have a gamma."""
        return tuple(i + 1 for i, branch in enumerate(BRANCHES) if branch in self.layer_scale)

    def problem(self, config: Any) -> str | None:
        """What of `config` this family does not allow, as the start of one error line, or None."""
        for name, allowed in self.switches.items():
            value = getattr(config, name)
            if value not in allowed:
                shown = " or ".join(repr(v) for v in allowed)
                return f"{named(name)}: got {value!r}; a {self.name} model has {shown}"
        for index, branch in enumerate(BRANCHES):
            if branch not in self.layer_scale and any(pair[index] is not None for pair in config.layer_init_values):
                off = ", ".join(f"{b}: off" for b in BRANCHES if b not in self.layer_scale)
                return (
                    f"init_values: LayerScale on the {branch} branch; a {self.name} model has it on "
                    f"{' and '.join(self.layer_scale) or 'no branch'} only (set {off})"
                )
        return None

    def holders(self, config: Any) -> list[str]:
        """The formats that hold `config` in full, by their fixes and the layer options each holds (what a key
        table drops is the format's)."""
        return [
            name
            for name, held in self.formats.items()
            if not held.differences(config) and unheld_option(config, name) is None
        ]


FAMILIES: dict[str, FamilyRecord] = {}


def named(name: str) -> str:
    """A config field as an error line names it: a value read from the config, with the field that sets it."""
    return f"{name} (set by {SET_BY[name]})" if name in SET_BY else name


def register_family(record: FamilyRecord) -> FamilyRecord:
    """Adds a family: configs may record it (`family: NAME` in a variant's YAML), formats and identity ask it."""
    if not isinstance(record, FamilyRecord):
        raise TypeError(f"register_family takes a FamilyRecord, got {type(record).__name__}")
    FAMILIES[record.name] = record
    return record


def either(names: list[str]) -> str:
    """Names as a refusal offers them: "a", "a or b", "a, b or c"."""
    return " or ".join(n for n in (", ".join(names[:-1]), names[-1] if names else "") if n)


def family_record(name: str) -> FamilyRecord:
    record = FAMILIES.get(name)
    if record is None:
        raise ValueError(
            f"family: got {name!r}; allowed: one of {', '.join(FAMILIES)} (or one added by register_family)"
        )
    return record


def is_family(name: Any) -> bool:
    return isinstance(name, str) and name in FAMILIES


def family_problem(config: Any) -> str | None:
    """One line for a config its family does not allow, naming the families that allow it, or None."""
    record = family_record(config.family)
    problem = record.problem(config)
    if problem is None:
        return None
    others = [r.name for r in FAMILIES.values() if r is not record and r.problem(config) is None]
    instead = f"family={' or family='.join(others)} holds it" if others else "no registered family holds it"
    return f"family={record.name}: {problem}; {instead}"


def layout_of_keys(keys: Collection[str]) -> str:
    """The key layout native checkpoint keys are, by the records' own rules (families added later asked first);
    DINOv3's, whose keys every other layout extends, where none claims them."""
    for record in reversed(list(FAMILIES.values())):
        if record.recognise is not None and record.recognise(keys):
            return record.layout
    return DINOV3.layout


# ------------------------------------------------------------------------------------------- the families

# What eva's DINOv3 architectures and transformers' DINOv3ViTModel fix: LayerNorm, no qk-norm, every head.
_DINOV3_LAYOUT = {"norm_layer": "layernorm", "qk_norm": False, "grouped_attention": False}
_EVA_DINOV3 = {"norm_eps": 1e-5, "proj_bias": True, "ffn_bias": True, "rope_normalize_coords": "separate"}
# Meta's code has LayerNorm and RMSNorm (its norm_layer_dict), no qk-norm, every head.
_META = {"norm_layer": {"layernorm", "rmsnorm"}, "qk_norm": False, "grouped_attention": False}
_DINOV3_FORMATS = {
    "native": Holding(),
    "meta": Holding(_META, ROPE_FP32),
    "meta-train": Holding(_META, ROPE_BF16),
    "hf": Holding({**_DINOV3_LAYOUT, "rope_normalize_coords": "separate"}, ROPE_FP32, "dinov3"),
    "timm": Holding({**_DINOV3_LAYOUT, **_EVA_DINOV3}, ROPE_FP32, "dinov3"),
}

DINOV3 = register_family(FamilyRecord("dinov3", "DINOv3, EUPE", _DINOV3_FORMATS))
LINGBOT = register_family(FamilyRecord("lingbot", "LingBot-Vision", _DINOV3_FORMATS, layout="dinov3"))
SAPIENS2 = register_family(
    FamilyRecord(
        "sapiens2",
        "Sapiens2",
        {
            "native": Holding(),
            "sapiens2": Holding({"norm_eps": 1e-6, "rope_normalize_coords": "separate"}),
            "hf": Holding({"ffn_layer": "swiglu", "rope_normalize_coords": "separate"}, ROPE_FP32, "sapiens2"),
            "timm": Holding(
                {**_EVA_DINOV3, "norm_eps": 1e-6, "qk_norm": True, "qkv_bias": True, "ffn_layer": "swiglu"},
                ROPE_FP32,
                "sapiens2",
            ),
        },
        switches={"norm_layer": ("rmsnorm",), "mask_k_bias": (False,)},
        layer_scale=("attn",),
        # Every Sapiens2 has a qk-norm (grouped blocks too): no other shipped layout has one.
        recognise=lambda keys: "blocks.0.attn.q_norm.weight" in keys,
    )
)
