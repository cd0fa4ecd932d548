"""A Hub error met on a command line names that command line's way to a local file, not a Python argument.

`timm-ls` commands name their own flag or form; timm's scripts, told apart by their name in `sys.argv[0]`,
name theirs (train.py's `--pretrained-path`, validate.py's `--checkpoint`); Python code keeps
`pretrained_cfg_overlay=dict(file=PATH)`. The Hub is the loopback server of `support.hub_server`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import timm
from safetensors.torch import save_file
from support.hub_server import LocalHub, closed_port_url, hub_env, point_client_at

from timm_layerscale.hub import HUB_TIMEOUT_VARIABLE, PYTHON_LOCAL_FILE, HubError, local_way_out
from timm_ls.main import main

HUB_ID = "timm/vit_small_patch16_dinov3_qkvb.lvd1689m"  # the hf_hub_id of vit_ls_small_patch16_dinov3.lvd1689m
NAME = "vit_ls_small_patch16_dinov3"
MAIN_JOB = ["--pretrained", "--no-plot", "--model-kwargs", "depth=2"]
INSPECT = ["inspect", NAME, "--pretrained"]
PYTHON_WAYS = ("pretrained_cfg_overlay", "hf_hub_filename")
SCRIPT = """
import timm, timm_layerscale
try:
    timm.create_model("vit_ls_small_patch16_dinov3.lvd1689m", pretrained=True, depth=2)
except Exception as exc:
    print(exc)
"""


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A Hub whose HUB_ID holds a file but no weights (HTTP 404 for them); this process's client, with an empty
    cache, talking to it."""
    (tmp_path / "root" / HUB_ID).mkdir(parents=True)
    save_file({}, tmp_path / "root" / HUB_ID / "other.safetensors")
    with LocalHub(tmp_path / "root") as server:
        point_client_at(server, tmp_path / "hf_home", monkeypatch)
        monkeypatch.setenv(HUB_TIMEOUT_VARIABLE, "5")
        yield server


def one_error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert not any(way in err for way in PYTHON_WAYS), err
    return err.strip()


@pytest.mark.parametrize("broken", [False, True], ids=["no weights file", "HTTP 500, nothing cached"])
def test_commands_name_their_own_way_to_a_local_file(hub: LocalHub, broken: bool, capsys, tmp_path) -> None:
    if broken:
        hub.broken.add(HUB_ID)
    problem = "answered HTTP 500" if broken else f"{HUB_ID} has no model.safetensors"
    line = one_error_line(MAIN_JOB, capsys)
    assert problem in line and line.endswith(", or pass the downloaded file instead with --checkpoint FILE")
    line = one_error_line(INSPECT, capsys)
    assert line.startswith("timm-ls: error: --pretrained: ") and problem in line
    assert line.endswith(", or pass the downloaded file instead: timm-ls inspect FILE")
    line = one_error_line(["export", f"{NAME}.lvd1689m", str(tmp_path / "m.onnx"), "--pretrained"], capsys)
    assert problem in line and line.endswith(
        ", or pass the downloaded file instead: timm-ls export FILE DST.onnx --model NAME"
    )
    assert not (tmp_path / "m.onnx").exists()


def test_the_same_error_in_python_names_pretrained_cfg_overlay(hub: LocalHub) -> None:
    hub.broken.add(HUB_ID)
    with pytest.raises(HubError, match=r"try again later, or pass pretrained_cfg_overlay=dict\(file=PATH\)$"):
        timm.create_model(f"{NAME}.lvd1689m", pretrained=True, depth=2)


@pytest.mark.parametrize(
    ("script", "way_out"),
    [
        ("train.py", "pass a local file with train.py's --pretrained-path PATH"),
        ("validate.py", "pass a local file with validate.py's --checkpoint PATH (without --pretrained)"),
        ("my_train.py", PYTHON_LOCAL_FILE),
    ],
)
def test_timms_scripts_are_told_by_name(tmp_path: Path, script: str, way_out: str) -> None:
    (tmp_path / script).write_text(SCRIPT)
    env = hub_env(type("Hub", (), {"url": closed_port_url()})(), tmp_path / "hf_home")
    env[HUB_TIMEOUT_VARIABLE] = "2"
    run = subprocess.run([sys.executable, tmp_path / script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith(f"reachable, or {way_out}"), run.stdout
    assert local_way_out(argv0=f"/somewhere/{script}") == way_out
