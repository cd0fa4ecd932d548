"""What every format module fills in, and what they share: the format's place in a conversion (`Job` in,
`PreparedWrite` out), config field tables read and written the same way, gammas of 1, and what a target cannot hold.

A format owns its two-way key table, how it is recognised, its config fields (both ways), its target options,
what it cannot hold, and its writer. `convert_checkpoint` opens, identifies, plans and hands the format a `Job`;
the format answers with an `PreparedWrite`: its tensors, how to write them, and what it loses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from timm_ls.destinations import format_destination_problem
from timm_ls.names import FormatSpec

from ...config import FFN_RATIO, MAX_RATIO, MAX_WIDTH, Rule, VitLsConfig, int_in, shown
from ...families import ROPE_FP32, ROPE_KEPT, Holding, either, family_record, fixed_words
from ...layer_options import unheld_option
from ...layers import effective_qkv_bias, ffn_hidden_features, split_qkv
from ..errors import CheckpointError
from ..mapping.gamma_keys import NATIVE_GAMMA_KEY, NATIVE_SPELLING, gamma_name, native_gamma_key
from ..mapping.keys import KeyTable, row
from ..mapping.plan import PERIODS, Plan, Step, passthrough
from ..read.reader import LazyCheckpoint
from ..write.writers import Progress

Tensor = torch.Tensor
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Pretrained-config fields that say where weights came from, not what they are: never written.
_SOURCE_FIELDS = ("url", "hf_hub_id", "hf_hub_filename", "source", "file", "state_dict", "architecture")


@dataclass(frozen=True)
class SourceConfig:
    """What a checkpoint says of its model (a config.json beside it, or what train.py records in it): model
    args and the pretrained cfg (data config, licence) completing the weights, and the variant of ours it
    records (`architecture`, in our names: a format translates its own), which names the model unless the
    caller names one. `origin` says where it was read, for the summary line."""

    args: dict[str, Any]
    pretrained_cfg: dict[str, Any] | None = None
    architecture: str | None = None
    origin: str = "config.json"


@dataclass
class Job:
    """What a format needs to write a checkpoint: the fitted tensors in native keys and the model they make."""

    tensors: Plan  # native keys, fitted to `config` and cast
    config: VitLsConfig
    architecture: str  # the shipped variant that names this model (its YAML's base, or the nearest)
    pretrained_cfg: dict[str, Any]
    fill_dtype: torch.dtype  # what new tensors are made in
    cast: torch.dtype | None  # the requested dtype, None to keep each tensor's
    dst: Path
    released: bool = False  # the shapes of a released DINOv3
    max_shard_size: int | str = "5GB"
    heads: LazyCheckpoint | None = None  # Meta's pretraining heads carried by the source
    options: dict[str, Any] = field(default_factory=dict)  # the format's own (`Format.takes`)


@dataclass
class PreparedWrite:
    tensors: Plan  # in the format's keys
    write: Callable[[Path, Progress | None], None]  # into the temporary destination
    not_held: list[str]
    warnings: list[str]
    notes: list[str] = field(default_factory=list)
    text: str | None = None  # lines for the user to keep (Meta's training YAML)


class Format:
    """One checkpoint format. Subclasses set `spec` (its `--to` name and what it writes), `title` (its keys as
    users name them) and `table`, and override what they support."""

    spec: FormatSpec
    title: str
    table: KeyTable
    reads_heads = False  # the reader keeps Meta's pretraining heads (`open_checkpoint(heads=True)`) for it
    takes: Mapping[str, Any] = {}  # options of its own, with their defaults
    default_dtype = "keep"  # what `dtype=None` means for it
    # Model args its files have no place for, so a key they lack says nothing of the model (`identity.key_args`).
    unheld_args: frozenset[str] = frozenset()
    # What it can hold, in one place (`check_holds`): the native key groups it may leave out (each named in the
    # summary; any other group it has no key for carries weights, and is refused). Which families it holds, the
    # config values it fixes for each and what its code does with RoPE are the family records' (`families`).
    may_drop: frozenset[str] = frozenset()
    rope_code = ""  # the code that builds this format's model, as the RoPE rule's line names it
    # The family its keys are where they are one family's own (identity ranks only that family's variants); "" where
    # they are a layout several families share, which the family records' rules read from the native keys.
    family = ""
    # LayerScale in its keys, N the branch (`gamma_keys`); `gamma_pattern` where one word with N cannot say it.
    gamma_spelling = NATIVE_SPELLING
    gamma_pattern = ""

    def family_of_keys(self, keys: Sequence[str]) -> str | None:
        """The family a checkpoint in this format's keys is, where its keys say (`family`), else None."""
        return self.family or None

    def holding(self, config: VitLsConfig) -> Holding:
        """What this format holds of the config's family (its record's), or one error line naming what it lacks
        and the formats that can hold the model (from the record)."""
        record = family_record(config.family)
        held = record.formats.get(self.name)
        instead = either(record.holders(config)) or "native"
        if held is None:
            raise CheckpointError(
                f"{self.title} cannot hold a {record.name} model ({record.title}); convert --to {instead} instead"
            )
        for name, fixed, value in held.differences(config)[:1]:
            raise CheckpointError(
                f"{self.title} fix {fixed_words(name, fixed)} for a {record.name} model, this model has {value!r}: "
                f"--to {self.name} cannot hold it; convert --to {instead} instead"
            )
        option = unheld_option(config, self.name)  # a layer whose declaration does not name this format
        if option is not None:
            raise CheckpointError(
                f"{self.title} have no place for {option.field}={option.value!r}: --to {self.name} cannot hold it; "
                f"convert --to {instead} instead"
            )
        return held

    def rope_rule(self, config: VitLsConfig) -> str | None:
        """The one rule for a target computing RoPE otherwise than the model: what to say of it (a warning,
        refused with --strict), before the figure of how far the outputs move; None where RoPE is kept."""
        held = family_record(config.family).formats.get(self.name)
        if held is None or held.rope != ROPE_FP32 or config.rope_dtype != "bf16":
            return None
        return (
            f"RoPE is computed in fp32 by {self.rope_code} and in bf16 by this model (rope_dtype=bf16): --to "
            f"{self.name} writes it, and its outputs move there"
        )

    @property
    def recomputes_periods(self) -> bool:
        """Whether its model computes RoPE's periods from the base (in fp32, unrounded) rather than holding them."""
        return PERIODS in self.may_drop

    def check_holds(self, config: VitLsConfig, unheld: Sequence[str]) -> None:
        """One error line, before anything is written, for a model this format cannot hold in full: a key group
        it would drop that carries weights (what it fixes of the family is `holding`'s)."""
        dropped = [g for g in unheld_groups(list(unheld)) if g not in self.may_drop]
        if dropped:
            instead = either([f for f in family_record(config.family).holders(config) if f != self.name])
            shown_groups = ", ".join(dropped[:6]) + (f" (+{len(dropped) - 6})" if len(dropped) > 6 else "")
            raise CheckpointError(
                f"{self.title} have no place for this model's {shown_groups}: --to {self.name} cannot hold it in "
                f"full; convert --to {instead or 'native'} instead"
            )

    @property
    def name(self) -> str:
        return self.spec.name

    def recognise(self, keys: Sequence[str]) -> bool:
        """Whether a checkpoint with these keys is in this format (the registry asks in its order)."""
        return False

    def read_config(self, cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> SourceConfig | None:
        """The model args of a config.json of this format travelling with the weights, or None if it is not one;
        a value of the wrong type or beyond any machine is one `ValueError` line starting with `where`."""
        return None

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Its own options (`takes`), checked (and parsed) before any work."""
        return dict(options)

    def prepare_write(self, job: Job) -> PreparedWrite:
        """Its tensors from the job's native ones, how to write them, and what it cannot hold."""
        raise NotImplementedError(f"{self.name} cannot be written")

    def writes_folder(self, dst: Path) -> bool:
        return self.spec.writes_folder(dst.name)

    def check_destination(self, dst: Path, overwrite: bool) -> None:
        """The one destination rule (`timm_ls.destinations`) for what this format writes at `dst`."""
        problem = format_destination_problem(
            self.spec, dst, overwrite=overwrite, overwrite_hint="--overwrite (overwrite=True)"
        )
        if problem:
            raise CheckpointError(problem)

    def __repr__(self) -> str:
        return f"<format {self.name}>"


# ------------------------------------------------------------------------------------------- config fields


@dataclass(frozen=True)
class ConfigField:
    """One field of a format's config and the model arg it is: read and written through the same row.

    `ours` names a field of `VitLsConfig` holding the same value (and checked by its rule); a derived field
    instead gives `write` (config -> their value), `read` (their whole config -> our args) and the `rule` its
    value is checked by before any is read.
    """

    theirs: str
    ours: str = ""
    write: Callable[[VitLsConfig], Any] | None = None
    read: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    rule: Rule | None = None


# What derived fields allow: a hidden width up to the widest FFN a config may have, a ratio, a switch.
HIDDEN_WIDTH = int_in(1, int(MAX_WIDTH * MAX_RATIO))
RATIO = FFN_RATIO
ALIGNMENT = int_in(0, MAX_WIDTH)  # 0: not a SwiGLU


def read_fields(fields: Sequence[ConfigField], cfg: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our args from a format's config, every value present checked by its row's rule first (the one checked
    path: a value of the wrong type or beyond any machine is refused by name before anything is computed)."""
    for f in fields:
        if f.theirs not in cfg:
            continue
        if f.rule is not None and not f.rule.check(cfg[f.theirs]):
            raise ValueError(f"{where}: {f.theirs}: got {shown(cfg[f.theirs])}; allowed: {f.rule.allowed}")
        if f.rule is None and f.ours:
            VitLsConfig.check_value(
                f.ours, cfg[f.theirs], where, f.theirs if f.theirs == f.ours else f"{f.theirs} ({f.ours})"
            )
    args: dict[str, Any] = {}
    for f in fields:
        if f.theirs in cfg:
            args.update(f.read(cfg) if f.read else {f.ours: cfg[f.theirs]} if f.ours else {})
    return args


def pretrained_cfg_of(cfg: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """A config's `pretrained_cfg`: a mapping, or one line saying it is not one."""
    found = cfg.get("pretrained_cfg") or {}
    if not isinstance(found, Mapping):
        raise ValueError(f"{where}: pretrained_cfg: got a {type(found).__name__}; allowed: a mapping")
    return dict(found)


def write_fields(fields: Sequence[ConfigField], config: VitLsConfig) -> dict[str, Any]:
    return {f.theirs: f.write(config) if f.write else getattr(config, f.ours) for f in fields}


def bf16_rope_targets(config: VitLsConfig) -> str:
    """The targets that keep a bf16-RoPE model's own RoPE, for the rule's line to name (from its record)."""
    held = family_record(config.family).formats.items()
    return either([name for name, holding in held if holding.rope == ROPE_KEPT]) or "native"


def gamma_branches(config: VitLsConfig) -> tuple[int, ...]:
    """The branches where the config's family's layouts have LayerScale (Sapiens2's: attention only)."""
    return family_record(config.family).gamma_branches()


def hidden_features(config: VitLsConfig) -> int:
    """The FFN's hidden width of a config's blocks, by the layers' one rule."""
    return ffn_hidden_features(config.embed_dim, config.ffn_layer, config.ffn_ratio, config.swiglu_align_to)


def ffn_args(dim: int, hidden: int, swiglu: bool, align: int = 1) -> dict[str, Any]:
    """Our FFN args for an MLP (or a SwiGLU aligned to `align`) `hidden` wide: `hidden_features` read back."""
    if swiglu:
        return {"ffn_layer": "swiglu", "ffn_ratio": hidden * 1.5 / dim, "swiglu_align_to": align}
    return {"ffn_layer": "mlp", "ffn_ratio": hidden / dim}


def pretrained_cfg_fields(pretrained_cfg: Mapping[str, Any], num_classes: int) -> dict[str, Any]:
    """A pretrained cfg to write: what the weights are (data config, licence), not where they came from."""
    cfg = {k: v for k, v in pretrained_cfg.items() if k not in _SOURCE_FIELDS and v is not None}
    cfg["num_classes"] = num_classes
    return cfg


def with_all_gammas(
    tensors: Plan, depth: int, dim: int, dtype: torch.dtype, branches: tuple[int, ...] = (1, 2)
) -> Plan:
    """Adds gammas of 1 where a branch has none: the same outputs in a format that always has LayerScale (on
    `branches`: Sapiens2's layouts have it on the attention branch only)."""
    keys = [native_gamma_key(i, branch) for i in range(depth) for branch in branches]
    missing = [key for key in keys if key not in tensors]
    if not missing:
        return tensors
    ones = torch.ones(dim, dtype=dtype)
    return Plan(tensors, [*passthrough(tensors), *(Step((key,), (), lambda: (ones,)) for key in missing)])


def qkv_biases(tensors: Mapping[str, Tensor], config: VitLsConfig) -> Iterator[tuple[int, tuple[Tensor, ...]]]:
    """Each block's effective (masked) q, k and v biases, read now: only the few small bias tensors."""
    for i in range(config.depth):
        key = f"blocks.{i}.attn.qkv.bias"
        if key in tensors:
            yield i, split_qkv(effective_qkv_bias(tensors[key], tensors.get(f"{key}_mask")), config.embed_dim)


def k_bias_blocks(tensors: Mapping[str, Tensor], config: VitLsConfig) -> list[int]:
    """The blocks whose effective k bias is non-zero."""
    return [i for i, (_, k, _) in qkv_biases(tensors, config) if k.any()]


# ---------------------------------------------------------------------------------- rows formats share

# Every key of the native layout, by pattern. Meta's files use exactly these keys (Meta has no `head`).
NATIVE_KEYS = (
    "cls_token",
    "storage_tokens",
    "mask_token",
    "patch_embed.proj.{p}",
    "rope_embed.periods",
    "blocks.{i}.norm1.{p}",
    "blocks.{i}.attn.qkv.weight",
    "blocks.{i}.attn.qkv.bias",
    "blocks.{i}.attn.qkv.bias_mask",
    "blocks.{i}.attn.q_norm.weight",
    "blocks.{i}.attn.k_norm.weight",
    "blocks.{i}.attn.proj.{p}",
    "blocks.{i}." + gamma_name(NATIVE_SPELLING, 1),
    "blocks.{i}.norm2.{p}",
    "blocks.{i}.mlp.fc1.{p}",
    "blocks.{i}.mlp.fc2.{p}",
    "blocks.{i}.mlp.w1.{p}",
    "blocks.{i}.mlp.w2.{p}",
    "blocks.{i}.mlp.w3.{p}",
    "blocks.{i}." + gamma_name(NATIVE_SPELLING, 2),
    "norm.{p}",
    "cls_norm.{p}",
    "local_cls_norm.{p}",
    "head.{p}",
)
_NATIVE_QKV = re.compile(r"^blocks\.\d+\.attn\.qkv\.weight$")


def native_keys(keys: Sequence[str]) -> bool:
    """Keys in the native layout: Meta's, or this package's (which adds a classifier head)."""
    return "storage_tokens" in keys or any(NATIVE_GAMMA_KEY.match(k) or _NATIVE_QKV.match(k) for k in keys)


# Meta's released keys are the native ones, without a classifier: Meta's files and its trainer's backbone.
META_TITLE = "Meta DINOv3 keys"
META_TABLE = KeyTable(tuple(row(key, key) for key in NATIVE_KEYS if not key.startswith("head.")))


def fuse(*parts: Tensor, **_) -> tuple[Tensor]:
    """Separate projections (q, k, v; gate, up) as one fused tensor, in order."""
    return (torch.cat(parts),)


def split3(qkv: Tensor, *, dim: int, **_) -> tuple[Tensor, ...]:
    """A fused qkv as q, k and v, GQA's narrower k and v included."""
    return split_qkv(qkv, dim)


# --------------------------------------------------------------------------------------- what is not held

# Native key groups a format may drop, and what losing them means.
UNHELD_NOTES = {
    PERIODS: "recomputed in fp32 there",
    "cls_norm": "cls and storage tokens are normed by norm there: their outputs differ",
    "local_cls_norm": "used only in local-crop pretraining",
    "mask_token": "used only for masked inputs",
    "head": "no classifier there",
}
# Losses that change the model's outputs: warnings (errors with strict).
OUTPUT_CHANGING = ("cls_norm",)


def unheld_groups(keys: list[str]) -> list[str]:
    """`cls_norm.weight`, `cls_norm.bias` -> `cls_norm`; block keys by their name within the block."""
    groups = []
    for key in keys:
        name = key.split(".", 2)[2] if key.startswith("blocks.") else key
        name = name.removesuffix(".weight").removesuffix(".bias")
        if name not in groups:
            groups.append(name)
    return groups


def not_held_report(
    unheld: list[str], to: str, changing: tuple[str, ...] = OUTPUT_CHANGING, named: Mapping[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """What a format has no key for, by group (`named` words a group its own way), and as warnings the not_held_report
    in `changing`, which change the outputs."""
    groups = unheld_groups(unheld)
    named = named or {}
    not_held = [named.get(g) or (f"{g} ({UNHELD_NOTES[g]})" if g in UNHELD_NOTES else g) for g in groups]
    warnings = [f"{to} cannot hold {g}: {UNHELD_NOTES[g]}" for g in groups if g in changing]
    return not_held, warnings
