"""No Hub and nothing cached: how long each pretrained entry point takes to say so, beyond its imports.

    python -m benchmarks.hub_offline [--rounds 5] [--guard 120]

Three entry points, each in fresh processes with an empty `HF_HOME` and every timeout at its default:
`timm.create_model("vit_ls_small_patch16_dinov3.lvd1689m", pretrained=True)` (its `HubError` printed as one
line), `timm-ls --pretrained` (the main job: its warning line, then random weights) and `timm-ls inspect
vit_ls_small_patch16_dinov3 --pretrained` (its error line). Two unreachable Hubs as `HF_ENDPOINT`: a loopback
port nothing listens on (refused at once), and a loopback server that accepts connections and never answers
(it counts them). Timed: from starting the process to its first line on stderr, minus the same for a process
that only does the entry point's imports and then prints a line (`import torch, timm, timm_layerscale`, and
for the CLI its front and the command's module) in the same round. Medians over the rounds; within a round
every process takes its turn.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from importlib.metadata import version
from pathlib import Path

from timm_ls.cpu import cpu_model

TARGET_S = 5.0
IMPORTS = "import torch, timm, timm_layerscale"
SAY_IMPORTED = "; import sys; print('imported', file=sys.stderr)"
CREATE_MODEL = f"""{IMPORTS}
try:
    timm.create_model("vit_ls_small_patch16_dinov3.lvd1689m", pretrained=True)
except timm_layerscale.HubError as exc:
    import sys
    print(f"HubError: {{exc}}", file=sys.stderr)
"""
CLI = [sys.executable, "-m", "timm_ls"]
# name: (command, the modules it imports before it asks the Hub)
ENTRY_POINTS = {
    "create_model(pretrained=True)": ([sys.executable, "-c", CREATE_MODEL], IMPORTS),
    "timm-ls --pretrained": ([*CLI, "--pretrained", "--no-plot"], f"{IMPORTS}, timm_ls.main, timm_layerscale.cli.demo"),
    "timm-ls inspect --pretrained": (
        [*CLI, "inspect", "vit_ls_small_patch16_dinov3", "--pretrained"],
        f"{IMPORTS}, timm_ls.main, timm_layerscale.cli.inspection",
    ),
}
UNSET = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")


class BlackHole:
    """A loopback endpoint that accepts connections, counts them and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.listener.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        self.listener.close()
        for connection in self.held:
            connection.close()


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def environment(endpoint: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET and not k.startswith("TIMM_LAYERSCALE_HUB")}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}


def to_first_line(command: list[str], env: dict[str, str], guard_s: float) -> tuple[float, int]:
    """Seconds from starting `command` to its first stderr line (inf past `guard_s`), and its stderr lines."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(guard_s, process.kill)
    timer.start()
    first = process.stderr.readline()
    seconds = time.perf_counter() - start if first and timer.is_alive() else float("inf")
    lines = int(bool(first)) + len(process.stderr.read().splitlines())
    process.wait()
    timer.cancel()
    return seconds, lines


def measure(rounds: int, guard_s: float) -> tuple[dict[str, list[float]], dict[tuple[str, str], dict]]:
    baselines: dict[str, list[float]] = {imports: [] for _, imports in ENTRY_POINTS.values()}
    runs = {(e, h): {"seconds": [], "lines": set(), "connections": []} for e in ENTRY_POINTS for h in ("port", "hole")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for imports, seconds in baselines.items():
                command = [sys.executable, "-c", imports + SAY_IMPORTED]
                seconds.append(to_first_line(command, environment(closed_port_url(), Path(tmp)), guard_s)[0])
            for (entry, hub), found in runs.items():
                hole = BlackHole() if hub == "hole" else None
                env = environment(hole.url if hole else closed_port_url(), Path(tmp) / f"{r}-{len(found['seconds'])}")
                seconds, lines = to_first_line(ENTRY_POINTS[entry][0], env, guard_s)
                found["seconds"].append(seconds)
                found["lines"].add(lines)
                if hole:
                    found["connections"].append(len(hole.held))
                    hole.close()
            print(f"round {r + 1} of {rounds} done", file=sys.stderr, flush=True)
    return baselines, runs


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores"


def report(baselines: dict[str, list[float]], runs: dict[tuple[str, str], dict], rounds: int) -> str:
    hubs = {"port": "closed port", "hole": "silent server"}
    rows = [
        "| entry point | Hub | to the line, s | imports, s | beyond imports, s [range] | connections | stderr lines |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for (entry, hub), found in runs.items():
        imports = baselines[ENTRY_POINTS[entry][1]]
        beyond = sorted(total - base for total, base in zip(found["seconds"], imports))  # within each round
        worst = max(worst, statistics.median(beyond))
        connections = ", ".join(map(str, sorted(set(found["connections"])))) or "-"
        rows.append(
            f"| `{entry}` | {hubs[hub]} | {statistics.median(found['seconds']):.2f} | {statistics.median(imports):.2f} "
            f"| **{statistics.median(beyond):.2f}** [{beyond[0]:.2f} to {beyond[-1]:.2f}] | {connections} | "
            f"{', '.join(map(str, sorted(found['lines'])))} |"
        )
    head = (
        f"{date.today().isoformat()}; {machine()}; Python {platform.python_version()}, torch {version('torch')}, "
        f"timm {version('timm')}, huggingface_hub {version('huggingface_hub')}; {rounds} rounds, medians"
    )
    verdict = "met" if worst < TARGET_S else "MISSED"
    return f"{head}\n\n" + "\n".join(rows) + f"\n\nTarget: under {TARGET_S:g} s beyond the imports: {verdict}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--guard", type=float, default=120.0, help="seconds after which a process is killed")
    args = parser.parse_args()
    baselines, runs = measure(args.rounds, args.guard)
    print(report(baselines, runs, args.rounds))


if __name__ == "__main__":
    main()
