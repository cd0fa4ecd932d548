"""Inference speed, peak memory and bf16 error against timm eva and transformers, measured in one run.

    python -m benchmarks.forward                      # CPU fp32: small and base, batch 1 and 8, 224 px
    python -m benchmarks.forward --device cuda --dtype bfloat16 --variants small base large \\
        --sizes 224 512 --batches 64 --compile

Per point it prints each model's median time, the speed-up of ours over each anchor (anchor time / our
time, the median of per-round ratios, with quartiles), the rate of ours in FLOP/s as a fraction of this
CPU's fp32 GEMM rate (a large matmul timed in the same rounds) or of the GPU's dense peak, peak memory
above the weights, the attention kernel each model ran, and each model's largest output error against
our fp32 output (Meta's, exactly). The target is a speed-up of at least --target over the faster anchor
(the one with the lower median time); a point that misses it gets the profile's top lines. All three
models carry the same weights.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from torch.utils.flop_counter import FlopCounterMode

from .common import (
    EVA,
    HF,
    OURS,
    add_machine_args,
    apply_machine_args,
    build_models,
    features,
    header,
    markdown,
    median_ms,
    peak_memory_mib,
    profile_top,
    ratio_stats,
    round_robin,
)

GEMM_SIDE = 1024
DENSE_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # vendor peaks, no sparsity


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((tflops for gpu, tflops in DENSE_BF16_TFLOPS.items() if gpu in name), None)


def attention_kernel(call) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    names = {e.key.removeprefix("aten::_") for e in prof.key_averages() if "scaled_dot_product" in e.key}
    inner = [n for n in names if n != "aten::scaled_dot_product_attention"]
    return ", ".join(sorted(inner)) or "none (no SDPA)"


@torch.inference_mode()
def run_point(models, variant, batch, size, args, device, dtype, reference_models):
    x32 = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch + size)).to(device)
    reference = features(OURS, reference_models[OURS], x32).float()
    x = x32.to(dtype)
    calls = {
        name: lambda name=name, model=model: features(name.removesuffix(" compiled"), model, x)
        for name, model in models.items()
    }
    if device.type == "cpu" and dtype == torch.float32:
        a, b = torch.randn(GEMM_SIDE, GEMM_SIDE), torch.randn(GEMM_SIDE, GEMM_SIDE)
        calls["gemm"] = lambda: torch.mm(a, b)
    with FlopCounterMode(display=False) as counter:
        calls[OURS]()
    flops = counter.get_total_flops()
    times = round_robin(calls, args.rounds, device)

    rows, misses = [], []
    for suffix in ["", " compiled"] if args.compile else [""]:
        ours, eva, hf = OURS + suffix, EVA + suffix, HF + suffix
        vs_eva, vs_hf = ratio_stats(times[eva], times[ours]), ratio_stats(times[hf], times[ours])
        faster = eva if median_ms(times[eva]) <= median_ms(times[hf]) else hf
        vs_faster = vs_eva if faster == eva else vs_hf
        ms = {n: median_ms(times[n]) for n in (ours, eva, hf)}
        ours_rate = [flops / t for t in times[ours]]
        if "gemm" in times:
            gemm_rate = [2 * GEMM_SIDE**3 / t for t in times["gemm"]]
            rate = f"{ratio_stats(ours_rate, gemm_rate)[0]:.0%} of GEMM"
        elif peak := peak_tflops(device, args.peak_tflops):
            rate = f"{statistics.median(ours_rate) / 1e12 / peak:.0%} MFU"
        else:
            rate = f"{statistics.median(ours_rate) / 1e9:.0f} GFLOP/s"
        memory = [peak_memory_mib(calls[n], device) for n in (ours, eva, hf)]
        errors = [
            (features(n.removesuffix(suffix), models[n], x).float() - reference).abs().max().item()
            for n in (ours, eva, hf)
        ]
        met = vs_faster[0] >= args.target
        rows.append(
            [
                variant,
                str(batch),
                str(size),
                "compiled" if suffix else "eager",
                *(f"{ms[n]:.1f}" for n in (ours, eva, hf)),
                f"{vs_eva[0]:.2f}",
                f"{vs_hf[0]:.2f}",
                f"{vs_faster[0]:.2f} [{vs_faster[1]:.2f}-{vs_faster[2]:.2f}] {'eva' if faster == eva else 'tf'}"
                + ("" if met else " MISS"),
                rate,
                " / ".join(f"{m:.0f}" for m in memory),
                " / ".join(f"{e:.1e}" for e in errors),
            ]
        )
        if not met:
            misses.append((f"{variant} batch {batch} {size}px {rows[-1][3]}", calls[ours], faster, calls[faster]))
    kernels = {n: attention_kernel(calls[n]) for n in (OURS, EVA, HF)}
    return rows, misses, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=["small", "base", "large"], default=["small", "base"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--sizes", nargs="+", type=int, default=[224])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd copies of all three")
    parser.add_argument("--target", type=float, help="speed-up over the faster anchor to meet (CPU 1.0, GPU 1.15)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense peak for MFU, if not in the table")
    add_machine_args(parser)
    args = parser.parse_args()
    apply_machine_args(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    args.target = args.target or (1.15 if device.type == "cuda" else 1.0)

    rows = [
        [
            "variant",
            "batch",
            "px",
            "mode",
            "ours ms",
            "eva ms",
            "transformers ms",
            "eva / ours",
            "transformers / ours",
            "faster anchor / ours [quartiles]",
            "ours rate",
            "peak MiB ours / eva / tf",
            "max err vs fp32 ours / eva / tf",
        ]
    ]
    misses, kernels = [], {}
    for variant in args.variants:
        reference = {name: m.eval().to(device) for name, m in build_models(variant).items()}
        models = {name: copy.deepcopy(m).to(dtype) for name, m in reference.items()}
        if dtype == torch.float32:
            reference = models
        if args.compile:
            models.update({f"{name} compiled": torch.compile(m) for name, m in list(models.items())})
        for size in args.sizes:
            for batch in args.batches:
                point_rows, point_misses, kernels[variant, size] = run_point(
                    models, variant, batch, size, args, device, dtype, reference
                )
                rows += point_rows
                misses += point_misses
        del models, reference
    print(header(f"Inference ({args.dtype} on {args.device}, {args.rounds} rounds)"))
    print(markdown(rows))
    for (variant, size), by_model in kernels.items():
        print(f"attention kernel, {variant} {size}px: " + "; ".join(f"{n}: {k}" for n, k in by_model.items()))
    with torch.inference_mode():
        for where, ours_call, anchor, anchor_call in misses:
            print(f"\nMISS at {where}: profile of ours, then of {anchor}")
            print(profile_top(ours_call, device))
            print(profile_top(anchor_call, device))


if __name__ == "__main__":
    main()
