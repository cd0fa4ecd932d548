"""CPU inference in bf16 and fp32 against timm's eva DINOv3 and a plain timm ViT: the whole grid in one process.

    python -m benchmarks.cpu_speed                  # ViT-S/16 and ViT-B/16, 224 and 512 px, batch 1 and 4,
                                                    # 1 and 2 threads, bf16 and fp32, eager
    python -m benchmarks.cpu_speed --variants small --sizes 224 --batches 1 --threads 1 --rounds 3   # quick
    python -m benchmarks.cpu_speed --compile        # also ours and eva through torch.compile (inductor)
    python -m benchmarks.cpu_speed --families       # EUPE-T, LingBot-S and Sapiens2-B against eva, bf16

bf16 is what a user gets from `model.to(torch.bfloat16).eval()` with a bf16 input under
`torch.inference_mode()`. Ours and eva carry one set of random weights off their init (`build_trio`); the
plain ViT (`vit_*_patch16_224`, `dynamic_img_size=True`: 197 tokens at 224 px against our 201) draws its own.
Each round runs every model once (and a bare GEMM), the order rotating from round to round; each call is
timed on the process's CPU clock and on the wall clock. Quoted per point: the median ms of each, the
speed-up of ours (anchor time / ours, median of the per-round ratios, with quartiles), the roofline fraction
of ours (the FLOPs of its linears, counted by `FlopCounterMode` as addmm/mm/bmm, over the rate of a
`torch.matmul` of tokens x C by C x 4C in the same dtype, timed in the same rounds) and, in bf16, each
model's error against itself in fp32 (relative Frobenius norm of the patch tokens of `forward_features` and
of the pooled output). Targets are judged on the `--judge` clock (CPU time by default: on a shared machine
it counts only what this process ran).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone

import timm
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from timm_ls.cpu import REPORTED_FLAGS, bf16_matrix_path, cpu_flags, cpu_model

from . import families as family_anchors
from .common import EVA, OURS, build_trio, markdown, median_ms, randomise_, ratio_stats, round_robin

PLAIN, GEMM = "plain ViT", "gemm"
PLAIN_NAMES = {"small": "vit_small_patch16_224", "base": "vit_base_patch16_224"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LINEAR_OPS = ("aten.addmm", "aten.mm", "aten.bmm")
COMPILED = " compiled"
# (what, threshold); see `targets`
BF16_VS_EVA, BF16_VS_PLAIN, ROOFLINE, FP32_VS_EVA, FP32_VS_EVA_Q1, COMPILED_VS_EVA = 1.2, 1.0, 0.65, 1.05, 1.0, 1.0
ROOFLINE_POINT = ("base", 224, 4)  # (variant, px, batch) where the roofline target holds


# ------------------------------------------------------------------------------------------------ models


def build_grid_models(variant: str) -> dict[str, nn.Module]:
    """Ours, eva (one set of weights) and the plain ViT, fp32, eval mode."""
    trio = build_trio(variant, torch.device("cpu"), {})
    torch.manual_seed(1)
    plain = timm.create_model(PLAIN_NAMES[variant], num_classes=0, dynamic_img_size=True)
    return {OURS: trio[OURS], EVA: trio[EVA], PLAIN: randomise_(plain, seed=1).eval()}


def cast(models: dict[str, nn.Module], dtype: torch.dtype, compile_: bool) -> dict[str, nn.Module]:
    """Copies in `dtype` as a user casts them, and compiled copies of ours and eva when asked."""
    cast_models = {name: copy.deepcopy(m).to(dtype).eval() for name, m in models.items()}
    if compile_:
        cast_models.update({name + COMPILED: torch.compile(cast_models[name], dynamic=False) for name in (OURS, EVA)})
    return cast_models


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


@torch.inference_mode()
def fidelity(model32: nn.Module, model16: nn.Module, x32: torch.Tensor) -> tuple[float, float]:
    """bf16 against fp32 of one model: patch tokens of `forward_features`, then the pooled output."""
    prefix = model32.num_prefix_tokens
    tokens32, tokens16 = model32.forward_features(x32), model16.forward_features(x32.to(torch.bfloat16))
    pooled = relative_error(model16(x32.to(torch.bfloat16)), model32(x32))
    return relative_error(tokens16[:, prefix:], tokens32[:, prefix:]), pooled


def linear_flops(model: nn.Module, x: torch.Tensor) -> int:
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(x)
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in LINEAR_OPS)


# ------------------------------------------------------------------------------------------------ timing


def both_clocks(calls: dict[str, Callable[[], object]]) -> tuple[Callable, dict[str, list[float]]]:
    """A `round_robin` timer returning each call's process CPU time and keeping its wall time aside."""
    wall: dict[str, list[float]] = {name: [] for name in calls}
    name_of = {id(call): name for name, call in calls.items()}

    def timer(call: Callable[[], object]) -> float:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        call()
        cpu_end, wall_end = time.process_time(), time.perf_counter()
        wall[name_of[id(call)]].append(wall_end - wall_start)
        return cpu_end - cpu_start

    return timer, wall


@torch.inference_mode()
def time_calls(calls: dict[str, Callable[[], object]], rounds: int, warmup: int) -> dict[str, dict[str, list]]:
    """Seconds per call on each clock: {"process": {name: [...]}, "wall": {name: [...]}}."""
    timer, wall = both_clocks(calls)
    process = round_robin(calls, rounds, torch.device("cpu"), warmup=warmup, timer=timer)
    return {"process": process, "wall": wall}


def gemm_call(tokens: int, dim: int, dtype: torch.dtype) -> tuple[Callable[[], object], int]:
    """A linear's GEMM of this many tokens (tokens x C by C x 4C, the weight transposed as `linear` holds
    it) and its FLOPs."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(tokens, dim, generator=generator).to(dtype)
    w = torch.randn(4 * dim, dim, generator=generator).to(dtype)
    return (lambda: torch.matmul(a, w.t())), 2 * tokens * dim * 4 * dim


def speedups(times: dict[str, list[float]], ours: str, anchor: str) -> tuple[float, float, float]:
    """anchor / ours: median and quartiles of the per-round ratios (above 1, ours is faster)."""
    return ratio_stats(times[anchor], times[ours])


def roofline(times: dict[str, list[float]], flops: int, gemm_flops: int) -> float:
    ours_rate = [flops / t for t in times[OURS]]
    gemm_rate = [gemm_flops / t for t in times[GEMM]]
    return ratio_stats(ours_rate, gemm_rate)[0]


# ------------------------------------------------------------------------------------------------ one point


def grid_point(models, reference, variant, dtype_name, size, batch, threads, args, fidelity_cache) -> dict:
    """Times, FLOPs and bf16 fidelity of one point of the grid."""
    torch.set_num_threads(threads)
    dtype = DTYPES[dtype_name]
    x32 = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(size + batch))
    x = x32.to(dtype)
    calls = {name: (lambda model=model, x=x: model(x)) for name, model in models.items()}
    ours = models[OURS]
    tokens = batch * (ours.num_prefix_tokens + (size // ours.get_patch_size()[0]) ** 2)
    calls[GEMM], gemm_flops = gemm_call(tokens, ours.embed_dim, dtype)
    key = (variant, size, batch)
    if dtype_name == "bf16" and key not in fidelity_cache:
        fidelity_cache[key] = {name: fidelity(reference[name], models[name], x32) for name in (OURS, EVA)}
    return dict(
        point=(variant, size, batch, threads, dtype_name),
        times=time_calls(calls, args.rounds, args.warmup),
        flops=linear_flops(ours, x),
        gemm_flops=gemm_flops,
        fidelity=fidelity_cache.get(key) if dtype_name == "bf16" else None,
    )


def fmt_ratio(stats: tuple[float, float, float]) -> str:
    return f"{stats[0]:.2f} [{stats[1]:.2f}-{stats[2]:.2f}]"


def fmt_fidelity(fid: dict | None) -> list[str]:
    if fid is None:
        return ["-", "-"]
    return [" / ".join(f"{fid[name][i]:.1e}" for name in (OURS, EVA)) for i in (0, 1)]


def point_rows(result: dict) -> list[list[str]]:
    """The eager row of a point, and the compiled one where there is one."""
    variant, size, batch, threads, dtype_name = result["point"]
    process, wall = result["times"]["process"], result["times"]["wall"]
    rows = []
    for suffix in ("", COMPILED) if OURS + COMPILED in process else ("",):
        ours, eva = OURS + suffix, EVA + suffix
        names = (ours, eva) + (() if suffix else (PLAIN,))
        ms = [" / ".join(f"{median_ms(clock[n]):.1f}" for n in names) for clock in (process, wall)]
        vs_plain = [fmt_ratio(speedups(clock, ours, PLAIN)) if not suffix else "-" for clock in (process, wall)]
        fraction = roofline(process, result["flops"], result["gemm_flops"]) if not suffix else None
        rows.append(
            [
                variant,
                str(size),
                str(batch),
                str(threads),
                dtype_name,
                "compiled" if suffix else "eager",
                *ms,
                fmt_ratio(speedups(process, ours, eva)),
                vs_plain[0],
                fmt_ratio(speedups(wall, ours, eva)),
                vs_plain[1],
                "-" if fraction is None else f"{fraction:.2f}",
                *fmt_fidelity(result["fidelity"] if not suffix else None),
            ]
        )
    return rows


GRID_HEADER = [
    "variant",
    "px",
    "batch",
    "threads",
    "dtype",
    "mode",
    "CPU ms ours / eva / plain",
    "wall ms ours / eva / plain",
    "eva/ours CPU [q1-q3]",
    "plain/ours CPU [q1-q3]",
    "eva/ours wall [q1-q3]",
    "plain/ours wall [q1-q3]",
    "roofline (CPU)",
    "bf16 err tokens ours / eva",
    "bf16 err pooled ours / eva",
]


# ------------------------------------------------------------------------------------------------ targets


def targets(result: dict, judge: str) -> list[tuple[str, float, float]]:
    """(what, measured, threshold) for every target that applies to this point."""
    variant, size, batch, threads, dtype_name = result["point"]
    times = result["times"][judge]
    where = f"{variant} {size}px batch {batch} {threads}T {dtype_name}"
    checks = []
    if dtype_name == "bf16":
        checks.append((f"{where}: eva/ours", speedups(times, OURS, EVA)[0], BF16_VS_EVA))
        checks.append((f"{where}: plain/ours", speedups(times, OURS, PLAIN)[0], BF16_VS_PLAIN))
        if (variant, size, batch) == ROOFLINE_POINT:
            checks.append((f"{where}: roofline", roofline(times, result["flops"], result["gemm_flops"]), ROOFLINE))
    else:
        median, q1, _ = speedups(times, OURS, EVA)
        checks += [(f"{where}: eva/ours", median, FP32_VS_EVA), (f"{where}: eva/ours q1", q1, FP32_VS_EVA_Q1)]
    if OURS + COMPILED in times:
        checks.append(
            (f"{where}: compiled eva/ours", speedups(times, OURS + COMPILED, EVA + COMPILED)[0], COMPILED_VS_EVA)
        )
    return checks


def print_targets(checks: list[tuple[str, float, float]], judge: str) -> None:
    print(f"\nTargets ({judge} clock):")
    for what, measured, threshold in checks:
        print(f"- {'PASS' if measured >= threshold else 'FAIL'} {what} {measured:.2f} (target >= {threshold})")
    met = sum(measured >= threshold for _, measured, threshold in checks)
    print(f"{met} of {len(checks)} targets met")


# ------------------------------------------------------------------------------------------------ families


def family_rows(name: str, args: argparse.Namespace, checks: list) -> list[list[str]]:
    """One family in bf16 against eva's architecture of it, at each batch and thread count."""
    reference = {key: m for key, m in family_anchors.build(name).items() if key in (OURS, EVA)}
    models = cast(reference, torch.bfloat16, compile_=False)
    height, width = family_anchors.FAMILIES[name][2]
    rows = []
    for batch in args.batches:
        x32 = torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(batch))
        x = x32.to(torch.bfloat16)
        fid = {key: fidelity(reference[key], models[key], x32) for key in (OURS, EVA)}
        calls = {key: (lambda model=model, x=x: model(x)) for key, model in models.items()}
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = time_calls(calls, args.rounds, args.warmup)
            process, wall = times["process"], times["wall"]
            ms = [" / ".join(f"{median_ms(clock[n]):.1f}" for n in (OURS, EVA)) for clock in (process, wall)]
            vs_eva = [speedups(clock, OURS, EVA) for clock in (process, wall)]
            where = f"{name} {height}x{width} batch {batch} {threads}T bf16"
            checks.append((f"{where}: eva/ours", speedups(times[args.judge], OURS, EVA)[0], BF16_VS_EVA))
            size = f"{height}x{width}"
            rows.append([name, size, str(batch), str(threads), *ms, *map(fmt_ratio, vs_eva), *fmt_fidelity(fid)])
    return rows


FAMILY_HEADER = [
    "family",
    "input",
    "batch",
    "threads",
    "CPU ms ours / eva",
    "wall ms ours / eva",
    "eva/ours CPU [q1-q3]",
    "eva/ours wall [q1-q3]",
    "bf16 err tokens ours / eva",
    "bf16 err pooled ours / eva",
]


# ------------------------------------------------------------------------------------------------ the run


def machine_lines(default_threads: int) -> str:
    flags = cpu_flags()
    found = ", ".join(f for f in REPORTED_FLAGS if f in flags) or "none of them"
    return (
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu_model()}, {default_threads} torch threads "
        f"by default, load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}\n"
        f"CPU flags: {found} (of {', '.join(REPORTED_FLAGS)}); bf16 matrix path: {bf16_matrix_path(flags)}\n"
        f"torch {torch.__version__}, timm {timm.__version__}, Python {platform.python_version()}"
    )


def run_grid(args: argparse.Namespace, checks: list) -> list[list[str]]:
    rows, fidelity_cache = [GRID_HEADER], {}
    for variant in args.variants:
        reference = build_grid_models(variant)
        for threads in args.threads:
            if args.compile:
                torch._dynamo.reset()  # inductor's CPU kernels keep the thread count they were compiled with
            for dtype_name in args.dtypes:
                models = cast(reference, DTYPES[dtype_name], args.compile)
                for size in args.sizes:
                    for batch in args.batches:
                        result = grid_point(
                            models, reference, variant, dtype_name, size, batch, threads, args, fidelity_cache
                        )
                        rows += point_rows(result)
                        checks += targets(result, args.judge)
                del models
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(PLAIN_NAMES), default=list(PLAIN_NAMES))
    parser.add_argument("--sizes", nargs="+", type=int, default=[224, 512])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch.set_num_threads values")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds per point (median over them)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls of each model first")
    parser.add_argument("--compile", action="store_true", help="also ours and eva through torch.compile")
    parser.add_argument(
        "--families", action="store_true", help="EUPE-T, LingBot-S and Sapiens2-B in bf16 against eva instead"
    )
    parser.add_argument("--judge", choices=["process", "wall"], default="process", help="the clock of the targets")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    default_threads = torch.get_num_threads()
    # one static graph per shape and dtype, for each of ours and eva: more than dynamo's default 8 per forward
    torch._dynamo.config.recompile_limit = 64
    checks: list[tuple[str, float, float]] = []
    if args.families:
        rows = [FAMILY_HEADER]
        for name in family_anchors.FAMILIES:
            rows += family_rows(name, args, checks)
        what = "the families in bf16 against eva"
    else:
        rows = run_grid(args, checks)
        what = "ours against eva and a plain ViT"
    print(f"CPU inference, {what}: {args.rounds} rounds, median (`python -m benchmarks.cpu_speed`)")
    print(machine_lines(default_threads))
    print(markdown(rows))
    print_targets(checks, args.judge)


if __name__ == "__main__":
    main()
