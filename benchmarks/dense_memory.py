"""Dense features at large sides: time and peak memory of one `forward_features` on a CPU, in one run.

    python -m benchmarks.dense_memory                                   # 512, 1024, 2048; 3 rounds
    python -m benchmarks.dense_memory --rounds 3 --rounds-at 1024=2 2048=1   # as in BENCHMARKS.md

Ours (`vit_ls_{small,base}_patch16_dinov3`), timm's eva (`vit_{small,base}_patch16_dinov3`) and
transformers' `DINOv3ViTModel` (SDPA attention) carry one set of weights (`common.build_trio`). Each
measurement runs in a fresh subprocess, so no allocator cache, no earlier peak and no other model's memory
hides or inflates it: the child builds the three models, keeps the one it measures, hands the rest back to
the system, reads its anonymous resident memory (`RssAnon` in /proc/self/status) as the baseline, then runs
one forward (fp32, batch 1, no grad) while a thread samples `RssAnon` every millisecond. The figures are the
medians over the rounds of the wall time, the process CPU time and the peak above the baseline. The models
take turns within a round, the order rotating.

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


def child(variant: str, name: str, side: int) -> dict[str, float]:
    """One measurement, in this process alone: peak RssAnon above the RSS after loading, and the times."""
    models = build_trio(variant, torch.device("cpu"), {})
    model = models.pop(name)
    del models
    x = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(side))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    loaded = rss_anon_mib()
    times = {}

    @torch.inference_mode()
    def call() -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        forward(name, model, x)
        times.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)

    peak = peak_memory_mib(call, torch.device("cpu"))
    return dict(peak_mib=peak, loaded_mib=loaded, **times)


def measure(variant: str, name: str, side: int) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.dense_memory", "--child", variant, name, str(side)]
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
                    found = measure(variant, name, side)
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
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "MODEL", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, name, side = args.child
        print(json.dumps(child(variant, name, int(side))))
        return
    args.rounds_at = {int(k): int(v) for k, _, v in (item.partition("=") for item in args.rounds_at)}
    print(header("Dense features: one forward_features, fp32, batch 1, CPU"), flush=True)
    results = run_all(args)
    print(table(results))
    loaded = {(v, n): statistics.median(f["loaded_mib"] for f in found) for (v, _, n), found in results.items()}
    print("RSS after loading (MiB): " + ", ".join(f"{v} {n} {m:.0f}" for (v, n), m in loaded.items()))
    a, b = fit(results)
    print(f"fit, ours: peak MiB = {a:.0f} + {b:.1f} * tokens * embed_dim / 2**20 ({b:.1f} bytes per token-channel)")


if __name__ == "__main__":
    main()
