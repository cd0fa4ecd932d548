"""The command's front answers before torch: `--help`, `--version`, each command's `--help`, a missing source
and a bad destination are checked by `timm_ls` alone, with one line each, the same line in every command."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from timm_ls import paths
from timm_ls.checks import names_a_path
from timm_ls.interrupts import arrived, interruptible
from timm_ls.main import main
from timm_ls.parsers import COMMANDS

# Runs the front in a fresh interpreter and reports which heavy packages it imported.
WATCH = """
import sys
from timm_ls import paths
from timm_ls.checks import names_a_path
from timm_ls.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
heavy = sorted(name for name in ("torch", "timm", "timm_layerscale", "transformers") if name in sys.modules)
print("IMPORTED", ",".join(heavy) or "-", file=sys.stderr)
raise SystemExit(code)
"""


def front(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WATCH, *args], capture_output=True, text=True, timeout=120)


def imported(run: subprocess.CompletedProcess[str]) -> str:
    return run.stderr.strip().splitlines()[-1].removeprefix("IMPORTED ")


@pytest.mark.parametrize("args", [["--help"], ["--version"], *([c, "--help"] for c in COMMANDS)], ids=str)
def test_help_and_version_import_neither_torch_nor_timm(args):
    run = front(*args)
    assert run.returncode == 0, run.stderr
    assert imported(run) == "-"
    assert run.stdout.startswith("usage: timm-ls" if args != ["--version"] else "timm-ls ")


def test_the_module_form_imports_neither_torch_nor_timm():
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "timm_ls", "--help"], capture_output=True, text=True
    )
    assert run.returncode == 0 and "usage: timm-ls" in run.stdout
    loaded = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if "|" in line}
    assert "timm_ls.main" in loaded and not {"torch", "timm", "timm_layerscale"} & loaded


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["convert", "{d}/absent.pth", "{d}/out", "--to", "native"],
            "checkpoint {d}/absent.pth does not exist; pass a weights file",
        ),
        (["export", "{d}/absent.pth", "{d}/m.onnx"], "checkpoint {d}/absent.pth does not exist; pass a weights file"),
        (["inspect", "{d}/absent.pth"], "checkpoint {d}/absent.pth does not exist; pass a weights file"),
        (
            ["inspect", "vit_ls_small_patch16_dinov3", "--checkpoint", "{d}/absent.pth"],
            "checkpoint {d}/absent.pth does not exist",
        ),
        (["demo", "--checkpoint", "{d}/absent.pth"], "checkpoint {d}/absent.pth does not exist; pass a weights file"),
        (
            ["convert", "{d}/src.pth", "{d}/missing/out", "--to", "native"],
            "the folder {d}/missing does not exist; create it first",
        ),
        (
            ["convert", "{d}/src.pth", "{d}/out.pth", "--to", "native"],
            "--to native writes a folder, and out.pth is named like a file; give the folder a name without .pth "
            "(e.g. out)",
        ),
        (
            ["convert", "{d}/src.pth", "{d}/folder", "--to", "meta"],
            "--to meta writes one file: name it .pth, .pt, .bin or .safetensors (got folder)",
        ),
        (
            ["convert", "{d}/src.pth", "{d}/folder.pth", "--to", "meta"],
            "{d}/folder.pth is a folder and --to meta writes a file",
        ),
        (["convert", "{d}/src.pth", "{d}/taken", "--to", "hf"], "{d}/taken exists; pass --overwrite to replace it"),
        (
            ["convert", "{d}/src.pth", "{d}/o", "--to", "onnx"],
            "unknown target 'onnx'; pass --to one of native, meta, meta-train, hf, timm",
        ),
        (["export", "vit_ls_small_patch16_dinov3", "{d}/missing/m.onnx"], "the folder {d}/missing does not exist"),
        (["export", "vit_ls_small_patch16_dinov3", "{d}/taken.onnx"], "{d}/taken.onnx exists; pass --overwrite"),
        (
            ["export", "vit_ls_small_patch16_dinov3", "{d}/m.onnx", "--dtype", "bf16"],
            "unknown dtype 'bf16'; pass --dtype one of fp32, fp16",
        ),
        (["inspect", "{d}/src.pth", "--plot", "{d}/missing/g.png"], "the folder {d}/missing does not exist"),
        (["demo", "--variant", "{d}/absent.yaml"], "variant file {d}/absent.yaml does not exist"),
        (["ablate", "--out", "{d}/missing/out"], "the folder {d}/missing does not exist"),
        (["run", "{d}/train.py"], "script {d}/train.py does not exist"),
        (
            ["features", "{d}/absent.png", "--model", "vit_ls_small_patch16_dinov3", "--out", "{d}/o"],
            "image file {d}/absent.png does not exist; pass the path of an image file or of a folder of them",
        ),
        (
            ["features", "{d}/src.pth", "--model", "vit_ls_small_patch16_dinov3", "--out", "{d}/taken"],
            "{d}/taken exists; pass --overwrite to replace it",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v)[:40],
)
def test_bad_sources_and_destinations_are_one_line_before_torch(args, line, tmp_path):
    (tmp_path / "src.pth").write_bytes(b"not read")
    (tmp_path / "folder.pth").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken.onnx").write_bytes(b"")
    run = front(*(a.format(d=tmp_path) for a in args))
    assert run.returncode == 2 and run.stdout == ""
    error = run.stderr.strip().splitlines()[:-1]
    assert error == [error[0]] and error[0].startswith(f"timm-ls: error: {line.format(d=tmp_path)}"), run.stderr
    assert imported(run) == "-"  # answered before the package (and torch) loaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.pth", "src.pth", "taken", "taken.onnx"]


def test_a_bare_word_is_left_to_the_command_as_a_model_name(capsys):
    assert main(["export", "vit_ls_smal_patch16_dinov3", "m.onnx"]) == 2
    assert "did you mean vit_ls_small_patch16_dinov3" in capsys.readouterr().err


def test_names_with_a_tag_are_not_paths():
    assert not names_a_path("vit_ls_small_patch16_dinov3.lvd1689m")
    assert names_a_path("model.safetensors") and names_a_path("ckpt/12499") and names_a_path("x.YAML")


@pytest.mark.parametrize("model", [[], ["--model", "vit_ls_small_patch16_dinov3"]], ids=["inferred", "given"])
def test_a_bad_model_kwargs_value_is_named_by_what_is_allowed(model, tmp_path, capsys):
    save_file(
        {"cls_token": torch.zeros(1, 1, 384), "storage_tokens": torch.zeros(1, 4, 384)}, tmp_path / "s.safetensors"
    )
    args = ["convert", str(tmp_path / "s.safetensors"), str(tmp_path / "out"), "--to", "native", *model]
    assert main([*args, "--model-kwargs", "depth=abc"]) == 2
    assert "depth: got 'abc'; allowed: an integer in [1, 1024]" in capsys.readouterr().err


def test_the_front_finds_the_shipped_files_where_the_package_is_installed():
    """Without importing the package: its YAML variants, the experiments and the images, installed or checked out."""
    assert (paths.config_dir() / "vit_ls_small_patch16_dinov3.yaml").is_file()
    assert (paths.experiments_dir() / "demo.yaml").is_file() and (paths.experiments_dir() / "ablate.yaml").is_file()
    assert sorted(p.name for p in paths.assets_dir().glob("*.png"))
    installed = paths.package_dir() / "configs"
    assert paths.config_dir() == (installed if installed.is_dir() else paths.package_dir().parent / "configs")


def test_a_folder_target_given_an_existing_file_is_refused(tmp_path):
    (tmp_path / "src.pth").write_bytes(b"never read")
    (tmp_path / "plain").write_bytes(b"mine")
    run = front("convert", str(tmp_path / "src.pth"), str(tmp_path / "plain"), "--to", "hf", "--overwrite")
    assert run.returncode == 2 and f"{tmp_path}/plain is a file and --to hf writes a folder" in run.stderr
    assert (tmp_path / "plain").read_bytes() == b"mine"


def test_a_missing_variant_file_is_named_as_one_in_every_command(tmp_path, capsys):
    for args in (["inspect", str(tmp_path / "v.yaml")], ["export", str(tmp_path / "v.yaml"), str(tmp_path / "m.onnx")]):
        assert main(args) == 2
        assert capsys.readouterr().err == f"timm-ls: error: variant file {tmp_path}/v.yaml does not exist; " + (
            "pass the path of a YAML variant file or a registered name (`timm-ls list`)\n"
        )


def test_an_os_error_of_a_command_is_one_line(tmp_path, capsys):
    (tmp_path / "script.py").write_text("open('/nonexistent-folder/file')\n")
    assert main(["run", str(tmp_path / "script.py")]) == 2
    assert capsys.readouterr().err == (
        "timm-ls: error: [Errno 2] No such file or directory: '/nonexistent-folder/file'\n"
    )


def test_a_signal_is_known_to_have_come_where_library_code_turned_it_into_its_own_error():
    """torch's loaders catch an exception raised inside them and raise their own: the command can still tell
    that a signal came (the entry point then reports the signal, not the library's words)."""
    with interruptible():
        assert arrived() is None
        try:
            try:
                signal.raise_signal(signal.SIGTERM)  # the command's handler raises Interrupted right here
            except KeyboardInterrupt:
                raise ValueError("could not determine the shape of object type 'UntypedStorage'") from None
        except ValueError:
            pass
    assert arrived() == signal.SIGTERM
    with interruptible():
        assert arrived() is None  # each command starts with none
