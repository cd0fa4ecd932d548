"""Adapting a model to unlabeled images: the loop (`loop.Loop`), the two methods (`ssl.DINOv3`, continued
DINOv3 training; `distill.Distill`, dense distillation) and the pieces of DINOv3's objective as Meta's trainer
has them: the losses (`losses`), the projection head (`heads.DINOHead`), iBOT's block masks (`masking`), the
schedules (`schedules`), the EMA teacher (`ema.EmaTeacher`) and the multi-crop views (`augment.MultiCrop`)."""

from .augment import CropConfig, Crops, MultiCrop
from .distill import Distill, DistillSettings
from .ema import EmaTeacher
from .heads import DINOHead
from .loop import Loop, LoopConfig
from .losses import DINOLoss, GramLoss, KoLeoLoss, KoLeoLossDistributed, iBOTPatchLoss, sinkhorn_knopp
from .masking import MaskingGenerator, collate_masks
from .method import Method, Shard, StepValues
from .schedules import CosineScheduler, ScheduleConfig, Schedules, build_schedules, linear_warmup_cosine_decay
from .ssl import DINOv3, SSLSettings

__all__ = [
    "CosineScheduler",
    "CropConfig",
    "Crops",
    "DINOHead",
    "DINOLoss",
    "DINOv3",
    "Distill",
    "DistillSettings",
    "EmaTeacher",
    "GramLoss",
    "KoLeoLoss",
    "KoLeoLossDistributed",
    "Loop",
    "LoopConfig",
    "MaskingGenerator",
    "Method",
    "MultiCrop",
    "SSLSettings",
    "ScheduleConfig",
    "Schedules",
    "Shard",
    "StepValues",
    "build_schedules",
    "collate_masks",
    "iBOTPatchLoss",
    "linear_warmup_cosine_decay",
    "sinkhorn_knopp",
]
