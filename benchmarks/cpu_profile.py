"""Where a CPU forward spends its time: copies, dtype conversions and the matmul share, ours against eva and
a plain ViT at one shape and dtype.

    python -m benchmarks.cpu_profile                                  # ViT-S/16, 224 px, batch 1, bf16, 1 thread
    python -m benchmarks.cpu_profile --variant base --batch 4 --dtype fp32 --threads 2

The models are those of `benchmarks.cpu_speed` (ours and eva with one set of weights, the plain timm ViT),
cast as a user casts them, under `torch.inference_mode()`. `torch.profiler` records --forwards calls of
each after a warm-up call; quoted per forward: how often `aten::copy_`, `aten::to`, `aten::_to_copy` and
`aten::clone` ran (nested calls included: a `_to_copy` runs a `copy_`), and the shares of self CPU time in
the matmuls (addmm, mm, bmm, linear, matmul and oneDNN's ops), in attention (SDPA's kernels) and in
everything else, whose largest ops are named.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from .common import EVA, OURS, markdown
from .cpu_speed import DTYPES, PLAIN, PLAIN_NAMES, build_grid_models, cast, machine_lines

COUNTED = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone")
MATMUL = ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul")
TOP_REST = 4


def kind(key: str) -> str:
    if key in MATMUL or "mkldnn" in key:
        return "matmul"
    if "scaled_dot_product" in key:
        return "attention"
    return "rest"


@torch.inference_mode()
def profile_row(name: str, model: nn.Module, x: torch.Tensor, forwards: int) -> list[str]:
    model(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            model(x)
    events = prof.key_averages()
    counts = {e.key: e.count / forwards for e in events}
    self_us = {"matmul": 0.0, "attention": 0.0, "rest": 0.0}
    rest = []
    for e in events:
        self_us[kind(e.key)] += e.self_cpu_time_total
        if kind(e.key) == "rest":
            rest.append((e.self_cpu_time_total, e.key))
    total = sum(self_us.values())
    top = ", ".join(f"{key.removeprefix('aten::')} {us / total:.0%}" for us, key in sorted(rest)[::-1][:TOP_REST])
    return [
        name,
        f"{total / forwards / 1000:.1f}",
        *(f"{counts.get(op, 0):g}" for op in COUNTED),
        *(f"{self_us[k] / total:.0%}" for k in ("matmul", "attention", "rest")),
        top,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(PLAIN_NAMES), default="small")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--forwards", type=int, default=3, help="profiled forwards per model")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    models = cast(build_grid_models(args.variant), DTYPES[args.dtype], compile_=False)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    x = x.to(DTYPES[args.dtype])
    rows = [
        [
            "model",
            "self CPU ms / forward",
            *(f"{op.removeprefix('aten::')} / forward" for op in COUNTED),
            "matmul share",
            "attention share",
            "rest share",
            f"largest of the rest (top {TOP_REST})",
        ]
    ]
    rows += [profile_row(name, models[name], x, args.forwards) for name in (OURS, EVA, PLAIN)]
    print(
        f"CPU profile, {args.variant} {args.size}px batch {args.batch} {args.dtype}, {args.threads} thread(s), "
        f"{args.forwards} forwards (`python -m benchmarks.cpu_profile`)"
    )
    print(machine_lines(default_threads))
    print(markdown(rows))


if __name__ == "__main__":
    main()
