"""`timm-ls probe` on a CPU: features per second, the probes' time, and the target case end to end.

    python -m benchmarks.probe                  # ViT-S/16 and ViT-B/16, fp32 and bf16 where the CPU has the units
    python -m benchmarks.probe --variants small --images 1000

1. Features per second: `probe.extract_features` (PNG decode, timm's eval transform at 224 px, batched
   `forward_intermediates` under inference_mode) on `--throughput-images` images, random weights, after one
   warm-up batch; bf16 only where /proc/cpuinfo lists `avx512_bf16` or `amx_bf16`.
2. The target case: `timm-ls probe DATA --model vit_ls_small_patch16_dinov3 --out DIR` in a fresh process on
   `--images` images (the demo's shapes drawn at 112 px, 80% train, 20% val, six classes), the data config set
   to 224 px, Meta's settings (kNN k 10/20/100/200, logistic regression over 45 C values, L-BFGS 1,000
   iterations at tol 1e-12); wall time of the whole command, and its results.json's times for the features, the
   kNN and the logistic regression. The goal: under 3 minutes on 2 cores, feature extraction included. It runs
   in bf16 where the CPU has the units (`--target-dtype` to choose).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timm
import torch
from PIL import Image

from timm_layerscale.probe import classification_transform, extract_features
from timm_layerscale.tools.shapes import CLASSES, ShapesSpec, draw_shapes

from .common import header, markdown

NAMES = {"small": "vit_ls_small_patch16_dinov3", "base": "vit_ls_base_patch16_dinov3"}
SIZE = 224
OVERLAY = f"pretrained_cfg_overlay={{'input_size': (3, {SIZE}, {SIZE})}}"
GOAL_S = 180


def bf16_units() -> list[str]:
    """The bf16 flags /proc/cpuinfo lists (empty where it lists none, or there is no such file)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags.split()]


def write_shapes(root: Path, count: int, train_fraction: float = 0.8, side: int = 112) -> list[Path]:
    """`root/{train,val}/<shape>/NNNN.png`, drawn 200 at a time (bounded memory); the paths written."""
    spec, paths, written = ShapesSpec(image_size=side), [], 0
    while written < count:
        n = min(200, count - written)
        images, labels = draw_shapes(n, spec, seed=written)
        pixels = ((images * 0.3 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        for picture, label in zip(pixels, labels.tolist()):
            split = "train" if written < train_fraction * count else "val"
            folder = root / split / CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            paths.append(folder / f"{written:04d}.png")
            Image.fromarray(picture).save(paths[-1])
            written += 1
    return paths


def throughput(variant: str, dtype: torch.dtype, paths: list[Path], batch: int) -> float:
    """Images per second through `extract_features` (decode, transform, forward), after a warm-up batch."""
    torch.manual_seed(0)
    model = timm.create_model(NAMES[variant], pretrained_cfg_overlay={"input_size": (3, SIZE, SIZE)}).eval()
    transform = classification_transform(model)
    model.to(dtype)
    last = len(model.blocks) - 1
    extract_features(model, paths[:batch], transform, [last], batch=batch, progress=False)
    start = time.perf_counter()
    extract_features(model, paths, transform, [last], batch=batch, progress=False)
    return len(paths) / (time.perf_counter() - start)


def _children_cpu() -> float:
    """User and system CPU seconds of the finished child processes: on a shared machine, what the run cost."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def target_case(data: Path, out: Path, threads: int, dtype: str) -> dict:
    """The command in a fresh process: its wall time and results.json's times."""
    command = [sys.executable, "-c", "import sys; from timm_ls.main import main; sys.exit(main())", "probe"]
    command += [str(data), "--model", NAMES["small"]]
    command += ["--model-kwargs", OVERLAY, "--dtype", dtype, "--threads", str(threads), "--out", str(out)]
    start, cpu_before = time.perf_counter(), _children_cpu()
    done = subprocess.run(command, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu_before
    if done.returncode:
        raise SystemExit(f"the probe failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    return {
        "wall": wall,
        "cpu": cpu,
        "stdout": done.stdout,
        **row["times_s"],
        "unconverged": row["logreg"]["unconverged_fits"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["small", "base"], choices=sorted(NAMES))
    parser.add_argument("--throughput-images", type=int, default=64)
    parser.add_argument("--images", type=int, default=1000, help="the target case's images")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target-dtype", choices=["fp32", "bf16"], help="default: bf16 where the CPU has the units")
    parser.add_argument("--no-throughput", action="store_true", help="the target case alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    units = bf16_units()
    print(header(f"probe on CPU, {args.threads} torch threads; bf16 units: {', '.join(units) or 'none'}"))
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    dtypes = {"fp32": torch.float32, **({"bf16": torch.bfloat16} if units else {})}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        paths = write_shapes(root / "throughput", args.throughput_images, train_fraction=1.0)
        rows = [["model", "dtype", "batch", "images/s"]]
        for variant in [] if args.no_throughput else args.variants:
            for name, dtype in dtypes.items():
                batch = 32 if variant == "small" else 16
                rows.append(
                    [
                        f"ViT-{variant[0].upper()}/16",
                        name,
                        str(batch),
                        f"{throughput(variant, dtype, paths, batch):.1f}",
                    ]
                )
                print(" ".join(rows[-1]), flush=True)
        if len(rows) > 1:
            print(markdown(rows))
        write_shapes(root / "data", args.images)
        target_dtype = args.target_dtype or ("bf16" if units else "fp32")
        found = target_case(root / "data", root / "out", args.threads, target_dtype)
    print(found.pop("stdout"))
    verdict = "under" if found["wall"] < GOAL_S else "OVER"
    print(
        f"target: {args.images} images, ViT-S/16 {target_dtype} at {SIZE} px, kNN + logistic regression: "
        f"{found['wall']:.1f} s wall ({verdict} {GOAL_S} s), {found['cpu']:.1f} CPU s; features "
        f"{found['features']:.1f} s, kNN {found['knn']:.2f} s, logistic regression {found['logreg']:.1f} s "
        f"({found['unconverged']} fits stopped at the iteration limit)"
    )
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
