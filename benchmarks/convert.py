"""Converting a 7B checkpoint: peak private memory and throughput against a plain file copy.

Writes a synthetic DINOv3 ViT-7B/16 checkpoint in Meta's layout (bf16, 13.4 GB, as a `.pth` like Meta's
release) tensor by tensor, then, in separate processes, alternating:

- copy:   a plain Python read-and-write copy of the same file (64 MiB chunks) with fsync,
- hf:     `convert_checkpoint(SRC, DST, to="hf")` (sharded at 5 GB; the variant inferred from the shapes),
- native: `convert_checkpoint(SRC, DST, to="native")`,
- meta-train: `convert_checkpoint(SRC, DST, to="meta-train")` into a torch.distributed.checkpoint folder: the
  backbone in fp32 (Meta's masters, twice the source's bytes) and new heads of the released models' sizes
  (dino 262,144 x 512 x 8,192, ibot 98,304 x 384 x 4,096: 1.25 GB in fp32), each tensor made as it is written.

Before each run the source's pages are dropped from the page cache (posix_fadvise DONTNEED), so every run
starts from the same cache state. Peak private memory is the child's `RssAnon` (mapped file pages do not
count), sampled from /proc/<pid>/status every 50 ms; time is measured inside the child around the work.
Then the cost of `.pth` output is measured on a 10-block checkpoint of the same shapes: Meta's layout
written as `.safetensors` and as `.pth`.

    python -m benchmarks.convert --workdir /path/with/45GB/free [--rounds 2] [--jobs copy,hf,native,meta-train]

It needs about 13.4 GB of free disk for the source plus the largest output (28 GB for meta-train) and deletes
its files at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

GB = 1e9
CHUNK = 64 << 20


def rss_anon_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def run_child(args: list[str]) -> tuple[float, float]:
    """(seconds the child reports for its work, peak RssAnon in MiB sampled every 50 ms)."""
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], rss_anon_kib(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"child {args} failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])["seconds"], peak[0] / 1024


def evict(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def size_of(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def need_disk(workdir: Path, nbytes: float) -> None:
    free = shutil.disk_usage(workdir).free
    if free < nbytes:
        raise SystemExit(f"{workdir} has {free / GB:.1f} GB free; this step needs {nbytes / GB:.1f} GB")


# ------------------------------------------------------------------------------------------- children


def child_copy(src: str, dst: str) -> None:
    start = time.perf_counter()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK):
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    print(json.dumps({"seconds": time.perf_counter() - start}))


def child_convert(src: str, dst: str, to: str, depth: str) -> None:
    from timm_layerscale import convert_checkpoint

    # The real depth is inferred from the shapes; fewer blocks need the variant named.
    model = None if depth == "40" else "vit_ls_7b_patch16_dinov3"
    if to == "meta-train":
        dst = str(Path(dst).with_suffix(""))  # no suffix: a distributed checkpoint folder
    start = time.perf_counter()
    result = convert_checkpoint(src, dst, to=to, model=model, model_kwargs={"depth": int(depth)} if model else None)
    print(result.summary(), file=sys.stderr)
    print(json.dumps({"seconds": time.perf_counter() - start}))


def child_make(path: str, depth: int) -> None:
    """A synthetic DINOv3 7B checkpoint in Meta's layout, written one tensor at a time."""
    import torch

    from timm_layerscale.checkpoints import TensorInfo
    from timm_layerscale.checkpoints.mapping.fit import own_value
    from timm_layerscale.checkpoints.write.writers import write_safetensors, write_torch_file
    from timm_layerscale.identity import expected_state
    from timm_layerscale.variants import VARIANTS

    config = VARIANTS["vit_ls_7b_patch16_dinov3"].config.replace(num_classes=0, depth=depth)
    shapes = expected_state(config)

    class Synthetic(dict):
        def info(self, key: str) -> TensorInfo:
            dtype = torch.float32 if key.endswith("periods") else torch.bfloat16
            return TensorInfo(shapes[key].shape, dtype)

        def __getitem__(self, key: str) -> torch.Tensor:
            if key.endswith("periods"):
                return own_value(key, shapes[key], config)
            return torch.full(shapes[key].shape, 0.5 + len(key) % 7 / 10, dtype=torch.bfloat16)

        def __iter__(self):
            return iter(shapes)

        def __len__(self) -> int:
            return len(shapes)

    start = time.perf_counter()
    target = Path(path)
    writer = write_safetensors if target.suffix == ".safetensors" else write_torch_file
    writer(target, Synthetic())
    print(json.dumps({"seconds": time.perf_counter() - start}))


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--depth", type=int, default=40, help="blocks of the 7B shape (40: the real one)")
    parser.add_argument("--jobs", default="copy,hf,native,meta-train", help="comma-separated; copy always runs")
    parser.add_argument("--no-pth-cost", action="store_true", help="skip the .pth output cost step")
    args = parser.parse_args()
    workdir = args.workdir / "convert-benchmark"
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "dinov3_vit7b16_synthetic.pth"
    try:
        jobs = ["copy", *(j for j in args.jobs.split(",") if j and j != "copy")]
        largest_output = 28.5 if "meta-train" in jobs else 13.5
        need_disk(workdir, (13.5 + largest_output) * GB * args.depth / 40 + GB)
        seconds, _ = run_child(["make", str(src), str(args.depth)])
        nbytes = size_of(src)
        print(f"source: {src.name}, {nbytes / GB:.2f} GB, written in {seconds:.0f} s", flush=True)
        results: dict[str, list[tuple[float, float]]] = {job: [] for job in jobs}
        for round_ in range(args.rounds):
            turn = round_ % len(jobs)
            for job in jobs[turn:] + jobs[:turn]:
                dst = workdir / f"out-{job}"
                evict(src)
                child = ["copy", str(src), str(dst)]
                if job != "copy":
                    child = ["convert", str(src), str(dst), job, str(args.depth)]
                seconds, peak = run_child(child)
                results[job].append((seconds, peak))
                print(
                    f"round {round_ + 1} {job:6s} {seconds:6.1f} s  {nbytes / GB / seconds:5.2f} GB/s  "
                    f"peak RssAnon {peak:6.0f} MiB  ({size_of(dst) / GB:.2f} GB written)",
                    flush=True,
                )
                remove(dst)
        copy_time = statistics.median(s for s, _ in results["copy"])
        for job in jobs[1:]:
            ratios = [c / s for (s, _), (c, _) in zip(results[job], results["copy"])]
            print(
                f"{job}: median {statistics.median(s for s, _ in results[job]):.1f} s, throughput "
                f"{statistics.median(ratios):.2f} x the copy's (median of rounds; copy {copy_time:.1f} s), "
                f"peak RssAnon {max(p for _, p in results[job]):.0f} MiB"
            )
        remove(src)
        if args.no_pth_cost:
            return

        # The cost of .pth output, on 10 blocks of the same shapes.
        quarter = workdir / "dinov3_vit7b16_10blocks.safetensors"
        run_child(["make", str(quarter), "10"])
        for suffix in (".safetensors", ".pth"):
            dst = workdir / f"out-meta{suffix}"
            evict(quarter)
            seconds, peak = run_child(["convert", str(quarter), str(dst), "meta", "10"])
            print(
                f".pth cost, 10 blocks ({size_of(quarter) / GB:.2f} GB) -> meta {suffix:12s} {seconds:6.1f} s  "
                f"peak RssAnon {peak:6.0f} MiB",
                flush=True,
            )
            remove(dst)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("copy", "convert", "make"):
        command, *rest = sys.argv[1:]
        if command == "copy":
            child_copy(*rest)
        elif command == "convert":
            child_convert(*rest)
        else:
            child_make(rest[0], int(rest[1]))
    else:
        main()
