"""`timm-ls features`' memory count against the run's measured peak, in one run.

    python -m benchmarks.features_memory            # the cases below, each in a fresh process

Each case runs in its own subprocess: it makes its images (noise, drawn from a seed), parses the command's own
arguments, loads the model (`cli.features.load_model`) and plans the images from their headers, hands cached
memory back (`malloc_trim`), then runs the rest of the command (`tools.feature_run.write_feature_pictures`:
forwards, spool, PCA, pictures, the staged folder put in place) while a thread samples the process's `RssAnon`
every millisecond. The figure is the peak above the `RssAnon` before the run, beside what the command counted
for it (`tools.feature_run.need`); the goal is a count within 25% of the measured peak. The spooled features
are file pages (the page cache), not the process's anonymous memory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from timm_layerscale.cli import features
from timm_layerscale.tools import feature_pictures, feature_run
from timm_ls.main import parse
from timm_ls.model_source import ModelSource

from .common import header, markdown, peak_memory_mib

# name -> (images, their size, the command's arguments)
CASES = {
    "ViT-S/16, 40 images 320x240, default size, batch 8": (40, (320, 240), ["--model", "vit_ls_small_patch16_dinov3"]),
    "ViT-S/16, 4 images 1600x1200 at 1024, per image": (
        4,
        (1600, 1200),
        ["--model", "vit_ls_small_patch16_dinov3", "--size", "1024", "--batch", "1", "--per-image"],
    ),
    "ViT-B/16, 8 images 640x480 at 512, batch 4, foreground": (
        8,
        (640, 480),
        ["--model", "vit_ls_base_patch16_dinov3", "--size", "512", "--batch", "4", "--foreground"],
    ),
    "ViT-B/16, 6 images 800x600 at 768, bf16, batch 2, --save": (
        6,
        (800, 600),
        ["--model", "vit_ls_base_patch16_dinov3", "--dtype", "bf16", "--batch", "2", "--save"],
    ),
}


def child(case: str) -> dict[str, float]:
    count, (width, height), extra = CASES[case]
    root = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"im{i:03d}.png")
    args = parse(["features", str(root), "--out", str(root / "out"), *extra])
    torch.manual_seed(0)
    loaded = features.load_model(args.model, ModelSource.of(args))
    size = None if args.size == "native" else int(args.size)
    jobs = feature_pictures.measure_images(sorted(root.glob("*.png")), size, loaded.patch)
    device = torch.device("cpu")
    loaded.model.to(device, feature_run.DTYPES[args.dtype])  # cast first: the fp32 weights it frees would hide a peak
    settings = features.settings(args)
    counted = feature_run.need(loaded, jobs, settings, device).total
    with contextlib.redirect_stdout(io.StringIO()):
        measured = peak_memory_mib(
            lambda: feature_run.write_feature_pictures(loaded, jobs, Path(args.out), settings, device), device
        )
    return dict(counted=counted / 2**20, measured=measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child)))
        return
    print(header("timm-ls features: the memory count against the measured peak RssAnon, CPU"))
    rows = [["case", "counted MiB", "measured peak MiB", "counted / measured"]]
    for case in CASES:
        command = [sys.executable, "-m", "benchmarks.features_memory", "--child", case, "--threads", str(args.threads)]
        found = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        ratio = found["counted"] / found["measured"]
        rows.append([case, f"{found['counted']:.0f}", f"{found['measured']:.0f}", f"{ratio:.2f}"])
        print(rows[-1], file=sys.stderr)
    print(markdown(rows))


if __name__ == "__main__":
    main()
