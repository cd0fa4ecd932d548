"""Self-supervised pretraining pieces, as Meta's DINOv3 trainer has them: the losses (`losses`)."""

from .losses import DINOLoss, GramLoss, KoLeoLoss, KoLeoLossDistributed, iBOTPatchLoss, sinkhorn_knopp

__all__ = ["DINOLoss", "GramLoss", "KoLeoLoss", "KoLeoLossDistributed", "iBOTPatchLoss", "sinkhorn_knopp"]
