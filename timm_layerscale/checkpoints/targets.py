"""Where a conversion lands: each target's layout table, its config file, its files, and what it cannot hold.

| target | files | config |
|---|---|---|
| native | `model.safetensors` | timm `config.json`: a registered vit_ls architecture and every model arg |
| meta | one `.pth` (or `.safetensors`) | none (Meta's code builds the model) |
| meta-train | `{"teacher": ...}` `.pth`, or a DCP folder (`iteration`, `model.*`) | none (Meta's training YAML) |
| hf | `model.safetensors` (sharded above 5 GB, with an index) | transformers `config.json` (DINOv3ViTModel) |
| timm | `model.safetensors` | timm `config.json`: eva's DINOv3 architecture (`_qkvb` for q/v biases) |
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import VitLsConfig
from ..layers import swiglu_hidden_features
from .errors import CheckpointError
from .layouts import META, NATIVE, TIMM_EVA, TRANSFORMERS, Layout
from .plan import Plan, Step, passthrough
from .writers import Progress, atomic_destination, write_safetensors, write_text

Tensor = torch.Tensor
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Pretrained-config fields that say where weights came from, not what they are: never written.
_SOURCE_FIELDS = ("url", "hf_hub_id", "hf_hub_filename", "source", "file", "state_dict", "architecture")


@dataclass(frozen=True)
class Target:
    name: str
    layout: Layout
    always_layer_scale: bool  # its models have LayerScale on every branch: gammas of 1 stand in for none
    folder: bool
    description: str


TARGETS = {
    t.name: t
    for t in (
        Target("native", NATIVE, False, True, "this package's layout with a timm config.json"),
        Target("meta", META, True, False, "Meta's DINOv3 keys in one .pth or .safetensors file"),
        Target(
            "meta-train",
            META,
            True,
            False,
            "what Meta's DINOv3 trainer loads: backbone and heads, a .pth or a distributed checkpoint folder",
        ),
        Target("hf", TRANSFORMERS, True, True, "transformers' DINOv3ViTModel folder"),
        Target("timm", TIMM_EVA, True, True, "timm's eva DINOv3 folder"),
    )
}


def with_all_gammas(tensors: Plan, depth: int, dim: int, dtype: torch.dtype) -> Plan:
    """Adds gammas of 1 where a branch has none: the same outputs in a layout that always has LayerScale."""
    missing = [
        f"blocks.{i}.ls{b}.gamma" for i in range(depth) for b in (1, 2) if f"blocks.{i}.ls{b}.gamma" not in tensors
    ]
    if not missing:
        return tensors
    ones = torch.ones(dim, dtype=dtype)
    return Plan(tensors, [*passthrough(tensors), *(Step((key,), (), lambda: (ones,)) for key in missing)])


def hidden_features(config: VitLsConfig) -> int:
    if config.ffn_layer == "swiglu":
        return swiglu_hidden_features(config.embed_dim, config.ffn_ratio, config.swiglu_align_to)
    return int(config.embed_dim * config.ffn_ratio)


# ------------------------------------------------------------------------------------------------ native


def pretrained_cfg_fields(pretrained_cfg: Mapping[str, Any], num_classes: int) -> dict[str, Any]:
    cfg = {k: v for k, v in pretrained_cfg.items() if k not in _SOURCE_FIELDS and v is not None}
    cfg["num_classes"] = num_classes
    return cfg


def native_config(config: VitLsConfig, architecture: str, pretrained_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """timm's config.json for this package's weights: `local-dir:` and `hf-hub:` rebuild the exact model.

    Every model arg is written, so the folder does not depend on the variant's YAML defaults of the day.
    """
    model_args = config.rebuild_args()
    return {
        "architecture": architecture,
        "num_classes": config.num_classes,
        "num_features": config.embed_dim,
        "global_pool": config.global_pool,
        "model_args": model_args,
        "pretrained_cfg": pretrained_cfg_fields(pretrained_cfg, config.num_classes),
    }


def write_native_folder(
    folder: Path,
    tensors: Mapping[str, Tensor],
    config: VitLsConfig,
    architecture: str,
    pretrained_cfg: Mapping[str, Any],
    overwrite: bool = False,
    progress: Progress | None = None,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Writes `model.safetensors` and timm's `config.json` for `tensors` (native keys, a plan or a state dict),
    and `extra_files` (name -> text, a model card), under a temporary name renamed to `folder` when complete."""
    folder = Path(folder)
    with atomic_destination(folder, overwrite, folder=True) as tmp:
        write_native_files(tmp, tensors, config, architecture, pretrained_cfg, progress)
        for name, text in (extra_files or {}).items():
            write_text(tmp / name, text)
    return folder


def write_native_files(
    folder: Path,
    tensors: Mapping[str, Tensor],
    config: VitLsConfig,
    architecture: str,
    pretrained_cfg: Mapping[str, Any],
    progress: Progress | None = None,
) -> None:
    write_safetensors(folder / WEIGHTS_FILE, tensors, progress=progress)
    write_text(folder / CONFIG_FILE, json.dumps(native_config(config, architecture, pretrained_cfg), indent=2))


# -------------------------------------------------------------------------------------------- timm eva

# Our variant -> timm's eva DINOv3 architecture of the same shape (`_qkvb` added for q/v biases).
EVA_ARCHITECTURES = {
    "vit_ls_small_patch16_dinov3": "vit_small_patch16_dinov3",
    "vit_ls_small_plus_patch16_dinov3": "vit_small_plus_patch16_dinov3",
    "vit_ls_base_patch16_dinov3": "vit_base_patch16_dinov3",
    "vit_ls_large_patch16_dinov3": "vit_large_patch16_dinov3",
    "vit_ls_huge_plus_patch16_dinov3": "vit_huge_plus_patch16_dinov3",
    "vit_ls_7b_patch16_dinov3": "vit_7b_patch16_dinov3",
}
EVA_WITHOUT_QKVB = ("vit_7b_patch16_dinov3",)


def _ratio_for(hidden: int, dim: int) -> float:
    """A ratio whose `int(dim * ratio)` is exactly `hidden` (how eva sizes its MLP)."""
    ratio = hidden / dim
    while int(dim * ratio) < hidden:
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def eva_config(config: VitLsConfig, variant: str, qkv_bias: bool, pretrained_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """timm's config.json naming eva's DINOv3 architecture for `variant`, with the args that differ."""
    base = EVA_ARCHITECTURES.get(variant)
    if base is None:
        raise CheckpointError(
            f"timm's eva has no DINOv3 architecture for {variant} (it has the shapes of "
            f"{', '.join(EVA_ARCHITECTURES)}); convert --to native, hf or meta instead"
        )
    if qkv_bias and base in EVA_WITHOUT_QKVB:
        raise CheckpointError(
            f"timm's eva has no {base}_qkvb to hold this checkpoint's non-zero q/v biases; convert --to native, "
            f"hf or meta instead"
        )
    unsupported = {
        "norm_eps": (config.norm_eps, 1e-5),
        "proj_bias": (config.proj_bias, True),
        "ffn_bias": (config.ffn_bias, True),
        "rope_normalize_coords": (config.rope_normalize_coords, "separate"),
    }
    for name, (value, fixed) in unsupported.items():
        if value != fixed:
            raise CheckpointError(
                f"timm's eva DINOv3 architectures fix {name}={fixed!r}, this model has {name}={value!r}; convert "
                f"--to native, hf or meta instead"
            )
    if config.global_pool not in ("token", "avg", "avgmax", "max", ""):
        raise CheckpointError(
            f"timm's eva has no global_pool={config.global_pool!r}; pass --model-kwargs global_pool=token"
        )
    swiglu = config.ffn_layer == "swiglu"
    model_args = {
        "img_size": config.img_size,
        "patch_size": config.patch_size,
        "in_chans": config.in_chans,
        "num_classes": config.num_classes,
        "global_pool": config.global_pool,
        "embed_dim": config.embed_dim,
        "depth": config.depth,
        "num_heads": config.num_heads,
        "mlp_ratio": _ratio_for(hidden_features(config), config.embed_dim),
        "swiglu_mlp": swiglu,
        "swiglu_align_to": config.swiglu_align_to if swiglu else 0,
        "num_reg_tokens": config.num_storage_tokens,
        "rope_temperature": config.rope_base,
        "dynamic_img_size": config.dynamic_img_size,
        "dynamic_img_pad": config.dynamic_img_pad,
    }
    architecture = base + ("_qkvb" if qkv_bias else "")
    cfg = pretrained_cfg_fields(pretrained_cfg, config.num_classes)
    cfg["fixed_input_size"] = not config.dynamic_img_size
    return {
        "architecture": architecture,
        "num_classes": config.num_classes,
        "num_features": config.embed_dim,
        "global_pool": config.global_pool,
        "model_args": model_args,
        "pretrained_cfg": cfg,
    }


# ---------------------------------------------------------------------------------------- transformers


def transformers_config(config: VitLsConfig, k_bias: bool, dtype: torch.dtype) -> dict[str, Any]:
    """transformers' config.json for DINOv3ViTModel, every field named."""
    if config.rope_normalize_coords != "separate":
        raise CheckpointError(
            f"transformers' DINOv3ViTModel normalises RoPE coordinates per side ('separate'), this model uses "
            f"{config.rope_normalize_coords!r}; convert --to native or meta instead"
        )
    gated = config.ffn_layer == "swiglu"
    first_init = next((v for pair in config.layer_init_values for v in pair if v), 1.0)
    return {
        "architectures": ["DINOv3ViTModel"],
        "model_type": "dinov3_vit",
        "hidden_size": config.embed_dim,
        "intermediate_size": hidden_features(config),
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.num_heads,
        "hidden_act": "silu" if gated else "gelu",
        "use_gated_mlp": gated,
        "layer_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "image_size": config.img_size,
        "patch_size": config.patch_size,
        "num_channels": config.in_chans,
        "num_register_tokens": config.num_storage_tokens,
        "query_bias": config.qkv_bias,
        "key_bias": k_bias,
        "value_bias": config.qkv_bias,
        "proj_bias": config.proj_bias,
        "mlp_bias": config.ffn_bias,
        "layerscale_value": first_init,
        "drop_path_rate": config.drop_path_rate,
        "pos_embed_shift": config.rope_shift_coords,
        "pos_embed_jitter": config.rope_jitter_coords,
        "pos_embed_rescale": config.rope_rescale_coords,
        "dtype": str(dtype).removeprefix("torch."),
    }


# ------------------------------------------------------------------------------------- what is not held

# Native key groups a target drops, and what losing them means.
UNHELD_NOTES = {
    "rope_embed.periods": "recomputed in fp32 there",
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
