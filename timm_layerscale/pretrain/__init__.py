"""Self-supervised pretraining pieces, as Meta's DINOv3 trainer has them: the losses (`losses`), the
projection head (`heads.DINOHead`) and iBOT's block masks (`masking`)."""

from .heads import DINOHead
from .losses import DINOLoss, GramLoss, KoLeoLoss, KoLeoLossDistributed, iBOTPatchLoss, sinkhorn_knopp
from .masking import MaskingGenerator, collate_masks

__all__ = [
    "DINOHead",
    "DINOLoss",
    "GramLoss",
    "KoLeoLoss",
    "KoLeoLossDistributed",
    "MaskingGenerator",
    "collate_masks",
    "iBOTPatchLoss",
    "sinkhorn_knopp",
]
