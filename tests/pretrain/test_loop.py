"""The pretraining loop: the batches it makes, a resumed run equal to an uninterrupted one to the bit, two
gloo ranks equal to one process on the same global batch, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from loop_fixture import Regress
from support import free_port, image_folder

from timm_layerscale.pretrain.checkpoint import CHECKPOINT_DIR, STATE_FILE, TENSORS_FILE, read_settings
from timm_layerscale.pretrain.data import global_batch, make_batch
from timm_layerscale.pretrain.loop import METRICS_FILE, Loop, LoopConfig
from timm_layerscale.pretrain.method import Shard


def test_each_epoch_takes_every_image_once_and_a_batch_runs_on_into_the_next():
    seen = [i for step in range(5) for i in global_batch(10, 4, seed=3, step=step)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != list(range(10))  # shuffled
    assert global_batch(10, 4, seed=3, step=2) == seen[8:12]  # across the epoch's end
    assert global_batch(10, 4, seed=4, step=0) != seen[:4]


def test_a_step_s_batch_is_made_again_the_same_and_ranks_hold_its_halves(tmp_path):
    files, method = image_folder(tmp_path), Regress()
    whole = make_batch(method, files, 4, seed=1, step=5)
    torch.manual_seed(123)  # the caller's generator plays no part
    again = make_batch(method, files, 4, seed=1, step=5)
    halves = [make_batch(method, files, 4, seed=1, step=5, shard=Shard(r, 2)) for r in (0, 1)]
    for key in whole:
        assert torch.equal(whole[key], again[key])
        assert torch.equal(whole[key], torch.cat([h[key] for h in halves]))
    other = make_batch(method, files, 4, seed=1, step=6)
    assert not torch.equal(whole["images"], other["images"])
    assert not torch.equal(whole["offsets"], other["offsets"])  # the collate's draws are the step's own


def run(out: Path, files, steps: int, resume: bool = False, save_every: int = 0, seed: int = 0) -> tuple:
    method = Regress(seed=seed)
    loop = Loop(method, files, LoopConfig(steps=steps, batch_size=4, save_every=save_every), out)
    if resume:
        loop.resume(out)
    return [r.loss for r in loop.run()], method


def test_a_resumed_run_gives_the_uninterrupted_run_s_losses_and_weights_to_the_bit(tmp_path):
    files = image_folder(tmp_path / "images")
    straight, whole = run(tmp_path / "straight", files, steps=6)
    first, _ = run(tmp_path / "split", files, steps=6, save_every=3)
    # the checkpoint after step 2, as a run stopped there left it; the method starts from other weights
    cut, _ = run(tmp_path / "cut", files, steps=3, save_every=3)
    assert cut == first[:3] == straight[:3]
    rest, resumed = run(tmp_path / "cut", files, steps=6, resume=True, seed=99)
    assert rest == straight[3:]
    state, expected = resumed.state_dict(), whole.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)  # the EMA buffer included
    lines = [json.loads(line) for line in (tmp_path / "cut" / METRICS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(6))
    assert [line["loss"] for line in lines] == straight


def test_resume_drops_the_metrics_of_steps_after_the_checkpoint(tmp_path):
    files = image_folder(tmp_path / "images")
    run(tmp_path / "run", files, steps=4, save_every=2)  # checkpoint after step 3
    metrics = tmp_path / "run" / METRICS_FILE
    metrics.write_text(metrics.read_text() + '{"step": 9, "loss": 1}\nnot json\n')
    loop = Loop(Regress(), files, LoopConfig(steps=5, batch_size=4), tmp_path / "run")
    assert loop.resume(tmp_path / "run") == 4
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2, 3]


def test_a_checkpoint_is_safetensors_and_json_and_nothing_else(tmp_path):
    files = image_folder(tmp_path / "images")
    run(tmp_path / "run", files, steps=2)
    folder = tmp_path / "run" / CHECKPOINT_DIR
    assert sorted(p.name for p in folder.iterdir()) == sorted([TENSORS_FILE, STATE_FILE])
    step, record = read_settings(tmp_path / "run")
    assert step == 1 and record["settings"]["loop"]["steps"] == 2


@pytest.mark.parametrize(
    "record",
    ["", "[]", '{"format": "x", "step": 1}', '{"format": "timm-layerscale pretrain checkpoint 1", "step": "1"}'],
)
def test_a_crafted_checkpoint_record_is_refused_in_one_line(tmp_path, record):
    folder = tmp_path / CHECKPOINT_DIR
    folder.mkdir()
    (folder / STATE_FILE).write_text(record)
    (folder / TENSORS_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match="pass a run's --out"):
        read_settings(tmp_path)


def test_refusals_name_the_setting(tmp_path):
    files = image_folder(tmp_path / "images", n=2)
    with pytest.raises(ValueError, match="at least 2; add images"):
        Loop(Regress(), files[:1], LoopConfig(steps=1, batch_size=2), tmp_path)
    with pytest.raises(ValueError, match="--steps"):
        Loop(Regress(), files, LoopConfig(steps=0, batch_size=2), tmp_path)


def ranks_worker(rank: int, port: int, files: list[Path], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        method = Regress()
        Loop(method, files, LoopConfig(steps=3, batch_size=4), Path(out)).run()
        if rank == 0:
            torch.save({k: v.clone() for k, v in method.state_dict().items()}, Path(out) / "state.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_train_as_one_process_on_the_same_global_batch(tmp_path):
    files = image_folder(tmp_path / "images")
    single, method = run(tmp_path / "one", files, steps=3)
    (tmp_path / "two").mkdir()
    mp.spawn(ranks_worker, args=(free_port(), files, str(tmp_path / "two")), nprocs=2, join=True)
    two = torch.load(tmp_path / "two" / "state.pt", weights_only=True)
    lines = [json.loads(line) for line in (tmp_path / "two" / METRICS_FILE).read_text().splitlines()]
    assert len(lines) == 3  # rank 0 alone writes, the global batch's loss
    assert [line["loss"] for line in lines] == pytest.approx(single, rel=1e-5)
    for key, value in method.state_dict().items():
        scale = value.abs().max().clamp_min(1e-12)
        assert (two[key] - value).abs().max() / scale < 1e-5, key
    moved = method.state_dict()["head.weight"] - Regress().state_dict()["head.weight"]
    assert moved.abs().max() > 1e-4  # the steps changed the weights, so equal weights say something
