"""Sapiens2's own checkpoints (facebookresearch/sapiens2 `sapiens/backbones/standalone/sapiens2.py`): one file that
upstream's `Sapiens2` backbone loads with `strict=True`, and what timm's `vit_*_patch16_sapiens2.fb` Hub files hold.

Keys: `patch_embed.projection`, `storage_tokens`, `rope_embed.periods`, `blocks.N.ln1`/`ln2` (RMSNorm),
`blocks.N.attn.wq`/`wk`/`wv` (k/v narrower in grouped blocks), `attn.q_norm`/`k_norm`, `attn.proj`,
`attn.gamma.weight` (LayerScale, attention branch only), `ffn.w12` (gate rows, then up rows) and `ffn.w3`, the
final norm `ln1`. No mask token, no classifier. Upstream's code builds the model from its arch name: no config.
The 4K `tokenizer.*` and task heads (`decode_head.*`) are refused, not dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from timm_ls.names import SAPIENS2_SPEC

from ..errors import CheckpointError
from ..mapping.gamma_keys import NATIVE_SPELLING, gamma_name
from ..mapping.keys import KeyTable, row
from ..mapping.plan import Plan
from ..write.writers import write_safetensors, write_torch_file
from .base import Format, Job, PreparedWrite, fuse, gamma_branches, not_held_report, split3, with_all_gammas

Tensor = torch.Tensor
GAMMA = "attn.gamma.weight"
REFUSED = {
    "tokenizer.": "Sapiens2's 4K window tokenizer, which no DINOv3-style model has",
    "decode_head.": "a Sapiens2 task head (pose, segmentation, normals, pointmap, albedo)",
}


def _split_halves(packed: Tensor, **_) -> tuple[Tensor, ...]:
    return packed.chunk(2)


def _mask_token_to_native(token: Tensor, **_) -> tuple[Tensor]:
    return (token.reshape(1, -1),)  # transformers' Sapiens2Model saves it [1, 1, dim] beside upstream's keys


class Sapiens2Table(KeyTable):
    """The key table, refusing in one line what it cannot read rather than passing it on."""

    def to_native(self, source: Mapping[str, Tensor]) -> Plan:
        for prefix, what in REFUSED.items():
            if any(k.startswith(prefix) for k in source):
                raise CheckpointError(
                    f"the checkpoint holds {prefix}* keys, {what}: convert the backbone alone (its keys without "
                    f"{prefix}*)"
                )
        return super().to_native(source)


TABLE = Sapiens2Table(
    (
        row("cls_token", "cls_token"),
        row("storage_tokens", "storage_tokens"),
        row("mask_token", "mask_token", _mask_token_to_native),  # in pretraining checkpoints only
        row("patch_embed.proj.{p}", "patch_embed.projection.{p}"),
        row("rope_embed.periods", "rope_embed.periods"),
        row("blocks.{i}.norm1.weight", "blocks.{i}.ln1.weight"),
        row("blocks.{i}.attn.qkv.{p}", tuple(f"blocks.{{i}}.attn.w{x}.{{p}}" for x in "qkv"), fuse, split3),
        row("blocks.{i}.attn.q_norm.weight", "blocks.{i}.attn.q_norm.weight"),
        row("blocks.{i}.attn.k_norm.weight", "blocks.{i}.attn.k_norm.weight"),
        row("blocks.{i}.attn.proj.{p}", "blocks.{i}.attn.proj.{p}"),
        row("blocks.{i}." + gamma_name(NATIVE_SPELLING, 1), "blocks.{i}." + GAMMA),
        row("blocks.{i}.norm2.weight", "blocks.{i}.ln2.weight"),
        row(("blocks.{i}.mlp.w1.{p}", "blocks.{i}.mlp.w2.{p}"), "blocks.{i}.ffn.w12.{p}", _split_halves, fuse),
        row("blocks.{i}.mlp.w3.{p}", "blocks.{i}.ffn.w3.{p}"),
        row("norm.weight", "ln1.weight"),
    ),
    aliases=(("embeddings.mask_token", "mask_token"),),  # transformers' name for it, left by its key mapping
)


class Sapiens2(Format):
    spec = SAPIENS2_SPEC
    title = "Sapiens2 keys"
    table = TABLE
    unheld_args = frozenset({"mask_token"})  # released backbones drop it: a file without one says nothing
    may_drop = frozenset({"mask_token", "head", "local_cls_norm"})
    family = "sapiens2"
    # LayerScale inside the attention module, and `ffn.gamma2.weight` where its FFN has one (released: none).
    gamma_spelling = GAMMA
    gamma_pattern = r"(?:attn\.gamma|ffn\.gamma(2))\.weight"

    def recognise(self, keys: Sequence[str]) -> bool:
        return (
            any(k.endswith((".attn.wq.weight", ".ffn.w12.weight")) for k in keys)
            or "patch_embed.projection.weight" in keys
        )

    def prepare_write(self, job: Job) -> PreparedWrite:
        config = job.config
        self.holding(config)  # upstream's code builds every model from its arch name, with what the record fixes
        branches = gamma_branches(config)
        full = with_all_gammas(job.tensors, config.depth, config.embed_dim, job.fill_dtype, branches)
        out, unheld = self.table.from_native(full, dim=config.embed_dim)
        self.check_holds(config, unheld)
        not_held, warnings = not_held_report([k for k in unheld if k != "mask_token"], self.name)
        if "mask_token" in unheld:
            not_held.append("mask_token (Sapiens2's released backbones have none)")
        writer = write_safetensors if job.dst.suffix == ".safetensors" else write_torch_file
        return PreparedWrite(out, lambda tmp, bar: writer(tmp, out, progress=bar), not_held, warnings)


SAPIENS2 = Sapiens2()
