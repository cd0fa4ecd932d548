"""The pretraining loop: a method (`pretrain.method`) trained on a folder's images for a number of steps, on
one process or on every rank of `torchrun` (DDP), with checkpoints to resume from and a `metrics.jsonl`.

A step's numbers depend only on the run's seed, the step and the weights: the batch is the step's slice of the
epochs' permutations, each image's views have their own seed, and a rank takes its contiguous part of the
global batch. So a resumed run gives the uninterrupted run's losses, and N ranks give one process's.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from . import distributed
from .checkpoint import load_checkpoint, save_checkpoint
from .data import make_batch
from .method import Method, Shard

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class LoopConfig:
    """How long and how: `batch_size` is the global batch (every rank's together)."""

    steps: int
    batch_size: int
    seed: int = 0
    save_every: int = 0  # 0: at the end only
    clip_grad: float = 3.0  # Meta's optim.clip_grad
    betas: tuple[float, float] = (0.9, 0.999)  # Meta's optim.adamw_beta1 / beta2
    bf16: bool = False  # autocast the forward to bfloat16

    def check(self, n_images: int, world: int) -> None:
        """A `ValueError` naming the setting to change where the run could not do what it says."""
        if self.steps < 1 or self.batch_size < 1 or self.save_every < 0:
            raise ValueError("--steps and --batch-size must be at least 1, --save-every at least 0")
        if n_images < 2:
            raise ValueError(f"{n_images} image(s) found: self-supervised training needs at least 2; add images")
        if self.batch_size % world:
            raise ValueError(f"--batch-size {self.batch_size} does not split over {world} ranks: make it a multiple")


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    parts: dict[str, float]
    lr: float
    images_per_s: float


def build_optimizer(method: Method, betas: tuple[float, float]) -> torch.optim.AdamW:
    return torch.optim.AdamW(method.param_groups(), lr=0.0, betas=betas)


def set_step_values(optimizer: torch.optim.Optimizer, method: Method, step: int) -> float:
    """Each group's learning rate and weight decay at `step`; returns the first group's rate (for the bar)."""
    values = method.step_values(step)
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = values[group["name"]].lr, values[group["name"]].weight_decay
    return optimizer.param_groups[0]["lr"]


def autocast(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


class Loop:
    """One run: `Loop(method, files, config, out).run()` trains from step 0, or from the checkpoint of
    `resume` (a run's folder), to `config.steps`; each step's record goes to `on_step` (the progress bar)."""

    def __init__(
        self,
        method: Method,
        files: Sequence[Path],
        config: LoopConfig,
        out: Path,
        settings: Mapping[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shard = Shard(distributed.rank(), distributed.world_size())
        config.check(len(files), self.shard.world)
        self.method, self.files, self.config, self.out = method, list(files), config, Path(out)
        self.device = torch.device(device)
        self.settings = {"loop": asdict(config), **(settings or {})}
        self.optimizer = build_optimizer(method, config.betas)
        self.start = 0
        self.model: nn.Module = method
        if self.shard.world > 1:
            self.model = DistributedDataParallel(method, broadcast_buffers=False)

    def resume(self, path: Path) -> int:
        """Loads a checkpoint's method and optimiser state; returns the step the run goes on from."""
        saved = load_checkpoint(path)
        self.method.load_state_dict(saved.method)
        self.optimizer.load_state_dict(saved.optimizer)
        self.start = saved.step + 1
        if self.is_writer:
            keep_metrics_until(self.out / METRICS_FILE, saved.step)
        return self.start

    @property
    def is_writer(self) -> bool:
        return self.shard.rank == 0

    def batch(self, step: int) -> dict[str, Tensor]:
        batch = make_batch(self.method, self.files, self.config.batch_size, self.config.seed, step, self.shard)
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}

    def step(self, step: int) -> StepRecord:
        began = time.perf_counter()
        lr = set_step_values(self.optimizer, self.method, step)
        batch = self.batch(step)
        self.method.train()
        with autocast(self.config.bf16, self.device):
            loss, parts = self.model(batch, step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.clip_grad:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad)
        self.optimizer.step()
        self.method.after_step(step)
        health = {name: torch.tensor(value) for name, value in self.method.metrics(batch).items()}
        total, values = self.global_mean(loss.detach(), {**parts, **health})
        seconds = time.perf_counter() - began
        return StepRecord(step, total, values, lr, self.config.batch_size / max(seconds, 1e-9))

    def global_mean(self, loss: Tensor, parts: Mapping[str, Tensor]) -> tuple[float, dict[str, float]]:
        """The loss and its parts over the global batch: each rank's mean, averaged over the ranks."""
        numbers = torch.stack([loss.float(), *(torch.as_tensor(v).float() for v in parts.values())])
        if self.shard.world > 1:
            distributed.all_reduce_(numbers)
            numbers /= self.shard.world
        values = numbers.tolist()
        return values[0], dict(zip(parts, values[1:]))

    def run(self, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        records = []
        if self.is_writer:
            self.out.mkdir(parents=True, exist_ok=True)
        for step in range(self.start, self.config.steps):
            record = self.step(step)
            records.append(record)
            if self.is_writer:
                append_metrics(self.out / METRICS_FILE, record)
            if on_step is not None:
                on_step(record)
            done = step + 1
            if done == self.config.steps or (self.config.save_every and done % self.config.save_every == 0):
                self.save(step)
        return records

    def save(self, step: int) -> None:
        if self.is_writer:
            save_checkpoint(self.out, self.method, self.optimizer, step, self.settings)
        if self.shard.world > 1:
            torch.distributed.barrier()


def append_metrics(path: Path, record: StepRecord) -> None:
    line = {"step": record.step, "loss": record.loss, **record.parts, "lr": record.lr}
    line["images_per_s"] = round(record.images_per_s, 3)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def keep_metrics_until(path: Path, step: int) -> None:
    """On resume: the lines of steps after the checkpoint's are dropped (they will be trained again)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if _step_of(line) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)


def _step_of(line: str) -> int:
    with contextlib.suppress(json.JSONDecodeError, TypeError, AttributeError):
        return int(json.loads(line).get("step", -1))
    return 1 << 62  # a line that cannot be read is dropped
