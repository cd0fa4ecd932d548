"""Mixed aspect ratios: one batch through the NaFlex path against the other ways to run it, in one run.

    python -m benchmarks.naflex                                  # CPU fp32, ViT-S/16, 64 images
    python -m benchmarks.naflex --threads 1 --clock process      # a shared CPU
    python -m benchmarks.naflex --device cuda --dtype bfloat16   # or benchmarks/gpu.py's naflex section

The images: --batch of them, six aspect ratios (1:1, 3:4, 4:3, 1:2, 2:1, 9:16) at about the same pixel
count (192 to 200 patches of 16 px, 224 px square's 196). Each way takes turns within each round, the
order rotating; the figure is the median of per-round time ratios against the NaFlex path, with quartiles:

- naflex: ours on timm's NaFlex batch (`patchify_image` per image, `NaFlexCollator` padding to the
  longest), each image at its own aspect ratio, one forward;
- square: each image resized to 224 x 224 beforehand (not timed), one forward of the image path;
- one at a time: the image path, each image at its own size, batch 1;
- grouped: the image path once per aspect ratio (no padding; what a loader that buckets by shape gets);
- timm NaFlexVit: timm's `vit_small_patch16_dinov3(use_naflex=True)` on the same weights and batch.

Also: peak memory above what was allocated before each call (RssAnon on a CPU, CUDA's allocator on a GPU),
and the largest difference of each image's NaFlex output from its own forward, relative to the output's
scale (the exactness the tests hold at 1e-5 in fp32), and of timm's NaFlexVit from ours.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import timm
import torch
import torch.nn.functional as F
from timm.data.naflex_dataset import NaFlexCollator
from timm.data.naflex_transforms import patchify_image
from timm.models.naflexvit import checkpoint_filter_fn as naflex_filter
from torch import nn

from .common import (
    EVA,
    OURS,
    SHAPES,
    add_machine_args,
    apply_machine_args,
    build_models,
    header,
    markdown,
    median_ms,
    peak_memory_mib,
    ratio_stats,
    round_robin,
)

# (height, width) in patches: 1:1, 3:4, 4:3, 1:2, 2:1, 9:16, each about 196 patches.
GRIDS = [(14, 14), (12, 16), (16, 12), (10, 20), (20, 10), (11, 18)]
WAYS = ("naflex", "square", "one at a time", "grouped", "timm NaFlexVit")
Timer = Callable[[dict[str, Callable[[], object]]], dict[str, list[float]]]


def timm_naflexvit(eva: nn.Module, eva_name: str, **kwargs) -> nn.Module:
    """timm's NaFlexVit of `eva_name` carrying `eva`'s weights, through timm's own converter."""
    flex = timm.create_model(eva_name, use_naflex=True, global_pool="token", num_classes=0, **kwargs)
    flex.load_state_dict(naflex_filter(eva.state_dict(), flex))
    return flex.eval()


def mixed_images(batch: int, patch: int, grids=GRIDS, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h * patch, w * patch, generator=generator) for h, w in (grids * batch)[:batch]]


def naflex_batch(images: list[torch.Tensor], patch: int) -> dict:
    items = []
    for image in images:
        patches, coord, valid = patchify_image(image, (patch, patch))
        items.append(({"patches": patches, "patch_coord": coord, "patch_valid": valid}, 0))
    batch, _ = NaFlexCollator(max_seq_len=max(item["patches"].shape[0] for item, _ in items))(items)
    return batch


def calls(ours: nn.Module, flex: nn.Module, images: list[torch.Tensor], patch: int, device, dtype) -> dict:
    """One call per way, inputs made beforehand (the loader's work is not timed)."""
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in naflex_batch(images, patch).items()}
    batch["patches"] = batch["patches"].to(dtype)
    side = round((sum(im.shape[1] * im.shape[2] for im in images) / len(images)) ** 0.5 / patch) * patch
    square = torch.stack([F.interpolate(im[None], size=(side, side), mode="bilinear")[0] for im in images])
    square = square.to(device, dtype)
    alone = [im[None].to(device, dtype) for im in images]
    shapes = sorted({tuple(im.shape) for im in images})
    groups = [torch.stack([im for im in images if tuple(im.shape) == s]).to(device, dtype) for s in shapes]
    return {
        "naflex": lambda: ours(batch),
        "square": lambda: ours(square),
        "one at a time": lambda: [ours(x) for x in alone],
        "grouped": lambda: [ours(x) for x in groups],
        "timm NaFlexVit": lambda: flex(batch),
    }


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).abs().max() / expected.abs().max()).item()


@torch.inference_mode()
def measure(
    ours: nn.Module, flex: nn.Module, batch: int, device, dtype, time_calls: Timer, memory, grids=GRIDS
) -> dict:
    """Times per way, speed-ups over NaFlex, peak memory (`memory(call)` in MiB, or None) and exactness."""
    patch = ours.get_patch_size()[0]
    images = mixed_images(batch, patch, grids)
    by_way = calls(ours, flex, images, patch, device, dtype)
    naflex_out, alone_out = by_way["naflex"](), by_way["one at a time"]()
    exact = max(relative(naflex_out[i : i + 1], out) for i, out in enumerate(alone_out))
    times = time_calls(by_way)
    return {
        "batch": batch,
        "grids": grids,
        "tokens_per_image": sum(h * w for h, w in grids) / len(grids),
        "times_s": times,
        "vs_naflex": {way: ratio_stats(times[way], times["naflex"]) for way in by_way},
        "peak_mib": {way: memory(call) for way, call in by_way.items()} if memory else {},
        "naflex_vs_alone_rel": exact,
        "timm_vs_ours_rel": relative(by_way["timm NaFlexVit"](), naflex_out),
    }


def table(result: dict) -> str:
    rows = [["way", "ms per batch", "images/s", "time / NaFlex's [quartiles]", "peak MiB"]]
    for way, seconds in result["times_s"].items():
        ms, ratio, peak = median_ms(seconds), result["vs_naflex"][way], result["peak_mib"].get(way)
        rows.append(
            [
                way,
                f"{ms:.1f}",
                f"{result['batch'] / ms * 1000:.1f}",
                f"{ratio[0]:.2f} [{ratio[1]:.2f}-{ratio[2]:.2f}]",
                "-" if peak is None else f"{peak:.0f}",
            ]
        )
    return (
        f"{markdown(rows)}\n\nEach image's NaFlex output against its own forward: {result['naflex_vs_alone_rel']:.1e} "
        f"of the output's scale; timm's NaFlexVit against ours: {result['timm_vs_ours_rel']:.1e}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["small", "base", "large"], default="small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    add_machine_args(parser)
    args = parser.parse_args()
    apply_machine_args(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    models = build_models(args.variant)
    ours = models[OURS].eval().to(device, dtype)
    flex = timm_naflexvit(models[EVA], SHAPES[args.variant][0]).to(device, dtype)
    del models
    result = measure(
        ours,
        flex,
        args.batch,
        device,
        dtype,
        time_calls=lambda by_way: round_robin(by_way, args.rounds, device, warmup=1),
        memory=lambda call: peak_memory_mib(call, device),
    )
    print(header(f"Mixed aspect ratios, {args.variant}, batch {args.batch} ({args.dtype} on {args.device})"))
    print(table(result))


if __name__ == "__main__":
    main()
