"""Meta's released DINOv3 backbones: `dinov3_vit*16_pretrain_*.pth`, what Meta's hub builders load.

Its keys are this package's own (the native layout without a classifier head). Recognised by the storage
tokens, a native gamma or a fused qkv weight. Written as one `.pth` (or `.safetensors`) file; Meta's code
builds the model, so there is no config. Its blocks always have LayerScale.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from timm_ls.names import META_SPEC

from ..mapping.gamma_keys import NATIVE_GAMMA_KEY, NATIVE_SPELLING, gamma_name
from ..mapping.keys import KeyTable, row
from ..write.writers import write_safetensors, write_torch_file
from .base import Format, Job, WritePlan, not_held_report, refuse_family, with_all_gammas

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


class Meta(Format):
    spec = META_SPEC
    title = "Meta DINOv3 keys"
    table = KeyTable(tuple(row(key, key) for key in NATIVE_KEYS if not key.startswith("head.")))

    def recognise(self, keys: Sequence[str]) -> bool:
        return native_keys(keys)

    def plan_write(self, job: Job) -> WritePlan:
        config = job.config
        refuse_family(config, "dinov3", "Meta's DINOv3 code", "sapiens2, native, hf or timm")
        full = with_all_gammas(job.tensors, config.depth, config.embed_dim, job.fill_dtype)
        out, unheld = self.table.from_native(full)
        not_held, warnings = not_held_report(unheld, self.name)
        writer = write_safetensors if job.dst.suffix == ".safetensors" else write_torch_file
        return WritePlan(out, lambda tmp, bar: writer(tmp, out, progress=bar), not_held, warnings)


META = Meta()
