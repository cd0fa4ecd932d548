"""Pretrained loading: time and private memory of `timm.create_model(..., pretrained=True)` from a local file.

(a) ViT-H+/16 (840M parameters) from a 3.4 GB fp32 safetensors file in timm eva's layout (the layout of the
    Hub file that the `.lvd1689m` tag downloads), taking turns:
    - ours: `timm.create_model("vit_ls_huge_plus_patch16_dinov3", pretrained=True,
      pretrained_cfg_overlay=dict(file=FILE))`,
    - eva:  `timm.create_model("vit_huge_plus_patch16_dinov3_qkvb.lvd1689m", pretrained=True,
      pretrained_cfg_overlay=dict(file=FILE))`, timm's own model and loader on the same file.
(b) ViT-7B/16 from a 27 GB fp32 file in timm eva's layout with `dtype=torch.bfloat16` (ours only; timm eva's
    figure is given by arithmetic, as the fp32 7B must never be built here). The file is sparse: its header
    and its small tensors are written, the large ones are holes that read as zeros, so it takes little disk.

Each run is a fresh process: imports first, the file already in the page cache, then the `create_model`
call alone is timed. Memory is the increase of the process's `RssAnon` (private memory) over its value just
before the call, sampled every 20 ms; `RssFile` (mapped file pages, reclaimable) is reported beside it.
Medians over the rounds.

    python -m benchmarks.load --workdir DIR --rounds 3            # (a); needs 3.5 GB disk, ~8 GB memory
    python -m benchmarks.load --workdir DIR --only 7b              # (b); needs ~18 GiB of free memory
    python -m benchmarks.load --workdir DIR --only 7b --depth-7b 8 # (b) on 8 of the 7B's 40 blocks

Files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30
H_PLUS = "vit_ls_huge_plus_patch16_dinov3"
H_PLUS_EVA = "vit_huge_plus_patch16_dinov3_qkvb"
SEVEN_B = "vit_ls_7b_patch16_dinov3"
SEVEN_B_EVA = "vit_7b_patch16_dinov3"


def status_mib() -> dict[str, float]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                name, value = line.split(":")
                values[name] = int(value.split()[0]) / 1024
    return values


def warm(path: Path) -> None:
    """Puts the file in the page cache (a sparse file's holes read as zeros without disk reads)."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


# ------------------------------------------------------------------------------------------- children


def child_load(side: str, path: str, dtype: str, depth: str = "") -> None:
    import timm
    import torch

    import timm_layerscale  # noqa: F401

    name = {"ours": H_PLUS, "eva": f"{H_PLUS_EVA}.lvd1689m", "ours7b": SEVEN_B, "eva7b": f"{SEVEN_B_EVA}.lvd1689m"}[
        side
    ]
    kwargs = {"dtype": getattr(torch, dtype)} if dtype != "float32" else {}
    if depth:
        kwargs["depth"] = int(depth)
    before = status_mib()
    peak = dict(before)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for key, value in status_mib().items():
                peak[key] = max(peak[key], value)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path), **kwargs)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    for key, value in status_mib().items():
        peak[key] = max(peak[key], value)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(
        json.dumps(
            {
                "seconds": seconds,
                "anon_mib": peak["RssAnon"] - before["RssAnon"],
                "file_mib": peak["RssFile"] - before["RssFile"],
                "weights_mib": nbytes / 2**20,
            }
        )
    )


def eva_shapes(name: str, depth: int | None = None) -> dict:
    import timm
    import torch

    with torch.device("meta"):
        model = timm.create_model(name, **({"depth": depth} if depth else {}))
    return {k: v for k, v in model.state_dict().items()}


def child_make_h_plus(path: str) -> None:
    """ViT-H+ in eva's layout, fp32, written tensor by tensor with values away from any init."""
    import torch

    from timm_layerscale.checkpoints import TensorInfo
    from timm_layerscale.checkpoints.write.writers import write_safetensors

    shapes = eva_shapes(H_PLUS_EVA)
    generator = torch.Generator().manual_seed(0)

    class Synthetic(dict):
        def info(self, key: str) -> TensorInfo:
            return TensorInfo(shapes[key].shape, torch.float32)

        def __getitem__(self, key: str) -> torch.Tensor:
            shape = shapes[key].shape
            if key.endswith(("gamma_1", "gamma_2")):
                return torch.rand(shape, generator=generator) + 0.5
            return torch.randn(shape, generator=generator) * 0.02

        def __iter__(self):
            return iter(shapes)

        def __len__(self) -> int:
            return len(shapes)

    write_safetensors(Path(path), Synthetic())


def child_make_sparse_7b(path: str, depth: str) -> None:
    """The 7B in eva's layout, fp32: the safetensors header, then a hole the size of the data, with only
    tensors under 1 MiB written (so a few MiB of disk; the holes read as zeros)."""
    import torch

    shapes = eva_shapes(SEVEN_B_EVA, int(depth))
    header, offset = {}, 0
    for key, tensor in shapes.items():
        nbytes = tensor.numel() * 4
        header[key] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(start + offset)
        for key, tensor in shapes.items():
            if tensor.numel() * 4 < 1 << 20:
                value = torch.rand(tensor.shape) + 0.5 if "gamma" in key else torch.randn(tensor.shape) * 0.02
                f.seek(start + header[key]["data_offsets"][0])
                f.write(value.float().numpy().tobytes())


# ---------------------------------------------------------------------------------------------- main


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def bench_h_plus(workdir: Path, rounds: int) -> None:
    path = workdir / "vit_huge_plus_patch16_dinov3_qkvb_eva.safetensors"
    subprocess.run([sys.executable, __file__, "make-h-plus", str(path)], check=True)
    size = path.stat().st_size
    print(f"file: {path.name}, {size / 1e9:.2f} GB ({size / GIB:.2f} GiB)", flush=True)
    warm(path)
    results: dict[str, list[dict]] = {"ours": [], "eva": []}
    for round_ in range(rounds):
        for side in ("ours", "eva") if round_ % 2 == 0 else ("eva", "ours"):
            warm(path)
            result = run_child("load", side, str(path), "float32")
            results[side].append(result)
            anon, file = result["anon_mib"], result["file_mib"]
            print(
                f"round {round_ + 1} {side:4s} {result['seconds']:6.2f} s  RssAnon +{anon:6.0f} MiB "
                f"({anon / result['weights_mib']:.2f}x the weights)  RssFile +{file:6.0f} MiB",
                flush=True,
            )
    ours = {k: statistics.median(r[k] for r in results["ours"]) for k in results["ours"][0]}
    eva = {k: statistics.median(r[k] for r in results["eva"]) for k in results["eva"][0]}
    ratios = [o["seconds"] / e["seconds"] for o, e in zip(results["ours"], results["eva"])]
    print(
        f"ViT-H+ median: ours {ours['seconds']:.2f} s, eva {eva['seconds']:.2f} s, ours/eva "
        f"{statistics.median(ratios):.3f} (median of rounds); RssAnon ours {ours['anon_mib']:.0f} MiB = "
        f"{ours['anon_mib'] / ours['weights_mib']:.2f}x the weights ({ours['weights_mib']:.0f} MiB), "
        f"eva {eva['anon_mib']:.0f} MiB = {eva['anon_mib'] / eva['weights_mib']:.2f}x"
    )
    path.unlink()


def bench_7b(workdir: Path, depth: int) -> None:
    free, needed = available_gib(), 18 * depth / 40
    if free < needed:
        raise SystemExit(f"the 7B run needs {needed:.0f} GiB of available memory; MemAvailable is {free:.1f} GiB")
    path = workdir / "vit_7b_patch16_dinov3_eva_sparse.safetensors"
    subprocess.run([sys.executable, __file__, "make-sparse-7b", str(path), str(depth)], check=True)
    try:
        size = path.stat().st_size
        print(f"file: {path.name}, {size / 1e9:.2f} GB, sparse", flush=True)
        warm(path)
        sides = ["ours7b"] if depth == 40 else ["ours7b", "eva7b"]  # never timm eva's full 7B here
        for side in sides:
            warm(path)
            result = run_child("load", side, str(path), "bfloat16", str(depth))
            anon, file, bf16 = result["anon_mib"], result["file_mib"], result["weights_mib"]
            print(
                f"7B ({depth} blocks) {side[:-2]}, dtype=bfloat16: {result['seconds']:.1f} s, RssAnon +{anon:.0f} MiB "
                f"= {anon / bf16:.2f}x its bf16 size ({bf16 / 1024:.2f} GiB), RssFile +{file:.0f} MiB",
                flush=True,
            )
    finally:
        path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("h-plus", "7b"))
    parser.add_argument("--depth-7b", type=int, default=40, help="blocks of the 7B shape (40: the real one)")
    args = parser.parse_args()
    workdir = args.workdir / "load-benchmark"
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if args.only != "7b":
            bench_h_plus(workdir, args.rounds)
        if args.only != "h-plus":
            bench_7b(workdir, args.depth_7b)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("load", "make-h-plus", "make-sparse-7b"):
        command, *rest = sys.argv[1:]
        {"load": child_load, "make-h-plus": child_make_h_plus, "make-sparse-7b": child_make_sparse_7b}[command](*rest)
    else:
        main()
