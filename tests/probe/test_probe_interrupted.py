"""Ctrl-C during `timm-ls probe`'s extraction leaves a consistent cache: every file in it reads whole, and the next
run reads what was cached, runs only the rest and gives the results of an uninterrupted run."""

from __future__ import annotations

import json
import signal

from safetensors import safe_open
from support.writes import frozen_when, signal_frozen, start
from test_probe_cli import OURS, TINY, draw_classes

from timm_ls.main import main


def test_ctrl_c_mid_extraction_leaves_a_cache_the_next_run_resumes_from(tmp_path, capsys):
    data = tmp_path / "data"
    draw_classes(data, {"train": 200, "val": 20})  # 600 train images: three cache files of 256 at most
    argv = ["probe", str(data), "--model", OURS, "--model-kwargs", *TINY, "--max-iter", "30", "--threads", "1"]
    out = tmp_path / "out"
    cached = lambda: list((out / "features").rglob("*.safetensors")) if (out / "features").is_dir() else []  # noqa: E731
    process = start(*argv, "--out", str(out))
    frozen_when(process, lambda: len(cached()) == 1, "the first cache file")
    signal_frozen(process, signal.SIGINT)
    err = process.communicate(timeout=300)[1].decode()
    assert process.returncode == 130 and err.strip().splitlines()[-1].startswith("timm-ls: interrupted"), err
    for path in cached():  # whole: written atomically, nothing half-written beside them
        with safe_open(path, "pt") as whole:
            assert whole.keys()
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]

    assert main([*argv, "--out", str(out)]) == 0
    resumed = capsys.readouterr().out
    assert "256 from the cache" in resumed, resumed
    assert main([*argv, "--out", str(tmp_path / "fresh")]) == 0
    capsys.readouterr()
    again, fresh = (json.loads((d / "results.json").read_text())["rows"][0] for d in (out, tmp_path / "fresh"))
    assert again["knn"] == fresh["knn"] and again["logreg"]["best_c"] == fresh["logreg"]["best_c"]
