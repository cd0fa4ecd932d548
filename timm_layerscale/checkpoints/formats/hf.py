"""transformers' DINOv3ViTModel: a Hub folder with `model.safetensors` (sharded above 5 GB, with an index) and
its `config.json`, every field named. What `--to hf` writes and `DINOv3ViTModel.from_pretrained` loads.

Keys `embeddings.*` and `layer.N.*` (transformers 5 names the blocks `model.layer.N` in memory: both are read),
q/k/v apart, LayerScale as `layer_scaleN.lambda1`, no RoPE periods (recomputed in fp32, unrounded), no
cls/local-cls norms. A k bias is written only where one is non-zero (`key_bias`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from timm_ls.names import HF_SPEC

from ...config import SWITCH, VitLsConfig
from ...layers import effective_qkv_bias
from ..errors import CheckpointError
from ..mapping.gamma_keys import NATIVE_SPELLING, gamma_name
from ..mapping.keys import KeyTable, row
from ..write.writers import Progress, write_sharded_safetensors, write_text
from .base import (
    CONFIG_FILE,
    HIDDEN_WIDTH,
    ConfigField,
    Format,
    Job,
    SourceConfig,
    WritePlan,
    ffn_args,
    hidden_features,
    k_bias_blocks,
    not_held_report,
    read_fields,
    with_all_gammas,
    write_fields,
)

Tensor = torch.Tensor
SPELLING = "layer_scaleN.lambda1"


def _fuse(*parts: Tensor, **_) -> tuple[Tensor]:
    return (torch.cat(parts),)


def _split3(qkv: Tensor, **_) -> tuple[Tensor, ...]:
    return qkv.chunk(3)


def _qkv_bias_from_parts(q: Tensor, k: Tensor | None, v: Tensor, **_) -> tuple[Tensor, Tensor | None]:
    # A file without a k bias gets a zero one (the model's own k-masking mask fills in); a file with one
    # keeps it through a mask of ones.
    if k is None:
        return torch.cat([q, torch.zeros_like(q), v]), None
    return torch.cat([q, k, v]), torch.ones(3 * q.shape[0], dtype=q.dtype, device=q.device)


def _qkv_bias_to_parts(bias: Tensor, mask: Tensor | None, *, k_bias: bool = False, **_):
    q, k, v = effective_qkv_bias(bias, mask).chunk(3)
    return q, k if k_bias else None, v


def _mask_token_to_native(token: Tensor, **_) -> tuple[Tensor]:
    return (token.reshape(1, -1),)


def _mask_token_to_transformers(token: Tensor, **_) -> tuple[Tensor]:
    return (token.reshape(1, 1, -1),)


def _native_gamma(branch: int) -> str:
    return "blocks.{i}." + gamma_name(NATIVE_SPELLING, branch)


TABLE = KeyTable(
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
            _qkv_bias_to_parts,
        ),
        row("blocks.{i}.attn.proj.{p}", "layer.{i}.attention.o_proj.{p}"),
        row(_native_gamma(1), "layer.{i}." + gamma_name(SPELLING, 1)),
        row("blocks.{i}.norm2.{p}", "layer.{i}.norm2.{p}"),
        row(
            ("blocks.{i}.mlp.w1.{p}", "blocks.{i}.mlp.w2.{p}", "blocks.{i}.mlp.w3.{p}"),
            ("layer.{i}.mlp.gate_proj.{p}", "layer.{i}.mlp.up_proj.{p}", "layer.{i}.mlp.down_proj.{p}"),
        ),
        row("blocks.{i}.mlp.fc1.{p}", "layer.{i}.mlp.up_proj.{p}"),
        row("blocks.{i}.mlp.fc2.{p}", "layer.{i}.mlp.down_proj.{p}"),
        row(_native_gamma(2), "layer.{i}." + gamma_name(SPELLING, 2)),
        row("norm.{p}", "norm.{p}"),
    ),
    aliases=(("model.layer.", "layer."),),  # transformers 5 names the blocks so in memory
)


def _ffn_args(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return ffn_args(cfg.get("hidden_size", 384), cfg["intermediate_size"], bool(cfg.get("use_gated_mlp")))


def _first_init_value(config: VitLsConfig) -> float:
    return next((v for pair in config.layer_init_values for v in pair if v), 1.0)


# config.json <-> model args, both ways. Fields the model fixes are written from the model (`write` only).
CONFIG_FIELDS = (
    ConfigField("hidden_size", "embed_dim"),
    ConfigField("intermediate_size", write=hidden_features, read=_ffn_args, rule=HIDDEN_WIDTH),
    ConfigField("num_hidden_layers", "depth"),
    ConfigField("num_attention_heads", "num_heads"),
    ConfigField("hidden_act", write=lambda c: "silu" if c.ffn_layer == "swiglu" else "gelu"),
    ConfigField("use_gated_mlp", write=lambda c: c.ffn_layer == "swiglu", rule=SWITCH),
    ConfigField("layer_norm_eps", "norm_eps"),
    ConfigField("rope_theta", "rope_base"),
    ConfigField("image_size", "img_size"),
    ConfigField("patch_size", "patch_size"),
    ConfigField("num_channels", "in_chans"),
    ConfigField("num_register_tokens", "num_storage_tokens"),
    ConfigField("query_bias", "qkv_bias"),
    ConfigField("value_bias", "qkv_bias"),
    ConfigField("proj_bias", "proj_bias"),
    ConfigField("mlp_bias", "ffn_bias"),
    ConfigField("layerscale_value", write=_first_init_value),
    ConfigField("drop_path_rate", "drop_path_rate"),
    ConfigField("pos_embed_shift", "rope_shift_coords"),
    ConfigField("pos_embed_jitter", "rope_jitter_coords"),
    ConfigField("pos_embed_rescale", "rope_rescale_coords"),
)


def transformers_config(config: VitLsConfig, k_bias: bool, dtype: torch.dtype) -> dict[str, Any]:
    """transformers' config.json for DINOv3ViTModel, every field named."""
    if config.rope_normalize_coords != "separate":
        raise CheckpointError(
            f"transformers' DINOv3ViTModel normalises RoPE coordinates per side ('separate'), this model uses "
            f"{config.rope_normalize_coords!r}; convert --to native or meta instead"
        )
    fields = write_fields(CONFIG_FIELDS, config)
    return {
        "architectures": ["DINOv3ViTModel"],
        "model_type": "dinov3_vit",
        **fields,
        "key_bias": k_bias,
        "dtype": str(dtype).removeprefix("torch."),
    }


class HuggingFace(Format):
    spec = HF_SPEC
    title = "transformers DINOv3ViTModel keys"
    table = TABLE
    unheld_args = frozenset({"local_cls_norm"})  # DINOv3ViTModel has no local-crop norm

    def recognise(self, keys: Sequence[str]) -> bool:
        lambda1 = f".{gamma_name(SPELLING, 1)}"
        return any(k.startswith(("embeddings.", "layer.", "model.layer.")) or lambda1 in k for k in keys)

    def read_config(self, cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> SourceConfig | None:
        if cfg.get("model_type") != "dinov3_vit":
            return None
        args = read_fields(CONFIG_FIELDS, cfg, where)
        args.setdefault("embed_dim", 384)
        if "intermediate_size" not in cfg:
            args.update(_ffn_args({**cfg, "intermediate_size": args["embed_dim"] * 4}))
        return SourceConfig(args)

    def plan_write(self, job: Job) -> WritePlan:
        config = job.config
        full = with_all_gammas(job.tensors, config.depth, config.embed_dim, job.fill_dtype)
        k_bias = bool(k_bias_blocks(full, config.depth))
        out, unheld = self.table.from_native(full, k_bias=k_bias)
        not_held, warnings = not_held_report(unheld, self.name)
        cfg = transformers_config(config, k_bias, job.fill_dtype)

        def write(tmp: Path, bar: Progress | None) -> None:
            write_sharded_safetensors(tmp, out, job.max_shard_size, bar)
            write_text(tmp / CONFIG_FILE, json.dumps(cfg, indent=2))

        return WritePlan(out, write, not_held, warnings)


HF = HuggingFace()
