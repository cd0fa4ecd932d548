"""Meta's DINOv3 pretraining heads: their sizes from a training config, their keys, and new ones made lazily.

Meta's trainer builds `dino_head` and `ibot_head` as `DINOHead(in_dim=embed_dim, out_dim=head_n_prototypes,
hidden_dim=head_hidden_dim, bottleneck_dim=head_bottleneck_dim, nlayers=head_nlayers)`: an MLP of `nlayers`
Linear layers with biases (`mlp.0`, `mlp.2`, ... with GELUs between them; `mlp` itself for one layer) and a
bias-free `last_layer`, every weight truncated normal with std 0.02 and every bias zero. Its config loader
merges the training YAML over `ssl_default_config.yaml`, whose heads are `DEFAULT_HEADS`.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import yaml

from .checkpoints.errors import CheckpointError
from .checkpoints.reader import LazyCheckpoint, TensorInfo
from .config import VitLsConfig

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
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
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
    layerscale = f"{config.layer_init_values[0][0] or 1e-5:.1e}" if layer_scale else "null"
    student = [
        "student:  # continued pretraining; the backbone args must match the checkpoint's",
        f"  resume_from_teacher_chkpt: {path}",
        f"  patch_size: {config.patch_size}",
        f"  layerscale: {layerscale}",
        f"  n_storage_tokens: {config.num_storage_tokens}",
        f"  qkv_bias: {_yaml_bool(config.qkv_bias)}",
        f"  proj_bias: {_yaml_bool(config.proj_bias)}",
        f"  ffn_bias: {_yaml_bool(config.ffn_bias)}",
        f"  mask_k_bias: {_yaml_bool(bias_mask)}",
        f"  untie_cls_and_patch_norms: {_yaml_bool(config.cls_norm)}",
        f"  untie_global_and_local_cls_norm: {_yaml_bool(config.local_cls_norm)}",
        f"  pos_embed_rope_base: {config.rope_base}",
    ]
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
    return "\n".join([*head_lines, *student, *gram, *distillation])


def _yaml_bool(value: bool) -> str:
    return "true" if value else "false"
