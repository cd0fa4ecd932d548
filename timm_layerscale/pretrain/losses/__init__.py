"""DINOv3's self-supervised losses, as Meta's `dinov3.loss` computes them, on one process or many."""

from .dino import DINOLoss
from .gram import GramLoss
from .ibot import iBOTPatchLoss
from .koleo import KoLeoLoss, KoLeoLossDistributed
from .sinkhorn import sinkhorn_knopp

__all__ = ["DINOLoss", "GramLoss", "KoLeoLoss", "KoLeoLossDistributed", "iBOTPatchLoss", "sinkhorn_knopp"]
