"""CPU deployment paths, ours against timm's eva DINOv3, interleaved in one process, with int8 fidelity.

    python -m benchmarks.cpu_deploy                         # ViT-B/16, 224 px, batch 4, one thread, every path
    python -m benchmarks.cpu_deploy --variant small --batch 1 --rounds 3 --paths eager-fp32 torch-int8   # quick

Paths, each of ours and of eva (`vit_*_patch16_dinov3_qkvb`, the same random weights off their init, LayerScale
drawn about 1 so every branch counts), all returning the normed tokens (`forward_features`):

- eager-fp32, eager-bf16: the model as a user casts it, under `torch.inference_mode()`;
- compiled, compiled-freezing: `torch.compile` (inductor, `dynamic=False`), the second with inductor's
  `freezing` (weights folded into the graph as constants, as for deployment);
- folded: ours after `fold_layer_scale` (every gamma in the projection before it); eva has no such tool, so
  its column repeats eva's eager fp32;
- torch-int8: `timm_layerscale.deploy.quantize(model, "dynamic")` for ours and
  `torch.ao.quantization.quantize_dynamic(model, {nn.Linear})` for eva;
- ort-fp32, ort-int8: ONNX Runtime sessions (`intra_op_num_threads` = --threads) of a static-shape export
  (ours through `timm_layerscale.export_onnx`, eva through `torch.onnx.export`, both dynamo, the same opset),
  int8 by `timm_layerscale.export.int8.quantize` for both files (ONNX Runtime's dynamic quantizer, int8
  weights per channel on every Linear).

Every call takes its turn in each round, the order rotating from round to round (`common.round_robin`);
each call is timed on the process's CPU clock and the wall clock.
Quoted per path: median ms of ours and eva, eva/ours (median of the per-round ratios, with quartiles), each
model's speed-up over its own eager fp32, and the path's fidelity against the same model in eager fp32 on
rendered images (pooled cosine mean and minimum, patch-token cosine mean; `timm_layerscale.fidelity`). The
eager fp32 row adds a plain timm ViT (197 tokens at 224 px against our 201) and the linears' rate: their
FLOPs (`FlopCounterMode`) over their self CPU time in one profiled forward, against the rate of a bare
`F.linear` of the MLP's first shape run back to back (`gemm_rate`).
The header names the CPU class `timm_ls.cpu.cpu_class` found (AMX, AVX-512 BF16, AVX-512, AVX2).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import quantize_dynamic
from torch.profiler import ProfilerActivity, profile

from timm_layerscale import export_onnx, fold_layer_scale
from timm_layerscale.deploy import quantize
from timm_layerscale.export.int8 import Int8Request
from timm_layerscale.export.int8 import quantize as quantize_onnx
from timm_layerscale.fidelity import Fidelity, Outputs, compare, rendered_images
from timm_ls.cpu import cpu_class, cpu_flags
from timm_ls.logs import quieted

from .common import EVA, OURS, markdown, median_ms, ratio_stats
from .cpu_profile import kind
from .cpu_speed import (
    PLAIN,
    PLAIN_NAMES,
    build_grid_models,
    fmt_ratio,
    linear_flops,
    machine_lines,
    time_calls,
)
from .export_onnx import session

EAGER = "eager-fp32"
PATHS = (EAGER, "eager-bf16", "compiled", "compiled-freezing", "folded", "torch-int8", "ort-fp32", "ort-int8")
INT8_PATHS = ("torch-int8", "ort-int8")
FIDELITY_IMAGES = 8
OPSET = 20
# (what, threshold), as the issue states them; see `targets`
EAGER_VS_EVA, EAGER_VS_PLAIN, LINEAR_RATE, INT8_VS_EAGER, PATCH_COSINE, POOLED_COSINE = (
    1.0,
    0.97,
    0.92,
    1.8,
    0.99,
    0.998,
)

Tokens = Callable[[torch.Tensor], torch.Tensor]


class _Features(nn.Module):
    """A model's `forward_features` as its `forward`, for `torch.onnx.export`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)


# ------------------------------------------------------------------------------------------------ the paths


def torch_paths(name: str, model: nn.Module, paths: list[str]) -> dict[str, Tokens]:
    """The PyTorch paths of one fp32 model, each a function from images to tokens."""
    made: dict[str, Tokens] = {}
    for path in paths:
        if path == EAGER:
            made[path] = model.forward_features
        elif path == "eager-bf16":
            bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
            made[path] = lambda x, m=bf16: m.forward_features(x.to(torch.bfloat16)).float()
        elif path in ("compiled", "compiled-freezing"):
            options = {"freezing": True} if path == "compiled-freezing" else None
            made[path] = torch.compile(copy.deepcopy(model).forward_features, dynamic=False, options=options)
        elif path == "folded":
            made[path] = (
                fold_layer_scale(copy.deepcopy(model)).forward_features if name == OURS else model.forward_features
            )
        elif path == "torch-int8":
            if name == OURS:
                quantized, _ = quantize(model, "dynamic")
            else:
                quantized = quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8).eval()
            made[path] = quantized.forward_features
    return made


def onnx_file(name: str, model: nn.Module, x: torch.Tensor, folder: Path) -> Path:
    """A static-shape fp32 export of `model`'s tokens: ours through the package, eva through torch."""
    path = folder / f"{'ours' if name == OURS else 'eva'}.onnx"
    with quieted():
        if name == OURS:
            export_onnx(model, path, batch=x.shape[0], size=tuple(x.shape[-2:]), outputs="tokens", opset=OPSET)
        else:
            torch.onnx.export(_Features(model).eval(), (x,), str(path), dynamo=True, opset_version=OPSET,
                              input_names=["pixel_values"], output_names=["tokens"])  # fmt: skip
    return path


def ort_paths(name: str, model: nn.Module, x: torch.Tensor, paths: list[str], folder: Path, threads: int) -> dict:
    """The ONNX Runtime paths of one model (fp32, then int8 from that file)."""
    if not {"ort-fp32", "ort-int8"} & set(paths):
        return {}
    fp32 = onnx_file(name, model, x, folder)
    files = {"ort-fp32": fp32}
    if "ort-int8" in paths:
        files["ort-int8"] = fp32.with_suffix(".int8.onnx")
        quantize_onnx(fp32, files["ort-int8"], Int8Request("dynamic", x, "", None), x.shape[0], external=False)
    made = {}
    for path in (p for p in files if p in paths):
        runtime = session(files[path], threads)
        made[path] = lambda images, s=runtime: torch.from_numpy(s.run(None, {"pixel_values": images.numpy()})[0])
    return made


# ------------------------------------------------------------------------------------------------ measuring


def fidelity(model: nn.Module, tokens: Tokens, images: torch.Tensor) -> Fidelity:
    """`tokens` against the fp32 model's own, pooled by the fp32 model's head (it has no weights)."""

    def outputs(features: torch.Tensor) -> Outputs:
        pooled = model.forward_head(features, pre_logits=True)
        return Outputs(pooled=pooled.float(), patches=features[:, model.num_prefix_tokens :].float())

    with torch.inference_mode():
        return compare(outputs(model.forward_features(images)), outputs(tokens(images)))


def chunked(tokens: Tokens, batch: int) -> Tokens:
    """`tokens` over images `batch` at a time: a static-shape export takes no other batch."""
    return lambda images: torch.cat([tokens(images[i : i + batch]) for i in range(0, len(images), batch)])


@torch.inference_mode()
def gemm_rate(tokens: int, dim: int, calls: int = 11) -> float:
    """FLOP/s of `F.linear` (tokens x C by 4C x C, with a bias: what an MLP's first linear runs), median of
    `calls` back to back on the CPU clock, its operands hot in cache: the rate a linear can reach."""
    generator = torch.Generator().manual_seed(0)
    a, w, b = (torch.randn(*shape, generator=generator) for shape in ((tokens, dim), (4 * dim, dim), (4 * dim,)))
    seconds = []
    for _ in range(3 + calls):
        start = time.process_time()
        F.linear(a, w, b)
        seconds.append(time.process_time() - start)
    return 2 * tokens * dim * 4 * dim / statistics.median(seconds[3:])


@torch.inference_mode()
def linear_rate(model: nn.Module, x: torch.Tensor, reference: float) -> float:
    """The linears' FLOPs over their self CPU time in one profiled forward, against `reference` FLOP/s."""
    model(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x)
    seconds = sum(e.self_cpu_time_total for e in prof.key_averages() if kind(e.key) == "matmul") / 1e6
    return linear_flops(model, x) / seconds / reference


def tokens_of(model: nn.Module, size: int) -> int:
    return model.num_prefix_tokens + (size // model.get_patch_size()[0]) ** 2


def key(path: str, name: str) -> str:
    return f"{path} | {name}"


def build_calls(models: dict[str, nn.Module], x: torch.Tensor, args: argparse.Namespace, folder: Path) -> dict:
    """{path: {model name: tokens function}} for ours and eva, and the plain ViT's eager fp32."""
    paths: dict[str, dict[str, Tokens]] = {path: {} for path in args.paths}
    for name in (OURS, EVA):
        made = torch_paths(name, models[name], args.paths)
        made.update(ort_paths(name, models[name], x, args.paths, folder, args.threads))
        for path, tokens in made.items():
            paths[path][name] = tokens
    paths[EAGER][PLAIN] = models[PLAIN].forward_features
    return paths


def measure(models: dict[str, nn.Module], args: argparse.Namespace) -> dict:
    """Times of every path (both clocks), fidelity of every path but eager fp32, and the linears' rates."""
    x = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    images = rendered_images(FIDELITY_IMAGES, args.size)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_calls(models, x, args, Path(tmp))
        calls = {key(p, n): (lambda t=tokens: t(x)) for p, made in paths.items() for n, tokens in made.items()}
        times = time_calls(calls, args.rounds, args.warmup)
        fid = {
            key(p, n): fidelity(models[n], chunked(tokens, args.batch), images)
            for p, made in paths.items()
            for n, tokens in made.items()
            if p != EAGER and not (p == "folded" and n == EVA)
        }
    reference = gemm_rate(args.batch * tokens_of(models[OURS], args.size), models[OURS].embed_dim)
    rates = {n: linear_rate(models[n], x, reference) for n in (OURS, EVA, PLAIN)}
    return {"times": times, "fidelity": fid, "rates": rates}


def fmt_fidelity(fid: dict[str, Fidelity], path: str) -> list[str]:
    def one(name: str, field: str) -> str:
        found = fid.get(key(path, name))
        return "-" if found is None else f"{getattr(found, field):.5f}"

    return [
        " / ".join(f"{one(n, 'pooled_cosine_mean')}, {one(n, 'pooled_cosine_min')}" for n in (OURS, EVA)),
        " / ".join(one(n, "patch_cosine_mean") for n in (OURS, EVA)),
    ]


def path_rows(result: dict, paths: list[str]) -> list[list[str]]:
    process, wall = result["times"]["process"], result["times"]["wall"]
    rows = [
        [
            "path",
            "CPU ms ours / eva",
            "eva/ours CPU [q1-q3]",
            "eva/ours wall [q1-q3]",
            "over its eager fp32: ours / eva (CPU)",
            "pooled cosine mean, min: ours / eva",
            "patch cosine mean: ours / eva",
        ]
    ]
    for path in paths:
        ours, eva = key(path, OURS), key(path, EVA)
        own = [ratio_stats(process[key(EAGER, n)], process[key(path, n)])[0] for n in (OURS, EVA)]
        rows.append(
            [
                path,
                f"{median_ms(process[ours]):.1f} / {median_ms(process[eva]):.1f}",
                fmt_ratio(ratio_stats(process[eva], process[ours])),
                fmt_ratio(ratio_stats(wall[eva], wall[ours])),
                " / ".join(f"{s:.2f}" for s in own),
                *fmt_fidelity(result["fidelity"], path),
            ]
        )
    return rows


def eager_rows(result: dict) -> list[list[str]]:
    process, rates = result["times"]["process"], result["rates"]
    ours, plain = key(EAGER, OURS), key(EAGER, PLAIN)
    return [
        ["plain ViT CPU ms", "plain/ours CPU [q1-q3]", "linears' rate / GEMM rate: ours / eva / plain"],
        [
            f"{median_ms(process[plain]):.1f}",
            fmt_ratio(ratio_stats(process[plain], process[ours])),
            " / ".join(f"{rates[n]:.2f}" for n in (OURS, EVA, PLAIN)),
        ],
    ]


def targets(result: dict, paths: list[str], judge: str) -> list[tuple[str, float, float]]:
    """(what, measured, threshold) for each target the measured paths allow."""
    times, fid = result["times"][judge], result["fidelity"]
    ours = key(EAGER, OURS)
    checks = [
        ("eager fp32: eva/ours", ratio_stats(times[key(EAGER, EVA)], times[ours])[0], EAGER_VS_EVA),
        ("eager fp32: plain/ours", ratio_stats(times[key(EAGER, PLAIN)], times[ours])[0], EAGER_VS_PLAIN),
        ("eager fp32: ours' linears' rate / GEMM rate", result["rates"][OURS], LINEAR_RATE),
    ]
    for path in (p for p in INT8_PATHS if p in paths):
        own = {n: ratio_stats(times[key(EAGER, n)], times[key(path, n)])[0] for n in (OURS, EVA)}
        checks += [
            (f"{path}: ours' speed-up over its eager fp32 / eva's", own[OURS] / own[EVA], 1.0),
            (f"{path}: ours' speed-up over its eager fp32", own[OURS], INT8_VS_EAGER),
            (f"{path}: ours' patch cosine mean", fid[key(path, OURS)].patch_cosine_mean, PATCH_COSINE),
            (f"{path}: ours' pooled cosine min", fid[key(path, OURS)].pooled_cosine_min, POOLED_COSINE),
        ]
    return checks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(PLAIN_NAMES), default="base")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime intra-op threads")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median over them)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls of each first (compiles)")
    parser.add_argument("--judge", choices=["process", "wall"], default="process", help="the clock of the targets")
    args = parser.parse_args()
    args.paths = [EAGER] + [p for p in PATHS if p in args.paths and p != EAGER]  # eager fp32: every ratio's base
    return args


def main() -> None:
    args = parse_args()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    result = measure(build_grid_models(args.variant), args)
    print(
        f"CPU deployment paths, {args.variant} {args.size}px batch {args.batch}, {args.threads} thread(s), "
        f"{args.rounds} rounds, median (`python -m benchmarks.cpu_deploy`)"
    )
    print(machine_lines(default_threads))
    print(f"CPU class: {cpu_class(cpu_flags())}")
    print(markdown(path_rows(result, args.paths)))
    print()
    print(markdown(eager_rows(result)))
    print(f"\nTargets ({args.judge} clock):")
    checks = targets(result, args.paths, args.judge)
    for what, measured, threshold in checks:
        print(f"- {'PASS' if measured >= threshold else 'FAIL'} {what} {measured:.3f} (target >= {threshold})")
    print(f"{sum(m >= t for _, m, t in checks)} of {len(checks)} targets met")


if __name__ == "__main__":
    main()
