"""Inference speed and peak memory against the two public anchors, measured in the same run.

    python benchmarks/forward.py [--variant small] [--batch 8] [--size 224] [--repeats 15] [--device cpu]

Prints median milliseconds per batch, the median per-round time ratio to ours (> 1: the anchor is slower)
and, on CUDA, peak memory. All three
models carry the same random weights (ours converts the anchors' state dict), so they do the same work.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import timm
import torch
import transformers
from transformers import DINOv3ViTConfig, DINOv3ViTModel

import timm_layerscale  # noqa: F401

logging.getLogger("timm_layerscale").setLevel(logging.ERROR)  # random weights trip the untrained-gamma warning

SHAPES = {
    "small": ("vit_small_patch16_dinov3_qkvb", 384, 6, 1536),
    "base": ("vit_base_patch16_dinov3_qkvb", 768, 12, 3072),
    "large": ("vit_large_patch16_dinov3_qkvb", 1024, 16, 4096),
}


def build(variant: str, device: str):
    eva_name, dim, heads, hidden = SHAPES[variant]
    eva = timm.create_model(eva_name, global_pool="token").eval()
    config = DINOv3ViTConfig(
        hidden_size=dim,
        num_attention_heads=heads,
        intermediate_size=hidden,
        num_hidden_layers=len(eva.blocks),
        num_register_tokens=4,
    )
    hf = DINOv3ViTModel(config).eval()
    ours = timm.create_model(f"vit_ls_{variant}_patch16_dinov3", rope_periods_bf16=False).eval()
    ours.load_state_dict(eva.state_dict())
    return {
        "timm-layerscale": (ours.to(device), lambda m, x: m(x)),
        "timm eva": (eva.to(device), lambda m, x: m(x)),
        "transformers": (hf.to(device), lambda m, x: m(pixel_values=x).pooler_output),
    }


def synchronize(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


@torch.inference_mode()
def measure(models: dict, x: torch.Tensor, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Round-robin timing, so machine drift hits every model alike; (median ms, median ratio, peak MiB)."""
    peaks = {}
    for name, (model, call) in models.items():
        for _ in range(3):
            call(model, x)
        if x.is_cuda:
            torch.cuda.reset_peak_memory_stats()
            call(model, x)
        synchronize(x)
        peaks[name] = torch.cuda.max_memory_allocated() / 2**20 if x.is_cuda else float("nan")
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, (model, call) in models.items():
            start = time.perf_counter()
            call(model, x)
            synchronize(x)
            times[name].append((time.perf_counter() - start) * 1000)
    ours = times["timm-layerscale"]
    return {
        name: (statistics.median(t), statistics.median(a / b for a, b in zip(t, ours)), peaks[name])
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=sorted(SHAPES), default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    models = {name: (model.to(dtype), call) for name, (model, call) in build(args.variant, args.device).items()}
    x = torch.randn(args.batch, 3, args.size, args.size, device=args.device, dtype=dtype)
    results = measure(models, x, args.repeats)
    versions = f"torch {torch.__version__}, timm {timm.__version__}, transformers {transformers.__version__}"
    print(f"{args.variant}, batch {args.batch} at {args.size}px, {args.dtype} on {args.device}, {args.repeats} rounds")
    print(versions)
    print(f"{'model':<16} {'median ms':>10} {'time / ours':>12} {'peak MiB':>9}")
    for name, (ms, ratio, peak) in results.items():
        print(f"{name:<16} {ms:>10.1f} {ratio:>12.2f} {peak:>9.0f}")


if __name__ == "__main__":
    main()
