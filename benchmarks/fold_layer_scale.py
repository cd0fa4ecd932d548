"""What `fold_layer_scale` buys for inference: time saved and the output difference it costs.

    python -m benchmarks.fold_layer_scale             # CPU fp32: small and base, batch 1 and 8, 224 px

The model carries random weights with gammas drawn in [0.5, 1.5] with random signs (trained gammas are
far from their init); its folded copy has every gamma fused into the projection before it. Per point: the
median time of both, the speed-up (unfolded / folded, median of per-round ratios, with quartiles) and the
largest absolute difference of the pooled output, whose target is at most 1e-5.
"""

from __future__ import annotations

import argparse
import copy

import timm
import torch

import timm_layerscale

from .common import add_machine_args, apply_machine_args, header, markdown, median_ms, ratio_stats, round_robin

TOLERANCE = 1e-5


@torch.inference_mode()
def measure(variant, batch, model, folded, args, device) -> list[str]:
    x = torch.randn(batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(batch)).to(device)
    times = round_robin({"unfolded": lambda: model(x), "folded": lambda: folded(x)}, args.rounds, device)
    diff = (model(x) - folded(x)).abs().max().item()
    median, q1, q3 = ratio_stats(times["unfolded"], times["folded"])
    unfolded_ms, folded_ms = median_ms(times["unfolded"]), median_ms(times["folded"])
    speed_up = f"{median:.3f} [{q1:.3f}-{q3:.3f}]"
    difference = f"{diff:.1e}{'' if diff <= TOLERANCE else ' OVER 1e-5'}"
    return [variant, str(batch), f"{unfolded_ms:.1f}", f"{folded_ms:.1f}", speed_up, difference]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=["small", "base", "large"], default=["small", "base"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    add_machine_args(parser)
    args = parser.parse_args()
    apply_machine_args(args)
    device = torch.device(args.device)
    rows = [["variant", "batch", "unfolded ms", "folded ms", "unfolded / folded [quartiles]", "max abs diff"]]
    for variant in args.variants:
        torch.manual_seed(0)
        model = timm.create_model(f"vit_ls_{variant}_patch16_dinov3").eval().to(device)
        with torch.no_grad():
            for name, gamma in model.named_parameters():
                if name.endswith(".gamma"):
                    gamma.uniform_(0.5, 1.5).mul_(torch.randint_like(gamma, 2) * 2 - 1)
        folded = timm_layerscale.fold_layer_scale(copy.deepcopy(model))
        for batch in args.batches:
            rows.append(measure(variant, batch, model, folded, args, device))
    print(header(f"fold_layer_scale (fp32 on {args.device}, {args.size}px, {args.rounds} rounds)"))
    print(markdown(rows))


if __name__ == "__main__":
    main()
