"""The training schedules of Meta's DINOv3 trainer: learning rate, weight decay, teacher momentum and teacher
temperature per iteration, from the keys of Meta's training config."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _linspace(start: float, stop: float, num: int, endpoint: bool = True) -> list[float]:
    # numpy's linspace: start plus i steps, the last value `stop` itself, so the values are Meta's
    if num <= 0:
        return []
    div = (num - 1) if endpoint else num
    if div == 0:
        return [float(start)]
    step = (stop - start) / div
    values = [start + i * step for i in range(num)]
    if endpoint:
        values[-1] = float(stop)
    return values


class CosineScheduler:
    """Meta's `CosineScheduler`: `freeze_iters` zeros, a linear warmup from `start_warmup_value` to
    `base_value` over `warmup_iters`, then a half cosine from `base_value` down (or up) to `final_value` over
    the rest of `total_iters`. With `trunc_extra` > 0 the cosine is that much longer, cut at the end of the
    schedule and rescaled so that it still ends at `final_value`. `scheduler[it]` past the end is `final_value`.
    """

    def __init__(
        self,
        base_value: float,
        final_value: float,
        total_iters: int,
        warmup_iters: int = 0,
        start_warmup_value: float = 0,
        freeze_iters: int = 0,
        trunc_extra: float = 0.0,
    ) -> None:
        cosine_iters = total_iters - warmup_iters - freeze_iters
        if cosine_iters < 0 or min(warmup_iters, freeze_iters) < 0:
            raise ValueError(
                f"a schedule of {total_iters} iterations cannot hold {freeze_iters} frozen and "
                f"{warmup_iters} warm-up iterations"
            )
        self.final_value = float(final_value)
        self.total_iters = total_iters
        freeze = [0.0] * freeze_iters
        warmup = _linspace(start_warmup_value, base_value, warmup_iters)
        self.schedule = freeze + warmup + _cosine(base_value, final_value, cosine_iters, trunc_extra)

    def __getitem__(self, it: int) -> float:
        return self.final_value if it >= self.total_iters else self.schedule[it]

    def __len__(self) -> int:
        return self.total_iters


def _cosine(base: float, final: float, steps: int, trunc_extra: float) -> list[float]:
    if trunc_extra == 0.0:
        return [final + 0.5 * (base - final) * (1 + math.cos(math.pi * i / steps)) for i in range(steps)]
    if steps == 0:
        return []
    halves = [(math.cos(a) + 1) / 2 for a in _linspace(0.0, math.pi, int((1 + trunc_extra) * steps))[:steps]]
    last = halves[-1]
    return [(h - last) / (1 - last) * (base - final) + final for h in halves]


def linear_warmup_cosine_decay(
    start: float,
    peak: float,
    end: float,
    warmup_iterations: int,
    total_iterations: int,
    cosine_iterations: int | None = None,
) -> list[float]:
    """Meta's second schedule form (`schedules:` in its config): a linear warmup from `start` to `peak`
    (`peak` itself not reached), a cosine from `peak` to `end` over `cosine_iterations` (the rest when None),
    then `end` to `total_iterations`."""
    cosine_iterations = total_iterations - warmup_iterations if cosine_iterations is None else cosine_iterations
    constant = total_iterations - cosine_iterations - warmup_iterations
    if constant < 0:
        raise ValueError(
            f"{warmup_iterations} warm-up and {cosine_iterations} cosine iterations exceed the "
            f"{total_iterations} of the schedule"
        )
    linear = _linspace(start, peak, warmup_iterations, endpoint=False)
    cosine = [(peak - end) * (math.cos(a) + 1) / 2 + end for a in _linspace(0.0, math.pi, cosine_iterations)]
    return linear + cosine + [float(end)] * constant


@dataclass(frozen=True)
class ScheduleConfig:
    """The keys of Meta's training config that make its schedules, with `ssl_default_config.yaml`'s values."""

    epoch_length: int = 1250  # train.OFFICIAL_EPOCH_LENGTH
    epochs: int = 100  # optim.epochs
    lr: float = 1e-3  # optim.lr
    min_lr: float = 1e-6  # optim.min_lr
    warmup_epochs: int = 10  # optim.warmup_epochs
    weight_decay: float = 0.04  # optim.weight_decay
    weight_decay_end: float = 0.4  # optim.weight_decay_end
    schedule_trunc_extra: float = 0.0  # optim.schedule_trunc_extra
    freeze_last_layer_epochs: int = 1  # optim.freeze_last_layer_epochs
    momentum_teacher: float = 0.992  # teacher.momentum_teacher
    final_momentum_teacher: float = 1.0  # teacher.final_momentum_teacher
    teacher_temp: float = 0.07  # teacher.teacher_temp
    warmup_teacher_temp: float = 0.04  # teacher.warmup_teacher_temp
    warmup_teacher_temp_epochs: int = 30  # teacher.warmup_teacher_temp_epochs


@dataclass(frozen=True)
class Schedules:
    lr: CosineScheduler
    weight_decay: CosineScheduler
    momentum: CosineScheduler
    teacher_temp: CosineScheduler
    last_layer_lr: CosineScheduler


def build_schedules(cfg: ScheduleConfig) -> Schedules:
    """Meta's `build_schedulers` (the first form): the five schedules its training loop reads each iteration.
    The teacher temperature warms up and then stays; the last layer's learning rate is 0 for the first
    `freeze_last_layer_epochs`."""
    total = cfg.epochs * cfg.epoch_length
    trunc = cfg.schedule_trunc_extra
    lr = dict(base_value=cfg.lr, final_value=cfg.min_lr, total_iters=total, trunc_extra=trunc)
    lr.update(warmup_iters=cfg.warmup_epochs * cfg.epoch_length, start_warmup_value=0)
    last_layer_lr = CosineScheduler(**lr)
    frozen = min(cfg.freeze_last_layer_epochs * cfg.epoch_length, total)
    last_layer_lr.schedule[:frozen] = [0.0] * frozen
    warm_temp = cfg.warmup_teacher_temp_epochs * cfg.epoch_length
    return Schedules(
        lr=CosineScheduler(**lr),
        weight_decay=CosineScheduler(cfg.weight_decay, cfg.weight_decay_end, total, trunc_extra=trunc),
        momentum=CosineScheduler(cfg.momentum_teacher, cfg.final_momentum_teacher, total, trunc_extra=trunc),
        teacher_temp=CosineScheduler(
            cfg.teacher_temp,
            cfg.teacher_temp,
            warm_temp,
            warmup_iters=warm_temp,
            start_warmup_value=cfg.warmup_teacher_temp,
        ),
        last_layer_lr=last_layer_lr,
    )
