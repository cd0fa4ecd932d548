"""model/file -> plan -> target table -> writer: `convert_checkpoint`, tensor by tensor.

A checkpoint is read lazily, mapped to native keys by its layout's table, fitted to the model it holds
(the variant given, or the one its shapes match, on the meta device), cast, mapped to the target's keys
by the target's table and written as it streams. Only the few small tensors whose values decide the
target's architecture (q/k/v biases, RoPE periods) and the gammas that are checked are read ahead.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from timm.models import get_pretrained_cfg

from .checkpoints.dcp_writer import write_dcp
from .checkpoints.errors import CheckpointError
from .checkpoints.fit import Fitted, fit_to_model
from .checkpoints.gamma_keys import NATIVE_GAMMA_KEY
from .checkpoints.layouts import META, detect_layout, effective_qkv_bias, layout_title
from .checkpoints.plan import Plan, cast_plan, info_of, passthrough
from .checkpoints.reader import ONLY_SET, LazyCheckpoint, TensorInfo, open_checkpoint
from .checkpoints.targets import (
    CONFIG_FILE,
    EVA_ARCHITECTURES,
    OUTPUT_CHANGING,
    TARGETS,
    UNHELD_NOTES,
    WEIGHTS_FILE,
    Target,
    eva_config,
    transformers_config,
    unheld_groups,
    with_all_gammas,
    write_native_files,
)
from .checkpoints.writers import (
    Progress,
    atomic_destination,
    write_safetensors,
    write_sharded_safetensors,
    write_text,
    write_torch_file,
)
from .config import VitLsConfig, resolve_init_values
from .meta_heads import DEFAULT_HEADS, RELEASED_HEADS, MetaHeads, heads_from_config, heads_of, meta_yaml, new_heads
from .model import VisionTransformerLS
from .variants import VARIANTS, VariantNameError, builtin_architecture, find_variant, load_variant

Tensor = torch.Tensor
WEIGHTS = ("auto", "ema", "raw")
DTYPES = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PERIODS = "rope_embed.periods"
PROGRESS_MIN_BYTES = 256 << 20  # a bar for conversions at least this large (when stderr is a terminal)
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
# Keys a file may lack that fitting fills, so they say nothing about which variant it is.
_FILLABLE = ("attn.qkv.bias_mask", PERIODS, "mask_token")


MAX_LISTED = 80  # characters of model arguments the summary line lists; `model_args` has them all


@dataclass
class ResolvedModel:
    """The model a checkpoint holds: its variant, full config, and why that variant."""

    name: str
    tag: str | None
    config: VitLsConfig
    reason: str
    pretrained_cfg: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversion:
    """What `convert_checkpoint` did; `summary()` is the one line the command prints."""

    source: str
    kind: str
    destination: Path
    target: str
    layout: str
    weights: str
    variant: str
    reason: str
    tensors: int
    nbytes: int
    seconds: float
    not_held: list[str]
    report: list[str]
    warnings: list[str]
    keys: str = ""  # the source's keys as users name them: "Meta DINOv3 keys"
    model_args: dict[str, Any] = field(default_factory=dict)  # the full config of the model written
    notes: list[str] = field(default_factory=list)  # the target's own, e.g. meta-train's heads and dtype
    meta_yaml: str | None = None  # meta-train: the lines of Meta's training YAML that use the checkpoint

    def summary(self) -> str:
        held = f"; not held by {self.target}: {', '.join(self.not_held)}" if self.not_held else ""
        notes = "".join(f"; {note}" for note in self.notes)
        return (
            f"converted {self.source} ({self.kind}, {self.keys or self.layout}, weights: {self.weights}) to "
            f"{self.target} "
            f"{self.destination}: {self.variant} ({self.reason}), {self.tensors} tensors, "
            f"{_size(self.nbytes)}, {self.seconds:.1f} s{notes}{held}"
        )


def convert_checkpoint(
    src: str | Path | Mapping[str, Any],
    dst: str | Path,
    to: str = "native",
    model: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    weights: str = "auto",
    fuse_layerscale: bool = False,
    overwrite: bool = False,
    strict: bool = False,
    *,
    max_shard_size: int | str = "5GB",
    progress: bool | None = None,
    meta_config: str | Path | None = None,
    seed: int = 0,
    distill_teacher: bool = False,
) -> Conversion:
    """Converts a checkpoint to `to` ("native", "meta", "meta-train", "hf" or "timm") at `dst`, tensor by tensor.

    `model` is a variant name (`NAME` or `NAME.TAG`) or a variant YAML file; without it the variant is
    inferred from the shapes (and the Hub config.json of a folder). `model_kwargs` override its args.
    `dtype` ("keep", "fp32", "bf16", "fp16") casts the weights, RoPE periods excepted; None is "keep", and
    "fp32" for meta-train (Meta's trainer keeps fp32 masters). `weights` picks
    the EMA/teacher ("ema") or trained ("raw") set, "auto" the EMA one where there is one.
    `fuse_layerscale` folds every gamma into the projection before it. `strict` turns warnings (NaN or
    Inf gammas, outputs the target cannot reproduce) into errors. `dst` is replaced only with `overwrite`;
    on any error nothing is left behind. Raises `CheckpointError` (or `ValueError`) for bad input.

    "meta-train" writes what Meta's DINOv3 trainer loads (`student.resume_from_teacher_chkpt`, `gram.ckpt`,
    `distillation.checkpoint_path`): `dst` ending in `.pth` is `{"teacher": state_dict}`, `dst` without a
    suffix a torch.distributed.checkpoint folder (`iteration` and `model.*`), keys `backbone.*`,
    `dino_head.*`, `ibot_head.*`. The source's heads are carried; without them new heads are made as Meta's
    DINOHead makes them from `seed`, sized by `meta_config` (Meta's training YAML, merged over its defaults),
    else as Meta trained the released models (their shapes) or by Meta's defaults. `distill_teacher` says the
    checkpoint will be a distillation teacher: new heads are then a warning (an error with `strict`).
    """
    start = time.perf_counter()
    dst = Path(dst)
    if dtype is None:
        dtype = "fp32" if to == "meta-train" else "keep"
    target = _checked_request(src, dst, to, dtype, weights, overwrite)
    heads_config = heads_from_config(meta_config) if meta_config is not None and to == "meta-train" else None
    with _opened(src, weights, heads=to == "meta-train") as ckpt:
        _refuse_to_replace_source(ckpt, dst)
        _refuse_without_backbone(ckpt)
        layout = detect_layout(ckpt)
        native = layout.to_native(ckpt)
        resolved = resolve_model(native, model, dict(model_kwargs or {}), ckpt.hub_config, fuse_layerscale)
        heads = _Heads(ckpt, heads_config, seed, distill_teacher) if target.name == "meta-train" else None
        keys_title = layout_title(layout, ckpt)
        fitted, export = _planned(native, keys_title, resolved, target.name, DTYPES[dtype], dst, max_shard_size, heads)
        warnings = fitted.warnings + export.warnings
        if strict and warnings:
            raise CheckpointError(f"{warnings[0]}; --strict refuses to convert it (drop --strict to convert anyway)")
        _write(export, dst, target, overwrite, progress)
        return Conversion(
            source=str(src) if isinstance(src, (str, Path)) else str(ckpt.path),
            kind=ckpt.kind,
            destination=dst,
            target=target.name,
            layout=layout.name,
            weights=ckpt.weights,
            variant=resolved.name + (f".{resolved.tag}" if resolved.tag else ""),
            reason=resolved.reason,
            tensors=len(export.tensors),
            nbytes=export.tensors.nbytes,
            seconds=time.perf_counter() - start,
            not_held=export.not_held,
            report=fitted.report(),
            warnings=warnings,
            keys=keys_title,
            model_args=resolved.config.to_dict(),
            notes=export.notes,
            meta_yaml=export.meta_yaml,
        )


def _checked_request(src: Any, dst: Path, to: str, dtype: str, weights: str, overwrite: bool) -> Target:
    """The target, once every argument is known good and the destination is free (or may be replaced)."""
    target = TARGETS.get(to)
    if target is None:
        raise CheckpointError(f"unknown target {to!r}; pass --to one of {', '.join(TARGETS)}")
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; pass --dtype one of {', '.join(DTYPES)}")
    if weights not in WEIGHTS:
        raise CheckpointError(f"unknown weights set {weights!r}; pass --weights one of {', '.join(WEIGHTS)}")
    if target.name == "meta" and dst.suffix not in (*TORCH_SUFFIXES, ".safetensors"):
        raise CheckpointError(f"--to meta writes one file: name it .pth or .safetensors (got {dst.name})")
    if target.name == "meta-train" and dst.suffix not in ("", ".pth"):
        raise CheckpointError(
            f"--to meta-train writes a .pth file or a distributed checkpoint folder: name it .pth or give a folder "
            f"name without a suffix (got {dst.name})"
        )
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it, or choose another path")
    return target


def _planned(
    native: Plan,
    layout: str,
    resolved: ResolvedModel,
    to: str,
    cast: torch.dtype | None,
    dst: Path,
    max_shard_size: int | str,
    heads: _Heads | None = None,
) -> tuple[Fitted, _Export]:
    """The checkpoint fitted to its model, cast, and mapped to the target's keys: all planned, nothing read."""
    fill_dtype = cast or dominant_dtype(native)
    fitted = fit_to_model(
        native,
        expected_state(resolved.config),
        layout=layout,
        model_name=resolved.name,
        config=resolved.config,
        fill_dtype=fill_dtype,
    )
    tensors = cast_plan(fitted.plan, cast, keep=[PERIODS])
    if heads is not None:
        return fitted, _export_meta_train(tensors, resolved, fill_dtype, cast, heads, dst)
    return fitted, _export(to, tensors, resolved, fill_dtype, dst, max_shard_size)


def _write(export: _Export, dst: Path, target: Target, overwrite: bool, progress: bool | None) -> None:
    """The target's files into a temporary name, renamed to `dst` when complete."""
    total = export.tensors.nbytes
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
    folder = target.folder if target.name != "meta-train" else not dst.suffix  # meta-train: .pth or a folder
    with (
        _progress_bar(total, f"{target.name} {dst.name}", show) as bar,
        atomic_destination(dst, overwrite, folder=folder) as tmp,
    ):
        export.write(tmp, bar)


@contextmanager
def _opened(src: Any, weights: str, heads: bool) -> Iterator[LazyCheckpoint]:
    if isinstance(src, LazyCheckpoint):
        if heads and src.heads is None:
            raise ValueError("meta-train carries the source's heads: open it with open_checkpoint(..., heads=True)")
        yield src
        return
    with open_checkpoint(src, weights, heads=heads) as ckpt:
        yield ckpt


def _refuse_without_backbone(ckpt: LazyCheckpoint) -> None:
    if not len(ckpt):
        parts = f" (only {', '.join(sorted({k.split('.')[0] for k in ckpt.heads}))})" if ckpt.heads else ""
        raise CheckpointError(f"{ckpt.path} holds no backbone{parts}; pass a checkpoint with the backbone's weights")


def _refuse_to_replace_source(ckpt: LazyCheckpoint, dst: Path) -> None:
    """Refuses a destination whose writing replaces a file the source reads: DST, or any file under a DST
    folder, that is one of them by device and inode (so also under another name, a symlink or a hard link)."""
    read = {_identity(path): path for path in ckpt.files}
    replaced = [dst, *(Path(parent, name) for parent, _, names in sorted(os.walk(dst)) for name in sorted(names))]
    for path in replaced:
        source = read.get(_identity(path)) if path.exists() else None
        if source is not None:
            same = f" ({path} is the same file)" if path != dst and path.resolve() != source.resolve() else ""
            raise CheckpointError(f"{dst} would replace the source file {source}{same}; choose another destination")


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_dev, stat.st_ino


@contextmanager
def _progress_bar(total: int, desc: str, show: bool):
    if not show:
        yield None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr) as bar:
        yield bar.update


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""


def dominant_dtype(tensors: Mapping[str, Tensor]) -> torch.dtype:
    """The floating dtype holding most of the bytes: fills are made in it."""
    totals: dict[torch.dtype, int] = {}
    for key in tensors:
        info = tensors.info(key)
        if info.dtype.is_floating_point and key != PERIODS:
            totals[info.dtype] = totals.get(info.dtype, 0) + info.nbytes
    return max(totals, key=totals.get) if totals else torch.float32


# --------------------------------------------------------------------------------------------- export


@dataclass
class _Export:
    tensors: Plan  # in the target's keys
    write: Callable[[Path, Progress | None], None]  # into the temporary destination
    not_held: list[str]
    warnings: list[str]
    notes: list[str] = field(default_factory=list)
    meta_yaml: str | None = None


def _export(
    to: str,
    tensors: Plan,
    resolved: ResolvedModel,
    fill_dtype: torch.dtype,
    dst: Path,
    max_shard_size: int | str,
) -> _Export:
    """The target's tensors (its table run over the native plan), how to write them, and what it drops."""
    config = resolved.config
    if to == "native":
        architecture = builtin_architecture(resolved.name, config)
        return _Export(
            tensors,
            lambda tmp, bar: write_native_files(tmp, tensors, config, architecture, resolved.pretrained_cfg, bar),
            [],
            [],
        )

    target = TARGETS[to]
    full = (
        with_all_gammas(tensors, config.depth, config.embed_dim, fill_dtype) if target.always_layer_scale else tensors
    )
    qv_bias, k_bias_blocks = _bias_parts(full, config.depth)
    options = {"hf": {"k_bias": bool(k_bias_blocks)}, "timm": {"qkv_bias": qv_bias}}.get(to, {})
    out, unheld = target.layout.from_native(full, **options)
    not_held, warnings = _losses(unheld, to, OUTPUT_CHANGING)
    if to == "timm" and k_bias_blocks:
        blocks = ", ".join(map(str, k_bias_blocks))
        not_held.append(f"non-zero k biases (blocks {blocks})")
        warnings.append(
            f"timm's eva has no k bias: the non-zero k biases of blocks {blocks} are dropped, outputs differ"
        )

    if to == "meta":
        writer = write_safetensors if dst.suffix == ".safetensors" else write_torch_file
        return _Export(out, lambda tmp, bar: writer(tmp, out, progress=bar), not_held, warnings)
    if to == "hf":
        cfg = transformers_config(config, bool(k_bias_blocks), fill_dtype)

        def write_hf(tmp: Path, bar: Progress | None) -> None:
            write_sharded_safetensors(tmp, out, max_shard_size, bar)
            write_text(tmp / CONFIG_FILE, json.dumps(cfg, indent=2))

        return _Export(out, write_hf, not_held, warnings)
    cfg = eva_config(config, resolved.name, qv_bias, resolved.pretrained_cfg)

    def write_eva(tmp: Path, bar: Progress | None) -> None:
        write_safetensors(tmp / WEIGHTS_FILE, out, progress=bar)
        write_text(tmp / CONFIG_FILE, json.dumps(cfg, indent=2))

    return _Export(out, write_eva, not_held, warnings)


def _losses(
    unheld: list[str], to: str, changing: tuple[str, ...], named: Mapping[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """What the target has no key for, by group (`named` words a group its own way), and as warnings the
    losses in `changing`, which change the outputs."""
    groups = unheld_groups(unheld)
    named = named or {}
    not_held = [named.get(g) or (f"{g} ({UNHELD_NOTES[g]})" if g in UNHELD_NOTES else g) for g in groups]
    warnings = [f"{to} cannot hold {g}: {UNHELD_NOTES[g]}" for g in groups if g in changing]
    return not_held, warnings


def _bias_parts(tensors: Mapping[str, Tensor], depth: int) -> tuple[bool, list[int]]:
    """Whether any effective q or v bias is non-zero, and the blocks whose effective k bias is."""
    qv, k_blocks = False, []
    for i in range(depth):
        key = f"blocks.{i}.attn.qkv.bias"
        if key not in tensors:
            continue
        mask = tensors.get(f"{key}_mask")
        q, k, v = effective_qkv_bias(tensors[key], mask).chunk(3)
        qv = qv or bool(q.any() or v.any())
        if k.any():
            k_blocks.append(i)
    return qv, k_blocks


# ---------------------------------------------------------------------------------------- meta-train

META_TRAIN_DCP_ITEMS = {"iteration": 0}  # Meta's save_checkpoint writes the iteration beside `model`
# Why Meta's DINOv3 trainer cannot hold a part of the backbone: warnings (errors with strict).
HEAD_NOTE = "no classifier in Meta's backbone"
WARM_UP = (
    "new heads on a trained backbone: warm them up with the backbone frozen before joint training "
    "(fresh heads trained jointly from the start can wreck the features)"
)


@dataclass
class _Heads:
    """What meta-train needs to know about the heads: the source's, the config's sizes, the seed, the use."""

    source: LazyCheckpoint
    config: MetaHeads | None
    seed: int
    distill_teacher: bool


def _joined(parts: Mapping[str, Mapping[str, Tensor]]) -> LazyCheckpoint:
    """Lazy mappings (plans, checkpoints) as one, each under its prefix; a tensor is read only when asked."""
    where = {prefix + key: (part, key) for prefix, part in parts.items() for key in part}
    infos = {key: info_of(part, inner) for key, (part, inner) in where.items()}
    return LazyCheckpoint(Path("joined"), "joined", ONLY_SET, infos, lambda key: where[key][0][where[key][1]])


def released_shape(resolved: ResolvedModel) -> bool:
    """Whether the model has the shapes of a released DINOv3: a shipped variant (each is one), shapes unchanged."""
    variant = VARIANTS.get(resolved.name)
    if variant is None:
        return False
    base, config = variant.config, resolved.config
    shape = ("embed_dim", "depth", "num_heads", "patch_size", "ffn_layer", "ffn_ratio", "swiglu_align_to")
    return all(getattr(base, name) == getattr(config, name) for name in shape)


def _layer_scale_limits(config: VitLsConfig) -> tuple[bool, list[str]]:
    """Whether Meta's blocks get gammas, and what of this model's LayerScale Meta's single init value cannot hold."""
    pairs = config.layer_init_values
    values = {v for pair in pairs for v in pair if v}
    off = [f"{i}.{branch}" for i, pair in enumerate(pairs) for branch, v in zip(("attn", "mlp"), pair) if not v]
    if not values:
        return False, []  # LayerScale off everywhere: Meta's blocks use an identity (student.layerscale: null)
    limits = []
    if off:
        shown = ", ".join(off[:6]) + (f" (+{len(off) - 6})" if len(off) > 6 else "")
        limits.append(
            f"LayerScale off in some branches only ({shown}): Meta's blocks all have it, gammas of 1 are written"
        )
    if len(values) > 1:
        limits.append(
            f"LayerScale init values per branch ({', '.join(f'{v:g}' for v in sorted(values))}): Meta's "
            f"student.layerscale is one value"
        )
    return True, limits


def _export_meta_train(
    tensors: Plan,
    resolved: ResolvedModel,
    fill_dtype: torch.dtype,
    cast: torch.dtype | None,
    heads: _Heads,
    dst: Path,
) -> _Export:
    """Meta's trainer's keys: `backbone.` + Meta's backbone keys, and the carried or new heads."""
    config = resolved.config
    layer_scale, limits = _layer_scale_limits(config)
    full = with_all_gammas(tensors, config.depth, config.embed_dim, fill_dtype) if layer_scale else tensors
    backbone, unheld = META.from_native(full)
    not_held, warnings = _losses(unheld, "meta-train", (*OUTPUT_CHANGING, "head"), named={"head": HEAD_NOTE})
    not_held += limits
    warnings += [f"meta-train cannot hold {limit}" for limit in limits]

    source = heads.source.heads or {}
    if source:
        sizes = heads_of({k: source.info(k) for k in source}, config.embed_dim, str(heads.source.path))
        if heads.config is not None and heads.config.infos(config.embed_dim, fill_dtype) != sizes.infos(
            config.embed_dim, fill_dtype
        ):
            raise CheckpointError(
                f"the source's heads are {sizes.describe()}, the --meta-config's {heads.config.describe()}: Meta's "
                f"strict load (and distillation, whose prototype counts must match) would refuse them; set the "
                f"config's dino:/ibot: head sizes to the source's"
            )
        made: Mapping[str, Tensor] = source
        notes = [f"heads carried: {sizes.describe()}"]
    else:
        sizes = heads.config or (RELEASED_HEADS if released_shape(resolved) else DEFAULT_HEADS)
        made = new_heads(sizes, config.embed_dim, heads.seed)
        why = "--meta-config" if heads.config else "as released" if sizes is RELEASED_HEADS else "Meta's defaults"
        notes = [f"heads new (seed {heads.seed}, {why}): {sizes.describe()}; {WARM_UP}"]
        if heads.distill_teacher:
            warnings.append(
                "a distillation teacher needs trained heads: this source has none, so its new heads teach random "
                "prototypes; train them first (continued pretraining with the backbone frozen), or convert a "
                "checkpoint that carries them"
            )
    # Carried heads keep their dtype unless cast; new ones are made in the backbone's (with "keep": its fills').
    head_plan = cast_plan(Plan(made, passthrough(made)), cast if source else cast or fill_dtype)
    out = _joined({"backbone.": backbone, "": head_plan})
    plan = Plan(out, passthrough(out))
    floating = {plan.info(k).dtype for k in plan if plan.info(k).dtype.is_floating_point and not k.endswith(PERIODS)}
    dtypes = sorted(str(dtype).removeprefix("torch.") for dtype in floating)
    notes.append(f"written in {'/'.join(dtypes)}")
    bias_mask = any(k.endswith("attn.qkv.bias_mask") for k in backbone)
    yaml_lines = meta_yaml(dst.resolve(), sizes, config, layer_scale, bias_mask)

    if dst.suffix:

        def write(tmp: Path, bar: Progress | None) -> None:
            write_torch_file(tmp, plan, progress=bar, under="teacher")
    else:

        def write(tmp: Path, bar: Progress | None) -> None:
            write_dcp(tmp, plan, "model", META_TRAIN_DCP_ITEMS, progress=bar)

    return _Export(plan, write, not_held, warnings, notes, yaml_lines)


# ------------------------------------------------------------------------------------------ the model


@functools.lru_cache(maxsize=32)
def _expected(config_json: str) -> dict[str, Tensor]:
    return VisionTransformerLS(VitLsConfig.from_dict(json.loads(config_json)), device="meta").state_dict()


def expected_state(config: VitLsConfig) -> dict[str, Tensor]:
    """The state dict of the model `config` builds, on the meta device (nothing allocated)."""
    return _expected(json.dumps(config.to_dict(), sort_keys=True))


def checkpoint_args(native: Mapping[str, Tensor], init_value: float) -> dict[str, Any]:
    """The model args a checkpoint's keys decide: biases, norms, head, LayerScale per branch, periods."""
    keys = set(native)
    depth = 1 + max((int(k.split(".")[1]) for k in keys if k.startswith("blocks.")), default=-1)
    args: dict[str, Any] = {
        "qkv_bias": "blocks.0.attn.qkv.bias" in keys,
        "proj_bias": "blocks.0.attn.proj.bias" in keys,
        "ffn_bias": bool({"blocks.0.mlp.fc1.bias", "blocks.0.mlp.w1.bias"} & keys),
        "cls_norm": "cls_norm.weight" in keys,
        "local_cls_norm": "local_cls_norm.weight" in keys,
        "num_classes": native.info("head.weight").shape[0] if "head.weight" in keys else 0,
    }
    branches = [(f"blocks.{i}.ls1.gamma" in keys, f"blocks.{i}.ls2.gamma" in keys) for i in range(depth)]
    if not any(a or m for a, m in branches):
        args["init_values"] = 0
    elif not all(a and m for a, m in branches):
        args["init_values"] = [{"attn": init_value if a else 0, "mlp": init_value if m else 0} for a, m in branches]
    else:
        args["init_values"] = init_value
    if PERIODS in keys:  # exact in bf16: Meta's rounding; the loaded periods win either way
        periods = native[PERIODS].float()
        args["rope_periods_bf16"] = bool(torch.equal(periods, periods.bfloat16().float()))
    else:  # layouts without periods compute them in fp32, unrounded
        args["rope_periods_bf16"] = False
    return args


def _differences(infos: Mapping[str, TensorInfo], expected: Mapping[str, Tensor], name: str) -> tuple[list[str], float]:
    """The keys whose shapes differ between a checkpoint and a model, and how far apart the two are."""
    found, distance = [], 0.0
    for key, target in expected.items():
        if key in infos and infos[key].shape != target.shape:
            found.append(f"{key} is {list(infos[key].shape)} in the checkpoint but {list(target.shape)} in {name}")
            distance += abs(math.log(max(infos[key].shape.numel(), 1) / max(target.shape.numel(), 1)))
        elif key not in infos and not key.endswith(_FILLABLE) and not NATIVE_GAMMA_KEY.match(key):
            found.append(f"{name} has {key} {list(target.shape)} and the checkpoint does not")
            distance += 1
    for key in infos:
        if key not in expected and not key.startswith(("local_cls_norm.", "head.")) and not NATIVE_GAMMA_KEY.match(key):
            found.append(f"the checkpoint has {key} {list(infos[key].shape)} and {name} does not")
            distance += 1
    return found, distance


def resolve_model(
    native: Plan,
    model: str | None,
    model_kwargs: dict[str, Any],
    hub_config: Mapping[str, Any] | None,
    fuse_layerscale: bool = False,
) -> ResolvedModel:
    """The variant and full config for a checkpoint in native keys: `model` if given, else the registered
    variant its shapes match (with the Hub config's architecture where the folder has one)."""
    hinted, hub_kwargs, hub_pretrained = hub_model_kwargs(hub_config or {})
    variants, tag = dict(VARIANTS), None
    if model and model.endswith((".yaml", ".yml")):
        variant = load_variant(model)  # not registered: the written config names a shipped architecture
        variants, names, reason = {variant.name: variant}, [variant.name], f"from {model}"
    elif model:
        try:
            variant, tag = find_variant(model)
        except VariantNameError as exc:
            raise CheckpointError(str(exc)) from None
        names, reason = [variant.name], "given"
    elif hinted:
        names, reason = [hinted], f"named in {CONFIG_FILE}"
    else:
        names, reason = sorted(VARIANTS), "inferred from the shapes" + (f" and {CONFIG_FILE}" if hub_kwargs else "")

    infos = {k: native.info(k) for k in native}
    overrides = {**hub_kwargs, **model_kwargs}
    candidates = []
    for name in names:
        variant = variants[name]
        base = {**variant.model_args, **variant.tag_model_args(tag)}
        try:
            init = _first_init_value(base)
            args = {**base, **checkpoint_args(native, init), **overrides}
            if fuse_layerscale:  # every gamma folds: the model has LayerScale off
                args["init_values"] = 0
            config = VitLsConfig.from_dict(args, source=f"the args of {name}")
        except ValueError:
            if len(names) == 1:
                raise
            continue
        differences, distance = _differences(infos, expected_state(config), name)
        overridden = sum(base.get(k) != v for k, v in overrides.items())
        candidates.append((bool(differences), overridden, distance, name, config, differences))
    if not candidates:
        raise CheckpointError(f"no registered variant builds with {overrides}; pass --model NAME")
    _, _, _, name, config, differences = min(candidates, key=lambda c: c[:4])
    if differences and len(names) > 1:
        more = f" ({len(differences) - 1} more keys differ)" if len(differences) > 1 else ""
        raise CheckpointError(
            f"the checkpoint's shapes match no registered variant; the nearest is {name}: {differences[0]}{more}; "
            f"pass --model NAME and --model-kwargs for what differs (e.g. embed_dim=... depth=... num_heads=...)"
        )
    pretrained = hub_pretrained or _pretrained_cfg(name, tag)
    listed = " ".join(f"{k}={v}" for k, v in overrides.items())
    if overrides:  # a config.json's every argument would make the summary line a paragraph: counted instead
        reason += f", with {listed}" if len(listed) <= MAX_LISTED else f", with {len(overrides)} model arguments"
    return ResolvedModel(name, tag, config, reason, pretrained)


def _first_init_value(args: Mapping[str, Any]) -> float:
    try:
        resolved = resolve_init_values(args.get("init_values", 1e-5), int(args.get("depth", 1)))
    except (ValueError, TypeError):
        return 1e-5
    return next((v for pair in resolved for v in pair if v), 1e-5)


def _pretrained_cfg(name: str, tag: str | None) -> dict[str, Any]:
    cfg = get_pretrained_cfg(f"{name}.{tag}" if tag else name)
    values = cfg.to_dict() if cfg is not None else {}
    if not tag:
        values.pop("tag", None)
    return values


# ------------------------------------------------------------------------------------- Hub config.json


def hub_model_kwargs(cfg: Mapping[str, Any]) -> tuple[str | None, dict[str, Any], dict[str, Any] | None]:
    """From a Hub folder's config.json: the variant it names (if ours), model args, and pretrained cfg."""
    fields = set(VitLsConfig.field_names())
    architecture = cfg.get("architecture")
    model_args = dict(cfg.get("model_args") or {})
    if architecture in VARIANTS:  # ours: every arg is there
        return architecture, {k: v for k, v in model_args.items() if k in fields}, dict(cfg.get("pretrained_cfg") or {})
    eva = {v: k for k, v in EVA_ARCHITECTURES.items()}.get(str(architecture).removesuffix("_qkvb"))
    if eva:
        return eva, _eva_kwargs(model_args), dict(cfg.get("pretrained_cfg") or {})
    if cfg.get("model_type") == "dinov3_vit":
        return None, _transformers_kwargs(cfg), None
    return None, {}, None


def _eva_kwargs(args: Mapping[str, Any]) -> dict[str, Any]:
    renamed = {"num_reg_tokens": "num_storage_tokens", "rope_temperature": "rope_base"}
    kept = ("img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads")
    kwargs = {renamed.get(k, k): v for k, v in args.items() if k in kept or k in renamed}
    if "mlp_ratio" in args and "embed_dim" in args:
        hidden = int(args["embed_dim"] * args["mlp_ratio"])
        if args.get("swiglu_mlp"):
            align = args.get("swiglu_align_to") or 1
            hidden += -hidden % align
            kwargs.update(ffn_layer="swiglu", ffn_ratio=hidden * 1.5 / args["embed_dim"], swiglu_align_to=align)
        else:
            kwargs.update(ffn_layer="mlp", ffn_ratio=hidden / args["embed_dim"])
    return kwargs


def _transformers_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    dim = cfg.get("hidden_size", 384)
    gated = bool(cfg.get("use_gated_mlp"))
    hidden = cfg.get("intermediate_size", dim * 4)
    names = {
        "num_hidden_layers": "depth",
        "num_attention_heads": "num_heads",
        "layer_norm_eps": "norm_eps",
        "rope_theta": "rope_base",
        "patch_size": "patch_size",
        "num_channels": "in_chans",
        "image_size": "img_size",
        "num_register_tokens": "num_storage_tokens",
        "pos_embed_shift": "rope_shift_coords",
        "pos_embed_jitter": "rope_jitter_coords",
        "pos_embed_rescale": "rope_rescale_coords",
    }
    kwargs = {ours: cfg[theirs] for theirs, ours in names.items() if theirs in cfg}
    kwargs.update(embed_dim=dim, ffn_layer="swiglu" if gated else "mlp")
    if gated:
        kwargs.update(ffn_ratio=hidden * 1.5 / dim, swiglu_align_to=1)
    else:
        kwargs.update(ffn_ratio=hidden / dim)
    return kwargs
