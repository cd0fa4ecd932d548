"""The variants are registered whenever timm is imported, in programs that never import timm_layerscale.

Each case is a fresh interpreter of this environment, where the package is installed (as a wheel in CI, or
editable): what runs is the installed start-up file, exactly as users get it. The cases run side by side.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import pkgutil
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import timm
import torch
from packaging.requirements import Requirement
from support import REPO, TINY
from support.hub_server import LocalHub, hub_env
from timm.models import save_for_hf

import _timm_layerscale_autoregister as autoregister

NAME = "vit_ls_small_patch16_dinov3"
UNKNOWN = f"Unknown model ({NAME})"

# Start-up state, then timm's create_model by name and from a local-dir: folder, never importing the package.
USE = f"""
import sys
startup = sorted(m for m in ("torch", "timm", "timm_layerscale", "yaml") if m in sys.modules)
import _timm_layerscale_autoregister
_timm_layerscale_autoregister.install()  # a second call adds nothing
hooks = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "TimmImportHook"]
print("startup", startup, hooks)

class Watch:  # sees the registration start: timm's own import must be complete by then
    def find_spec(self, name, path=None, target=None):
        if name == "timm_layerscale" and "timm" in sys.modules:
            print("registering after timm's import:", hasattr(sys.modules["timm"], "get_pretrained_cfg_value"))

sys.meta_path.insert(0, Watch())
if sys.argv[3] == "on":  # a second finder that asks the others (another package's, say): neither may recurse
    sys.meta_path.insert(0, _timm_layerscale_autoregister.TimmImportHook())
import importlib.util
spec = importlib.util.find_spec("timm")  # "is timm installed?", as transformers asks, before any import
print("find_spec", spec.loader.is_package("timm"))
import timm, torch

def build(name, **kwargs):
    try:
        return timm.create_model(name, **kwargs)
    except RuntimeError as error:
        print("error", error)

model = build("{NAME}", **{TINY!r})
if model is not None:
    print("by name", type(model).__name__, len(model.blocks))
expected = torch.load(sys.argv[2], weights_only=True)
names = ["local-dir:" + sys.argv[1]] + (["hf-hub:someone/their-vit-ls"] if sys.argv[3] == "on" else [])
for name in names:
    model = build(name, pretrained=True)
    if model is not None:
        print(name.split(":")[0], all(torch.equal(v, expected[k]) for k, v in model.state_dict().items()))
print("after", "timm_layerscale" in sys.modules, type(timm.__spec__.loader).__name__,
      [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "TimmImportHook"])
if sys.argv[3] == "off":  # timm already imported when the hook is installed: it registers at once
    import os
    os.environ["TIMM_LAYERSCALE_AUTOREGISTER"] = "1"
    import _timm_layerscale_autoregister
    _timm_layerscale_autoregister.install()
    print("late install", bool(timm.list_models("{NAME}")))
"""

# A module that torchrun runs as `python -m`, whose DataLoader workers build the model by name in each start
# method (spawn and forkserver start fresh interpreters).
WORKERS = f"""
import multiprocessing, os, sys
import timm, torch

class Models(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, index):
        model = timm.create_model("{NAME}", **{TINY!r})
        return sum(k.endswith("gamma") for k in model.state_dict())

if __name__ == "__main__":
    print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "as", __spec__.name)
    for method in ("fork", "spawn", "forkserver"):
        context = multiprocessing.get_context(method)
        loader = torch.utils.data.DataLoader(Models(), num_workers=1, multiprocessing_context=context)
        print(method, int(next(iter(loader))), "timm_layerscale" in sys.modules)
"""

BROKEN_PACKAGE = "raise ImportError('this copy of timm_layerscale is broken')\n"
EXITING_PACKAGE = "raise SystemExit('this copy of timm_layerscale exits')\n"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("autoregister")
    model = timm.create_model(NAME, num_classes=3, **TINY)
    save_for_hf(model, root / "saved", safe_serialization=True)
    save_for_hf(model, root / "hub" / "someone" / "their-vit-ls", safe_serialization=True)
    torch.save(model.state_dict(), root / "expected.pth")
    (root / "use.py").write_text(USE)
    (root / "workers_probe.py").write_text(WORKERS)
    (root / "broken" / "timm_layerscale").mkdir(parents=True)
    (root / "broken" / "timm_layerscale" / "__init__.py").write_text(BROKEN_PACKAGE)
    (root / "exiting" / "timm_layerscale").mkdir(parents=True)
    (root / "exiting" / "timm_layerscale" / "__init__.py").write_text(EXITING_PACKAGE)

    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", autoregister.SWITCH)}
    base.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    hook_folder = str(Path(autoregister.__file__).parent)
    use = [sys.executable, str(root / "use.py"), str(root / "saved"), str(root / "expected.pth")]
    cases = {
        "on": ([*use, "on"], {}),
        "off": ([*use, "off"], {autoregister.SWITCH: "0"}),
        # The broken package first, then the start-up hook this process imported (the installed one in CI).
        "broken": ([*use, "broken"], {"PYTHONPATH": os.pathsep.join([str(root / "broken"), hook_folder])}),
        "exiting": ([*use, "exiting"], {"PYTHONPATH": os.pathsep.join([str(root / "exiting"), hook_folder])}),
        "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "-m", "workers_probe"], {}),
    }
    with LocalHub(root / "hub") as hub:  # "on" also builds hf-hub:someone/their-vit-ls from it
        online = {k: v for k, v in hub_env(hub, root / "hf_home").items() if k.startswith("HF_")}
        envs = {name: {**base, **extra} for name, (_, extra) in cases.items()}
        envs["on"] = {k: v for k, v in {**envs["on"], **online}.items() if k != "HF_HUB_OFFLINE"}
        procs = {
            name: subprocess.Popen(
                args, cwd=root, env=envs[name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for name, (args, _) in cases.items()
        }
        outputs = {name: p.communicate(timeout=300) for name, p in procs.items()}
    return {name: Run(procs[name].returncode, *out) for name, out in outputs.items()}


REGISTERING = "registering after timm's import: True"


def test_interpreter_start_imports_neither_torch_nor_timm(runs: dict[str, Run]) -> None:
    assert runs["on"].stdout.splitlines()[0] == "startup [] ['TimmImportHook']"


def test_importing_timm_registers_the_variants(runs: dict[str, Run]) -> None:
    run = runs["on"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[1:] == [
        "find_spec True",
        REGISTERING,
        "by name VisionTransformerLS 2",
        "local-dir True",  # a folder saved from a vit_ls model rebuilds
        "hf-hub True",  # and so does a Hub repository of one
        "after True SourceFileLoader []",  # timm keeps its own loader; the hook is gone
    ]


def test_switched_off_both_fail_as_timm_does(runs: dict[str, Run]) -> None:
    run = runs["off"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "startup [] []",
        "find_spec True",
        f"error {UNKNOWN}",
        f"error {UNKNOWN}",
        "after False SourceFileLoader []",
        REGISTERING,  # installed after timm's import: registers at once
        "late install True",
    ]


@pytest.mark.parametrize(
    "case, error",
    [
        ("broken", "ImportError: this copy of timm_layerscale is broken"),
        ("exiting", "SystemExit: this copy of timm_layerscale exits"),
    ],
)
def test_a_failed_registration_warns_and_leaves_timm_working(runs: dict[str, Run], case: str, error: str) -> None:
    run = runs[case]
    assert run.returncode == 0, run.stderr
    after = "after False SourceFileLoader []"
    assert run.stdout.splitlines()[1:] == ["find_spec True", REGISTERING, f"error {UNKNOWN}", f"error {UNKNOWN}", after]
    assert "RuntimeWarning: timm-layerscale could not register the vit_ls_* models with timm " in run.stderr
    assert f"({error}); timm works without them" in run.stderr
    assert run.stderr.count("could not register") == 1


def test_torchrun_python_m_and_every_dataloader_start_method(runs: dict[str, Run]) -> None:
    run = runs["torchrun"]
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines == ["rank 0 of 1 as workers_probe", "fork 4 True", "spawn 4 True", "forkserver 4 True"]


def test_installed_start_up_files_are_recorded_and_run_after_editable_finders() -> None:
    # The installed copy, not whatever metadata sys.path shows first: `python -m pytest` puts the working
    # directory first, where a source tree's `*.egg-info` has no start-up files.
    installed = importlib.metadata.distributions(name="timm-layerscale", path=site.getsitepackages())
    distribution = next(iter(installed))
    files = {f.name: f for f in distribution.files if f.name.startswith("timm_layerscale-autoregister.")}
    assert sorted(files) == ["timm_layerscale-autoregister.pth", "timm_layerscale-autoregister.start"]
    for record in files.values():  # listed in RECORD, so that uninstalling removes them
        digest = hashlib.sha256(Path(record.locate()).read_bytes()).digest()
        assert record.hash.value == base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    pth, start = (Path(files[n].locate()) for n in sorted(files))
    assert str(pth.parent) in site.getsitepackages() and start.parent == pth.parent
    assert pth.read_text() == "import _timm_layerscale_autoregister; _timm_layerscale_autoregister.install()\n"
    assert pkgutil.resolve_name(start.read_text().strip()) is autoregister.install  # PEP 829, Python 3.15+
    editable = [p.name for p in pth.parent.glob("__editable__*.pth")] + ["__editable__.timm_layerscale-9.pth"]
    assert max([*editable, pth.name]) == pth.name  # site runs .pth files in name order


def test_the_switch_reads_common_spellings_of_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in (("0", False), ("off", False), ("False", False), ("no", False), ("1", True), ("", True)):
        monkeypatch.setenv(autoregister.SWITCH, value)
        assert autoregister.enabled() is expected
    monkeypatch.delenv(autoregister.SWITCH)
    assert autoregister.enabled()


def test_the_build_asks_for_a_setuptools_that_reads_the_license_string() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)  # an SPDX string: setuptools 77 or later (PEP 639)
    (setuptools,) = (r for r in map(Requirement, project["build-system"]["requires"]) if r.name == "setuptools")
    assert "76.3" not in setuptools.specifier and "77.0" in setuptools.specifier
