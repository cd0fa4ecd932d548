"""Every GPU target in one budgeted run: bf16 speed against timm eva, transformers and a plain timm ViT,
FLOP/s and MFU, torch.compile, peak memory, bf16 fidelity, streaming load to CUDA and FSDP2 on one rank.

    python -u -m benchmarks.gpu --out gpu-results                # one H200, about 8 minutes
    python -u -m benchmarks.gpu --smoke --out /tmp/gpu-smoke     # CPU, tiny widths, fp32: proves it runs

Models, per variant (small, base, large, huge_plus): ours (`vit_ls_*_patch16_dinov3`), timm eva in its
fastest eager form (`vit_*_patch16_dinov3`: fused qkv, no qkv bias, SDPA), transformers' `DINOv3ViTModel`
(SDPA) and, for work per second only, a plain timm `VisionTransformer` of the same width, depth and MLP
(learned position embedding, no RoPE, no storage tokens). The first three carry the same random weights,
moved off their inits, with the all-zero qkv biases of the released files (so eva's bias-free form
computes the same function): ours draws them, and eva's and transformers' copies come through this
package's layout tables. Each output is the normed CLS token.

Timing: the models take turns within each round (the order rotating each round), CUDA events around
each call with a synchronize after it, medians of the per-round time ratios with quartiles. FLOPs are
counted once per model and point by `torch.utils.flop_counter.FlopCounterMode` (matmuls, convolutions and
attention); MFU is FLOP/s over the dense bf16 peak given by --peak-tflops (989, the H100/H200 SXM
spec). Memory: CUDA's peak allocation during one call above what was allocated before it (every model's
weights and the input). Fidelity: each model's bf16 output against ours in fp32 (TF32 off), which is
Meta's output exactly. A point that misses a target gets the top kernels of a profile of ours and of
the faster anchor beside it.

Sections, in this order, each skippable: --skip-fsdp, --skip-rope (one block's RoPE in four forms),
--skip-load, then per variant --skip-fidelity and --skip-eager (with --skip-memory, --skip-profile inside),
then --skip-naflex (benchmarks/naflex.py: ViT-S on six aspect ratios through the NaFlex path, as squares,
one at a time, grouped, and timm's NaFlexVit), then --skip-compile (small and large at 224 px by default).
A section that fails is recorded and the next one runs. --budget-s stops gracefully: a step that would not
fit in what is left is skipped and recorded, rounds stop early (at least 3). Results go to --out as
results.json (everything, raw times included) and summary.md (the tables), rewritten after every point, so
a run cut short still leaves what it measured.

Wall time on one H200, estimated (not yet run there): imports and CUDA start 20 s, fsdp 10 s, RoPE 5 s,
load 25 s (a 1.6 GiB file, four loads), the four variants 150 s (four models x 8 points x 13 calls, about
4.3 s a round, plus FLOP counts, memory calls and profiles), mixed aspect ratios 10 s, compiling small then
large 240 s (eight compiles): about 7.7 minutes, which the default --budget-s 450 caps (imports not counted;
the last compile runs only if the sections before it take less than estimated).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from timm_layerscale import fold_layer_scale, shard_model
from timm_layerscale.checkpoints.formats.timm import TIMM
from timm_layerscale.layers import RopeEmbedding, apply_rope
from timm_layerscale.layers.attention import rotate_heads

from .common import (
    EVA,
    EVA_FORMS,
    HF,
    OURS,
    build_plain,
    build_trio,
    features,
    header,
    markdown,
    median_ms,
    nbytes,
    ours_name,
    peak_memory_mib,
    profile_top,
    randomise_,
    ratio_stats,
    round_robin,
    synchronize,
    timed,
)
from .forward import attention_kernel
from .naflex import measure as measure_naflex
from .naflex import table as naflex_table
from .naflex import timm_naflexvit

PLAIN = "plain ViT"
FOLDED = "ours, LayerScale folded"  # --folded: `fold_layer_scale` on a copy, timed beside, no target
ANCHORS = (EVA, HF)
TINY = dict(embed_dim=64, num_heads=4, depth=2)  # --smoke: the variants' rules at a tiny width
H200_DENSE_BF16_TFLOPS = 989.0
TARGETS = dict(eager_speedup=1.15, compiled_speedup=1.0, work_vs_plain=0.9)

echo = lambda *parts: print(*parts, flush=True)  # noqa: E731  (progress must reach a pipe at once)


# --------------------------------------------------------------------------------------------- budget


class Budget:
    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def allows(self, step: str, needs_s: float) -> bool:
        if self.left() >= needs_s:
            return True
        self.skipped.append(f"{step} (needs ~{needs_s:.0f} s, {max(self.left(), 0):.0f} s left)")
        echo(f"  skip {step}: budget")
        return False


# --------------------------------------------------------------------------------------------- models


# --------------------------------------------------------------------------------------------- timing


def interleaved(
    calls: dict[str, Callable[[], object]], rounds: int, device: torch.device, budget: Budget, warmup: int
) -> dict[str, list[float]]:
    """`round_robin` timed by `timed`, ending early (after 3 rounds at least) when the budget runs short."""

    def go_on(r: int, times: dict[str, list[float]]) -> bool:
        if r < 3 or budget.left() >= 2 * sum(t[-1] for t in times.values()) + 5:
            return True
        echo(f"  rounds cut at {r}: budget")
        return False

    return round_robin(calls, rounds, device, warmup, timer=lambda call: timed(call, device), go_on=go_on)


def count_flops(call: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


# --------------------------------------------------------------------------------------------- sections


def inputs(batch: int, size: int, device: torch.device) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(size)).to(device)


def fidelity(trio: dict[str, nn.Module], sizes: list[int], batch: int, device: torch.device, dtype) -> dict:
    """Each model's output in `dtype` against ours in fp32; converts the trio to `dtype` in place."""
    references = {}
    with torch.inference_mode():
        for size in sizes:
            references[size] = features(OURS, trio[OURS], inputs(batch, size, device)).float()
        for model in trio.values():
            model.to(dtype)
        result = {}
        for size in sizes:
            x, reference = inputs(batch, size, device).to(dtype), references[size]
            errors = {}
            for name, model in trio.items():
                diff = features(name, model, x).float() - reference
                errors[name] = dict(max_abs=diff.abs().max().item(), rel_rms=(diff.norm() / reference.norm()).item())
            anchors_best = min(errors[n]["rel_rms"] for n in ANCHORS)
            errors["met"] = errors[OURS]["rel_rms"] <= anchors_best
            result[size] = errors
    return result


def point(
    models: dict[str, nn.Module],
    eager: dict[str, nn.Module],
    variant: str,
    size: int,
    mode: str,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    budget: Budget,
) -> dict:
    """Times, FLOPs, memory, kernels and, where a target is missed, profiles at one (variant, size, mode).

    `models` are timed; `eager` are the same models uncompiled, whose FLOPs are counted."""
    x = inputs(args.batch, size, device).to(dtype)
    calls = {name: (lambda name=name, model=model: features(name, model, x)) for name, model in models.items()}
    result: dict = {"variant": variant, "size": size, "mode": mode, "batch": args.batch}
    with torch.inference_mode():
        if mode == "compiled":
            compile_s = {}
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                synchronize(device)
                compile_s[name] = time.perf_counter() - start
                echo(f"  compiled {name}: {compile_s[name]:.1f} s")
            result["compile_s"] = compile_s
        flops = {name: count_flops(lambda name=name, m=m: features(name, m, x)) for name, m in eager.items()}
        times = interleaved(calls, args.rounds, device, budget, warmup=args.warmup)
        result["times_s"] = times
        result["flops"] = flops
        ms = {name: median_ms(t) for name, t in times.items()}
        faster = min(ANCHORS, key=lambda n: ms[n])
        result["ms"] = ms
        result["faster_anchor"] = faster
        result["speedup"] = {n: ratio_stats(times[n], times[OURS]) for n in ANCHORS}
        rates = {n: flops[n] / (ms[n] / 1000) for n in calls}
        result["tflops"] = {n: r / 1e12 for n, r in rates.items()}
        result["mfu"] = {n: r / 1e12 / args.peak_tflops for n, r in rates.items()}
        result["work_vs_plain"] = rates[OURS] / rates[PLAIN]
        if not args.skip_memory and mode == "eager":
            result["peak_mib"] = {n: peak_memory_mib(call, device) for n, call in calls.items()}
        target = TARGETS["eager_speedup" if mode == "eager" else "compiled_speedup"]
        misses = []
        if result["speedup"][faster][0] < target:
            misses.append(f"speed-up over {faster} {result['speedup'][faster][0]:.2f} < {target}")
        if result["work_vs_plain"] < TARGETS["work_vs_plain"]:
            misses.append(f"FLOP/s vs plain ViT {result['work_vs_plain']:.2f} < {TARGETS['work_vs_plain']}")
        peak = result.get("peak_mib", {})
        if peak.get(OURS) is not None and peak[OURS] > min(peak[n] for n in ANCHORS) + 1:  # 1 MiB: sampling
            misses.append(f"peak memory {peak[OURS]:.0f} MiB > {min(peak[n] for n in ANCHORS):.0f} MiB")
        result["misses"] = misses
        if mode == "eager":
            result["attention_kernel"] = {n: attention_kernel(calls[n]) for n in (OURS, *ANCHORS)}
        if misses and not args.skip_profile and budget.allows(f"profile {variant} {size}px {mode}", 10):
            names = (OURS, faster, PLAIN) if result["work_vs_plain"] < TARGETS["work_vs_plain"] else (OURS, faster)
            result["profiles"] = {n: profile_top(calls[n], device) for n in names}
    sp = result["speedup"][faster]
    echo(
        f"  {variant} {size}px {mode}: ours {ms[OURS]:.2f} ms, eva {ms[EVA]:.2f}, tf {ms[HF]:.2f}, plain "
        f"{ms[PLAIN]:.2f}; {sp[0]:.2f}x {faster}; work/plain {result['work_vs_plain']:.2f}; "
        f"MFU {result['mfu'][OURS]:.0%}" + (f"; MISS: {'; '.join(misses)}" if misses else "")
    )
    return result


def kernels_by_head_dim(device: torch.device, dtype: torch.dtype) -> dict[int, str]:
    """The SDPA kernel each head size gets (64: S to H+; 128: the 7B), at 224 px's 201 tokens."""
    found = {}
    with torch.inference_mode():
        for head_dim, heads in ((64, 16), (128, 32)):
            q = torch.randn(8, heads, 201, head_dim, device=device, dtype=dtype)
            found[head_dim] = attention_kernel(lambda q=q: F.scaled_dot_product_attention(q, q, q))
    return found


def bench_rope(args, device, dtype, budget, results, overrides) -> None:
    """The RoPE of one block alone, on the q/k heads of a qkv output at each variant's width: the model's
    (`rotate_heads`: in bf16 inference `apply_rope_into`, written back into qkv), the plain `apply_rope`,
    and the roll-based form of before; median time and peak memory above the input."""

    def broadcast(f):
        return lambda x, r: f(x, (r[0][:, None], r[1][:, None]))

    forms = {  # the model's form rotates q and k in place (inference), so the rounds keep rotating them
        "model's (in place)": rotate_heads,
        "plain apply_rope": broadcast(apply_rope),
        "roll, before": broadcast(lambda x, r: (x * r[1]).add_(x.roll(x.shape[-1] // 2, dims=-1) * r[0]).to(x.dtype)),
    }
    rows = {}
    for variant in args.variants:
        with torch.device("meta"):
            config = timm.create_model(ours_name(variant), **overrides).config
        for size in args.sizes:
            grid = size // config.patch_size
            sin, cos = RopeEmbedding(config.head_dim, num_prefix_tokens=config.num_prefix_tokens)(grid, grid)
            rope = (sin.to(device), cos.to(device))
            shape = (args.batch, sin.shape[0], 3 * config.num_heads, config.head_dim)
            qk = torch.randn(shape, device=device).to(dtype)[:, :, : 2 * config.num_heads]
            calls = {name: (lambda f=f, qk=qk, rope=rope: f(qk, rope)) for name, f in forms.items()}
            with torch.inference_mode():
                times = interleaved(calls, args.rounds, device, budget, warmup=args.warmup)
                memory = {n: peak_memory_mib(c, device) for n, c in calls.items()}
            rows[f"{variant} {size}px"] = {n: dict(ms=median_ms(t), peak_mib=memory[n]) for n, t in times.items()}
            echo(f"  rope {variant} {size}px: " + ", ".join(f"{n} {median_ms(t):.3f} ms" for n, t in times.items()))
    results["rope"] = rows


def bench_variant(variant, args, device, dtype, budget, results, overrides) -> None:
    """Fidelity, then eager points at every size."""
    echo(f"[{variant}] building the trio ({budget.left():.0f} s left)")
    trio = build_trio(variant, device, overrides)
    results["weights_mib"][variant] = nbytes(trio[OURS]) / 2**20
    if args.folded:
        trio[FOLDED] = fold_layer_scale(copy.deepcopy(trio[OURS]))  # folded in fp32, then cast with the rest
    if not args.skip_fidelity:
        results["fidelity"][variant] = fidelity(trio, args.sizes, args.fidelity_batch, device, dtype)
        for size, errors in results["fidelity"][variant].items():
            echo(f"  fidelity {size}px: " + ", ".join(f"{n} {errors[n]['rel_rms']:.2e}" for n in trio))
    for model in trio.values():
        model.to(dtype)
    for size in args.sizes:
        if not args.skip_eager and budget.allows(f"eager {variant} {size}px", args.reserve_s):
            models = dict(trio, **{PLAIN: build_plain(trio[OURS], size, device, dtype)})
            results["points"].append(point(models, models, variant, size, "eager", args, device, dtype, budget))
            del models
            write(args.out, results)


def bench_compiled(variant, args, device, dtype, budget, results, overrides) -> None:
    """Compiled points (`torch.compile`, one mode for all four models) at --compile-sizes."""
    trio = {n: m.to(dtype) for n, m in build_trio(variant, device, overrides).items()}
    for size in args.compile_sizes:
        needs = args.compile_s_estimate * (1.6 if variant in ("large", "huge_plus") else 1) + args.reserve_s
        if budget.allows(f"compile {variant} {size}px", needs):
            models = dict(trio, **{PLAIN: build_plain(trio[OURS], size, device, dtype)})
            compiled = {n: torch.compile(m, mode=args.compile_mode) for n, m in models.items()}
            results["points"].append(point(compiled, models, variant, size, "compiled", args, device, dtype, budget))
            del compiled, models
            torch._dynamo.reset()
            write(args.out, results)


def bench_naflex(args, device, dtype, budget, results, overrides) -> None:
    """ViT-S on a batch of six aspect ratios: the NaFlex path against squares, one image at a time, one batch
    per aspect ratio and timm's NaFlexVit on the same weights (benchmarks/naflex.py)."""
    trio = build_trio("small", device, overrides)
    flex = timm_naflexvit(trio[EVA].cpu(), EVA_FORMS["small"][0], **overrides).to(device, dtype)
    results["naflex"] = measure_naflex(
        trio[OURS].to(dtype),
        flex,
        args.batch,
        device,
        dtype,
        time_calls=lambda calls: interleaved(calls, args.rounds, device, budget, warmup=args.warmup),
        memory=None if args.skip_memory else lambda call: peak_memory_mib(call, device),
    )
    ms = {way: median_ms(t) for way, t in results["naflex"]["times_s"].items()}
    echo("  naflex: " + ", ".join(f"{way} {t:.2f} ms" for way, t in ms.items()))


def bench_load(args, device, budget, results, overrides) -> None:
    """`create_model(..., pretrained=True, device=device, dtype=bf16)` of ViT-H+ from a bf16 file in eva's
    layout (the Hub tag's) made here: time and peak device memory, ours (streaming) against timm eva."""
    dtype = torch.float32 if args.smoke else torch.bfloat16
    eva_name = EVA_FORMS["huge_plus"][1]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        path = Path(tmp) / "vit_huge_plus_bf16.safetensors"
        start = time.perf_counter()
        with torch.device(device):
            source = randomise_(timm.create_model(ours_name("huge_plus"), num_classes=0, **overrides))
        state, _ = TIMM.table.from_native(source.state_dict(), qkv_bias=True, dim=source.embed_dim)
        save_file({k: v.to(dtype).cpu().contiguous() for k, v in state.items()}, str(path))
        del source, state
        echo(f"  wrote {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s")
        sides = {
            OURS: lambda: timm.create_model(
                ours_name("huge_plus"),
                pretrained=True,
                pretrained_cfg_overlay=dict(file=str(path)),
                num_classes=0,
                device=device,
                dtype=dtype,
                **overrides,
            ),
            EVA: lambda: eva_load(eva_name, path, device, dtype, overrides),
        }
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        order = list(sides)
        for r in range(args.load_rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                if not budget.allows(f"load {name} round {r + 1}", 20):
                    continue
                runs[name].append(one_load(sides[name], device))
                echo(f"  load {name}: {runs[name][-1]['seconds']:.2f} s, peak {runs[name][-1]['peak_mib']} MiB")
    median_s = {n: statistics.median(r["seconds"] for r in v) for n, v in runs.items() if v}
    results["load"] = {"file_dtype": str(dtype), "runs": runs, "median_s": median_s}
    if len(median_s) == 2:
        results["load"]["ours_vs_eva_time"] = median_s[OURS] / median_s[EVA]
    if device.type == "cuda" and runs[OURS]:
        results["load"]["one_copy"] = max(r["peak_vs_weights"] for r in runs[OURS]) <= 1.05


def eva_load(name: str, path: Path, device: torch.device, dtype: torch.dtype, overrides: dict) -> nn.Module:
    kwargs = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), num_classes=0, **overrides)
    try:
        return timm.create_model(name, device=device, dtype=dtype, **kwargs)
    except TypeError:  # a timm without device/dtype at construction: its documented way is a move after
        return timm.create_model(name, **kwargs).to(device=device, dtype=dtype)


def one_load(load: Callable[[], nn.Module], device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    model = load()
    synchronize(device)
    seconds = time.perf_counter() - start
    weights = nbytes(model) / 2**20
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.type == "cuda" else None
    del model
    return dict(
        seconds=seconds,
        weights_mib=weights,
        peak_mib=None if peak is None else round(peak),
        peak_vs_weights=None if peak is None else peak / weights,
    )


def bench_fsdp(args, device, results, overrides) -> None:
    """One SGD step of `shard_model` on one rank (NCCL on a GPU, gloo on a CPU) against the plain model."""
    import torch.distributed as dist  # deferred: only this section needs the process group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        with torch.device(device):
            plain = randomise_(timm.create_model(ours_name("small"), num_classes=10, **overrides)).train()
        sharded = shard_model(copy.deepcopy(plain), mesh=init_device_mesh(device.type, (1,)))
        x = inputs(args.fsdp_batch, args.sizes[0], device)
        labels = torch.arange(args.fsdp_batch, device=device) % 10
        losses = {}
        for name, model in (("unsharded", plain), ("shard_model", sharded)):
            # SGD: its step is proportional to the gradient, so nondeterministic attention backward kernels
            # move parameters by as little as they move gradients (AdamW's first step is about lr * sign).
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loss = F.cross_entropy(model(x), labels)
            loss.backward()
            optimizer.step()
            losses[name] = loss.item()
        worst, scale = 0.0, 0.0
        for a, b in zip(plain.parameters(), sharded.parameters()):
            b = b.full_tensor() if isinstance(b, DTensor) else b
            worst = max(worst, (a.detach() - b.detach()).abs().max().item())
            scale = max(scale, a.detach().abs().max().item())
        results["fsdp"] = dict(
            backend=backend,
            losses=losses,
            max_abs_param_diff=worst,
            param_scale=scale,
            matches=worst <= 1e-5 * scale
            and abs(losses["unsharded"] - losses["shard_model"]) <= 1e-5 * abs(losses["unsharded"]),
        )
        echo(f"  fsdp ({backend}): losses {losses}, max param diff {worst:.2e} (scale {scale:.2f})")
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- output


def write(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "summary.md").write_text(summary(results))


def summary(results: dict, with_profiles: bool = True) -> str:
    lines = [results["header"], f"peak for MFU: {results['peak_tflops']} TFLOP/s dense bf16", ""]
    rows = [
        [
            "variant",
            "px",
            "mode",
            "ours ms",
            "eva ms",
            "tf ms",
            "plain ms",
            "faster anchor / ours [quartiles]",
            "ours FLOP/s / plain's",
            "MFU ours / eva / tf / plain",
            "peak MiB above weights ours / eva / tf",
            "misses",
            "folded ms",
        ]
    ]
    for p in results["points"]:
        ms, sp = p["ms"], p["speedup"][p["faster_anchor"]]
        peak = p.get("peak_mib") or {}
        rows.append(
            [
                p["variant"],
                str(p["size"]),
                p["mode"],
                *(f"{ms[n]:.2f}" for n in (OURS, EVA, HF, PLAIN)),
                f"{sp[0]:.2f} [{sp[1]:.2f}-{sp[2]:.2f}] {'eva' if p['faster_anchor'] == EVA else 'tf'}",
                f"{p['work_vs_plain']:.2f}",
                " / ".join(f"{p['mfu'][n]:.0%}" for n in (OURS, EVA, HF, PLAIN)),
                " / ".join("-" if peak.get(n) is None else f"{peak[n]:.0f}" for n in (OURS, EVA, HF)),
                "; ".join(p["misses"]) or "none",
                f"{ms[FOLDED]:.2f}" if FOLDED in ms else "-",
            ]
        )
    lines += ["## Inference, batch " + str(results["args"]["batch"]), markdown(rows), ""]
    if results["fidelity"]:
        rows = [["variant", "px", "rel. RMS err vs ours fp32: ours / eva / tf", "max abs err: ours / eva / tf", "met"]]
        for variant, by_size in results["fidelity"].items():
            for size, e in by_size.items():
                rows.append(
                    [
                        variant,
                        str(size),
                        " / ".join(f"{e[n]['rel_rms']:.2e}" for n in (OURS, EVA, HF)),
                        " / ".join(f"{e[n]['max_abs']:.2e}" for n in (OURS, EVA, HF)),
                        "yes" if e["met"] else "MISS",
                    ]
                )
        lines += ["## bf16 fidelity", markdown(rows), ""]
    if load := results.get("load"):
        rows = [["side", "median s", "peak MiB / weights MiB (each run)"]]
        for name, runs in load["runs"].items():
            rows.append(
                [
                    name,
                    f"{load['median_s'].get(name, float('nan')):.2f}",
                    ", ".join(f"{r['peak_mib']} / {r['weights_mib']:.0f}" for r in runs),
                ]
            )
        verdict = {k: load[k] for k in ("ours_vs_eva_time", "one_copy") if k in load}
        lines += [f"## Streaming load of ViT-H+ ({load['file_dtype']} file)", markdown(rows), json.dumps(verdict), ""]
    if rope := results.get("rope"):
        names = list(next(iter(rope.values())))
        rows = [["point", *(f"{n} ms" for n in names), "peak MiB " + " / ".join(names)]]
        for where, by_form in rope.items():
            rows.append(
                [
                    where,
                    *(f"{by_form[n]['ms']:.3f}" for n in names),
                    " / ".join(
                        "-" if by_form[n]["peak_mib"] is None else f"{by_form[n]['peak_mib']:.0f}" for n in names
                    ),
                ]
            )
        lines += ["## RoPE of one block (q/k slice of qkv)", markdown(rows), ""]
    if naflex := results.get("naflex"):
        lines += [f"## Mixed aspect ratios, ViT-S, batch {naflex['batch']}", naflex_table(naflex), ""]
    if fsdp := results.get("fsdp"):
        lines += ["## shard_model, one rank", json.dumps(fsdp), ""]
    if results.get("kernels"):
        lines += ["## SDPA kernel by head size: " + json.dumps(results["kernels"]), ""]
    for p in results["points"]:
        kernel = p.get("attention_kernel")
        if kernel:
            lines.append(f"attention kernel {p['variant']} {p['size']}px: {json.dumps(kernel)}")
        for name, table in (p.get("profiles") or {}).items() if with_profiles else ():
            lines += ["", f"### profile {p['variant']} {p['size']}px {p['mode']}: {name}", "```", table, "```"]
    if results["errors"]:
        lines += ["", "## errors", *(f"- {k}: {v}" for k, v in results["errors"].items())]
    if results["skipped"]:
        lines += ["", "## skipped", *(f"- {s}" for s in results["skipped"])]
    lines += ["", f"wall time {results.get('wall_s', 0):.0f} s; sections: {json.dumps(results['section_s'])}"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and summary.md")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny widths, fp32, 1 round, no compile")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop gracefully after this many seconds")
    parser.add_argument("--variants", nargs="+", choices=list(EVA_FORMS), default=list(EVA_FORMS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[224, 512])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--fidelity-batch", type=int, default=16)
    parser.add_argument("--compile-variants", nargs="+", choices=list(EVA_FORMS), default=["small", "large"])
    parser.add_argument("--compile-sizes", nargs="+", type=int, default=[224])
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode, the same for all models")
    parser.add_argument(
        "--compile-s-estimate", type=float, default=90.0, help="seconds of a small variant's four compiles"
    )
    parser.add_argument("--reserve-s", type=float, default=15.0, help="least budget a timed point needs")
    parser.add_argument("--load-rounds", type=int, default=2)
    parser.add_argument("--fsdp-batch", type=int, default=16)
    parser.add_argument("--folded", action="store_true", help="also time ours with LayerScale folded (eager)")
    parser.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS)
    parser.add_argument("--workdir", default=None, help="where the ViT-H+ file is written (default: TMPDIR)")
    for section in ("rope", "load", "eager", "fidelity", "memory", "compile", "profile", "fsdp", "naflex"):
        parser.add_argument(f"--skip-{section}", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes = [32, 48]
        args.compile_sizes = [32]
        args.batch, args.rounds, args.warmup, args.fidelity_batch, args.fsdp_batch = 2, 1, 1, 2, 2
        args.load_rounds, args.skip_compile = 1, True
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --smoke for the CPU check")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    overrides = TINY if args.smoke else {}
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is fp32 throughout
    torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "header": header(f"GPU benchmark ({'smoke, CPU fp32' if args.smoke else 'bf16'}, batch {args.batch})"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "peak_tflops": args.peak_tflops,
        "targets": TARGETS,
        "points": [],
        "fidelity": {},
        "weights_mib": {},
        "section_s": {},
        "skipped": budget.skipped,
        "errors": {},
    }
    echo(results["header"])

    def section(name: str, run: Callable[[], None], needs_s: float) -> None:
        if not budget.allows(name, needs_s):
            return
        echo(f"[{name}] ({budget.left():.0f} s left)")
        start = time.perf_counter()
        try:
            run()
        except Exception as error:  # one failed section must not cost the others' figures
            traceback.print_exc()
            results["errors"][name] = f"{type(error).__name__}: {error}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results["section_s"][name] = round(time.perf_counter() - start, 1)
        results["wall_s"] = time.perf_counter() - budget.start
        write(args.out, results)

    results["kernels"] = kernels_by_head_dim(device, dtype)
    if not args.skip_fsdp:
        section("fsdp", lambda: bench_fsdp(args, device, results, overrides), 10)
    if not args.skip_rope:
        section("rope", lambda: bench_rope(args, device, dtype, budget, results, overrides), 10)
    if not args.skip_load:
        section("load", lambda: bench_load(args, device, budget, results, overrides), 40)
    for variant in args.variants:
        section(variant, lambda v=variant: bench_variant(v, args, device, dtype, budget, results, overrides), 20)
    if not args.skip_naflex:
        section("naflex", lambda: bench_naflex(args, device, dtype, budget, results, overrides), 15)
    if not args.skip_compile:
        for variant in [v for v in args.compile_variants if v in args.variants]:
            run = lambda v=variant: bench_compiled(v, args, device, dtype, budget, results, overrides)  # noqa: E731
            section(f"{variant} compiled", run, args.compile_s_estimate)
    results["wall_s"] = time.perf_counter() - budget.start
    write(args.out, results)
    echo(f"done in {results['wall_s']:.0f} s; {args.out / 'summary.md'}")
    echo(summary(results, with_profiles=False))  # the profiles are in summary.md


if __name__ == "__main__":
    main()
