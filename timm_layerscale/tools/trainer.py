"""A short, seeded training run on shapes: AdamW, linear warmup then cosine decay, held-out evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .shapes import Shapes


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.05
    eval_every: int = 50

    def describe(self) -> str:
        return (
            f"{self.steps} steps of batch {self.batch_size}, AdamW lr {self.lr:g} (warmup {self.warmup} steps, "
            f"then cosine to 0), weight decay {self.weight_decay:g} (not on gammas, norms, biases, tokens)"
        )

    def short_warmup_note(self) -> str | None:
        """One line when the run ends inside its warmup: the learning rate never reaches its peak."""
        if self.steps >= self.warmup:
            return None
        top = lr_at(self.steps - 1, self) if self.steps else 0.0
        return (
            f"training stops at step {self.steps}, inside the {self.warmup}-step warmup: the learning rate climbs "
            f"to {top:.2g}, "
            f"never to its peak {self.lr:g}, and never decays; give more steps or a shorter warmup"
        )


@dataclass
class TrainResult:
    history: list[dict[str, float]] = field(default_factory=list)  # one row per evaluation
    diverged_at: int | None = None  # the step whose loss was NaN or Inf


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: decaying gammas would pull every branch back towards muted."""
    skip = getattr(model, "no_weight_decay", lambda: set())()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 or name in skip else decay).append(param)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 512) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over the whole set."""
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0
    for start in range(0, len(images), batch):
        logits = model(images[start : start + batch])
        target = labels[start : start + batch]
        loss += F.cross_entropy(logits, target, reduction="sum").item()
        correct += (logits.argmax(-1) == target).sum().item()
    model.train(was_training)
    return loss / len(images), correct / len(images)


def train(
    model: nn.Module,
    data: Shapes,
    cfg: TrainConfig,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Trains in place. Batches are drawn from `seed`; a NaN or Inf loss stops the run and is recorded."""
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    result = TrainResult()
    window_loss, window_correct, window_seen = 0.0, 0, 0
    model.train()
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order = torch.cat([order, torch.randperm(len(data.train_images), generator=generator)])
        index, order = order[: cfg.batch_size], order[cfg.batch_size :]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        logits = model(data.train_images[index])
        loss = F.cross_entropy(logits, data.train_labels[index])
        if not torch.isfinite(loss):
            result.diverged_at = step + 1
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        window_loss += loss.item() * len(index)
        window_correct += (logits.argmax(-1) == data.train_labels[index]).sum().item()
        window_seen += len(index)
        if on_step is not None:
            on_step(step + 1, loss.item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            test_loss, test_acc = evaluate(model, data.test_images, data.test_labels)
            result.history.append(
                dict(
                    step=step + 1,
                    lr=lr_at(step, cfg),
                    train_loss=window_loss / window_seen,
                    train_acc=window_correct / window_seen,
                    test_loss=test_loss,
                    test_acc=test_acc,
                )
            )
            window_loss, window_correct, window_seen = 0.0, 0, 0
    return result
