"""What registering the variants on `import timm` costs: at interpreter start, and at timm's import.

    python -m benchmarks.startup [--rounds 20]

Every figure comes from fresh interpreters of this environment, the switch on and off in turn, and is a median:

- start-up hook: what `site` runs for `timm_layerscale-autoregister.pth` (import the hook module, put its
  finder on `sys.meta_path`), timed inside the interpreter;
- `python -c pass`, whole process, switch on and off;
- registering: `import timm_layerscale` right after `import timm` (the switch off), which is the work the
  hook adds to timm's import, timed inside the interpreter;
- `import timm` inside the interpreter, switch on (timm_layerscale imported, variants registered) and off;
  torch's own import dominates this one, and its disk reads make it the noisiest figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PTH = Path(sysconfig.get_paths()["purelib"]) / "timm_layerscale-autoregister.pth"
SWITCH = "TIMM_LAYERSCALE_AUTOREGISTER"
# The .pth line as `site` runs it, in an interpreter started with -S: the other .pth files first (an editable
# install's finder among them), untimed.
TIME_HOOK = f"""
import os, site, sys, time
sitedir = {str(PTH.parent)!r}
sys.path.append(sitedir)
for name in sorted(os.listdir(sitedir)):
    if name.endswith(".pth") and name != {PTH.name!r}:
        site.addpackage(sitedir, name, None)
line = open({str(PTH)!r}).read()
start = time.perf_counter()
exec(line)
print(time.perf_counter() - start)
"""
TIMED = "import time{setup}; start = time.perf_counter(); import {module}; print(time.perf_counter() - start)"
TIME_IMPORT = TIMED.format(setup="", module="timm")
TIME_REGISTER = TIMED.format(setup=", timm", module="timm_layerscale")


def run(args: list[str], switch: str) -> tuple[float, str]:
    env = {**os.environ, SWITCH: switch}
    start = time.perf_counter()
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    return time.perf_counter() - start, out


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    if not PTH.is_file():
        raise SystemExit(f"{PTH} is missing: install the package (pip install . or pip install -e .) first")
    hook, register, blank, timm_import = [], [], {"1": [], "0": []}, {"1": [], "0": []}
    for _ in range(args.rounds):
        hook.append(float(run([sys.executable, "-S", "-c", TIME_HOOK], "1")[1]))
        register.append(float(run([sys.executable, "-c", TIME_REGISTER], "0")[1]))
        for switch in ("1", "0"):
            blank[switch].append(run([sys.executable, "-c", "pass"], switch)[0])
            timm_import[switch].append(float(run([sys.executable, "-c", TIME_IMPORT], switch)[1]))
    print(f"{args.rounds} rounds, Python {sys.version.split()[0]}, {sys.executable}")
    rows = {
        "start-up hook (.pth line)": hook,
        "python -c pass, switch on": blank["1"],
        "python -c pass, switch off": blank["0"],
        "registering (import timm_layerscale)": register,
        "import timm, switch on (registers)": timm_import["1"],
        "import timm, switch off": timm_import["0"],
    }
    for name, values in rows.items():
        print(f"{name:38s}{median_ms(values)}")


if __name__ == "__main__":
    main()
