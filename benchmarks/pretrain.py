"""Pretraining speed and memory: images/s of a training step of each method, and its peak memory.

    python -m benchmarks.pretrain                          # CPU, ViT-S/16 student, ViT-B/16 teacher, 224 px
    python -m benchmarks.pretrain --batch 4 --rounds 3 --dtypes fp32 bf16

Rows, each the median over `--rounds` steps after one warm-up step, on one prepared batch (the loop's data
reading is timed apart, in the last column); ours and the anchor take turns, one step each per round, by the
clock `--clock` names:
1. distill: our `Distill` step (teacher forward, student forward and backward through both heads, AdamW)
   against timm's `FeatureDistillationTask` (the anchor: pooled features by MSE, its own projection) on the
   same student, teacher and images; the ratio is the anchor's time over ours;
2. dinov3: our `DINOv3` step (EMA teacher on 2 global crops, student on 2 masked global and the local crops,
   DINO, iBOT, KoLeo, optionally Gram; AdamW; the EMA update). Meta's trainer needs its launcher and CUDA,
   so no anchor runs beside it: images/s and memory alone.
Peak memory is the step's anonymous resident memory (`RssAnon`) above what the models already hold.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import timm
import torch
from PIL import Image
from timm.task.distillation import FeatureDistillationTask
from torch import nn

from timm_layerscale.pretrain.data import make_batch
from timm_layerscale.pretrain.distill import Distill, DistillSettings
from timm_layerscale.pretrain.ssl import DINOv3, SSLSettings
from timm_ls.cpu import bf16_matrix_path, cpu_flags

from .common import (
    add_machine_args,
    apply_machine_args,
    header,
    markdown,
    peak_memory_mib,
    ratio_stats,
    round_robin,
)

STUDENT, TEACHER = "vit_ls_small_patch16_dinov3", "vit_ls_base_patch16_dinov3"
CPU = torch.device("cpu")


def render(folder: Path, n: int, size: int) -> list[Path]:
    rng = np.random.default_rng(0)
    files = []
    for i in range(n):
        files.append(folder / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(files[-1])
    return files


def autocast(dtype: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def method_step(method: nn.Module, batch: dict, dtype: str) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(method.param_groups(), lr=1e-5)

    def step() -> None:
        with autocast(dtype):
            loss, _ = method(batch, 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        method.after_step(0)

    return step


def anchor_step(student: nn.Module, teacher: nn.Module, images: torch.Tensor, dtype: str) -> Callable[[], None]:
    task = FeatureDistillationTask(student, teacher, task_loss_weight=0.0, verbose=False)
    task.train()
    optimizer = torch.optim.AdamW([p for p in task.parameters() if p.requires_grad], lr=1e-5)
    target = torch.zeros(len(images), dtype=torch.long)

    def step() -> None:
        with autocast(dtype):
            loss = task(images, target)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def data_seconds(method: nn.Module, files: list[Path], batch: int) -> float:
    start = time.perf_counter()
    make_batch(method, files, batch, seed=0, step=1)
    return time.perf_counter() - start


def distill_rows(args: argparse.Namespace, files: list[Path], dtype: str) -> list[list[str]]:
    torch.manual_seed(0)
    teacher, student = timm.create_model(TEACHER), timm.create_model(STUDENT, num_classes=0)
    method = Distill(student, teacher, DistillSettings(steps=10, size=args.size))
    batch = make_batch(method, files, args.batch, seed=0, step=0)
    memory = peak_memory_mib(method_step(method, batch, dtype), CPU)
    reading = data_seconds(method, files, args.batch)
    images = method.student_norm(batch["images"])
    anchor = anchor_step(timm.create_model(STUDENT, num_classes=10), teacher, images, dtype)
    times = round_robin({"ours": method_step(method, batch, dtype), "anchor": anchor}, args.rounds, CPU, warmup=1)
    ours, theirs = times["ours"], times["anchor"]
    median, q1, q3 = ratio_stats(theirs, ours)
    rate = args.batch / float(np.median(ours))
    anchor_rate = args.batch / float(np.median(theirs))
    return [
        ["distill", dtype, f"{rate:.2f}", f"{median:.2f} [{q1:.2f}-{q3:.2f}]", f"{memory:.0f}", f"{reading:.2f}"],
        ["timm FeatureDistillationTask", dtype, f"{anchor_rate:.2f}", "1.00", "", ""],
    ]


def dinov3_rows(args: argparse.Namespace, files: list[Path], dtype: str) -> list[list[str]]:
    torch.manual_seed(0)
    settings = SSLSettings(
        steps=10, global_size=args.size, local_crops=args.local_crops, prototypes=args.prototypes, gram=args.gram
    )
    method = DINOv3(timm.create_model(STUDENT, num_classes=0), settings)
    batch = make_batch(method, files, args.batch, seed=0, step=0)
    memory = peak_memory_mib(method_step(method, batch, dtype), CPU)
    ours = round_robin({"ours": method_step(method, batch, dtype)}, args.rounds, CPU, warmup=1)["ours"]
    reading = data_seconds(method, files, args.batch)
    rate = args.batch / float(np.median(ours))
    name = "dinov3 + gram" if args.gram else "dinov3"
    return [[name, dtype, f"{rate:.2f}", "", f"{memory:.0f}", f"{reading:.2f}"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-crops", type=int, default=8)
    parser.add_argument("--prototypes", type=int, default=65536)
    parser.add_argument("--gram", action="store_true", help="dinov3 with Gram anchoring")
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--methods", nargs="+", choices=["distill", "dinov3"], default=["distill", "dinov3"])
    add_machine_args(parser)
    args = parser.parse_args()
    apply_machine_args(args)
    rows = [["method", "autocast", "images/s", "anchor / ours [quartiles]", "peak MiB", "data s/batch"]]
    with tempfile.TemporaryDirectory() as folder:
        files = render(Path(folder), max(args.batch, 2), 2 * args.size)
        for dtype in args.dtypes:
            if "distill" in args.methods:
                rows += distill_rows(args, files, dtype)
            if "dinov3" in args.methods:
                rows += dinov3_rows(args, files, dtype)
    print(header(f"Pretraining steps (student {STUDENT}, teacher {TEACHER}, batch {args.batch} at {args.size}px)"))
    print(f"bf16 matrix units: {bf16_matrix_path(cpu_flags())}; {args.rounds} steps after one warm-up")
    print(markdown(rows))


if __name__ == "__main__":
    main()
