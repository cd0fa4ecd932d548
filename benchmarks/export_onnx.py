"""CPU inference through ONNX Runtime: ours exported against timm eva exported the same way and eager PyTorch;
and the 7B's export from a checkpoint, its time and peak memory.

    python -m benchmarks.export_onnx                                  # small and base, batch 1 and 8, 224 px
    python -m benchmarks.export_onnx --threads 1 --rounds 15          # a shared machine
    python -m benchmarks.export_onnx --export-7b --workdir /tmp/onnx7b  # writes a 13.4 GB fp16 checkpoint first

Both models carry the same weights (see common.build_models) and are exported by torch's exporter with the
same opset, dynamic batch and sides; ours through `export_onnx` (its side check and metadata included),
eva through `torch.onnx.export` directly. Both run in ONNX Runtime's CPU provider with the same threads as
torch, all graph optimisations on. Per round each of the three runs once, the order rotating; medians of
per-round time ratios with quartiles. The 7B export runs in a child process (so its peak RssAnon is its
own), from a random fp16 checkpoint in Meta's layout written tensor by tensor beforehand.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from timm_layerscale import export_onnx
from timm_layerscale.checkpoints import TensorInfo
from timm_layerscale.checkpoints.write.writers import write_safetensors
from timm_layerscale.model import VisionTransformerLS
from timm_layerscale.variants import VARIANTS

from .common import (
    EVA,
    OURS,
    add_machine_args,
    apply_machine_args,
    build_models,
    header,
    markdown,
    median_ms,
    ratio_stats,
    round_robin,
    rss_anon_mib,
)

ORT_OURS, ORT_EVA, EAGER = "ours ORT", "eva ORT", "ours eager"


def export_eva(model: torch.nn.Module, path: Path, opset: int) -> None:
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    sides = {2: 16 * torch.export.Dim("patches_h", min=1, max=1024), 3: 16 * torch.export.Dim("patches_w", max=1024)}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(),
            (torch.zeros(2, 3, 32, 48),),
            str(path),
            dynamo=True,
            input_names=["pixel_values"],
            output_names=["pooled"],
            dynamic_shapes={"x": {0: batch, **sides}},
            opset_version=opset,
        )


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def inference(args: argparse.Namespace) -> None:
    threads = torch.get_num_threads()
    print(header(f"ONNX Runtime {ort.__version__} CPU inference, opset {args.opset}, {threads} threads"))
    rows = [
        [
            "variant", "batch", "ours ORT ms", "eva ORT ms", "ours eager ms", "eva ORT / ours ORT [quartiles]",
            "eager / ours ORT [quartiles]", "max rel err vs eager ours / eva",
        ]
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            models = build_models(variant)
            ours, eva = models[OURS].eval(), models[EVA].eval()
            export_onnx(ours, Path(tmp) / f"{variant}-ours.onnx", opset=args.opset, overwrite=True)
            export_eva(eva, Path(tmp) / f"{variant}-eva.onnx", args.opset)
            runtimes = {
                ORT_OURS: session(Path(tmp) / f"{variant}-ours.onnx", threads),
                ORT_EVA: session(Path(tmp) / f"{variant}-eva.onnx", threads),
            }
            for batch in args.batches:
                x = torch.randn(batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
                feed = {"pixel_values": x.numpy()}
                with torch.inference_mode():
                    eager_out = {ORT_OURS: ours(x), ORT_EVA: eva(x)}  # each runtime against its own model
                errors = [
                    float(np.abs(rt.run(None, feed)[0] - eager_out[name].numpy()).max() / eager_out[name].abs().max())
                    for name, rt in runtimes.items()
                ]
                calls = {name: (lambda rt=rt, feed=feed: rt.run(None, feed)) for name, rt in runtimes.items()}

                def eager(x=x, model=ours):
                    with torch.inference_mode():
                        model(x)

                calls[EAGER] = eager
                times = round_robin(calls, args.rounds, torch.device("cpu"))
                eva_ratio = ratio_stats(times[ORT_EVA], times[ORT_OURS])
                eager_ratio = ratio_stats(times[EAGER], times[ORT_OURS])
                rows.append(
                    [
                        variant,
                        str(batch),
                        f"{median_ms(times[ORT_OURS]):.1f}",
                        f"{median_ms(times[ORT_EVA]):.1f}",
                        f"{median_ms(times[EAGER]):.1f}",
                        f"{eva_ratio[0]:.2f} [{eva_ratio[1]:.2f}-{eva_ratio[2]:.2f}]",
                        f"{eager_ratio[0]:.2f} [{eager_ratio[1]:.2f}-{eager_ratio[2]:.2f}]",
                        " / ".join(f"{e:.1e}" for e in errors),
                    ]
                )
                print(rows[-1], flush=True)
    print(markdown(rows))


# --------------------------------------------------------------------------------------------- the 7B


def write_random_7b(path: Path, depth: int) -> None:
    """A random fp16 7B in Meta's layout, written tensor by tensor (never the whole model in memory)."""
    config = VARIANTS["vit_ls_7b_patch16_dinov3"].config.replace(depth=depth)
    shapes = VisionTransformerLS(config, device="meta", dtype=torch.float16).state_dict()

    class Random(dict):
        def __getitem__(self, key: str) -> torch.Tensor:
            meta = shapes[key]
            return (torch.randn(meta.shape) * 0.02).to(meta.dtype)

        def info(self, key: str) -> TensorInfo:
            return TensorInfo(shapes[key].shape, shapes[key].dtype)

    write_safetensors(path, Random.fromkeys(shapes))


def export_child(checkpoint: str, dst: str, depth: str) -> None:
    """Runs in its own process: the export, then its time and the process's peak RssAnon as JSON."""
    peak, done = [rss_anon_mib()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon_mib())
            time.sleep(0.005)

    before = rss_anon_mib()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    kwargs = {"depth": int(depth)}
    result = export_onnx(
        checkpoint, dst, model="vit_ls_7b_patch16_dinov3", model_kwargs=kwargs, dtype="fp16", overwrite=True
    )
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    print(json.dumps({"seconds": seconds, "peak_rss_anon_mib": max(peak[0], rss_anon_mib()), "before_mib": before,
                      "summary": result.summary()}))  # fmt: skip


def export_7b(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint, dst = workdir / "vit7b16-fp16.safetensors", workdir / "vit7b16.onnx"
    if not checkpoint.exists():
        start = time.perf_counter()
        write_random_7b(checkpoint, args.depth)
        print(f"wrote {checkpoint} ({checkpoint.stat().st_size / 1e9:.1f} GB) in {time.perf_counter() - start:.0f} s")
    child = subprocess.run(
        [sys.executable, __file__, "--_export-child", str(checkpoint), str(dst), str(args.depth)],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(child.stdout.strip().splitlines()[-1])
    data = dst.with_name(dst.name + ".data")
    print(header(f"7B export to ONNX, fp16, depth {args.depth}"))
    print(
        markdown(
            [
                ["checkpoint", "onnx + data", "seconds", "peak RssAnon MiB", "RssAnon before MiB"],
                [
                    f"{checkpoint.stat().st_size / 1e9:.1f} GB",
                    f"{dst.stat().st_size / 1e6:.1f} MB + {data.stat().st_size / 1e9:.1f} GB",
                    f"{figures['seconds']:.0f}",
                    f"{figures['peak_rss_anon_mib']:.0f}",
                    f"{figures['before_mib']:.0f}",
                ],
            ]
        )
    )
    print(figures["summary"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["small", "base"], choices=["small", "base", "large"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--opset", type=int, default=20)
    parser.add_argument("--export-7b", action="store_true", help="measure the 7B's export instead")
    parser.add_argument("--workdir", default="onnx-7b", help="where the 7B's checkpoint and export go")
    parser.add_argument("--depth", type=int, default=40, help="the 7B's depth (40; less to save disk)")
    parser.add_argument("--_export-child", nargs=3, help=argparse.SUPPRESS)
    add_machine_args(parser)
    args = parser.parse_args()
    if args._export_child:
        export_child(*args._export_child)
        return
    apply_machine_args(args)
    export_7b(args) if args.export_7b else inference(args)


if __name__ == "__main__":
    main()
