"""The families against timm's eva port of each, and transformers' Sapiens2Model: CPU eager forward, batch 1.

    python -m benchmarks.families                       # EUPE-T and LingBot-S at 224 px, Sapiens2-B at 256x192
    python -m benchmarks.families --threads 1 --clock process --rounds 15

Each family at its released width and depth: ours draws random weights off their init (`randomise_`), eva
loads them through `--to timm`'s key table (eva's layout of the family), transformers' Sapiens2Model through
`--to hf`'s. RoPE in fp32 everywhere (periods unrounded), as eva computes it. Before timing, each anchor's
output is checked against ours (max difference over max |ours|). The models take turns, the order rotating
each round; quoted: the median of each, and the median of the per-round ratios ours / anchor with its
quartiles (below 1, ours is faster).
"""

from __future__ import annotations

import argparse

import timm
import torch
from torch import nn
from transformers import Sapiens2Config, Sapiens2Model

from timm_layerscale.checkpoints.formats.hf import HF as HF_FORMAT
from timm_layerscale.checkpoints.formats.hf import transformers_config
from timm_layerscale.checkpoints.formats.timm import TIMM
from timm_layerscale.families import family_record

from .common import (
    EVA,
    HF,
    OURS,
    add_machine_args,
    apply_machine_args,
    header,
    load_exact,
    markdown,
    median_ms,
    randomise_,
    ratio_stats,
    round_robin,
)

# name: (our variant, eva's architecture of the family, input (H, W))
FAMILIES = {
    "EUPE-T": ("vit_ls_tiny_patch16_dinov3", "vit_tiny_patch16_dinov3_qkvb", (224, 224)),
    "LingBot-S": ("vit_ls_small_patch16_lingbot", "vit_small_patch16_lingbot", (224, 224)),
    "Sapiens2-B": ("vit_ls_base_patch16_sapiens2", "vit_base_patch16_sapiens2", (256, 192)),
}


def build(name: str) -> dict[str, nn.Module]:
    """Ours, eva and (for Sapiens2) transformers, fp32, eval mode, one set of weights."""
    variant, eva_name, size = FAMILIES[name]
    torch.manual_seed(0)
    ours = timm.create_model(variant, num_classes=0, img_size=size, rope_dtype="fp32", rope_periods_bf16=False)
    randomise_(ours)
    config, native = ours.config, ours.state_dict()
    layout = family_record(config.family).layout
    eva = timm.create_model(eva_name, pretrained=False, global_pool="token", num_classes=0, img_size=size)
    eva_state, _ = TIMM.table.from_native(native, layout=layout, qkv_bias=True, dim=config.embed_dim)
    load_exact(eva, dict(eva_state.items()))
    models = {OURS: ours.eval(), EVA: eva.eval()}
    if layout == "sapiens2":
        fields = transformers_config(config, k_bias=True, dtype=torch.float32)
        hf_config = Sapiens2Config(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
        hf_config._attn_implementation = "sdpa"
        hf = Sapiens2Model(hf_config)
        hf_state, _ = HF_FORMAT.table.from_native(native, k_bias=True, dim=config.embed_dim)
        load_exact(hf, dict(hf_state.items()))
        models[HF] = hf.eval()
    return models


def call(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Each model's normed tokens (ours and eva) or last hidden state (transformers)."""
    return model(pixel_values=x).last_hidden_state if name == HF else model.forward_features(x)


@torch.inference_mode()
def measure(name: str, args: argparse.Namespace) -> list[list[str]]:
    models = build(name)
    height, width = FAMILIES[name][2]
    x = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(1))
    reference = call(OURS, models[OURS], x)
    diffs = {
        key: ((call(key, model, x) - reference).abs().max() / reference.abs().max()).item()
        for key, model in models.items()
        if key != OURS
    }
    calls = {key: (lambda key=key, model=model: call(key, model, x)) for key, model in models.items()}
    times = round_robin(calls, args.rounds, torch.device("cpu"))
    rows = []
    for key, diff in diffs.items():
        median, q1, q3 = ratio_stats(times[OURS], times[key])
        ours_ms, anchor_ms = median_ms(times[OURS]), median_ms(times[key])
        size = f"{height}x{width}"
        rows.append(
            [name, size, key, f"{ours_ms:.1f}", f"{anchor_ms:.1f}", f"{median:.3f} [{q1:.3f}-{q3:.3f}]", f"{diff:.1e}"]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=15)
    add_machine_args(parser)
    args = parser.parse_args()
    apply_machine_args(args)
    rows = [["family", "input", "anchor", "ours ms", "anchor ms", "ours / anchor [quartiles]", "rel diff"]]
    for name in args.families:
        rows.extend(measure(name, args))
    print(header(f"the families against their anchors (fp32 eager on cpu, batch 1, {args.rounds} rounds)"))
    print(markdown(rows))


if __name__ == "__main__":
    main()
