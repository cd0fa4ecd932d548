"""Self-supervised pretraining pieces, as Meta's DINOv3 trainer has them: the losses (`losses`), the
projection head (`heads.DINOHead`), iBOT's block masks (`masking`), the schedules (`schedules`), the EMA
teacher (`ema.EmaTeacher`) and the multi-crop views (`augment.MultiCrop`)."""

from .augment import CropConfig, Crops, MultiCrop
from .ema import EmaTeacher
from .heads import DINOHead
from .losses import DINOLoss, GramLoss, KoLeoLoss, KoLeoLossDistributed, iBOTPatchLoss, sinkhorn_knopp
from .masking import MaskingGenerator, collate_masks
from .schedules import CosineScheduler, ScheduleConfig, Schedules, build_schedules, linear_warmup_cosine_decay

__all__ = [
    "CosineScheduler",
    "CropConfig",
    "Crops",
    "DINOHead",
    "DINOLoss",
    "EmaTeacher",
    "GramLoss",
    "KoLeoLoss",
    "KoLeoLossDistributed",
    "MaskingGenerator",
    "MultiCrop",
    "ScheduleConfig",
    "Schedules",
    "build_schedules",
    "collate_masks",
    "iBOTPatchLoss",
    "linear_warmup_cosine_decay",
    "sinkhorn_knopp",
]
