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

from ...config import HEADS_PER_BLOCK, MAX_DEPTH, MAX_HEADS, SWITCH, Rule, VitLsConfig, int_in, shown
from ...families import SAPIENS2 as SAPIENS2_FAMILY
from ...families import Holding, family_record
from ...layers import effective_qkv_bias, split_qkv
from ..mapping.gamma_keys import NATIVE_SPELLING, gamma_name
from ..mapping.keys import KeyTable, row
from ..mapping.plan import PERIODS
from ..write.writers import Progress, write_sharded_safetensors, write_text
from .base import (
    CONFIG_FILE,
    HIDDEN_WIDTH,
    ConfigField,
    Format,
    Job,
    PreparedWrite,
    SourceConfig,
    ffn_args,
    fuse,
    gamma_branches,
    hidden_features,
    k_bias_blocks,
    not_held_report,
    read_fields,
    split3,
    with_all_gammas,
    write_fields,
)

Tensor = torch.Tensor
SPELLING = "layer_scaleN.lambda1"


def _qkv_bias_from_parts(q: Tensor, k: Tensor | None, v: Tensor, **_) -> tuple[Tensor, Tensor | None]:
    # A file without a k bias gets a zero one (the model's own k-masking mask fills in); a file with one
    # keeps it through a mask of ones.
    if k is None:
        return torch.cat([q, torch.zeros_like(q), v]), None
    qkv = torch.cat([q, k, v])
    return qkv, torch.ones_like(qkv)


def _qkv_bias_to_parts(bias: Tensor, mask: Tensor | None, *, dim: int, k_bias: bool = False, **_):
    q, k, v = split_qkv(effective_qkv_bias(bias, mask), dim)
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
            fuse,
            split3,
        ),
        row(
            ("blocks.{i}.attn.qkv.bias", "blocks.{i}.attn.qkv.bias_mask?"),
            tuple(f"layer.{{i}}.attention.{part}_proj.bias{'?' * (part == 'k')}" for part in "qkv"),
            _qkv_bias_from_parts,
            _qkv_bias_to_parts,
        ),
        row("blocks.{i}.attn.q_norm.weight", "layer.{i}.attention.q_norm.weight"),
        row("blocks.{i}.attn.k_norm.weight", "layer.{i}.attention.k_norm.weight"),
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


KV_HEADS_PER_LAYER = Rule(lambda v: v is None or HEADS_PER_BLOCK.check(v), f"null or {HEADS_PER_BLOCK.allowed}")


def _per_layer_kv_heads(cfg: Mapping[str, Any]) -> dict[str, Any]:
    heads = cfg["num_key_value_heads_per_layer"]
    return {} if heads is None else {"num_kv_heads": list(heads)}


# Sapiens2Config <-> model args, beside the fields it shares with DINOv3ViTConfig (its norms are RMSNorm).
SAPIENS2_FIELDS = (
    *(f for f in CONFIG_FIELDS if f.theirs not in ("layer_norm_eps", "query_bias", "value_bias")),
    ConfigField("rms_norm_eps", "norm_eps"),
    ConfigField("query_bias", "qkv_bias"),
    ConfigField("key_bias", "qkv_bias"),
    ConfigField("value_bias", "qkv_bias"),
    ConfigField("use_qk_norm", "qk_norm"),
    ConfigField("use_mask_token", "mask_token"),
    # null, as in transformers, stands for its default pattern (SAPIENS2_PATTERN)
    ConfigField(
        "num_key_value_heads_per_layer",
        write=lambda c: c.layer_kv_heads,
        read=_per_layer_kv_heads,
        rule=KV_HEADS_PER_LAYER,
    ),
)
# What a Sapiens2Config stands for beside its fields: its family's switches and what Sapiens2Model fixes.
SAPIENS2_FIXED = {
    "family": SAPIENS2_FAMILY.name,
    **{name: allowed[0] for name, allowed in SAPIENS2_FAMILY.switches.items() if len(allowed) == 1},
    **SAPIENS2_FAMILY.formats["hf"].fixes,
}


# transformers' Sapiens2Config fields for its default k/v pattern, read only where no per-layer list is given.
SAPIENS2_PATTERN = (
    ConfigField("num_key_value_attention_heads", rule=int_in(1, MAX_HEADS)),
    ConfigField("num_first_full_attention_layers", rule=int_in(0, MAX_DEPTH)),
    ConfigField("num_last_full_attention_layers", rule=int_in(0, MAX_DEPTH)),
)


def _sapiens2_args(cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> dict[str, Any]:
    args = {**read_fields((*SAPIENS2_FIELDS, *SAPIENS2_PATTERN), cfg, where), **SAPIENS2_FIXED}
    dim = args.get("embed_dim", 1024)
    hidden = cfg.get("intermediate_size", 4 * dim)
    if not HIDDEN_WIDTH.check(hidden):
        raise ValueError(f"{where}: intermediate_size: got {shown(hidden)}; allowed: {HIDDEN_WIDTH.allowed}")
    args.update(ffn_args(dim, hidden, True))
    if cfg.get("num_key_value_heads_per_layer") is None:  # transformers' own default pattern, from checked values
        heads, depth = args.get("num_heads", 16), args.get("depth", 24)
        kv = cfg.get("num_key_value_attention_heads", 8)
        first, last = cfg.get("num_first_full_attention_layers", 8), cfg.get("num_last_full_attention_layers", 8)
        args["num_kv_heads"] = [heads if i < first or i >= depth - last else kv for i in range(depth)]
    return args


def hf_layout(config: VitLsConfig) -> str:
    """The layout transformers holds the config's family in, by its record (DINOv3ViTModel's where it has none)."""
    held = family_record(config.family).formats.get(HF_SPEC.name, Holding(layout="dinov3"))
    return held.layout


def sapiens2_config(config: VitLsConfig, dtype: torch.dtype) -> dict[str, Any]:
    """transformers' config.json for Sapiens2Model, every field named (the k/v heads per block too: its
    default of 8 grouped heads is wrong for the 1B and the 5B)."""
    return {
        "architectures": ["Sapiens2Model"],
        "model_type": "sapiens2",
        **write_fields(SAPIENS2_FIELDS, config),
        "dtype": str(dtype).removeprefix("torch."),
    }


def transformers_config(config: VitLsConfig, k_bias: bool, dtype: torch.dtype) -> dict[str, Any]:
    """transformers' config.json for the model of the family's layout (its record's): DINOv3ViTModel or
    Sapiens2Model."""
    if hf_layout(config) == "sapiens2":
        return sapiens2_config(config, dtype)
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
    title = "transformers DINOv3ViTModel or Sapiens2Model keys"
    table = TABLE
    unheld_args = frozenset({"local_cls_norm"})  # DINOv3ViTModel has no local-crop norm
    may_drop = frozenset({PERIODS, "local_cls_norm", "head"})
    rope_code = "transformers"
    gamma_spelling = SPELLING

    def recognise(self, keys: Sequence[str]) -> bool:
        lambda1 = f".{gamma_name(SPELLING, 1)}"
        return any(k.startswith(("embeddings.", "layer.", "model.layer.")) or lambda1 in k for k in keys)

    def read_config(self, cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> SourceConfig | None:
        if cfg.get("model_type") == "sapiens2":
            return SourceConfig(_sapiens2_args(cfg, where))
        if cfg.get("model_type") != "dinov3_vit":
            return None
        args = read_fields(CONFIG_FIELDS, cfg, where)
        args.setdefault("embed_dim", 384)
        if "intermediate_size" not in cfg:
            args.update(_ffn_args({**cfg, "intermediate_size": args["embed_dim"] * 4}))
        return SourceConfig(args)

    def prepare_write(self, job: Job) -> PreparedWrite:
        config = job.config
        sapiens2 = self.holding(config).layout == "sapiens2"  # Sapiens2Model: a k bias in every block
        full = with_all_gammas(job.tensors, config.depth, config.embed_dim, job.fill_dtype, gamma_branches(config))
        k_bias = sapiens2 or bool(k_bias_blocks(full, config))
        out, unheld = self.table.from_native(full, k_bias=k_bias, dim=config.embed_dim)
        self.check_holds(config, unheld)
        not_held, warnings = not_held_report(unheld, self.name)
        cfg = transformers_config(config, k_bias, job.fill_dtype)

        def write(tmp: Path, bar: Progress | None) -> None:
            write_sharded_safetensors(tmp, out, job.max_shard_size, bar)
            write_text(tmp / CONFIG_FILE, json.dumps(cfg, indent=2))

        return PreparedWrite(out, write, not_held, warnings)


HF = HuggingFace()
