"""model/file -> plan -> format -> writer: `convert_checkpoint`, tensor by tensor.

The orchestrator: it opens the source lazily, has the source's format map its keys to native ones, asks the
identity rule which model the weights are, fits the weights to that model (on the meta device) and casts
them, then hands them to the target format, which maps them to its keys and names its writer; the files are
written under a temporary name and renamed when complete. It knows no format: each lives in
`checkpoints/formats/`. Only the few small tensors whose values decide the target's architecture (q/k/v
biases, RoPE periods) and the gammas that are checked are read ahead.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from timm_ls.destinations import held_problem
from timm_ls.names import CAST_DTYPES, KEEP, WEIGHTS_SETS

from .checkpoints.dtypes import cast_dtype
from .checkpoints.errors import CheckpointError
from .checkpoints.formats import Format, Job, PreparedWrite, target_format
from .checkpoints.formats.base import bf16_rope_targets
from .checkpoints.mapping.fit import Fitted, fit_to_model
from .checkpoints.mapping.layer_scale import branches_with_layer_scale
from .checkpoints.mapping.plan import PERIODS, Plan, cast_plan, dominant_dtype
from .checkpoints.read.reader import LazyCheckpoint, open_checkpoint
from .checkpoints.write.writers import atomic_destination
from .config import VitLsConfig
from .identity import IdentifiedModel, expected_state, identify_checkpoint
from .layers import RopeEmbedding
from .model import VisionTransformerLS
from .variants import VARIANTS

__all__ = ["Conversion", "PreparedConversion", "convert_checkpoint", "prepare_conversion"]

PROGRESS_MIN_BYTES = 256 << 20  # a bar for conversions at least this large (when stderr is a terminal)
# How far a target computing RoPE in fp32 moves a bf16-RoPE model's outputs is measured on the model itself up
# to this much of fp32 weights (a Sapiens2 1B), at this many patches: a few seconds beside the conversion.
ROPE_MEASURE_BYTES = 4 << 30
ROPE_MEASURE_PATCHES = (8, 8)
ROPE_MEASURE_IMAGES = 4  # the largest move of a few images: one image's varies by about 2x


@dataclass
class Conversion:
    """What `convert_checkpoint` did; `summary()` is the one line the command prints."""

    source: str
    kind: str
    destination: Path
    target: str
    source_format: str  # the source's format, by its --to name
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

    @property
    def layout(self) -> str:
        """The old name of `source_format`, still read."""
        return self.source_format

    def summary(self) -> str:
        held = f"; not held by {self.target}: {', '.join(self.not_held)}" if self.not_held else ""
        notes = "".join(f"; {note}" for note in self.notes)
        return (
            f"converted {self.source} ({self.kind}, {self.keys or self.source_format}, weights: {self.weights}) to "
            f"{self.target} "
            f"{self.destination}: {self.variant} ({self.reason}), {self.tensors} tensors, "
            f"{_size(self.nbytes)}, {self.seconds:.1f} s{notes}{held}"
        )


@dataclass
class _Request:
    """A conversion's arguments, each checked before any file is read."""

    target: Format
    dst: Path
    cast: torch.dtype | None
    weights: str
    options: dict[str, Any]


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
    **options: Any,
) -> Conversion:
    """Converts a checkpoint to the format `to` ("native", "meta", "meta-train", "hf", "timm", "sapiens2", or one
    registered with `register_format`) at `dst`, tensor by tensor.

    `model` is a variant name (`NAME` or `NAME.TAG`) or a variant YAML file; without it the variant is the one
    nearest the weights' shapes (a folder's config.json completing its arguments). `model_kwargs` override its
    args. `dtype` ("keep", "fp32", "bf16", "fp16") casts the weights, RoPE periods excepted; None is the
    format's default ("keep"; "fp32" for meta-train, whose trainer keeps fp32 masters). `weights` picks the
    EMA/teacher ("ema") or trained ("raw") set, "auto" the EMA one where there is one. `fuse_layerscale` folds
    every gamma into the projection before it. `strict` turns warnings (NaN or Inf gammas, outputs the target
    cannot reproduce) into errors. `dst` must sit in an existing folder and is replaced only with `overwrite`;
    on any error nothing is left behind. `options` are the format's own (meta-train: `meta_config`, Meta's
    training YAML sizing new heads; `seed` of new heads; `distill_teacher`, new heads then warn). Raises
    `CheckpointError` (or `ValueError`) for bad input.

    "meta-train" writes what Meta's DINOv3 trainer loads: `dst` ending in `.pth` is `{"teacher": state_dict}`,
    `dst` without a suffix a torch.distributed.checkpoint folder (`iteration` and `model.*`), keys `backbone.*`,
    `dino_head.*`, `ibot_head.*`, the source's heads carried or new ones made as Meta's DINOHead makes them.
    """
    start = time.perf_counter()
    request = _checked_request(Path(dst), to, dtype, weights, options, overwrite)
    with _opened(src, weights, heads=request.target.reads_heads) as ckpt:
        _refuse_to_replace_source(ckpt, request.dst)
        prepared = _prepared_conversion(ckpt, request, model, model_kwargs, fuse_layerscale, max_shard_size)
        warnings = prepared.fitted.warnings + prepared.prepared_write.warnings + rope_warning(prepared, request.target)
        if strict and warnings:
            raise CheckpointError(f"{warnings[0]}; --strict refuses to convert it (drop --strict to convert anyway)")
        _write(prepared.prepared_write, request, overwrite, progress)
        return prepared.conversion(src, ckpt, request, warnings, time.perf_counter() - start)


@dataclass
class PreparedConversion:
    """A conversion planned to the last tensor, nothing written: the source's format, the model it holds,
    the weights fitted to it, and the target's tensors with what it cannot hold."""

    source: Format
    identity: IdentifiedModel
    fitted: Fitted
    prepared_write: PreparedWrite

    def conversion(
        self, src: Any, ckpt: LazyCheckpoint, request: _Request, warnings: list[str], seconds: float
    ) -> Conversion:
        return Conversion(
            source=str(src) if isinstance(src, (str, Path)) else str(ckpt.path),
            kind=ckpt.kind,
            destination=request.dst,
            target=request.target.name,
            source_format=self.source.name,
            weights=ckpt.weights,
            variant=self.identity.full_name,
            reason=self.identity.reason,
            tensors=len(self.prepared_write.tensors),
            nbytes=self.prepared_write.tensors.nbytes,
            seconds=seconds,
            not_held=self.prepared_write.not_held,
            report=[*self.fitted.report(warnings=False), *left_out_report(ckpt)],  # warnings go to stderr
            warnings=warnings,
            keys=self.source.title,
            model_args=self.identity.config.to_dict(),
            notes=self.prepared_write.notes,
            meta_yaml=self.prepared_write.text,
        )


def rope_warning(prepared: PreparedConversion, target: Format) -> list[str]:
    """The target's RoPE rule (`Format.rope_rule`) as one line, with how far the outputs move: measured on the
    model built both ways from the fitted weights at a small input, up to `ROPE_MEASURE_BYTES` of weights."""
    config = prepared.identity.config
    rule = target.rope_rule(config)
    if rule is None:
        return []
    keep = f"; convert --to {bf16_rope_targets(config)} to keep its bf16 RoPE"
    weights = fp32_weight_bytes(config)
    if weights > ROPE_MEASURE_BYTES:
        return [
            f"{rule} (not measured: its fp32 weights are {_size(weights)}, above the {_size(ROPE_MEASURE_BYTES)} "
            f"this measure loads; 1e-4 to 1e-3 relative on Sapiens2's smaller models, more with depth){keep}"
        ]
    moved = rope_move(prepared.fitted.plan, config, target.recomputes_periods)
    side = "x".join(str(n * config.patch_size) for n in ROPE_MEASURE_PATCHES)
    return [f"{rule} by {moved:.1e} relative (measured on this model, {ROPE_MEASURE_IMAGES} images at {side}){keep}"]


@torch.no_grad()
def rope_move(weights: Plan, config: VitLsConfig, recompute_periods: bool) -> float:
    """max |fp32-RoPE tokens - bf16-RoPE tokens| over max |bf16-RoPE tokens|: the model built both ways on the
    same weights (the periods the base gives in fp32 where the target recomputes them), its normed tokens on
    `rope_measure_images`."""
    as_built = VisionTransformerLS(config, device="meta").eval()
    fp32 = config.replace(rope_dtype="fp32", rope_periods_bf16=config.rope_periods_bf16 and not recompute_periods)
    in_fp32 = VisionTransformerLS(fp32, device="meta").eval()
    targets = as_built.state_dict()
    state = {key: tensor.to(targets[key].dtype) for key, tensor in weights.items()}
    as_built.load_state_dict(state, assign=True, strict=True)
    if recompute_periods:
        state[PERIODS] = RopeEmbedding(fp32.head_dim, base=fp32.rope_base, round_periods_to_bf16=False).periods
    in_fp32.load_state_dict(state, assign=True, strict=True)  # the same weight tensors: no second copy
    images = rope_measure_images(config)
    want, got = as_built.forward_features(images), in_fp32.forward_features(images)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def rope_measure_images(config: VitLsConfig) -> torch.Tensor:
    """What `rope_move` measures on: `ROPE_MEASURE_IMAGES` random images of `ROPE_MEASURE_PATCHES`, seeded."""
    height, width = (n * config.patch_size for n in ROPE_MEASURE_PATCHES)
    shape = (ROPE_MEASURE_IMAGES, config.in_chans, height, width)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def fp32_weight_bytes(config: VitLsConfig) -> int:
    return sum(t.numel() for t in expected_state(config).values()) * 4


def left_out_report(ckpt: LazyCheckpoint) -> list[str]:
    """A line naming the tensors beside the backbone that the conversion drops (a task head), by group."""
    if not ckpt.left_out:
        return []
    groups = sorted({key.split(".", 1)[0] + (".*" if "." in key else "") for key in ckpt.left_out})
    shown = ", ".join(groups[:4]) + (f" and {len(groups) - 4} more" if len(groups) > 4 else "")
    return [f"dropped {len(ckpt.left_out)} tensors beside the backbone, which a backbone does not hold: {shown}"]


def prepare_conversion(
    ckpt: LazyCheckpoint,
    dst: str | Path,
    to: str = "native",
    model: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    fuse_layerscale: bool = False,
    **options: Any,
) -> PreparedConversion:
    """What `convert_checkpoint(ckpt, dst, ...)` would write, planned from shapes and nothing written:
    `.prepared_write.tensors.infos` holds every key, shape and dtype of the target (a dry run; the destination is
    not checked). Reads only what a conversion reads ahead (q/k/v biases, RoPE periods, gammas)."""
    weights = ckpt.weights if ckpt.weights in WEIGHTS_SETS else "auto"
    request = _checked_request(Path(dst), to, dtype, weights, options, overwrite=None)
    return _prepared_conversion(ckpt, request, model, model_kwargs, fuse_layerscale, "5GB")


def _prepared_conversion(
    ckpt: LazyCheckpoint,
    request: _Request,
    model: str | None,
    model_kwargs: Mapping[str, Any] | None,
    fuse: bool,
    max_shard_size: int | str,
) -> PreparedConversion:
    found = identify_checkpoint(ckpt, model, model_kwargs, fuse)
    fitted, prepared_write = _prepare(
        found.native, found.format.title, found.model, request, ckpt.heads, max_shard_size
    )
    return PreparedConversion(found.format, found.model, fitted, prepared_write)


def _variant_layer_scale(name: str) -> tuple[str, ...]:
    """The branches the registered variant `name` has LayerScale on (none for a YAML file's)."""
    variant = VARIANTS.get(name)
    return branches_with_layer_scale(variant.config.layer_init_values) if variant else ()


def _checked_request(
    dst: Path, to: str, dtype: str | None, weights: str, options: Mapping[str, Any], overwrite: bool | None
) -> _Request:
    """The format with its options, the dtype and weights set, once each is known good, and the destination
    when `overwrite` is given (a dry run writes nothing)."""
    if weights not in WEIGHTS_SETS:
        raise CheckpointError(f"unknown weights set {weights!r}; pass --weights one of {', '.join(WEIGHTS_SETS)}")
    target, checked = target_format(to, options, dst if overwrite is not None else None, bool(overwrite))
    dtype = dtype or target.default_dtype
    if dtype not in (KEEP, *CAST_DTYPES):
        raise CheckpointError(f"unknown dtype {dtype!r}; pass --dtype one of {', '.join((KEEP, *CAST_DTYPES))}")
    return _Request(target, dst, None if dtype == KEEP else cast_dtype(dtype), weights, checked)


def _prepare(
    native: Plan,
    keys: str,
    identity: IdentifiedModel,
    request: _Request,
    heads: LazyCheckpoint | None,
    max_shard_size: int | str,
) -> tuple[Fitted, PreparedWrite]:
    """The checkpoint fitted to its model, cast, and mapped to the target's keys: all planned, nothing read."""
    fill_dtype = request.cast or dominant_dtype(native)
    fitted = fit_to_model(
        native,
        expected_state(identity.config),
        format_title=keys,
        model_name=identity.name,
        config=identity.config,
        fill_dtype=fill_dtype,
        variant_layer_scale=_variant_layer_scale(identity.name),
    )
    job = Job(
        tensors=cast_plan(fitted.plan, request.cast, keep=[PERIODS]),
        config=identity.config,
        architecture=identity.architecture,
        pretrained_cfg=identity.pretrained_cfg,
        fill_dtype=fill_dtype,
        cast=request.cast,
        dst=request.dst,
        released=identity.released,
        max_shard_size=max_shard_size,
        heads=heads,
        options=request.options,
    )
    return fitted, request.target.prepare_write(job)


def _write(prepared_write: PreparedWrite, request: _Request, overwrite: bool, progress: bool | None) -> None:
    """The target's files into a temporary name, renamed to `dst` when complete."""
    total = prepared_write.tensors.nbytes
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
    dst, target = request.dst, request.target
    with (
        _progress_bar(total, f"{target.name} {dst.name}", show) as bar,
        atomic_destination(
            dst, overwrite, folder=target.writes_folder(dst), what=f"--to {target.name}", ours=target.spec.files
        ) as tmp,
    ):
        prepared_write.write(tmp, bar)


@contextmanager
def _opened(src: Any, weights: str, heads: bool) -> Iterator[LazyCheckpoint]:
    if isinstance(src, LazyCheckpoint):
        if heads and src.heads is None:
            raise ValueError("meta-train carries the source's heads: open it with open_checkpoint(..., heads=True)")
        yield src
    else:
        with open_checkpoint(src, weights, heads=heads) as ckpt:
            yield ckpt


def _refuse_to_replace_source(ckpt: LazyCheckpoint, dst: Path) -> None:
    """Refuses a destination whose writing replaces a file the source reads: DST, or any file under a DST
    folder, that is one of them by device and inode (so also under another name, a symlink or a hard link);
    and a source with no backbone to convert."""
    problem = held_problem(dst, [ckpt.path])  # before looking through all of a DST that holds it
    if problem:
        raise CheckpointError(problem)
    read = {_inode(path): path for path in ckpt.files}
    replaced = [dst, *(Path(parent, name) for parent, _, names in sorted(os.walk(dst)) for name in sorted(names))]
    for path in replaced:
        source = read.get(_inode(path)) if path.exists() else None
        if source is not None:
            same = f" ({path} is the same file)" if path != dst and path.resolve() != source.resolve() else ""
            raise CheckpointError(f"{dst} would replace the source file {source}{same}; choose another destination")
    if not len(ckpt):
        parts = f" (only {', '.join(sorted({k.split('.')[0] for k in ckpt.heads}))})" if ckpt.heads else ""
        raise CheckpointError(f"{ckpt.path} holds no backbone{parts}; pass a checkpoint with the backbone's weights")


def _inode(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_dev, stat.st_ino


@contextmanager
def _progress_bar(total: int, desc: str, show: bool) -> Iterator[Any]:
    if not show:
        yield None
        return
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr) as bar:
        yield bar.update


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""
