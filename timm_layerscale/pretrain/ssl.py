"""DINOv3's self-supervised objective as a pretraining method: continued training of a DINOv3-style ViT with
Meta's losses (`SSLMetaArch.forward_backward` / `compute_losses` of `facebookresearch/dinov3`).

Per step: the EMA teacher sees the two global crops and gives Sinkhorn-Knopp targets for their class tokens
(DINO head) and for the patches masked in the student's input (iBOT head). The student sees the global crops
with iBOT's masks and the local crops without. The loss, with Meta's weights and crop-count scales: DINO on the
student's global class tokens against the other global crop's targets (`ignore_diagonal`), DINO on the local
crops against both global crops' targets, iBOT on the masked patches, KoLeo on the student's global class
tokens before the head, and (`gram=True`) Gram anchoring of the student's global patch tokens to a frozen copy
of the starting backbone. After the optimiser's step the teacher moves toward the student.

Where this differs from Meta's trainer (each one is also said where it matters below):
- the learning rate is taken as given: Meta's `optim.scaling_rule` (sqrt_wrt_1024) is not applied;
- Meta's epoch-based lengths are shares of `steps` (of Meta's 100 epochs: lr warm-up 10 when
  `warmup_steps` is None, teacher-temperature warm-up 30, last-layer freeze 1);
- no layer-wise lr decay (`optim.layerwise_decay` 0.9) and no `patch_embed_lr_mult` (0.2): one rate for
  the backbone; the no-weight-decay rule is `method.no_weight_decay`'s (Meta's also decays the tokens);
- `head_warmup_steps` (not Meta's): the backbone's rate is 0 while the new heads learn, since released
  checkpoints carry no DINO/iBOT heads;
- iBOT's masks are drawn for the whole global batch and each rank takes its rows (Meta draws per rank), so
  a rank's count of masked images varies while the global batch's is Meta's;
- KoLeo's nearest neighbours come from the whole global batch (`KoLeoLossDistributed`, every rank gathered),
  so N ranks give one process's loss; Meta's default (`koleo_loss_distributed: false`) searches each GPU's
  own batch;
- the Gram teacher is the starting backbone, fixed (no `gram.rep_update` from the EMA teacher), sees the
  student's global crops (no `gram_teacher_crops_size`) and compares each image's Gram matrix
  (`gram.img_level: true`, as Meta's gram-anchoring config; the default config's batch-level matrix would
  depend on the rank count), with a constant `gram_loss_weight` (no `gram.loss_weight_schedule`);
- `local_crops` may be 0 (Meta asserts > 0): the local DINO term is then 0;
- the local crops pass the same final norms as the global ones (no `untie_global_and_local_cls_norm`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from .augment import CropConfig, Crops, MultiCrop
from .ema import EmaTeacher
from .heads import DINOHead
from .losses import DINOLoss, GramLoss, KoLeoLossDistributed, iBOTPatchLoss
from .masking import MaskingGenerator, collate_masks
from .method import Method, Shard, StepValues, feature_std, split_decay, with_decay
from .schedules import ScheduleConfig, Schedules, build_schedules

N_GLOBAL_CROPS = 2
META = ScheduleConfig()  # ssl_default_config.yaml: its epochs (100) and the epoch lengths of its schedules
PARTS = ("dino_local", "dino_global", "koleo", "ibot", "gram")  # Meta's order of the terms


def meta_share(steps: int, meta_epochs: int) -> int:
    """`meta_epochs` of Meta's `optim.epochs` as a number of this run's `steps`."""
    return steps * meta_epochs // META.epochs


@dataclass(frozen=True)
class SSLSettings:
    """A DINOv3 run's length, schedule, crops, heads, loss weights and masks; Meta's defaults
    (`ssl_default_config.yaml`) unless said."""

    steps: int
    lr: float = 1e-3  # optim.lr, the effective rate (Meta's scaling rule is not applied)
    min_lr: float = 1e-6  # optim.min_lr
    warmup_steps: int | None = None  # None: Meta's optim.warmup_epochs 10 of 100, a tenth of the run
    weight_decay: float = 0.04  # optim.weight_decay
    weight_decay_end: float = 0.4  # optim.weight_decay_end
    global_size: int = 224  # crops.global_crops_size
    local_size: int = 96  # crops.local_crops_size
    local_crops: int = 8  # crops.local_crops_number
    prototypes: int = 65536  # dino.head_n_prototypes and ibot.head_n_prototypes
    head_hidden_dim: int = 2048  # dino/ibot.head_hidden_dim
    head_bottleneck_dim: int = 256  # dino/ibot.head_bottleneck_dim
    head_nlayers: int = 3  # dino/ibot.head_nlayers
    gram: bool = False  # gram.use_loss
    head_warmup_steps: int = 0  # not Meta's: the backbone's lr is 0 for these first steps
    dino_loss_weight: float = 1.0  # dino.loss_weight
    koleo_loss_weight: float = 0.1  # dino.koleo_loss_weight
    ibot_loss_weight: float = 1.0  # ibot.loss_weight
    gram_loss_weight: float = 1.0  # gram.loss_weight
    mask_probability: float = 0.5  # ibot.mask_sample_probability
    mask_ratio: tuple[float, float] = (0.1, 0.5)  # ibot.mask_ratio_min_max

    @property
    def lr_warmup_steps(self) -> int:
        return meta_share(self.steps, META.warmup_epochs) if self.warmup_steps is None else self.warmup_steps

    def check(self, patch_size: Sequence[int] = (16, 16)) -> None:
        """A `ValueError` naming the setting where the run could not do what it says."""
        if self.steps < 1:
            raise ValueError(f"steps {self.steps}: pass at least 1")
        if not 0 <= self.lr_warmup_steps < self.steps:
            raise ValueError(f"warmup_steps {self.lr_warmup_steps} must be from 0 to fewer than steps {self.steps}")
        if not 0 <= self.head_warmup_steps < self.steps:
            raise ValueError(
                f"head_warmup_steps {self.head_warmup_steps} must be from 0 to fewer than steps {self.steps} "
                "(the backbone would never train)"
            )
        if not self.lr > 0 or not self.min_lr >= 0:
            raise ValueError(f"lr {self.lr} and min_lr {self.min_lr}: pass a positive lr and a min_lr of 0 or more")
        for name, size in (("global_size", self.global_size), ("local_size", self.local_size)):
            if size < 1 or any(size % p for p in patch_size):
                raise ValueError(f"{name} {size} is not a multiple of the student's patch size {tuple(patch_size)}")
        if self.local_crops < 0 or min(self.prototypes, self.head_hidden_dim, self.head_bottleneck_dim) < 1:
            raise ValueError("local_crops must be 0 or more, prototypes and the head sizes at least 1")
        low, high = self.mask_ratio
        if not 0 <= low < high <= 1 or not 0 <= self.mask_probability <= 1:
            raise ValueError(f"mask_ratio {self.mask_ratio} needs 0 <= low < high <= 1, mask_probability 0 to 1")


def schedule_config(settings: SSLSettings) -> ScheduleConfig:
    """Meta's schedules over `settings.steps` iterations (one-iteration "epochs"), its lengths as shares."""
    steps = settings.steps
    return ScheduleConfig(
        epoch_length=1,
        epochs=steps,
        lr=settings.lr,
        min_lr=settings.min_lr,
        warmup_epochs=settings.lr_warmup_steps,
        weight_decay=settings.weight_decay,
        weight_decay_end=settings.weight_decay_end,
        freeze_last_layer_epochs=meta_share(steps, META.freeze_last_layer_epochs),
        warmup_teacher_temp_epochs=meta_share(steps, META.warmup_teacher_temp_epochs),
    )


def stack_crop_major(views: Sequence[Sequence[Tensor]]) -> Tensor:
    """Per image lists of crops -> `[crops * images, ...]`: crop 0 of every image, then crop 1, ... (Meta's)."""
    return torch.stack([image[i] for i in range(len(views[0])) for image in views])


def mask_batch(masks: Tensor) -> dict[str, Tensor]:
    """A `[crops, patches]` bool mask and what the losses read from it, as Meta's collate makes them."""
    indices = masks.flatten().nonzero().flatten()
    weights = (1 / masks.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(masks)[masks]
    n_masked = torch.full((1,), fill_value=indices.shape[0], dtype=torch.long)
    return {"masks": masks, "mask_indices": indices, "masks_weight": weights, "n_masked_patches": n_masked}


def rank_rows(masks: Tensor, per_rank: int, shard: Shard) -> Tensor:
    """This rank's rows of the global batch's crop-major masks, crop-major again."""
    rows = slice(shard.rank * per_rank, (shard.rank + 1) * per_rank)
    return masks.unflatten(0, (N_GLOBAL_CROPS, -1))[:, rows].flatten(0, 1)


@dataclass
class TeacherOutput:
    cls_probs: Tensor  # [2, B, K]: Sinkhorn-Knopp targets of the global crops' class tokens
    masked_patch_probs: Tensor  # [masked patches, K]


@dataclass
class StudentOutput:
    global_cls: Tensor  # [2, B, D], before the head (KoLeo's input)
    global_patches: Tensor  # [2 * B, P, D], of the masked input (Gram's input)
    global_logits: Tensor  # [2, B, K]
    local_logits: Tensor  # [local crops, B, K]
    masked_patch_logits: Tensor  # [masked patches, K]


class DINOv3(Method):
    """`DINOv3(student, settings)`: `student` (this package's ViT, `num_classes=0`, with a mask token) trained
    with its EMA teacher; the state holds the student, its heads, the teacher, the Gram teacher (with `gram`)
    and the losses' centres."""

    name = "dinov3"

    def __init__(self, student: nn.Module, settings: SSLSettings) -> None:
        super().__init__()
        patch = tuple(student.patch_embed.patch_size)
        settings.check(patch)
        if student.mask_token is None:
            raise ValueError("the student has no mask token (mask_token=False): iBOT needs one")
        if student.num_classes:
            raise ValueError("the student has a classifier (DDP would find it unused): create it with num_classes=0")
        self.settings = settings
        self.student = student
        self.dino_head, self.ibot_head = self._head(), self._head()  # Meta's ibot.separate_head
        self.teacher = nn.ModuleDict(
            {name: copy.deepcopy(module) for name, module in self._student_modules().items()}
        ).requires_grad_(False)
        self.gram_teacher = copy.deepcopy(student).requires_grad_(False) if settings.gram else None
        self.dino_loss = DINOLoss(settings.prototypes)
        self.ibot_patch_loss = iBOTPatchLoss(settings.prototypes)
        self.dino_loss.init_weights()
        self.ibot_patch_loss.init_weights()
        self.koleo_loss = KoLeoLossDistributed()  # the global batch's neighbours, not each rank's (Meta's)
        self.gram_loss = GramLoss(apply_norm=True, remove_neg=False, remove_only_teacher_neg=False)
        self.schedules: Schedules = build_schedules(schedule_config(settings))
        self.to(next(student.parameters()).device)  # the new heads and centres where the student is
        self.ema = EmaTeacher(self.teacher, self._student_modules())
        crops = CropConfig(
            global_crops_size=settings.global_size,
            local_crops_size=settings.local_size,
            local_crops_number=settings.local_crops,
        )
        self.multicrop = MultiCrop(crops)
        self.grid = (settings.global_size // patch[0], settings.global_size // patch[1])
        # Meta's train.py: `0.5 * img_size // patch_size * img_size // patch_size`, evaluated left to right
        self.max_block = 0.5 * settings.global_size // patch[0] * settings.global_size // patch[1]
        self._last: tuple[Tensor, Tensor] | None = None
        self.train()

    def _head(self) -> DINOHead:
        s = self.settings
        return DINOHead(
            self.student.embed_dim,
            s.prototypes,
            nlayers=s.head_nlayers,
            hidden_dim=s.head_hidden_dim,
            bottleneck_dim=s.head_bottleneck_dim,
        )

    def _student_modules(self) -> nn.ModuleDict:
        """The student's parts under the teacher's names; built on call, so nothing is registered twice."""
        return nn.ModuleDict({"backbone": self.student, "dino_head": self.dino_head, "ibot_head": self.ibot_head})

    def train(self, mode: bool = True) -> DINOv3:
        """The teachers stay in eval mode, as Meta's `SSLMetaArch.train`."""
        super().train(mode)
        self.teacher.eval()
        if self.gram_teacher is not None:
            self.gram_teacher.eval()
        return self

    def views(self, image: Tensor) -> Crops:
        return self.multicrop(image)

    def collate(self, samples: Sequence[Crops], generator: np.random.Generator, shard: Shard) -> dict[str, Tensor]:
        """Crop-major global and local crops (Meta's collate), and this rank's rows of the global batch's masks."""
        size = self.settings.local_size
        global_crops = stack_crop_major([s.global_crops for s in samples])
        local = [s.local_crops for s in samples]
        local_crops = stack_crop_major(local) if local[0] else global_crops.new_zeros(0, 3, size, size)
        masks = self.draw_masks(len(samples) * shard.world, generator)
        return {
            "global_crops": global_crops,
            "local_crops": local_crops,
            **mask_batch(rank_rows(masks, len(samples), shard)),
        }

    def draw_masks(self, n_images: int, generator: np.random.Generator) -> Tensor:
        """iBOT's masks of `n_images` images' global crops, `[2 * n_images, patches]` crop-major, drawn as
        Meta's collate draws them from a `random.Random` and a `RandomState` seeded from `generator`."""
        seeds = generator.integers(0, 2**32, size=2)
        rng, np_rng = random.Random(int(seeds[0])), np.random.RandomState(int(seeds[1]))
        blocks = MaskingGenerator(self.grid, max_num_patches=self.max_block, rng=rng, np_rng=np_rng)
        s = self.settings
        n_tokens = self.grid[0] * self.grid[1]
        drawn = collate_masks(N_GLOBAL_CROPS * n_images, n_tokens, s.mask_ratio, s.mask_probability, blocks)
        return drawn["collated_masks"]

    @torch.no_grad()
    def teacher_output(self, batch: dict[str, Tensor], teacher_temp: float) -> TeacherOutput:
        """The EMA teacher on the global crops (unmasked): Sinkhorn-Knopp targets of its class tokens and of
        its patch tokens where the student's are masked (Meta's `get_teacher_output`)."""
        tokens = self.teacher["backbone"].forward_features(batch["global_crops"])
        cls, patches = tokens[:, 0], tokens[:, self.student.num_prefix_tokens :]
        masked = torch.index_select(patches.flatten(0, 1), dim=0, index=batch["mask_indices"])
        masked_after_head = self.teacher["ibot_head"](masked)
        cls_after_head = self.teacher["dino_head"](cls)
        cls_probs = self.dino_loss.sinkhorn_knopp_teacher(cls_after_head, teacher_temp=teacher_temp)
        patch_probs = self.ibot_patch_loss.sinkhorn_knopp_teacher(
            masked_after_head, teacher_temp=teacher_temp, n_masked_patches_tensor=batch["n_masked_patches"]
        )
        return TeacherOutput(cls_probs.unflatten(0, (N_GLOBAL_CROPS, -1)), patch_probs)

    def student_output(self, batch: dict[str, Tensor]) -> StudentOutput:
        """The student on the masked global crops and the local crops; the DINO head on every class token in one
        pass, the iBOT head on the masked patches (Meta's `get_student_output`)."""
        prefix = self.student.num_prefix_tokens
        tokens = self.student.forward_features(batch["global_crops"], masks=batch["masks"])
        cls, patches = tokens[:, 0], tokens[:, prefix:]
        every_cls = [cls]
        if len(batch["local_crops"]):
            every_cls.append(self.student.forward_features(batch["local_crops"])[:, 0])
        masked = torch.index_select(patches.flatten(0, 1), dim=0, index=batch["mask_indices"])
        masked_logits = self.ibot_head(masked)
        logits = self.dino_head(torch.cat(every_cls))
        images = len(cls) // N_GLOBAL_CROPS
        return StudentOutput(
            global_cls=cls.unflatten(0, (N_GLOBAL_CROPS, images)),
            global_patches=patches,
            global_logits=logits[: len(cls)].unflatten(0, (N_GLOBAL_CROPS, images)),
            local_logits=logits[len(cls) :].unflatten(0, (self.settings.local_crops, images)),
            masked_patch_logits=masked_logits,
        )

    def loss_scales(self) -> dict[str, float]:
        """Each part's factor in the loss: Meta's weights times its scales by crop counts (DINOv2's)."""
        s, n_local = self.settings, self.settings.local_crops
        global_terms = N_GLOBAL_CROPS * (N_GLOBAL_CROPS - 1)  # ignore_diagonal (dino.global_ignore_diagonal)
        local_terms = N_GLOBAL_CROPS * n_local
        return {
            "dino_local": s.dino_loss_weight * local_terms / (global_terms + local_terms),
            "dino_global": s.dino_loss_weight * global_terms / (global_terms + local_terms),
            "koleo": s.koleo_loss_weight * N_GLOBAL_CROPS,
            "ibot": s.ibot_loss_weight,
            "gram": s.gram_loss_weight,
        }

    def loss_parts(self, teacher: TeacherOutput, student: StudentOutput, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Meta's `compute_losses` terms, unweighted, by name."""
        dino = self.dino_loss
        parts = {
            "dino_local": (
                dino(student.local_logits, teacher.cls_probs)
                if self.settings.local_crops
                else student.global_logits.new_zeros(())
            ),
            "dino_global": dino(student.global_logits, teacher.cls_probs, ignore_diagonal=True),
            "koleo": sum(self.koleo_loss(x) for x in student.global_cls) / N_GLOBAL_CROPS,
            "ibot": self.ibot_patch_loss.forward_masked(
                student.masked_patch_logits,
                teacher.masked_patch_probs,
                student_masks_flat=batch["masks"],
                n_masked_patches=batch["mask_indices"].shape[0],
                masks_weight=batch["masks_weight"],
            ),
        }
        if self.gram_teacher is not None:
            with torch.no_grad():
                target = self.gram_teacher.forward_features(batch["global_crops"])[:, self.student.num_prefix_tokens :]
            parts["gram"] = self.gram_loss(student.global_patches, target, img_level=True)
        return parts

    def forward(self, batch: dict[str, Tensor], step: int) -> tuple[Tensor, dict[str, Tensor]]:
        teacher = self.teacher_output(batch, self.schedules.teacher_temp[step])
        student = self.student_output(batch)
        parts = self.loss_parts(teacher, student, batch)
        scales = self.loss_scales()
        loss = sum(scales[name] * parts[name] for name in PARTS if name in parts)
        self._last = (teacher.cls_probs.detach(), student.global_cls.detach())
        return loss, {name: value.detach() for name, value in parts.items()}

    def param_groups(self) -> list[dict]:
        """The backbone's and the heads' MLPs' groups (decayed and not), and the heads' last layers, whose rate
        is Meta's `last_layer_lr` (0 for the first 1/100 of the run)."""
        heads = (self.dino_head, self.ibot_head)
        mlps = nn.ModuleList([head.mlp for head in heads])
        last = [p for head in heads for p in head.last_layer.parameters() if p.requires_grad]
        groups = split_decay(self.student, "backbone") + split_decay(mlps, "heads")
        return [*groups, dict(params=last, name="heads_last_layer")]

    def step_values(self, step: int) -> dict[str, StepValues]:
        s = self.schedules
        lr, wd = s.lr[step], s.weight_decay[step]
        backbone = StepValues(0.0 if step < self.settings.head_warmup_steps else lr, wd)
        values = {"heads_last_layer": StepValues(s.last_layer_lr[step], wd)}
        for prefix, base in (("backbone", backbone), ("heads", StepValues(lr, wd))):
            values.update({name: with_decay(base, name) for name in (prefix, f"{prefix}_no_wd")})
        return values

    def after_step(self, step: int) -> None:
        """The teacher (backbone and heads) moves toward the student by `1 - momentum[step]`."""
        self.ema.update(self.schedules.momentum[step])

    def backbone(self) -> nn.Module:
        return self.student

    def metrics(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """From the last forward: the entropy of the teacher's class-token targets (log K when uniform) and the
        spread of the student's global class tokens (`feature_std`, 0 at collapse)."""
        if self._last is None:
            return {}
        probs, cls = self._last
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1).mean().item()
        return {"teacher_entropy": entropy, "student_cls_std": feature_std(cls)}
