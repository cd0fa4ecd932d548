"""Dense features at large sides: time and peak memory of one `forward_features` on a CPU, in one run.

    python -m benchmarks.dense_memory                                   # 512, 1024, 2048; 3 rounds
    python -m benchmarks.dense_memory --rounds 3 --rounds-at 1024=2 2048=1   # as in BENCHMARKS.md
    python -m benchmarks.dense_memory --dtype bf16 --grad no_grad --threads 1 --malloc mmap

Ours (`vit_ls_{small,base}_patch16_dinov3`), timm's eva (`vit_{small,base}_patch16_dinov3`) and
transformers' `DINOv3ViTModel` (SDPA attention) carry one set of weights (`common.build_trio`). Each
measurement runs in a fresh subprocess, so no allocator cache, no earlier peak and no other model's memory
hides or inflates it: the child builds the three models, keeps the one it measures, hands the rest back to
the system, reads its anonymous resident memory (`RssAnon` in /proc/self/status) as the baseline, then runs
one forward (batch 1; fp32 or bf16, under `torch.inference_mode()` or `torch.no_grad()`, on the torch threads
asked for) while a thread samples `RssAnon` every millisecond. The figures are the medians over the rounds of
the wall time, the process CPU time and the peak above the baseline. The models take turns within a round, the
order rotating.

What the peak counts depends on glibc's heap (`--malloc`). By default ("heap") the two dropped models leave
their weights' memory free in the heap, handed back to the system but kept by malloc: the forward's
temporaries are carved from it, and a page once touched stays resident until the next trim, so the peak is
every page any temporary touched, which depends on where malloc placed each size. "mmap" sets
`M_MMAP_THRESHOLD` to 128 KiB before anything is built: every tensor from 128 KiB up is its own mapping,
returned when it is freed, so the peak is what the forward holds at once, whatever the heap's history.

The last line fits `peak MiB = a + b * tokens * embed_dim / 2**20` to ours (least squares), the formula
`timm-ls features` counts a forward by (`timm_layerscale.tools.feature_memory.forward_bytes`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from .common import EVA, HF, OURS, build_trio, header, markdown, peak_memory_mib, rss_anon_mib

MODELS = (OURS, EVA, HF)
DIMS = {"small": 384, "base": 768}
PATCH = 16
PREFIX = 5  # the CLS token and 4 storage tokens


def forward(name: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every token, normed: each model's `forward_features`."""
    return model(pixel_values=x).last_hidden_state if name == HF else model.forward_features(x)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def keep_blocks(name: str, model: torch.nn.Module, depth: int) -> None:
    """The first `depth` blocks only: what a block holds at its peak is the same in every block."""
    if name == HF:
        model.model.layer = model.model.layer[:depth]
    else:
        model.blocks = model.blocks[:depth]


def child(variant: str, name: str, side: int, options: argparse.Namespace) -> dict[str, float]:
    """One measurement, in this process alone: peak RssAnon above the RSS after loading, and the times."""
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.malloc == "mmap" and not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused: --malloc mmap needs glibc")
    models = build_trio(variant, torch.device("cpu"), {})
    model = models.pop(name).to(DTYPES[options.dtype])
    del models
    if options.depth:
        keep_blocks(name, model, options.depth)
    x = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(side)).to(DTYPES[options.dtype])
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    loaded = rss_anon_mib()
    times = {}

    def call() -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        with GRAD_MODES[options.grad]():
            forward(name, model, x)
        times.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)

    peak = peak_memory_mib(call, torch.device("cpu"))
    return dict(peak_mib=peak, loaded_mib=loaded, **times)


def measure(variant: str, name: str, side: int, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.dense_memory", "--child", variant, name, str(side)]
    command += ["--dtype", args.dtype, "--grad", args.grad, "--malloc", args.malloc]
    command += ["--threads", str(args.threads)] if args.threads else []
    command += ["--depth", str(args.depth)] if args.depth else []
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_all(args: argparse.Namespace) -> dict[tuple[str, int, str], list[dict[str, float]]]:
    results: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    for variant in args.variants:
        for side in args.sides:
            for r in range(args.rounds_at.get(side, args.rounds)):
                for name in MODELS[r % 3 :] + MODELS[: r % 3]:
                    found = measure(variant, name, side, args)
                    results.setdefault((variant, side, name), []).append(found)
                    print(f"  {variant} {side} {name}: {found['wall']:.1f} s, {found['peak_mib']:.0f} MiB", flush=True)
    return results


def fit(results: dict[tuple[str, int, str], list[dict[str, float]]]) -> tuple[float, float]:
    """`a` MiB and `b` bytes per token and channel of ours' peak, least squares over every point."""
    rows = [
        ((side // PATCH) ** 2 + PREFIX) * DIMS[variant] / 2**20
        for (variant, side, name), found in results.items()
        if name == OURS
        for _ in found
    ]
    peaks = [f["peak_mib"] for (_, _, name), found in results.items() if name == OURS for f in found]
    a, b = np.linalg.lstsq(np.stack([np.ones(len(rows)), rows], 1), np.array(peaks), rcond=None)[0]
    return float(a), float(b)


def table(results: dict[tuple[str, int, str], list[dict[str, float]]]) -> str:
    rows = [["model", "side", "patches", "rounds", *(f"{n} s (CPU s)" for n in MODELS), *(f"{n} MiB" for n in MODELS)]]
    for variant, side in dict.fromkeys((v, s) for v, s, _ in results):
        got = [results[(variant, side, n)] for n in MODELS]
        med = [{k: statistics.median(f[k] for f in found) for k in ("wall", "cpu", "peak_mib")} for found in got]
        rows.append(
            [
                f"ViT-{variant[0].upper()}/16",
                str(side),
                str((side // PATCH) ** 2),
                str(len(got[0])),
                *(f"{m['wall']:.1f} ({m['cpu']:.0f})" for m in med),
                *(f"{m['peak_mib']:.0f}" for m in med),
            ]
        )
    return markdown(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["small", "base"], choices=sorted(DIMS))
    parser.add_argument("--sides", nargs="+", type=int, default=[512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per model and point")
    parser.add_argument(
        "--rounds-at", nargs="+", default=[], metavar="SIDE=N", help="fewer rounds at a side, e.g. 2048=1"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the model's and image's dtype")
    parser.add_argument("--grad", choices=sorted(GRAD_MODES), default="inference_mode", help="how grad is off")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--malloc", choices=["heap", "mmap"], default="heap", help="glibc as it comes, or a mapping per tensor"
    )
    parser.add_argument("--depth", type=int, help="run the first N blocks only (default: all)")
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "MODEL", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, name, side = args.child
        print(json.dumps(child(variant, name, int(side), args)))
        return
    args.rounds_at = {int(k): int(v) for k, _, v in (item.partition("=") for item in args.rounds_at)}
    what = f"{args.dtype}, {args.grad}, {args.threads or 'default'} threads, malloc {args.malloc}"
    what += f", first {args.depth} blocks" if args.depth else ""
    print(header(f"Dense features: one forward_features, batch 1, CPU, {what}"), flush=True)
    results = run_all(args)
    print(table(results))
    loaded = {(v, n): statistics.median(f["loaded_mib"] for f in found) for (v, _, n), found in results.items()}
    print("RSS after loading (MiB): " + ", ".join(f"{v} {n} {m:.0f}" for (v, n), m in loaded.items()))
    a, b = fit(results)
    print(f"fit, ours: peak MiB = {a:.0f} + {b:.1f} * tokens * embed_dim / 2**20 ({b:.1f} bytes per token-channel)")


if __name__ == "__main__":
    main()
