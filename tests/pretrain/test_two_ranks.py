"""The losses under a 2-rank gloo group: Meta's values on each rank, and the same centring as one process on
the whole batch."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pretrain_fixture import ATOL, max_diff, meta

from timm_layerscale.pretrain.losses import DINOLoss, KoLeoLossDistributed, iBOTPatchLoss, sinkhorn_knopp

K = 16


def dino_diffs(p: str) -> dict[str, float]:
    loss = DINOLoss(K)
    logits = meta(p + "dino.teacher_logits")
    found = {
        f"dino.sk_{t}": max_diff(loss.sinkhorn_knopp_teacher(logits, t), meta(p + f"dino.sk_{t}")) for t in (0.07, 0.04)
    }
    loss.init_weights()
    for step, temp in ((1, 0.07), (2, 0.04)):
        batch = meta(p + "dino.teacher_logits" + ("" if step == 1 else "_2"))
        loss.update_center(batch)
        found[f"dino.centred_{step}"] = max_diff(
            loss.softmax_center_teacher(batch, temp), meta(p + f"dino.centred_{step}")
        )
        found[f"dino.center_{step}"] = max_diff(loss.center, meta(p + f"dino.center_{step}"))
    probs = meta(p + "dino.sk_0.07").unflatten(0, (2, 4))
    local = loss(meta(p + "dino.student_local"), probs)
    found["dino.loss_local"] = max_diff(local, meta(p + "dino.loss_local"))
    return found


def ibot_diffs(p: str) -> dict[str, float]:
    loss = iBOTPatchLoss(K)
    logits = meta(p + "ibot.masked_teacher_logits")
    count = torch.full((1,), len(logits), dtype=torch.long)
    found = {"ibot.sk_0.07": max_diff(loss.sinkhorn_knopp_teacher(logits, 0.07, count), meta(p + "ibot.sk_0.07"))}
    loss.init_weights()
    tokens = meta(p + "ibot.teacher_patch_logits")
    loss.update_center(tokens)
    found["ibot.centred_1"] = max_diff(loss.softmax_center_teacher(tokens, 0.07), meta(p + "ibot.centred_1"))
    found["ibot.center_1"] = max_diff(loss.center, meta(p + "ibot.center_1"))
    return found


def koleo_diffs(p: str) -> dict[str, float]:
    found = {}
    modules = {
        "dist_top1": KoLeoLossDistributed(),
        "dist_top2": KoLeoLossDistributed(topk=2),
        "dist_group4": KoLeoLossDistributed(loss_group_size=4),
    }
    for name, module in modules.items():
        x = meta(p + "koleo.x").requires_grad_(True)
        value = module(x)
        value.backward()
        found[f"koleo.{name}"] = max_diff(value.detach(), meta(p + f"koleo.{name}"))
        found[f"koleo.{name}_grad"] = max_diff(x.grad, meta(p + f"koleo.{name}_grad"))
    return found


def worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.set_num_threads(1)
    p = f"r2.rank{rank}."
    found = {**dino_diffs(p), **ibot_diffs(p), **koleo_diffs(p)}
    torch.save(DINOLoss(K).sinkhorn_knopp_teacher(meta(p + "dino.teacher_logits"), 0.07), Path(out, f"sk{rank}.pt"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_give_metas_values(tmp_path):
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    mp.spawn(worker, args=(f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, join=True)
    found = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)}
    assert set(found[0]) == set(found[1]) and len(found[0]) == 16
    for rank, diffs in found.items():
        assert {key: d for key, d in diffs.items() if d > ATOL} == {}, rank
    # the two ranks' centring is one process's on the whole batch
    halves = [meta(f"r2.rank{r}.dino.teacher_logits") for r in range(2)]
    together = sinkhorn_knopp(torch.cat(halves), 0.07, n_samples=16)
    ranked = torch.cat([torch.load(tmp_path / f"sk{r}.pt") for r in range(2)])
    assert max_diff(ranked, together) <= ATOL
