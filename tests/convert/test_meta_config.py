"""`--meta-config`: Meta's training YAML may size the heads, and must keep iBOT's head separate.

Meta's trainer builds a separate `ibot_head` only when `ibot.separate_head` is true (the YAML boolean); any
other value, falsy or not, is refused before anything is written, through `convert_checkpoint` and the CLI.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from support import FIXTURES, META_CONFIGS, VARIANT

from timm_layerscale import CheckpointError, convert_checkpoint
from timm_ls.main import main

SOURCE = FIXTURES / "meta_mlp.safetensors"
MODEL_KWARGS = {k: META_CONFIGS["meta_mlp"][k] for k in ("embed_dim", "depth", "num_heads", "ffn_ratio")}
HEADS = "  head_n_prototypes: 16\n  head_bottleneck_dim: 8\n  head_hidden_dim: 32\n  head_nlayers: 2\n"


def config(path: Path, separate_head: str | None) -> Path:
    ibot = HEADS + (f"  separate_head: {separate_head}\n" if separate_head is not None else "")
    path.write_text(f"dino:\n{HEADS}ibot:\n{ibot}")
    return path


def to_meta_train(dst: Path, meta_config: Path):
    return convert_checkpoint(
        SOURCE, dst, to="meta-train", model=VARIANT["mlp"], model_kwargs=MODEL_KWARGS, meta_config=meta_config
    )


@pytest.mark.parametrize(
    ("value", "shown"),
    [("0", "0"), ('"no"', "no"), ("null", "None"), ("~", "None"), ("false", "False"), ("1", "1"), ('"true"', "true")],
)
def test_anything_but_true_is_refused(tmp_path, value, shown):
    path = config(tmp_path / "heads.yaml", value)
    with pytest.raises(CheckpointError) as info:
        to_meta_train(tmp_path / "out.pth", path)
    assert str(info.value) == (
        f"--meta-config {path} sets ibot.separate_head: {shown}; Meta's trainer requires true (a separate ibot_head)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.yaml"]


@pytest.mark.parametrize("value", ["true", None], ids=["true", "absent"])
def test_true_or_absent_is_a_separate_head(tmp_path, value):
    to_meta_train(tmp_path / "out.pth", config(tmp_path / "heads.yaml", value))
    written = torch.load(tmp_path / "out.pth", weights_only=True)["teacher"]
    assert written["ibot_head.last_layer.weight"].shape == written["dino_head.last_layer.weight"].shape == (16, 8)


def test_the_cli_refuses_it_in_one_line_exit_2(tmp_path):
    path = config(tmp_path / "heads.yaml", "0")
    args = ["convert", str(SOURCE), str(tmp_path / "out.pth"), "--to", "meta-train", "--model", VARIANT["mlp"]]
    args += ["--model-kwargs", *(f"{k}={v}" for k, v in MODEL_KWARGS.items()), "--meta-config", str(path)]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(args)
    assert (code, out.getvalue()) == (2, "")
    assert err.getvalue() == f"timm-ls: error: --meta-config {path} sets ibot.separate_head: 0; Meta's trainer " + (
        "requires true (a separate ibot_head)\n"
    )
    assert not (tmp_path / "out.pth").exists()
