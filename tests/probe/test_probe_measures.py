"""The probe says what it measured: the table and results.json name the tokens each protocol read (kNN the CLS
token, whatever --tokens says), and features alike across images (a random-init model's CLS tokens) give one
warning line naming them and what to pass instead, where features that differ give none."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file
from support import move_off_init_
from test_probe_cli import OURS, TINY, draw_classes, probe

from timm_layerscale.probe.evaluate import spread
from timm_layerscale.probe.results import ALIKE, flat_features_warnings
from timm_ls.main import main


def random_init(data, out, *extra: str) -> list[str]:
    args = ["probe", str(data), "--model", OURS, "--model-kwargs", *TINY, "--threads", "1", "--max-iter", "30"]
    return [*args, "--val-split", "0.5", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    draw_classes(root, {"train": 8})
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model moved off its init (its tokens differ across images), as a --checkpoint file."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save_file(move_off_init_(timm.create_model(OURS, depth=2, embed_dim=64, num_heads=2)).state_dict(), path)
    return path


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("timm-ls: warning:")]


def test_a_random_init_models_alike_cls_tokens_are_one_warning_naming_them(data, tmp_path, capsys):
    assert main(random_init(data, tmp_path / "out")) == 0
    out, err = capsys.readouterr()
    (line,) = warnings_of(err)
    assert f"{OURS} layer last: the CLS tokens read by kNN and the logistic regression are alike" in line
    assert "pass --tokens avgpool or a trained checkpoint" in line
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert row["tokens"] == {"knn": "cls", "logreg": "cls"}
    assert row["seeds"] == {"val_split": 0, "logreg_holdout": 0, "head": None}
    assert row["spread"]["knn"] < ALIKE and row["spread"]["knn"] == row["spread"]["logreg"]
    header = out.splitlines()[1].split()
    assert header[:4] == ["model", "layer", "kNN", "tokens"] and "logreg" in header


def test_with_avgpool_the_knn_columns_still_say_cls_and_only_knns_tokens_are_warned_of(data, tmp_path, capsys):
    assert main(random_init(data, tmp_path / "out", "--tokens", "avgpool")) == 0
    out, err = capsys.readouterr()
    (line,) = warnings_of(err)
    assert "the CLS tokens read by kNN are alike" in line and "logistic" not in line
    assert "--tokens avgpool" not in line and "pass a trained checkpoint" in line
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert row["tokens"] == {"knn": "cls", "logreg": "avgpool"} and row["spread"]["logreg"] > 100 * ALIKE
    body = out.splitlines()[2].split()
    assert body[:3] == [OURS, "last", "cls"] and "avgpool" in body[3:]


def test_features_that_differ_across_images_give_no_warning(data, tmp_path, trained, capsys):
    assert main(probe(data, tmp_path / "out", trained, "--val-split", "0.5", "--tokens", "cls+avgpool")) == 0
    assert warnings_of(capsys.readouterr().err) == []
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert row["tokens"] == {"knn": "cls", "logreg": "cls+avgpool"} and min(row["spread"].values()) > 100 * ALIKE


@pytest.mark.parametrize(
    ("spread", "tokens", "words"),
    [
        ({"knn": 0.0, "logreg": 0.5}, "cls+avgpool", "the CLS tokens read by kNN are alike"),
        ({"knn": 0.5, "logreg": ALIKE / 2}, "cls+avgpool", "CLS+avgpool tokens read by the logistic regression"),
        ({"knn": 0.5, "logreg": 0.0}, "avgpool", "pass a trained checkpoint"),
        ({"knn": 0.0, "logreg": 0.0}, "cls", "pass --tokens avgpool or a trained checkpoint"),
    ],
)
def test_the_warning_names_only_the_alike_tokens_and_their_readers(spread, tokens, words):
    row = {"model": "m", "layer": "0", "spread": spread, "tokens": {"knn": "cls", "logreg": tokens}}
    (line,) = flat_features_warnings(row)
    assert words in line and line.startswith("m layer 0: ") and "\n" not in line


def test_at_the_bound_and_for_segmentation_rows_nothing_is_said():
    assert flat_features_warnings({"spread": {"knn": ALIKE, "logreg": 1.0}, "tokens": {}}) == []
    assert flat_features_warnings({"miou": 40.0}) == []


def test_spread_is_the_spread_across_images_relative_to_the_magnitude():
    same = torch.tensor([[3.0, -1.0], [3.0, -1.0], [3.0, -1.0]])
    assert spread(same) == 0.0 and spread(torch.zeros(4, 3)) == 0.0
    varied = torch.tensor([[1.0, 10.0], [3.0, 10.0]])  # stds 1.41 and 0 over the rows, mean magnitude 6
    assert spread(varied) == pytest.approx(2**0.5 / 2 / 6)
    assert spread(varied * 1000) == pytest.approx(spread(varied))
