"""What an export starts from: a model in memory (a module, a name without weights, a YAML variant), or weights
in a file (a checkpoint, a folder, a tag's pretrained file) that stream into the file without a model made."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
from timm.models import get_pretrained_cfg
from torch import nn

from timm_ls.names import is_variant_file

from ..checkpoints import CheckpointError, Fitted, open_checkpoint, plan_load
from ..checkpoints.mapping.keys import block_index
from ..checkpoints.mapping.plan import Plan, passthrough
from ..config import VitLsConfig
from ..identity import identify_checkpoint
from ..loading import pretrained_source
from ..model import VisionTransformerLS
from ..variants import VARIANTS, VariantNameError, close_variant_names, find_variant, register_variant
from .errors import ExportError


@dataclass
class Source:
    name: str  # NAME or NAME.TAG
    config: VitLsConfig
    pretrained_cfg: dict[str, Any]
    weights: str  # where the weights come from, in words
    model: nn.Module | None = None  # a model in memory, or
    checkpoint: Path | None = None  # a file streamed into the export

    @contextmanager
    def weights_for(self, model: VisionTransformerLS) -> Iterator[Fitted]:
        """The checkpoint planned into `model` (on the meta device), blocks beyond its depth dropped (a
        reduced-depth export of a deep checkpoint); read while the block runs."""
        with open_checkpoint(self.checkpoint) as ckpt:
            fitted = plan_load(ckpt, model, prepare=lambda native: first_blocks(native, self.config.depth))
            yield fitted
            fitted.plan.release()


def first_blocks(native: Plan, depth: int) -> Plan:
    """The native plan without blocks from `depth` on."""
    kept = [k for k in native if (block_index(k) or 0) < depth]
    return Plan(native, passthrough(kept)) if len(kept) < len(native) else native


def _registered(name: str) -> tuple[str, str | None] | None:
    if name.partition(".")[0] not in VARIANTS:
        return None
    try:
        variant, tag = find_variant(name)
    except VariantNameError as exc:
        raise ExportError(str(exc)) from None
    return variant.name, tag


def resolve_source(
    source: str | Path | nn.Module, model: str | None, model_kwargs: Mapping[str, Any], pretrained: bool
) -> Source:
    if isinstance(source, nn.Module):
        if not isinstance(source, VisionTransformerLS):
            raise ExportError(f"export_onnx exports VisionTransformerLS models, got {type(source).__name__}")
        cfg = dict(getattr(source, "pretrained_cfg", None) or {})
        name = (cfg.get("architecture") or "VisionTransformerLS") + (f".{cfg['tag']}" if cfg.get("tag") else "")
        return Source(name, source.config, cfg, "the given model", model=source)
    text = str(source)
    if is_variant_file(text) and Path(text).is_file():
        text = register_variant(Path(text))
    found = _registered(text) if not Path(text).exists() else None
    if found is not None:
        return _named(*found, model_kwargs, pretrained)
    if Path(text).exists():
        return _streamed(Path(text), model, model_kwargs, f"checkpoint {text}")
    if "/" in text or Path(text).suffix:
        raise ExportError(f"{text} does not exist; pass the path of a checkpoint file or folder")
    raise ExportError(
        f"{text} is not a registered variant; did you mean {', '.join(close_variant_names(text.partition('.')[0]))}? "
        f"(`timm-ls list` shows all)"
    )


def _named(base: str, tag: str | None, model_kwargs: Mapping[str, Any], pretrained: bool) -> Source:
    if pretrained:  # the tag's file, streamed like any checkpoint
        tag = tag or next(iter(VARIANTS[base].tags), None)
        cfg = get_pretrained_cfg(f"{base}.{tag}") if tag else None
        if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
            raise ExportError(f"{base} has no pretrained weights; pass a checkpoint file or folder instead")
        path = pretrained_source(cfg.to_dict())
        return _streamed(Path(path), f"{base}.{tag}", model_kwargs, f"pretrained {cfg.hf_hub_id or path}")
    name = f"{base}.{tag}" if tag else base
    built = timm.create_model(name, **model_kwargs).eval()
    return Source(name, built.config, dict(built.pretrained_cfg), "random init", model=built)


def _streamed(path: Path, model: str | None, model_kwargs: Mapping[str, Any], weights: str) -> Source:
    depth = model_kwargs.get("depth")
    fewer = isinstance(depth, int) and not isinstance(depth, bool) and depth > 0
    with open_checkpoint(path) as ckpt:
        try:
            found = identify_checkpoint(
                ckpt, model, model_kwargs, prepare=(lambda native: first_blocks(native, depth)) if fewer else None
            )
        except CheckpointError as exc:
            raise ExportError(str(exc)) from None
    identified = found.model
    return Source(identified.full_name, identified.config, identified.pretrained_cfg, weights, checkpoint=path)
