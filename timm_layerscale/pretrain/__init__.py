"""Self-supervised pretraining pieces, as Meta's DINOv3 trainer has them: the losses (`losses`) and the
projection head (`heads.DINOHead`)."""

from .heads import DINOHead
from .losses import DINOLoss, GramLoss, KoLeoLoss, KoLeoLossDistributed, iBOTPatchLoss, sinkhorn_knopp

__all__ = [
    "DINOHead",
    "DINOLoss",
    "GramLoss",
    "KoLeoLoss",
    "KoLeoLossDistributed",
    "iBOTPatchLoss",
    "sinkhorn_knopp",
]
