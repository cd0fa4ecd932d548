"""name -> config -> model: variants are YAML files, registered with timm at import.

Each file under `configs/` names a variant (its file name), its architecture (`model:`, the fields of
`VitLsConfig`) and its pretrained weights (`pretrained:`, one entry per timm tag, with timm's pretrained
config fields and optional `model:` overrides that the tag implies). `register_variant` takes a user's own
file the same way; `base:` starts from a registered variant.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._builder import resolve_pretrained_cfg
from timm.models._pretrained import PretrainedCfg

from timm_ls import paths
from timm_ls.layer_sets import feature_layers
from timm_ls.plain_yaml import load_file

from .config import VitLsConfig
from .hub import OFFICIAL_SUFFIX
from .loading import load_pretrained
from .model import VisionTransformerLS

__all__ = ["VARIANTS", "Variant", "config_dir", "create_variant", "load_variant", "register_variant"]

# Read by timm's `register_model`, so each variant's cfgs must be here before it is registered.
default_cfgs: dict[str, Any] = {}
VARIANTS: dict[str, Variant] = {}

TOP_LEVEL_KEYS = ("description", "base", "model", "pretrained")
TAG_CFG_KEYS = (*(f.name for f in fields(PretrainedCfg)), "model")
FEATURE_BLOCKS = 4  # features_only returns the last four blocks (or all, if fewer) unless out_indices says
# timm 1.0.31 records a model's arguments (`model._model_args`) and its save_for_hf / push_to_hf_hub write
# them; older timms write only the architecture, which must then stay the name that rebuilds the model.
TIMM_RECORDS_MODEL_ARGS = importlib.util.find_spec("timm.models._input") is not None


def config_dir() -> Path:
    """The shipped YAML files: inside the installed package, or at the top of a source checkout."""
    return paths.config_dir()


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    model_args: dict[str, Any]
    tags: dict[str, dict[str, Any]]
    source: str
    base: str | None = None  # the registered variant its YAML starts from

    @property
    def config(self) -> VitLsConfig:
        return VitLsConfig.from_dict(self.model_args, source=self.source)

    def tag_model_args(self, tag: str | None) -> dict[str, Any]:
        return dict(self.tags.get(tag or "", {}).get("model", {}))


def _pretrained_cfg(**overrides: Any) -> dict[str, Any]:
    return {
        "url": "",
        "num_classes": 0,
        "input_size": (3, 256, 256),
        "pool_size": None,
        "crop_pct": 1.0,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "dinov3-license",
        **overrides,
    }


def load_variant(source: str | Path | dict[str, Any], name: str | None = None) -> Variant:
    """Reads and checks a variant: a YAML path or an already parsed mapping (then `name` is required)."""
    if isinstance(source, dict):
        data, where = source, f"variant {name!r}"
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"variant file {path} does not exist; pass the path of a YAML variant file")
        data, where, name = load_file(path) or {}, str(path), name or path.stem
    if not name or not isinstance(data, dict):
        raise ValueError(f"{where}: a variant needs a name and a mapping with keys {TOP_LEVEL_KEYS}")
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(TOP_LEVEL_KEYS)}")
    _check_shapes(data, where)
    model_args, tags = {}, {}
    if data.get("base"):
        if data["base"] not in VARIANTS:
            raise ValueError(f"{where}: base {data['base']!r} is not a registered variant; one of {sorted(VARIANTS)}")
        base = VARIANTS[data["base"]]
        model_args, tags = dict(base.model_args), dict(base.tags)
    model_args.update(data.get("model") or {})
    if "pretrained" in data:
        tags = dict(data.get("pretrained") or {})
    for tag, cfg in tags.items():
        bad = sorted(set(cfg or {}) - set(TAG_CFG_KEYS))
        if bad:
            raise ValueError(f"{where}: pretrained.{tag}: unknown key(s) {bad}; allowed: {list(TAG_CFG_KEYS)}")
    variant = Variant(name, data.get("description", ""), model_args, tags, where, data.get("base") or None)
    for tag in ("", *tags):  # every tag's architecture must be valid now, not at first use
        VitLsConfig.from_dict({**model_args, **variant.tag_model_args(tag)}, source=where)
    return variant


def _check_shapes(data: dict[str, Any], where: str) -> None:
    """Each top-level key holds what it names: text, a registered name, a mapping of fields, of tags."""
    for key, kind, what in (
        ("description", str, "text"),
        ("base", str, "a registered variant's name"),
        ("model", dict, "a mapping of config fields"),
        ("pretrained", dict, "a mapping of tags"),
    ):
        if data.get(key) is not None and not isinstance(data[key], kind):
            raise ValueError(f"{where}: {key}: got a {type(data[key]).__name__}; allowed: {what}")
    for tag, cfg in (data.get("pretrained") or {}).items():
        if not isinstance(tag, str) or not isinstance(cfg, (dict, type(None))):
            raise ValueError(f"{where}: pretrained: {tag!r} is not a tag name with a mapping of its pretrained cfg")
        if cfg and cfg.get("model") is not None and not isinstance(cfg["model"], dict):
            raise ValueError(
                f"{where}: pretrained.{tag}.model: got a {type(cfg['model']).__name__}; allowed: a mapping"
            )
        if any(not isinstance(k, str) for k in (cfg or {})):
            raise ValueError(f"{where}: pretrained.{tag}: its keys must be names of pretrained cfg fields")
    if any(not isinstance(k, str) for k in data.get("model") or {}):
        raise ValueError(f"{where}: model: its keys must be names of config fields")


def _requested_tag(variant: Variant, pretrained_cfg: Any) -> str | None:
    if isinstance(pretrained_cfg, str):
        return pretrained_cfg
    if isinstance(pretrained_cfg, PretrainedCfg):
        return pretrained_cfg.tag
    if isinstance(pretrained_cfg, dict):
        return pretrained_cfg.get("tag")
    return next(iter(variant.tags), None)


def _fixed_size_overlay(cfg: PretrainedCfg, overlay: dict[str, Any] | None, config: VitLsConfig) -> dict[str, Any]:
    """A model without `dynamic_img_size` takes one input size, its `img_size`: its pretrained cfg says so, so
    that timm's `resolve_data_config` + `create_transform` make inputs it accepts. The channel count stays
    the weights' (timm adapts the first conv from it)."""
    channels = (cfg.input_size or (3,))[0]
    height, width = (config.img_size, config.img_size) if isinstance(config.img_size, int) else config.img_size
    return {**(overlay or {}), "input_size": (channels, height, width), "fixed_input_size": True}


def create_variant(variant: Variant, pretrained: bool = False, **kwargs: Any) -> VisionTransformerLS:
    """Builds a variant through timm's builder: the YAML's arguments, the tag's, then the caller's."""
    tag = _requested_tag(variant, kwargs.get("pretrained_cfg"))
    model_kwargs = {**variant.model_args, **variant.tag_model_args(tag), **kwargs}
    # Checked before timm's builder sees it: the feature wrapper's default depends on a valid depth.
    config = VitLsConfig.from_dict({k: v for k, v in model_kwargs.items() if k in VitLsConfig.field_names()})
    if isinstance(
        model_kwargs.get("out_indices"), str
    ):  # a name ("four_even", ...) as numbers, so feature_info lists those blocks
        model_kwargs["out_indices"] = tuple(feature_layers(model_kwargs["out_indices"], config.depth))
    overlay = kwargs.get("pretrained_cfg_overlay")
    cfg = resolve_pretrained_cfg(variant.name, kwargs.get("pretrained_cfg"), overlay)
    if not config.dynamic_img_size:
        model_kwargs["pretrained_cfg_overlay"] = _fixed_size_overlay(cfg, overlay, config)
    model_cls = VisionTransformerLS
    if pretrained:
        # Built and loaded in one step, streamed into a model on the meta device (loading.py); timm's builder
        # still fills in its arguments, records the pretrained cfg and wraps features_only models afterwards.
        ungated = ungated_tag(variant, cfg.tag)
        model_cls = partial(load_pretrained, cfg.to_dict(), kwargs.get("cache_dir"), ungated=ungated)
    model = build_model_with_cfg(
        model_cls,
        variant.name,
        False,
        feature_cfg=dict(feature_cls="getter", out_indices=min(FEATURE_BLOCKS, config.depth)),
        **model_kwargs,
    )
    if TIMM_RECORDS_MODEL_ARGS and not _is_shipped(variant) and isinstance(model, VisionTransformerLS):
        _record_rebuild(model, variant)
    return model


def _record_rebuild(model: VisionTransformerLS, variant: Variant) -> None:
    """A model of a user's own YAML variant names a shipped architecture and records every argument, so that
    timm's save_for_hf / push_to_hf_hub publish a model that rebuilds where the YAML was never registered
    (timm's create_model adds the caller's arguments on top when this returns)."""
    architecture = builtin_architecture(variant.name, model.config)
    model.pretrained_cfg = model.default_cfg = {**model.pretrained_cfg, "architecture": architecture}
    model._model_args = {**model.config.rebuild_args(), **model._model_args}


def register_variant(source: str | Path | dict[str, Any], name: str | None = None) -> str:
    """Registers a variant with timm (`timm.create_model(name)` then works); returns its name."""
    variant = load_variant(source, name)
    cfgs = {
        f"{variant.name}.{tag}": _pretrained_cfg(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in (cfg or {}).items() if k != "model"}
        )
        for tag, cfg in variant.tags.items()
    }
    default_cfgs.update(generate_default_cfgs(cfgs or {variant.name: _pretrained_cfg()}))

    def entrypoint(pretrained: bool = False, **kwargs: Any) -> VisionTransformerLS:
        return create_variant(variant, pretrained, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = variant.name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = variant.description
    VARIANTS[variant.name] = variant
    register_model(entrypoint)
    return variant.name


def builtin_architecture(name: str | None, config: VitLsConfig) -> str:
    """A shipped variant to name in a saved config: `name` if it is one, else the shipped one its YAML
    starts from (`base:`, followed), else the one whose arguments differ least from `config` (the saved
    config carries every argument, so any shipped name rebuilds it)."""
    shipped = {n: v for n, v in VARIANTS.items() if _is_shipped(v)}
    seen = set()
    while name in VARIANTS and name not in shipped and name not in seen:
        seen.add(name)
        name = VARIANTS[name].base
    if name in shipped:
        return name
    values = config.to_dict()

    def differing(variant: Variant) -> int:
        return sum(values.get(k) != v for k, v in variant.model_args.items())

    return min(sorted(shipped), key=lambda n: differing(shipped[n]))


def _is_shipped(variant: Variant) -> bool:
    return Path(variant.source).parent == config_dir()


class VariantNameError(ValueError):
    """A `NAME[.TAG]` that names no registered variant, or a tag it lacks; the message is one line."""


def close_variant_names(name: str) -> list[str]:
    """The registered names nearest `name` (every name when none is near), for a "did you mean"."""
    return difflib.get_close_matches(name, VARIANTS, n=3, cutoff=0.5) or sorted(VARIANTS)


def find_variant(name: str, what: str = "model") -> tuple[Variant, str | None]:
    """`NAME` or `NAME.TAG` -> the registered variant and the tag (None without one); `what` names the
    argument in the error (`unknown model 'vit_ls_smal'; did you mean ...`)."""
    base, _, tag = name.partition(".")
    if base not in VARIANTS:
        raise VariantNameError(
            f"unknown {what} {base!r}; did you mean {', '.join(close_variant_names(base))}? (`timm-ls list` shows all)"
        )
    variant = VARIANTS[base]
    if tag and tag not in variant.tags:
        raise VariantNameError(f"{base} has no pretrained tag {tag!r}; its tags: {', '.join(variant.tags) or 'none'}")
    return variant, tag or None


def ungated_tag(variant: Variant, tag: str | None) -> str:
    """`NAME.TAG` of the ungated copy of a gated tag's weights (`lvd1689m` for `lvd1689m_facebook`), or ''."""
    ungated = (tag or "").removesuffix(OFFICIAL_SUFFIX)
    return f"{variant.name}.{ungated}" if ungated != (tag or "") and ungated in variant.tags else ""


def register_builtin_variants() -> None:
    for path in sorted(config_dir().glob("*.yaml")):
        register_variant(path)
