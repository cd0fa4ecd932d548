"""Meta's DINOv3 training checkpoints: what Meta's trainer resumes from (`student.resume_from_teacher_chkpt`),
anchors to (`gram.ckpt`) and distils from (`distillation.checkpoint_path`).

`{"teacher": ...}` in a `.pth` file, or a torch.distributed.checkpoint folder (`iteration` and `model.*`), keys
`backbone.` + Meta's backbone keys beside `dino_head.*` and `ibot_head.*`. The reader unwraps such files by
itself (weights sets, the `backbone.` prefix, heads kept apart with `open_checkpoint(heads=True)`), so what it
reads is Meta's released layout. Written with the source's heads, or new ones made as Meta's DINOHead makes
them, sized by a training YAML, as released, or by Meta's defaults.

Meta's trainer builds `dino_head` and `ibot_head` as `DINOHead(in_dim=embed_dim, out_dim=head_n_prototypes,
hidden_dim=head_hidden_dim, bottleneck_dim=head_bottleneck_dim, nlayers=head_nlayers)`: an MLP of `nlayers`
Linear layers with biases (`mlp.0`, `mlp.2`, ... with GELUs between them; `mlp` itself for one layer) and a
bias-free `last_layer`, every weight truncated normal with std 0.02 and every bias zero. Its config loader
merges the training YAML over `ssl_default_config.yaml`, whose heads are `DEFAULT_HEADS`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from timm_ls import plain_yaml
from timm_ls.names import META_TRAIN_SPEC

from ...config import BRANCHES, VitLsConfig
from ...layers import swiglu_hidden_features
from ..errors import CheckpointError
from ..mapping.plan import Plan, TensorInfo, cast_plan, info_of, passthrough
from ..read.reader import ONLY_SET, LazyCheckpoint
from ..write.dcp import write_dcp
from ..write.writers import Progress, write_torch_file
from .base import (
    META_TABLE,
    META_TITLE,
    OUTPUT_CHANGING,
    PERIODS,
    Format,
    Job,
    PreparedWrite,
    gamma_branches,
    not_held_report,
    with_all_gammas,
)

Tensor = torch.Tensor
HEAD_NAMES = ("dino_head", "ibot_head")
INIT_STD = 0.02


@dataclass(frozen=True)
class HeadSize:
    """One head's sizes, named as Meta's config names them (`head_<field>` under `dino:` or `ibot:`)."""

    n_prototypes: int
    bottleneck_dim: int
    hidden_dim: int
    nlayers: int = 3

    def describe(self) -> str:
        hidden = self.hidden_dim if self.nlayers > 1 else "-"  # one layer: no hidden layer
        return f"{self.n_prototypes}/{self.bottleneck_dim}/{hidden} x{self.nlayers}"

    def shapes(self, in_dim: int) -> dict[str, torch.Size]:
        """{key inside the head: shape}, in Meta's module order."""
        dims = [in_dim, *[self.hidden_dim] * (self.nlayers - 1), self.bottleneck_dim]
        shapes = {}
        for i, (n_in, n_out) in enumerate(itertools.pairwise(dims)):
            name = "mlp" if self.nlayers == 1 else f"mlp.{2 * i}"
            shapes[f"{name}.weight"] = torch.Size([n_out, n_in])
            shapes[f"{name}.bias"] = torch.Size([n_out])
        shapes["last_layer.weight"] = torch.Size([self.n_prototypes, self.bottleneck_dim])
        return shapes


@dataclass(frozen=True)
class MetaHeads:
    dino: HeadSize
    ibot: HeadSize

    def describe(self) -> str:
        return f"dino {self.dino.describe()}, ibot {self.ibot.describe()} (prototypes/bottleneck/hidden x layers)"

    def infos(self, in_dim: int, dtype: torch.dtype) -> dict[str, TensorInfo]:
        return {
            f"{name}.{key}": TensorInfo(shape, dtype)
            for name, size in zip(HEAD_NAMES, (self.dino, self.ibot), strict=True)
            for key, shape in size.shapes(in_dim).items()
        }


# ssl_default_config.yaml: what a model trained from Meta's defaults has.
DEFAULT_HEADS = MetaHeads(HeadSize(65536, 256, 2048), HeadSize(65536, 256, 2048))
# dinov3_vit7b16_pretrain.yaml and the distilled configs: the heads of every released DINOv3 ViT.
RELEASED_HEADS = MetaHeads(HeadSize(262144, 512, 8192), HeadSize(98304, 384, 4096))


def heads_from_config(path: str | Path) -> MetaHeads:
    """The heads Meta's trainer builds from the training YAML at `path`, merged over Meta's defaults."""
    path = Path(path)
    try:
        data = plain_yaml.load_file(path)
    except (OSError, plain_yaml.YamlError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"--meta-config {path} is not a readable YAML file ({first}); pass Meta's training YAML"
        ) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CheckpointError(
            f"--meta-config {path} holds a {type(data).__name__}, not a config mapping; pass Meta's training YAML"
        )
    sizes = []
    for section, default in zip(("dino", "ibot"), (DEFAULT_HEADS.dino, DEFAULT_HEADS.ibot), strict=True):
        values = data.get(section) or {}
        if not isinstance(values, dict):
            raise CheckpointError(f"--meta-config {path}: `{section}:` is not a mapping; pass Meta's training YAML")
        if section == "ibot" and values.get("separate_head", True) is not True:
            raise CheckpointError(
                f"--meta-config {path} sets ibot.separate_head: {values['separate_head']}; Meta's trainer requires "
                f"true (a separate ibot_head)"
            )
        size = {}
        for field in fields(HeadSize):
            value = values.get(f"head_{field.name}", getattr(default, field.name))
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(
                    f"--meta-config {path}: {section}.head_{field.name} is {value!r}; it must be a positive integer"
                )
            size[field.name] = value
        sizes.append(HeadSize(**size))
    return MetaHeads(*sizes)


def heads_of(infos: Mapping[str, TensorInfo], embed_dim: int, source: str) -> MetaHeads:
    """The sizes of the heads a checkpoint carries, checked to be exactly what Meta's DINOHead holds."""
    missing = [name for name in HEAD_NAMES if not any(k.startswith(name + ".") for k in infos)]
    if missing:
        raise CheckpointError(
            f"{source} carries {' and '.join(n for n in HEAD_NAMES if n not in missing)} but no {missing[0]}; "
            f"Meta's trainer needs both (a separate ibot head): convert a checkpoint with both heads, or the "
            f"backbone alone for new heads"
        )
    sizes = []
    for name in HEAD_NAMES:
        keys = {k.removeprefix(name + "."): info for k, info in infos.items() if k.startswith(name + ".")}
        linear = sorted(k for k in keys if k.startswith("mlp") and k.endswith(".weight"))
        last = keys.get("last_layer.weight")
        first = keys.get("mlp.weight") or keys.get("mlp.0.weight")
        if last is None or first is None or len(last.shape) != 2 or len(first.shape) != 2:
            raise CheckpointError(f"{source}: {name} is not a DINOHead (no mlp or last_layer weights); {_CARRY_FIX}")
        size = HeadSize(last.shape[0], last.shape[1], first.shape[0] if len(linear) > 1 else 0, len(linear))
        expected = size.shapes(embed_dim)
        got = {k: info.shape for k, info in keys.items()}
        if got != expected:
            differ = sorted(set(got) ^ set(expected)) or [k for k in got if got[k] != expected[k]]
            raise CheckpointError(
                f"{source}: {name} differs from Meta's DINOHead of in_dim {embed_dim} at {differ[0]}; {_CARRY_FIX}"
            )
        sizes.append(size)
    return MetaHeads(*sizes)


_CARRY_FIX = "Meta's trainer would not load it: convert the backbone alone for new heads"


def new_heads(heads: MetaHeads, in_dim: int, seed: int) -> LazyCheckpoint:
    """Heads as Meta's `DINOHead.init_weights` makes them, in fp32, one tensor when read, each from its own
    generator seeded by (`seed`, key): the same tensors whatever the order they are read in."""
    infos = heads.infos(in_dim, torch.float32)

    def make(key: str) -> Tensor:
        tensor = torch.zeros(infos[key].shape, dtype=torch.float32)
        if key.endswith(".weight"):
            digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            torch.nn.init.trunc_normal_(tensor, std=INIT_STD, generator=generator)
        return tensor

    return LazyCheckpoint(Path("new heads"), "new heads", f"seed {seed}", infos, make)


# Meta's trainer builds the backbone from `student.arch` (a function of dinov3.models.vision_transformer), which
# alone fixes the width, depth, heads and MLP ratio: (embed_dim, depth, num_heads, ffn_ratio).
META_ARCHS = {
    "vit_small": (384, 12, 6, 4.0),
    "vit_base": (768, 12, 12, 4.0),
    "vit_large": (1024, 24, 16, 4.0),
    "vit_so400m": (1152, 27, 18, 3.777777778),
    "vit_huge2": (1280, 32, 20, 4.0),
    "vit_giant2": (1536, 40, 24, 4.0),
    "vit_7b": (4096, 40, 32, 3.0),
}
# `student.ffn_layer` for a SwiGLU by the multiple its hidden size is rounded up to; and `norm_layer` by our norm and
# its eps (Meta's norm_layer_dict: two LayerNorms, and an RMSNorm of eps 1e-5).
META_SWIGLU = {8: "swiglu", 32: "swiglu32", 64: "swiglu64", 128: "swiglu128"}
META_NORMS = {"layernorm": {1e-5: "layernormbf16", 1e-6: "layernorm"}, "rmsnorm": {1e-5: "rmsnorm"}}
# The RoPE coordinate rescaling Meta pretrained every released backbone with (its hub builders and its
# training configs), a training-time augmentation, printed where a backbone's config sets none.
META_RESCALE_COORDS = 2


def rope_dtype_line(config: VitLsConfig) -> str:
    """`rope_dtype` is what RoPE computes in (fp32 for Meta's hub builders and this family's variants);
    `rope_periods_bf16` rounds only the stored periods. Meta's build_model reads no pos_embed_rope_dtype, so
    its trainer keeps the constructor's bf16 whatever is printed: the comment says so."""
    return (
        f"{config.rope_dtype}  # RoPE computed in {config.rope_dtype}, as this model and Meta's hub builders do "
        "(rope_periods_bf16 rounds only the stored periods); Meta's build_model ignores this key and computes it "
        "in bf16"
    )


def _arch(config: VitLsConfig) -> tuple[str, list[str]]:
    """Meta's `arch` for this model's shape, or the nearest one, with one comment line saying why Meta's
    config cannot express the shape (no key of `student:` overrides what `arch` fixes)."""
    shape = (config.embed_dim, config.depth, config.num_heads, float(config.ffn_ratio))
    named = next((arch for arch, dims in META_ARCHS.items() if _same_shape(dims, shape)), None)
    if named:
        return named, []
    nearest = min(META_ARCHS, key=lambda arch: sum(abs(math.log(a / b)) for a, b in zip(META_ARCHS[arch], shape)))
    wide, deep, heads, ratio = META_ARCHS[nearest]
    return nearest, [
        f"  # Meta's config cannot express this backbone: {config.embed_dim} wide, {config.depth} blocks, "
        f"{config.num_heads} heads, MLP ratio {config.ffn_ratio:g}, and `arch` alone sets those (the nearest, "
        f"{nearest}, is {wide}/{deep}/{heads}/{ratio:g}); register a vit_* function of this shape in "
        f"dinov3.models.vision_transformer and name it here"
    ]


def _same_shape(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b))


def _ffn_layer(config: VitLsConfig) -> tuple[str, list[str]]:
    if config.ffn_layer != "swiglu":
        return "mlp", []
    if config.swiglu_align_to in META_SWIGLU:
        return META_SWIGLU[config.swiglu_align_to], []
    hidden = swiglu_hidden_features(config.embed_dim, config.ffn_ratio, config.swiglu_align_to)
    unaligned = swiglu_hidden_features(config.embed_dim, config.ffn_ratio, 1)
    if hidden == unaligned and unaligned % 8 == 0:  # rounding up to 8 changes nothing
        return "swiglu", []
    return "swiglu", [f"  # Meta's SwiGLU rounds its hidden size to 8, 32, 64 or 128, this one is {hidden}"]


def _rescale_coords(config: VitLsConfig) -> tuple[str, list[str]]:
    if config.rope_rescale_coords is not None:
        return _yaml_value(config.rope_rescale_coords), []
    note = (
        f"  # pos_embed_rope_rescale_coords: {META_RESCALE_COORDS} is Meta's pretraining value (its hub builders and "
        "release training configs); this backbone's config sets no rope_rescale_coords"
    )
    return str(META_RESCALE_COORDS), [note]


def student_lines(config: VitLsConfig, path: str, layer_scale: bool, bias_mask: bool) -> list[str]:
    """`student:` as Meta's trainer reads it to build this backbone (every key it reads, named)."""
    arch, arch_note = _arch(config)
    ffn_layer, ffn_note = _ffn_layer(config)
    rescale, rescale_note = _rescale_coords(config)
    norms = META_NORMS[config.norm_layer]
    norm = norms.get(config.norm_eps)
    eps = " or ".join(f"{e:g}" for e in norms)
    norm_note = [] if norm else [f"  # Meta's {config.norm_layer} has eps {eps}, this backbone's {config.norm_eps:g}"]
    layerscale = f"{config.layer_init_values[0][0] or 1e-5:.1e}" if layer_scale else "null"
    values = {
        "resume_from_teacher_chkpt": path,
        "arch": arch,
        "patch_size": config.patch_size,
        "ffn_layer": ffn_layer,
        "ffn_ratio": f"{config.ffn_ratio:g}  # read from arch, not from here",
        "layerscale": layerscale,
        "norm_layer": norm or next(iter(norms.values())),
        "n_storage_tokens": config.num_storage_tokens,
        "qkv_bias": _yaml_value(config.qkv_bias),
        "proj_bias": _yaml_value(config.proj_bias),
        "ffn_bias": _yaml_value(config.ffn_bias),
        # Without a qkv bias the mask is moot; the released 7B's config says true, as ours does by default.
        "mask_k_bias": _yaml_value(bias_mask or (not config.qkv_bias and config.mask_k_bias)),
        "untie_cls_and_patch_norms": _yaml_value(config.cls_norm),
        "untie_global_and_local_cls_norm": _yaml_value(config.local_cls_norm),
        "pos_embed_rope_base": config.rope_base,
        "pos_embed_rope_normalize_coords": config.rope_normalize_coords,
        "pos_embed_rope_shift_coords": _yaml_value(config.rope_shift_coords),
        "pos_embed_rope_jitter_coords": _yaml_value(config.rope_jitter_coords),
        "pos_embed_rope_rescale_coords": rescale,
        "pos_embed_rope_dtype": rope_dtype_line(config),
    }
    head = "student:  # continued pretraining; the backbone args must match the checkpoint's"
    notes = [*arch_note, *ffn_note, *norm_note, *rescale_note]
    return [head, *notes, *(f"  {key}: {value}" for key, value in values.items())]


def meta_yaml(destination: Path, heads: MetaHeads, config: VitLsConfig, layer_scale: bool, bias_mask: bool) -> str:
    """The lines of Meta's training YAML that use the written checkpoint: continued pretraining (`student:`),
    Gram anchoring (`gram:`) and distillation (`distillation:`), with the head sizes each must match."""
    path = str(destination)
    head_lines = []
    for section, size in (("dino", heads.dino), ("ibot", heads.ibot)):
        head_lines.append(f"{section}:")
        head_lines += [
            f"  head_{f.name}: {getattr(size, f.name)}"
            for f in fields(HeadSize)
            if f.name != "hidden_dim" or size.nlayers > 1
        ]
    head_lines.insert(head_lines.index("ibot:") + 1, "  separate_head: true")
    gram = [
        "gram:  # Gram anchoring: the backbone alone is loaded, the heads skipped; set crops.gram_teacher_crops_size",
        "  use_loss: true",
        "  ema_teacher: false",
        f"  ckpt: {path}",
    ]
    distillation = [
        "distillation:  # this checkpoint as the teacher: the student's dino/ibot head_n_prototypes must match",
        "  enabled: true",
        '  full_cfg_path: "<the teacher\'s training YAML, with the dino and ibot head sizes above>"',
        f"  checkpoint_path: {path}",
    ]
    student = student_lines(config, path, layer_scale, bias_mask)
    return "\n".join([*head_lines, *student, *gram, *distillation])


def _yaml_value(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------------------------------- the format

META_TRAIN_DCP_ITEMS = {"iteration": 0}  # Meta's save_checkpoint writes the iteration beside `model`
# Why Meta's DINOv3 trainer cannot hold a part of the backbone: warnings (errors with strict).
HEAD_NOTE = "no classifier in Meta's backbone"
WARM_UP = (
    "new heads on a trained backbone: warm them up with the backbone frozen before joint training "
    "(fresh heads trained jointly from the start can wreck the features)"
)


def _joined(parts: Mapping[str, Mapping[str, Tensor]]) -> LazyCheckpoint:
    """Lazy mappings (plans, checkpoints) as one, each under its prefix; a tensor is read only when asked."""
    where = {prefix + key: (part, key) for prefix, part in parts.items() for key in part}
    infos = {key: info_of(part, inner) for key, (part, inner) in where.items()}
    return LazyCheckpoint(Path("joined"), "joined", ONLY_SET, infos, lambda key: where[key][0][where[key][1]])


def _layer_scale_limits(config: VitLsConfig) -> tuple[bool, list[str]]:
    """Whether Meta's blocks get gammas, and what of this model's LayerScale Meta's single init value cannot hold."""
    pairs = config.layer_init_values
    values = {v for pair in pairs for v in pair if v}
    off = [f"{i}.{branch}" for i, pair in enumerate(pairs) for branch, v in zip(BRANCHES, pair) if not v]
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


def _heads(job: Job) -> tuple[MetaHeads, Mapping[str, Tensor], list[str], list[str]]:
    """The heads written (sizes and tensors), with notes and warnings: the source's, else new ones."""
    config, chosen = job.config, job.options.get("meta_config")
    source = job.heads or {}
    if source:
        sizes = heads_of({k: source.info(k) for k in source}, config.embed_dim, str(job.heads.path))
        dim, dtype = config.embed_dim, job.fill_dtype
        if chosen is not None and chosen.infos(dim, dtype) != sizes.infos(dim, dtype):
            raise CheckpointError(
                f"the source's heads are {sizes.describe()}, the --meta-config's {chosen.describe()}: Meta's "
                f"strict load (and distillation, whose prototype counts must match) would refuse them; set the "
                f"config's dino:/ibot: head sizes to the source's"
            )
        return sizes, source, [f"heads carried: {sizes.describe()}"], []
    seed = job.options.get("seed", 0)
    sizes = chosen or (RELEASED_HEADS if job.released else DEFAULT_HEADS)
    why = "--meta-config" if chosen else "as released" if sizes is RELEASED_HEADS else "Meta's defaults"
    notes = [f"heads new (seed {seed}, {why}): {sizes.describe()}; {WARM_UP}"]
    warnings = []
    if job.options.get("distill_teacher"):
        warnings.append(
            "a distillation teacher needs trained heads: this source has none, so its new heads teach random "
            "prototypes; train them first (continued pretraining with the backbone frozen), or convert a "
            "checkpoint that carries them"
        )
    return sizes, new_heads(sizes, config.embed_dim, seed), notes, warnings


class MetaTrain(Format):
    spec = META_TRAIN_SPEC
    title = META_TITLE
    table = META_TABLE
    reads_heads = True
    may_drop = frozenset({"head"})  # Meta's backbone has no classifier
    default_dtype = "fp32"  # Meta's trainer keeps fp32 master weights
    takes = META_TRAIN_SPEC.option_defaults

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        checked = dict(options)
        if checked.get("meta_config") is not None:
            checked["meta_config"] = heads_from_config(checked["meta_config"])
        return checked

    def prepare_write(self, job: Job) -> PreparedWrite:
        """Meta's trainer's keys: `backbone.` + Meta's backbone keys, and the carried or new heads."""
        config = job.config
        self.holding(config)
        layer_scale, limits = _layer_scale_limits(config)
        branches = gamma_branches(config) if layer_scale else ()  # none: Meta's blocks use an identity
        full = with_all_gammas(job.tensors, config.depth, config.embed_dim, job.fill_dtype, branches)
        backbone, unheld = self.table.from_native(full)
        self.check_holds(config, unheld)
        not_held, warnings = not_held_report(unheld, self.name, (*OUTPUT_CHANGING, "head"), named={"head": HEAD_NOTE})
        not_held += limits
        warnings += [f"meta-train cannot hold {limit}" for limit in limits]
        sizes, made, notes, head_warnings = _heads(job)
        # Carried heads keep their dtype unless cast; new ones are made in the backbone's (with "keep": its fills').
        head_plan = cast_plan(Plan(made, passthrough(made)), job.cast if job.heads else job.cast or job.fill_dtype)
        out = _joined({"backbone.": backbone, "": head_plan})
        plan = Plan(out, passthrough(out))
        floating = {
            plan.info(k).dtype for k in plan if plan.info(k).dtype.is_floating_point and not k.endswith(PERIODS)
        }
        notes.append(f"written in {'/'.join(sorted(str(dtype).removeprefix('torch.') for dtype in floating))}")
        bias_mask = any(k.endswith("attn.qkv.bias_mask") for k in backbone)
        yaml_lines = meta_yaml(job.dst.resolve(), sizes, config, layer_scale, bias_mask)
        return PreparedWrite(plan, _writer(plan, job.dst), not_held, warnings + head_warnings, notes, yaml_lines)


def _writer(plan: Plan, dst: Path) -> Callable[[Path, Progress | None], None]:
    if dst.suffix:
        return lambda tmp, bar: write_torch_file(tmp, plan, progress=bar, under="teacher")
    return lambda tmp, bar: write_dcp(tmp, plan, "model", META_TRAIN_DCP_ITEMS, progress=bar)


META_TRAIN = MetaTrain()
