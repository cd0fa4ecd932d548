"""Training step speed (forward, backward, AdamW) against timm eva, and DINOv3's sample drop against DropPath.

    python -m benchmarks.train_step                   # CPU fp32, ViT-S/16, batch 16, 224 px

Two tables, each from round-robin rounds with medians of per-round ratios and their quartiles:
1. ours against eva, both with the same weights and no stochastic depth;
2. ours with `stochastic_depth="sample_drop"` against ours with timm's DropPath, at each rate.
Both are regression guards: ours at least as fast as eva, and sample drop at least --guard times as fast
as DropPath at each rate. A guard that breaks gets the profile's top lines.
"""

from __future__ import annotations

import argparse

import timm
import torch
from torch import nn

from .common import (
    EVA,
    OURS,
    add_machine_args,
    apply_machine_args,
    build_models,
    header,
    markdown,
    median_ms,
    peak_memory_mib,
    profile_top,
    ratio_stats,
    round_robin,
)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor):
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()

    return step


def steps_for(models: dict[str, nn.Module], x: torch.Tensor) -> dict:
    return {name: train_step(m.train(), torch.optim.AdamW(m.parameters(), lr=1e-4), x) for name, m in models.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["small", "base", "large"], default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--rates", nargs="+", type=float, default=[0.1, 0.4])
    parser.add_argument("--guard", nargs="+", type=float, default=[1.0, 1.5], help="sample drop speed-up per rate")
    parser.add_argument("--device", default="cpu")
    add_machine_args(parser)
    args = parser.parse_args()
    apply_machine_args(args)
    device = torch.device(args.device)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0)).to(device)
    broken = []

    models = build_models(args.variant)
    steps = steps_for({name: models[name].to(device) for name in (OURS, EVA)}, x)
    times = round_robin(steps, args.rounds, device)
    memory = {name: peak_memory_mib(step, device) for name, step in steps.items()}
    median, q1, q3 = ratio_stats(times[EVA], times[OURS])
    ms = {name: f"{median_ms(t):.0f}" for name, t in times.items()}
    anchor_rows = [
        ["model", "step ms", "eva / ours [quartiles]", "peak MiB"],
        [OURS, ms[OURS], f"{median:.2f} [{q1:.2f}-{q3:.2f}]", f"{memory[OURS]:.0f}"],
        [EVA, ms[EVA], "1.00", f"{memory[EVA]:.0f}"],
    ]
    if median < 1.0:
        broken.append(("ours slower than eva", steps[OURS], EVA, steps[EVA]))
    weights = models[OURS].state_dict()
    del models, steps

    variants = {}
    for rate in args.rates:
        for kind in ("drop_path", "sample_drop"):
            name = f"vit_ls_{args.variant}_patch16_dinov3"
            model = timm.create_model(name, drop_path_rate=rate, stochastic_depth=kind, rope_periods_bf16=False)
            model.load_state_dict(weights)
            variants[f"{kind} {rate}"] = model.to(device)
    steps = steps_for(variants, x)
    times = round_robin(steps, args.rounds, device)
    drop_rows = [["rate", "DropPath step ms", "sample drop step ms", "DropPath / sample drop [quartiles]", "guard"]]
    for rate, guard in zip(args.rates, args.guard):
        path, sample = f"drop_path {rate}", f"sample_drop {rate}"
        median, q1, q3 = ratio_stats(times[path], times[sample])
        held = median >= guard
        ms = {name: f"{median_ms(t):.0f}" for name, t in times.items()}
        verdict = f">= {guard:g}: {'held' if held else 'BROKEN'}"
        drop_rows.append([f"{rate:g}", ms[path], ms[sample], f"{median:.2f} [{q1:.2f}-{q3:.2f}]", verdict])
        if not held:
            broken.append((f"sample drop at {rate}", steps[sample], path, steps[path]))

    print(header(f"Training step ({args.variant}, batch {args.batch} at {args.size}px, fp32 on {args.device})"))
    print(f"{args.rounds} rounds; loss: mean square of the pooled features; AdamW lr 1e-4")
    print(markdown(anchor_rows))
    print()
    print(markdown(drop_rows))
    for what, ours_step, other, other_step in broken:
        print(f"\nGUARD BROKEN: {what}; profile of ours, then of {other}")
        print(profile_top(ours_step, device))
        print(profile_top(other_step, device))


if __name__ == "__main__":
    main()
