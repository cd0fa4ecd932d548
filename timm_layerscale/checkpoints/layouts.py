"""Checkpoint layouts: one table per layout, mapping every key of the native layout (Meta's DINOv3 keys,
which are this package's) to that layout's keys and back.

A table row pairs native key patterns with layout key patterns (`{i}` a block index, `{p}` `weight` or
`bias`, a trailing `?` an optional key) and, where the tensors differ, one function per direction. Most
rows rename; a few fuse or split (q/k/v, eva's q/v biases, transformers' 3-d mask token). Reading a file
runs the rows from layout to native, writing one runs them back, both as plans over shapes alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from .errors import CheckpointError
from .gamma_keys import ANY_GAMMA_KEY, GAMMA_SPELLINGS, NATIVE_GAMMA_KEY, NATIVE_SPELLING, gamma_name
from .plan import Plan, Step, StepFn, info_of, passthrough, same

Tensor = torch.Tensor
StateDict = dict[str, Tensor]

_PLACEHOLDERS = {"i": r"\d+", "p": r"weight|bias"}


class KeyPattern:
    def __init__(self, template: str) -> None:
        self.optional = template.endswith("?")
        self.template = template.rstrip("?")
        parts = re.split(r"\{(\w+)\}", self.template)
        regex = "".join(
            re.escape(part) if n % 2 == 0 else f"(?P<{part}>{_PLACEHOLDERS[part]})" for n, part in enumerate(parts)
        )
        self.regex = re.compile(f"^{regex}$")

    def match(self, key: str) -> dict[str, str] | None:
        found = self.regex.match(key)
        return None if found is None else found.groupdict()

    def fill(self, groups: Mapping[str, str]) -> str:
        return self.template.format(**groups)


@dataclass(frozen=True)
class Rule:
    """Native keys <-> layout keys; the functions map the tensors (in pattern order) each way."""

    native: tuple[KeyPattern, ...]
    layout: tuple[KeyPattern, ...]
    to_native: StepFn = same
    to_layout: StepFn = same


def row(native: str | tuple[str, ...], layout: str | tuple[str, ...], to_native=same, to_layout=same) -> Rule:
    def patterns(keys):
        return tuple(KeyPattern(k) for k in ((keys,) if isinstance(keys, str) else keys))

    return Rule(patterns(native), patterns(layout), to_native, to_layout)


def _match(keys: list[str], rules: Iterable[Rule], from_native: bool, options: Mapping[str, Any]):
    """Steps mapping `keys` across the rules, and the keys no rule covers.

    A rule applies to a group of keys when all its required keys are there; the first that applies wins,
    so the gated-MLP rows (which need a gate key) come before the plain ones that share a key name.
    """
    present, placed, steps = set(keys), set(), []
    for key in keys:
        if key in placed:
            continue
        for rule in rules:
            src, dst = (rule.native, rule.layout) if from_native else (rule.layout, rule.native)
            groups = next((g for p in src if (g := p.match(key)) is not None), None)
            if groups is None:
                continue
            inputs = [p.fill(groups) for p in src]
            if any(k not in present and not p.optional for k, p in zip(inputs, src)):
                continue
            fn = rule.to_layout if from_native else rule.to_native
            outputs = tuple(p.fill(groups) for p in dst)
            steps.append(Step(outputs, tuple(k if k in present else None for k in inputs), partial(fn, **options)))
            placed.update(k for k in inputs if k in present)
            break
    return steps, [k for k in keys if k not in placed]


@dataclass(frozen=True)
class Layout:
    name: str
    rules: tuple[Rule, ...]
    # Spellings of the same keys that loading accepts (source prefix -> table prefix).
    aliases: tuple[tuple[str, str], ...] = field(default=())
    title: str = ""  # the keys as users name them, for messages: "Meta DINOv3 keys"

    def to_native(self, source: Mapping[str, Tensor]) -> Plan:
        """Native keys from this layout; keys the table does not know pass through (for the checks to name)."""
        spelled = {self._unalias(k): k for k in source}
        steps, unknown = _match(list(spelled), self.rules, from_native=False, options={})
        steps = [Step(s.outputs, tuple(spelled.get(k) if k else None for k in s.inputs), s.fn) for s in steps]
        return Plan(source, [*steps, *passthrough(spelled[k] for k in unknown)])

    def from_native(self, native: Mapping[str, Tensor], **options: Any) -> tuple[Plan, list[str]]:
        """This layout's keys from native ones, and the native keys it has no place for."""
        steps, unheld = _match(list(native), self.rules, from_native=True, options=options)
        return Plan(native, steps), unheld

    def _unalias(self, key: str) -> str:
        for alias, canonical in self.aliases:
            if key.startswith(alias):
                return canonical + key[len(alias) :]
        return key


# ------------------------------------------------------------------------------------------ tensor maps


def _fuse(*parts: Tensor, **_) -> tuple[Tensor]:
    return (torch.cat(parts),)


def _split3(qkv: Tensor, **_) -> tuple[Tensor, ...]:
    return qkv.chunk(3)


def effective_qkv_bias(bias: Tensor, mask: Tensor | None) -> Tensor:
    """What the forward adds: Meta multiplies the qkv bias by its (loaded) mask."""
    return bias if mask is None else bias * mask.to(bias.dtype)


def _qkv_bias_from_parts(q: Tensor, k: Tensor | None, v: Tensor, **_) -> tuple[Tensor, Tensor | None]:
    # A file without a k bias gets a zero one (the model's own k-masking mask fills in); a file with one
    # keeps it through a mask of ones.
    if k is None:
        return torch.cat([q, torch.zeros_like(q), v]), None
    return torch.cat([q, k, v]), torch.ones(3 * q.shape[0], dtype=q.dtype, device=q.device)


def _qkv_bias_to_transformers(bias: Tensor, mask: Tensor | None, *, k_bias: bool = False, **_):
    q, k, v = effective_qkv_bias(bias, mask).chunk(3)
    return q, k if k_bias else None, v


def _qkv_bias_to_eva(bias: Tensor, mask: Tensor | None, *, qkv_bias: bool = True, **_):
    if not qkv_bias:
        return None, None
    q, _, v = effective_qkv_bias(bias, mask).chunk(3)
    return q, v


def _eva_qkv_bias_to_native(q: Tensor, v: Tensor, **_) -> tuple[Tensor, None]:
    return torch.cat([q, torch.zeros_like(q), v]), None


def _mask_token_to_native(token: Tensor, **_) -> tuple[Tensor]:
    return (token.reshape(1, -1),)


def _mask_token_to_transformers(token: Tensor, **_) -> tuple[Tensor]:
    return (token.reshape(1, 1, -1),)


# ------------------------------------------------------------------------------------------------ tables

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


def _native_gamma(branch: int) -> str:
    return "blocks.{i}." + gamma_name(NATIVE_SPELLING, branch)


NATIVE = Layout("native", tuple(row(key, key) for key in NATIVE_KEYS), title="timm-layerscale keys")
META = Layout(
    "meta", tuple(row(key, key) for key in NATIVE_KEYS if not key.startswith("head.")), title="Meta DINOv3 keys"
)

TRANSFORMERS = Layout(
    "transformers",
    (
        row("cls_token", "embeddings.cls_token"),
        row("storage_tokens", "embeddings.register_tokens"),
        row("mask_token", "embeddings.mask_token", _mask_token_to_native, _mask_token_to_transformers),
        row("patch_embed.proj.{p}", "embeddings.patch_embeddings.{p}"),
        row("blocks.{i}.norm1.{p}", "layer.{i}.norm1.{p}"),
        row(
            "blocks.{i}.attn.qkv.weight",
            tuple(f"layer.{{i}}.attention.{part}_proj.weight" for part in "qkv"),
            _fuse,
            _split3,
        ),
        row(
            ("blocks.{i}.attn.qkv.bias", "blocks.{i}.attn.qkv.bias_mask?"),
            tuple(f"layer.{{i}}.attention.{part}_proj.bias{'?' * (part == 'k')}" for part in "qkv"),
            _qkv_bias_from_parts,
            _qkv_bias_to_transformers,
        ),
        row("blocks.{i}.attn.proj.{p}", "layer.{i}.attention.o_proj.{p}"),
        row(_native_gamma(1), "layer.{i}." + gamma_name("layer_scaleN.lambda1", 1)),
        row("blocks.{i}.norm2.{p}", "layer.{i}.norm2.{p}"),
        row(
            ("blocks.{i}.mlp.w1.{p}", "blocks.{i}.mlp.w2.{p}", "blocks.{i}.mlp.w3.{p}"),
            ("layer.{i}.mlp.gate_proj.{p}", "layer.{i}.mlp.up_proj.{p}", "layer.{i}.mlp.down_proj.{p}"),
        ),
        row("blocks.{i}.mlp.fc1.{p}", "layer.{i}.mlp.up_proj.{p}"),
        row("blocks.{i}.mlp.fc2.{p}", "layer.{i}.mlp.down_proj.{p}"),
        row(_native_gamma(2), "layer.{i}." + gamma_name("layer_scaleN.lambda1", 2)),
        row("norm.{p}", "norm.{p}"),
    ),
    aliases=(("model.layer.", "layer."),),  # transformers 5 names the blocks so in memory
    title="transformers DINOv3ViTModel keys",
)

TIMM_EVA = Layout(
    "timm-eva",
    (
        row("cls_token", "cls_token"),
        row("storage_tokens", "reg_token"),
        row("patch_embed.proj.{p}", "patch_embed.proj.{p}"),
        row("blocks.{i}.norm1.{p}", "blocks.{i}.norm1.{p}"),
        row("blocks.{i}.attn.qkv.weight", "blocks.{i}.attn.qkv.weight"),
        row(
            ("blocks.{i}.attn.qkv.bias", "blocks.{i}.attn.qkv.bias_mask?"),
            ("blocks.{i}.attn.q_bias", "blocks.{i}.attn.v_bias"),
            _eva_qkv_bias_to_native,
            _qkv_bias_to_eva,
        ),
        row("blocks.{i}.attn.proj.{p}", "blocks.{i}.attn.proj.{p}"),
        row(_native_gamma(1), "blocks.{i}." + gamma_name("gamma_N", 1)),
        row("blocks.{i}.norm2.{p}", "blocks.{i}.norm2.{p}"),
        row(
            ("blocks.{i}.mlp.w1.{p}", "blocks.{i}.mlp.w2.{p}", "blocks.{i}.mlp.w3.{p}"),
            ("blocks.{i}.mlp.fc1_g.{p}", "blocks.{i}.mlp.fc1_x.{p}", "blocks.{i}.mlp.fc2.{p}"),
        ),
        row("blocks.{i}.mlp.fc1.{p}", "blocks.{i}.mlp.fc1.{p}"),
        row("blocks.{i}.mlp.fc2.{p}", "blocks.{i}.mlp.fc2.{p}"),
        row(_native_gamma(2), "blocks.{i}." + gamma_name("gamma_N", 2)),
        row("norm.{p}", "norm.{p}"),
        row("head.{p}", "head.{p}"),
    ),
    title="timm eva keys",
)


def layout_title(layout: Layout, keys: Iterable[str]) -> str:
    """The keys as users name them. Ours are Meta's; a classifier head marks a timm-layerscale model's own."""
    if layout is META and any(key.startswith("head.") for key in keys):
        return NATIVE.title
    return layout.title


# ----------------------------------------------------------------------------------------------- detect

# Position-embedding tables of ViTs that are not DINOv3 (which has RoPE and no table).
_POS_EMBED = re.compile(r"(^|\.)(pos_embed|position_embeddings)$")
_NATIVE_QKV = re.compile(r"^blocks\.\d+\.attn\.qkv\.weight$")
_PATCH_WEIGHT = re.compile(r"(^|\.)(patch_embed\.proj|patch_embeddings(\.projection)?)\.weight$")


def _foreign_family(keys: list[str], source: Mapping[str, Tensor]) -> str | None:
    """A one-line reason when the keys are a ViT with a learned position embedding, by family."""
    pos_key = next((k for k in keys if _POS_EMBED.search(k)), None)
    if pos_key is None:
        return None
    patch_key = next((k for k in keys if _PATCH_WEIGHT.search(k)), None)
    patch = info_of(source, patch_key).shape[-1] if patch_key else None
    if any(k.startswith(("cls_attn_blocks.", "blocks_token_only.")) for k in keys):
        family, instead = "CaiT", "timm's cait_* models"
    elif patch == 14 or any(k.endswith(("mask_token", "register_tokens")) for k in keys):
        family, instead = "DINOv2", "timm's vit_*_patch14_dinov2 models or transformers' Dinov2Model"
    elif any(ANY_GAMMA_KEY.search(k) for k in keys):
        family, instead = "DeiT-III", "timm's deit3_* models"
    else:
        family, instead = "ViT (not DINOv3)", "timm's vit_* models"
    shape = list(info_of(source, pos_key).shape)
    return (
        f"this is a {family} checkpoint: it has a learned position embedding ({pos_key} {shape}) where DINOv3 "
        f"uses RoPE and has none, so no vit_ls variant can hold it; load it with {instead} instead"
    )


def detect_layout(source: Mapping[str, Tensor]) -> Layout:
    """The layout of a checkpoint's keys, or a `CheckpointError` naming what it is instead."""
    keys = list(source)
    foreign = _foreign_family(keys, source)
    if foreign:
        raise CheckpointError(foreign)
    eva_keys = (*(f".{gamma_name('gamma_N', n)}" for n in (1, 2)), ".attn.q_bias", ".mlp.fc1_g.weight")
    if "reg_token" in keys or any(k.endswith(eva_keys) for k in keys):
        return TIMM_EVA
    if any(
        k.startswith(("embeddings.", "layer.", "model.layer.")) or f".{gamma_name('layer_scaleN.lambda1', 1)}" in k
        for k in keys
    ):
        return TRANSFORMERS
    if "storage_tokens" in keys or any(NATIVE_GAMMA_KEY.match(k) or _NATIVE_QKV.match(k) for k in keys):
        return META
    raise CheckpointError(
        f"unrecognised checkpoint layout (first keys: {', '.join(keys[:4])}); expected Meta DINOv3, "
        f"transformers DINOv3ViT or timm eva DINOv3 weights"
    )


# ------------------------------------------------------------------------------------ LayerScale names


def rename_layer_scale(state_dict: Mapping[str, Any], to: str) -> dict[str, Any]:
    """Renames LayerScale keys of any ViT-like state dict to one spelling, keeping order and values.

    `to` is "lsN.gamma" (Meta, timm ViT), "gamma_N" (timm eva, CaiT, DeiT-III) or "layer_scaleN.lambda1"
    (transformers). Other keys are left as they are.
    """
    if to not in GAMMA_SPELLINGS:
        raise ValueError(f"to: got {to!r}; allowed: {', '.join(GAMMA_SPELLINGS)}")

    def rename(key: str) -> str:
        found = ANY_GAMMA_KEY.search(key)
        if found is None:
            return key
        branch = next(b for b in found.groups()[1:] if b)
        return key[: found.end(1)] + gamma_name(to, branch)

    renamed = {rename(k): v for k, v in state_dict.items()}
    if len(renamed) != len(state_dict):
        raise ValueError(
            f"the state dict holds the same LayerScale under two spellings; keep one before renaming to {to}"
        )
    return renamed
