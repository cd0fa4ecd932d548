"""`timm-ls convert` and `timm-ls inspect` on many DCP folders in one process, watching what they change in it.

`python dcp_attacks.py PLAN.json RESULTS.json`: PLAN holds `cases` ({name: folder}, valid folders first, so
the imports a first read does are done before anything is compared), `convert` (the arguments after
`convert SRC DST`) and `out` (a folder for the outputs). For each case RESULTS holds both commands' exit
codes and output, every attribute of pathlib, torch and the classes and functions the metadata unpickler
allows that the case added, removed or replaced, the modules it imported and whether convert wrote its
output; `paths_work` says whether
pathlib still gives a fresh path's name and parent.
"""

import io
import json
import pathlib
import sys
from contextlib import redirect_stderr, redirect_stdout

import torch
import torch.serialization
from torch.distributed.checkpoint import filesystem, metadata

from timm_layerscale.checkpoints import dtypes
from timm_layerscale.checkpoints.read.dcp import reader as dcp
from timm_layerscale.checkpoints.read.dcp import unpickler as dcp_unpickler
from timm_ls.main import main

WATCHED = {
    "pathlib": pathlib,
    **{f"pathlib.{name}": getattr(pathlib, name) for name in pathlib.__all__},
    "torch": torch,
    "torch.Size": torch.Size,
    "torch.float32": torch.float32,
    "torch.strided": torch.strided,
    "torch.serialization": torch.serialization,
    "torch.serialization._get_layout": torch.serialization._get_layout,
    "metadata": metadata,
    "filesystem": filesystem,
    **{f"metadata.{cls.__name__}": cls for cls in dcp_unpickler.dataclasses_allowed()},
    "metadata._MEM_FORMAT_ENCODING": metadata._MEM_FORMAT_ENCODING,
    **{f"metadata._MEM_FORMAT_ENCODING.{m.name}": m for m in metadata._MEM_FORMAT_ENCODING},
    "dcp": dcp,
    "dcp_unpickler": dcp_unpickler,
    "dcp_unpickler.layout": dcp_unpickler.layout,
    "dtypes": dtypes,
}


def attributes() -> dict[str, dict[str, object]]:
    """Every watched object's attributes, the values held (so identities stay comparable)."""
    return {name: dict(vars(obj)) if hasattr(obj, "__dict__") else {} for name, obj in WATCHED.items()}


def changes(before: dict[str, dict[str, object]], after: dict[str, dict[str, object]]) -> list[str]:
    gone = object()
    found = []
    for name, was in before.items():
        now = after[name]
        found += [f"{name}.{key}" for key in was.keys() | now.keys() if was.get(key, gone) is not now.get(key, gone)]
    return sorted(found)


def paths_work() -> bool:
    fresh = pathlib.PurePosixPath("run/ckpt/__0_0.distcp")
    return fresh.name == "__0_0.distcp" and pathlib.Path("/a/b").parent == pathlib.Path("/a")


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def main_() -> None:
    plan = json.loads(pathlib.Path(sys.argv[1]).read_text())
    results = {}
    for i, (case, folder) in enumerate(plan["cases"].items()):
        before, modules = attributes(), set(sys.modules)
        dst = str(pathlib.Path(plan["out"]) / f"{i}.pth")
        convert = run(["convert", folder, dst, "--to", "meta", *plan["convert"]])
        inspect = run(["inspect", folder])
        results[case] = {
            "convert": convert,
            "inspect": inspect,
            "changed": changes(before, attributes()),
            "imported": sorted(set(sys.modules) - modules),
            "written": pathlib.Path(dst).exists(),
            "paths_work": paths_work(),
        }
    pathlib.Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main_()
