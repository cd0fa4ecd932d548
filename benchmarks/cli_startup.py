"""How soon `timm-ls` answers when it need not load torch: help, version, and input it refuses.

    python -m benchmarks.cli_startup [--rounds 10]

Each case is a whole `timm-ls` process (the console script of this environment), timed from start to exit, in
turns with `python -c "import torch"` in the same round; the figure is the median over rounds of the ratio of
the two (target: at most 0.2). The refused cases are a missing source (a path that does not exist) and a bad
destination (a folder target named like a file), which the front answers before loading the command's module.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 0.2
COMMANDS = ("demo", "inspect", "ablate", "list", "run", "convert", "export")


def cases(script: str, tmp: Path) -> dict[str, list[str]]:
    (tmp / "src.pth").write_bytes(b"never read")
    found = {"--help": [script, "--help"], "--version": [script, "--version"]}
    found.update({f"{command} --help": [script, command, "--help"] for command in COMMANDS})
    found["missing source"] = [script, "convert", str(tmp / "absent.pth"), str(tmp / "out"), "--to", "native"]
    found["bad destination"] = [script, "convert", str(tmp / "src.pth"), str(tmp / "out.pth"), "--to", "native"]
    found["python -m timm_ls --help"] = [sys.executable, "-m", "timm_ls", "--help"]
    return found


def seconds(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(args, capture_output=True, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    script = shutil.which("timm-ls", path=str(Path(sys.executable).parent))
    if script is None:
        raise SystemExit("timm-ls is not installed beside this Python: pip install -e . first")
    torch_import = [sys.executable, "-c", "import torch"]
    with tempfile.TemporaryDirectory() as tmp:
        found = cases(script, Path(tmp))
        ratios: dict[str, list[float]] = {name: [] for name in found}
        baseline = []
        for _ in range(args.rounds):
            base = seconds(torch_import)
            baseline.append(base)
            for name, command in found.items():
                ratios[name].append(seconds(command) / base)
    print(f"{args.rounds} rounds; import torch: median {statistics.median(baseline) * 1e3:.0f} ms (the unit)")
    for name, values in ratios.items():
        ratio = statistics.median(values)
        print(f"{name:28s} {ratio:5.3f} x import torch  {'ok' if ratio <= TARGET else 'over ' + str(TARGET)}")


if __name__ == "__main__":
    main()
