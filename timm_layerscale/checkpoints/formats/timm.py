"""timm's eva DINOv3 (`vit_*_patch16_dinov3[_qkvb]`): a folder with `model.safetensors` and timm's `config.json`
naming eva's architecture of the same shape. What `--to timm` writes and `timm.create_model("local-dir:...")`
builds into timm's own eva.

Keys as eva's: `reg_token` for the storage tokens, LayerScale as `gamma_N`, SwiGLU as `fc1_g`/`fc1_x`/`fc2`,
q and v biases apart (`_qkvb` architectures) or none, no k bias, mask token, periods or local-cls norm.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch

from timm_ls.names import TIMM_SPEC

from ...config import SWITCH, VitLsConfig
from ...layers import effective_qkv_bias, split_qkv
from ..errors import CheckpointError
from ..mapping.gamma_keys import NATIVE_SPELLING, gamma_name
from ..mapping.keys import KeyTable, row
from ..mapping.plan import PERIODS, Plan, passthrough
from ..write.writers import Progress, write_safetensors, write_text
from .base import (
    ALIGNMENT,
    CONFIG_FILE,
    RATIO,
    WEIGHTS_FILE,
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
    pretrained_cfg_fields,
    pretrained_cfg_of,
    qkv_biases,
    read_fields,
    split3,
    with_all_gammas,
    write_fields,
)

Tensor = torch.Tensor
SPELLING = "gamma_N"


def _dinov3(name: str, qkvb: bool = True, plain: bool = True) -> tuple[str | None, str | None]:
    return (name if plain else None), (f"{name}_qkvb" if qkvb else None)


# Our shipped variant -> timm's eva architectures of the same shape: (without q/v biases, with them).
EVA_ARCHITECTURES = {
    "vit_ls_tiny_patch16_dinov3": _dinov3("vit_tiny_patch16_dinov3", plain=False),
    "vit_ls_small_patch16_dinov3": _dinov3("vit_small_patch16_dinov3"),
    "vit_ls_small_plus_patch16_dinov3": _dinov3("vit_small_plus_patch16_dinov3"),
    "vit_ls_base_patch16_dinov3": _dinov3("vit_base_patch16_dinov3"),
    "vit_ls_large_patch16_dinov3": _dinov3("vit_large_patch16_dinov3"),
    "vit_ls_huge_plus_patch16_dinov3": _dinov3("vit_huge_plus_patch16_dinov3"),
    "vit_ls_7b_patch16_dinov3": _dinov3("vit_7b_patch16_dinov3", qkvb=False),
    **{f"vit_ls_{s}_patch16_lingbot": (None, f"vit_{s}_patch16_lingbot") for s in ("small", "base", "large")},
    "vit_ls_giant_patch16_lingbot": ("vit_giant_patch16_lingbot", None),
    **{
        f"vit_ls_{s}_patch16_sapiens2": (f"vit_{s}_patch16_sapiens2",) * 2
        for s in ("base", "large", "huge", "giant", "5b")
    },
}
EVA_POOLS = ("token", "avg", "avgmax", "max", "")


def _qkv_bias_to_eva(bias: Tensor, mask: Tensor | None, *, qkv_bias: bool = True, **_):
    if not qkv_bias:
        return None, None
    q, _, v = split_qkv(effective_qkv_bias(bias, mask), bias.shape[0] // 3)
    return q, v


def _eva_qkv_bias_to_native(q: Tensor, v: Tensor, **_) -> tuple[Tensor, None]:
    return torch.cat([q, torch.zeros_like(q), v]), None


def _native_gamma(branch: int) -> str:
    return "blocks.{i}." + gamma_name(NATIVE_SPELLING, branch)


def _split_halves(packed: Tensor, **_) -> tuple[Tensor, ...]:
    return packed.chunk(2)


DINOV3_TABLE = KeyTable(
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
        row(_native_gamma(1), "blocks.{i}." + gamma_name(SPELLING, 1)),
        row("blocks.{i}.norm2.{p}", "blocks.{i}.norm2.{p}"),
        row(
            ("blocks.{i}.mlp.w1.{p}", "blocks.{i}.mlp.w2.{p}", "blocks.{i}.mlp.w3.{p}"),
            ("blocks.{i}.mlp.fc1_g.{p}", "blocks.{i}.mlp.fc1_x.{p}", "blocks.{i}.mlp.fc2.{p}"),
        ),
        row("blocks.{i}.mlp.fc1.{p}", "blocks.{i}.mlp.fc1.{p}"),
        row("blocks.{i}.mlp.fc2.{p}", "blocks.{i}.mlp.fc2.{p}"),
        row(_native_gamma(2), "blocks.{i}." + gamma_name(SPELLING, 2)),
        row("norm.{p}", "norm.{p}"),
        row("head.{p}", "head.{p}"),
    )
)
# eva's Sapiens2: q, k and v projections apart (k/v narrower under grouped-query attention), qk-norm, LayerScale
# on the attention branch only (the family's record: no gamma_2 row), the SwiGLU's gate and up rows packed in
# `mlp.fc1` (gate first).
SAPIENS2_TABLE = KeyTable(
    (
        row("cls_token", "cls_token"),
        row("storage_tokens", "reg_token"),
        row("patch_embed.proj.{p}", "patch_embed.proj.{p}"),
        row("blocks.{i}.norm1.{p}", "blocks.{i}.norm1.{p}"),
        row("blocks.{i}.attn.qkv.{p}", tuple(f"blocks.{{i}}.attn.{x}_proj.{{p}}" for x in "qkv"), fuse, split3),
        row("blocks.{i}.attn.q_norm.weight", "blocks.{i}.attn.q_norm.weight"),
        row("blocks.{i}.attn.k_norm.weight", "blocks.{i}.attn.k_norm.weight"),
        row("blocks.{i}.attn.proj.{p}", "blocks.{i}.attn.proj.{p}"),
        row(_native_gamma(1), "blocks.{i}." + gamma_name(SPELLING, 1)),
        row("blocks.{i}.norm2.{p}", "blocks.{i}.norm2.{p}"),
        row(("blocks.{i}.mlp.w1.{p}", "blocks.{i}.mlp.w2.{p}"), "blocks.{i}.mlp.fc1.{p}", _split_halves, fuse),
        row("blocks.{i}.mlp.w3.{p}", "blocks.{i}.mlp.fc2.{p}"),
        row("norm.{p}", "norm.{p}"),
        row("head.{p}", "head.{p}"),
    )
)


@dataclass(frozen=True)
class EvaTables:
    """eva's two layouts: DINOv3's (EUPE and LingBot too) and Sapiens2's, told apart by its q projection."""

    dinov3: KeyTable
    sapiens2: KeyTable

    def to_native(self, source: Mapping[str, Tensor]) -> Plan:
        sapiens2 = any(k.endswith(".attn.q_proj.weight") for k in source)
        return (self.sapiens2 if sapiens2 else self.dinov3).to_native(source)

    def from_native(self, native: Mapping[str, Tensor], *, layout: str = "dinov3", **options: Any):
        return (self.sapiens2 if layout == "sapiens2" else self.dinov3).from_native(native, **options)


TABLE = EvaTables(DINOV3_TABLE, SAPIENS2_TABLE)


def _ratio_for(hidden: int, dim: int) -> float:
    """A ratio whose `int(dim * ratio)` is exactly `hidden` (how eva sizes its MLP)."""
    ratio = hidden / dim
    if int(dim * ratio) < hidden:  # one step suffices: hidden / dim is correctly rounded, so within an ulp
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def _ffn_args(args: Mapping[str, Any]) -> dict[str, Any]:
    if "embed_dim" not in args:
        return {}
    dim, swiglu = args["embed_dim"], bool(args.get("swiglu_mlp"))
    hidden = int(dim * args["mlp_ratio"])
    align = (args.get("swiglu_align_to") or 1) if swiglu else 1
    return ffn_args(dim, hidden + -hidden % align, swiglu, align)


# eva's model args <-> ours, both ways.
CONFIG_FIELDS = (
    *(ConfigField(name, name) for name in ("img_size", "patch_size", "in_chans", "num_classes", "global_pool")),
    *(ConfigField(name, name) for name in ("embed_dim", "depth", "num_heads")),
    ConfigField("mlp_ratio", write=lambda c: _ratio_for(hidden_features(c), c.embed_dim), read=_ffn_args, rule=RATIO),
    ConfigField("swiglu_mlp", write=lambda c: c.ffn_layer == "swiglu", rule=SWITCH),
    ConfigField("swiglu_align_to", write=lambda c: c.swiglu_align_to if c.ffn_layer == "swiglu" else 0, rule=ALIGNMENT),
    ConfigField("num_reg_tokens", "num_storage_tokens"),
    ConfigField("rope_temperature", "rope_base"),
    ConfigField("dynamic_img_size", "dynamic_img_size"),
    ConfigField("dynamic_img_pad", "dynamic_img_pad"),
)


def _eva_model(name: str, what: str) -> str:
    """`name` if this timm has it, else one line naming the timm that does."""
    if not timm.models.is_model(name):
        raise CheckpointError(
            f"this timm ({timm.__version__}) has no {name} to hold {what}: upgrade timm to 1.0.31 or later, or "
            f"convert --to native or hf instead"
        )
    return name


def eva_architecture(config: VitLsConfig, variant: str, qkv_bias: bool) -> str:
    """eva's architecture for a shipped `variant`, or one error line naming what eva cannot build."""
    plain, with_qv = EVA_ARCHITECTURES.get(variant, (None, None))
    if plain is None and with_qv is None:
        raise CheckpointError(
            f"timm's eva has no DINOv3 architecture for {variant} (it has the shapes of "
            f"{', '.join(EVA_ARCHITECTURES)}); convert --to native, hf or meta instead"
        )
    if qkv_bias and with_qv is None:
        raise CheckpointError(
            f"timm's eva has no {plain}_qkvb to hold this checkpoint's non-zero q/v biases; convert --to native, "
            f"hf or meta instead"
        )
    if config.global_pool not in EVA_POOLS:
        raise CheckpointError(
            f"timm's eva has no global_pool={config.global_pool!r}; pass --model-kwargs global_pool=token"
        )
    return _eva_model(with_qv if qkv_bias or plain is None else plain, variant)


def eva_config(
    config: VitLsConfig, variant: str, qkv_bias: bool, pretrained_cfg: Mapping[str, Any], layout: str = "dinov3"
) -> dict[str, Any]:
    """timm's config.json naming eva's architecture for `variant`, with every model arg."""
    cfg = pretrained_cfg_fields(pretrained_cfg, config.num_classes)
    cfg["fixed_input_size"] = not config.dynamic_img_size
    args = write_fields(CONFIG_FIELDS, config)
    if layout == "sapiens2":  # a packed SwiGLU (eva's GluMlp: no alignment), k/v heads per block
        args.update(swiglu_align_to=0, num_kv_heads=config.layer_kv_heads)
    return {
        "architecture": eva_architecture(config, variant, qkv_bias),
        "num_classes": config.num_classes,
        "num_features": config.embed_dim,
        "global_pool": config.global_pool,
        "model_args": args,
        "pretrained_cfg": cfg,
    }


def qv_bias(tensors: Mapping[str, Tensor], config: VitLsConfig) -> bool:
    """Whether any effective q or v bias is non-zero (eva's `_qkvb` architectures hold them)."""
    return any(bool(q.any() or v.any()) for _, (q, _, v) in qkv_biases(tensors, config))


class TimmEva(Format):
    spec = TIMM_SPEC
    title = "timm eva keys"
    table = TABLE
    # eva's plain architectures have no qkv bias (Meta's all-zero ones are left out), and eva no local-crop norm.
    unheld_args = frozenset({"qkv_bias", "local_cls_norm", "mask_token"})
    may_drop = frozenset({PERIODS, "local_cls_norm", "mask_token"})
    rope_code = "timm's eva"
    gamma_spelling = SPELLING

    def recognise(self, keys: Sequence[str]) -> bool:
        eva_keys = (*(f".{gamma_name(SPELLING, n)}" for n in (1, 2)), ".attn.q_bias", ".mlp.fc1_g.weight")
        return "reg_token" in keys or any(k.endswith(eva_keys) for k in keys)

    def read_config(self, cfg: Mapping[str, Any], where: str = CONFIG_FILE) -> SourceConfig | None:
        ours = {eva: variant for variant, archs in EVA_ARCHITECTURES.items() for eva in archs if eva}
        variant = ours.get(str(cfg.get("architecture")))
        if variant is None:
            return None
        args = cfg.get("model_args")
        return SourceConfig(
            read_fields(CONFIG_FIELDS, args if isinstance(args, Mapping) else {}, f"{where}: model_args"),
            pretrained_cfg_of(cfg, where),
            variant,
        )

    def prepare_write(self, job: Job) -> PreparedWrite:
        config = job.config
        layout = self.holding(config).layout  # eva's table of the family: DINOv3's or Sapiens2's
        full = with_all_gammas(job.tensors, config.depth, config.embed_dim, job.fill_dtype, gamma_branches(config))
        only_qkvb = EVA_ARCHITECTURES.get(job.architecture, ("", ""))[0] is None
        if only_qkvb and layout == "dinov3" and not config.qkv_bias:
            raise CheckpointError(
                f"timm's eva has only a _qkvb architecture for {job.architecture} and this model has no qkv bias: "
                f"--to timm cannot hold it; convert --to native or hf instead"
            )
        with_qv = qv_bias(full, config) or (only_qkvb and layout == "dinov3")
        out, unheld = self.table.from_native(full, layout=layout, qkv_bias=with_qv, dim=config.embed_dim)
        self.check_holds(config, unheld)
        k_blocks = k_bias_blocks(full, config) if layout == "dinov3" else []
        if k_blocks:
            raise CheckpointError(
                f"timm's eva has no k bias and blocks {', '.join(map(str, k_blocks))} of this model have non-zero "
                f"ones: --to timm cannot hold it; convert --to native or hf instead"
            )
        if not config.num_storage_tokens:  # eva with no register tokens has no reg_token
            out = Plan(out, passthrough(k for k in out if k != "reg_token"))
        not_held, warnings = not_held_report(unheld, self.name)
        cfg = eva_config(config, job.architecture, with_qv, job.pretrained_cfg, layout)

        def write(tmp: Path, bar: Progress | None) -> None:
            write_safetensors(tmp / WEIGHTS_FILE, out, progress=bar)
            write_text(tmp / CONFIG_FILE, json.dumps(cfg, indent=2))

        return PreparedWrite(out, write, not_held, warnings)


TIMM = TimmEva()
