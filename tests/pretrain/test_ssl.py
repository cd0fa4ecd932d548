"""DINOv3's objective as a pretraining method (`pretrain.ssl`): the batch it makes, Meta's loss composed from
the loss modules, the EMA teacher, the head warm-up, the Gram teacher, Meta's schedules as shares of the run,
a resumed run equal to an uninterrupted one to the bit, and two gloo ranks equal to one process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support import TINY, free_port, image_folder, move_off_init_

from timm_layerscale.pretrain import Crops, DINOLoss, GramLoss
from timm_layerscale.pretrain.data import collate_generator, make_batch
from timm_layerscale.pretrain.loop import Loop, LoopConfig
from timm_layerscale.pretrain.method import Shard
from timm_layerscale.pretrain.ssl import DINOv3, SSLSettings

SMALL = dict(global_size=48, local_size=32, local_crops=2, prototypes=64, head_hidden_dim=32, head_bottleneck_dim=16)
PATCHES = 9  # 48 / 16 squared
PREFIX = 5  # the class token and 4 storage tokens


def make(steps: int = 3, seed: int = 0, **changes) -> DINOv3:
    """A tiny student off its init (so that every image's class token differs) and the method around it."""
    torch.manual_seed(seed)
    student = timm.create_model("vit_ls_tiny_patch16_dinov3", num_classes=0, img_size=48, **TINY)
    with torch.no_grad():
        move_off_init_(student, seed)
    return DINOv3(student, SSLSettings(steps=steps, **{**SMALL, **changes}))


def labelled(image: int) -> Crops:
    """Crops whose pixels say which they are: 100 * crop + image, local ones from 1000."""
    return Crops(
        global_crops=[torch.full((3, 48, 48), 100.0 * c + image) for c in range(2)],
        local_crops=[torch.full((3, 32, 32), 1000 + 100.0 * c + image) for c in range(2)],
    )


def test_views_are_meta_s_crops_and_collate_stacks_them_crop_major():
    method = make()
    crops = method.views(torch.randint(0, 256, (3, 40, 52), dtype=torch.uint8))
    assert [tuple(c.shape) for c in crops.global_crops] == [(3, 48, 48)] * 2
    assert [tuple(c.shape) for c in crops.local_crops] == [(3, 32, 32)] * 2
    batch = method.collate([labelled(i) for i in range(4)], np.random.default_rng(0), Shard())
    assert all(isinstance(v, torch.Tensor) for v in batch.values())
    assert batch["global_crops"][:, 0, 0, 0].tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    assert batch["local_crops"][:, 0, 0, 0].tolist() == [1000, 1001, 1002, 1003, 1100, 1101, 1102, 1103]
    assert batch["masks"].shape == (8, PATCHES)


def test_masks_are_meta_s_share_and_ratios_and_do_not_depend_on_the_rank_count():
    method, samples = make(), [labelled(i) for i in range(4)]
    whole = method.collate(samples, collate_generator(0, 5), Shard())
    masks = whole["masks"]
    counts = masks.sum(1)
    assert masks.dtype == torch.bool and int((counts > 0).sum()) == 4  # int(8 images * 0.5)
    ratios = torch.linspace(0.1, 0.5, 5)[1:]  # the i+1-th of n+1 points over Meta's (0.1, 0.5)
    assert sorted(counts[counts > 0].tolist()) == sorted(int(PATCHES * r) for r in ratios)
    assert torch.equal(whole["mask_indices"], masks.flatten().nonzero().flatten())
    assert torch.equal(whole["masks_weight"], (1 / counts.float()).repeat_interleave(counts))
    assert whole["n_masked_patches"].tolist() == [int(counts.sum())]
    again = method.collate(samples, collate_generator(0, 6), Shard())
    assert not torch.equal(again["masks"], masks)  # the step's own draw
    halves = [method.collate(samples[2 * r : 2 * r + 2], collate_generator(0, 5), Shard(r, 2)) for r in (0, 1)]
    for key in ("masks", "global_crops", "local_crops"):
        joined = torch.cat([h[key].unflatten(0, (-1, 2)) for h in halves], dim=1).flatten(0, 1)
        assert torch.equal(joined, whole[key]), key
    for half in halves:
        assert half["n_masked_patches"].tolist() == [int(half["masks"].sum())]


def test_the_loss_is_meta_s_weighted_sum_and_dino_is_dino_loss_on_the_heads(tmp_path):
    files = image_folder(tmp_path, n=4)
    method = make(steps=10)  # teacher temperature warm-up over 3 steps: 0.04, 0.055, 0.07
    batch = make_batch(method, files, 4, seed=0, step=1)
    loss, parts = method(batch, 1)
    assert set(parts) == {"dino_global", "dino_local", "ibot", "koleo"}
    assert all(torch.isfinite(v) and v.ndim == 0 and not v.requires_grad for v in parts.values())
    # Meta's scales: 2 global terms (diagonal ignored) and 2 x 2 local terms; KoLeo times the 2 global crops
    weighted = 2 / 6 * parts["dino_global"] + 4 / 6 * parts["dino_local"] + 0.1 * 2 * parts["koleo"] + parts["ibot"]
    assert loss.item() == pytest.approx(weighted.item(), rel=1e-6)
    with torch.no_grad():
        teacher = method.teacher
        teacher_cls = teacher["backbone"].forward_features(batch["global_crops"])[:, 0]
        targets = DINOLoss(64).sinkhorn_knopp_teacher(teacher["dino_head"](teacher_cls), 0.055).unflatten(0, (2, 4))
        student_global = method.student.forward_features(batch["global_crops"], masks=batch["masks"])[:, 0]
        student_local = method.student.forward_features(batch["local_crops"])[:, 0]
        logits = method.dino_head(torch.cat([student_global, student_local]))
        dino = DINOLoss(64)
        by_hand = dino(logits[:8].unflatten(0, (2, 4)), targets, ignore_diagonal=True)
        assert by_hand.item() == pytest.approx(parts["dino_global"].item(), rel=1e-6)
        assert dino(logits[8:].unflatten(0, (2, 4)), targets).item() == pytest.approx(
            parts["dino_local"].item(), rel=1e-6
        )
        with_diagonal = dino(logits[:8].unflatten(0, (2, 4)), targets)
        assert with_diagonal.item() != pytest.approx(parts["dino_global"].item(), rel=1e-4)
    assert set(method.metrics(batch)) == {"teacher_entropy", "student_cls_std"}


def test_meta_s_epoch_lengths_are_shares_of_the_run_and_head_warm_up_stops_the_backbone():
    method = make(steps=200, head_warmup_steps=5)
    s = method.schedules
    # warm-up over 30 of 100 epochs, Meta's linspace reaching 0.07 at its last step, then constant
    assert (
        s.teacher_temp[0] == pytest.approx(0.04)
        and s.teacher_temp[58] < 0.07 == s.teacher_temp[59] == s.teacher_temp[150]
    )
    assert s.last_layer_lr[1] == 0 and s.last_layer_lr[2] > 0  # 1 of 100 epochs: 2 steps
    assert s.lr[0] == 0 and s.lr[20] == pytest.approx(1e-3)  # warm-up: 10 of 100 epochs
    assert s.momentum[0] == pytest.approx(0.992) and s.weight_decay[0] == pytest.approx(0.04)
    values = method.step_values(4)
    assert values["backbone"].lr == values["backbone_no_wd"].lr == 0 and values["heads"].lr > 0
    assert values["heads_no_wd"].weight_decay == 0 and values["heads"].weight_decay > 0
    assert method.step_values(5)["backbone"].lr == method.step_values(5)["heads"].lr > 0
    assert method.step_values(1)["heads_last_layer"].lr == 0 < method.step_values(2)["heads_last_layer"].lr
    names = {g["name"] for g in method.param_groups()}
    assert names == {"backbone", "backbone_no_wd", "heads", "heads_no_wd", "heads_last_layer"}


def test_the_teacher_moves_toward_the_student_by_one_minus_the_step_s_momentum(tmp_path):
    method = make()
    loop = Loop(method, image_folder(tmp_path / "images", n=4), LoopConfig(steps=3, batch_size=4), tmp_path / "run")
    seen, after_step = {}, method.after_step

    def spy(step: int) -> None:
        seen["teacher"] = {k: v.clone() for k, v in method.teacher.named_parameters()}
        seen["student"] = {k: v.clone() for k, v in method._student_modules().named_parameters()}
        after_step(step)

    method.after_step = spy
    loop.step(0)
    loop.step(1)
    momentum, other = method.schedules.momentum[1], method.schedules.momentum[0]
    assert momentum != other
    moved, wrong = False, False
    for name, param in method.teacher.named_parameters():
        before, student = seen["teacher"][name], seen["student"][name]
        assert torch.allclose(param, before * momentum + student * (1 - momentum), rtol=1e-6, atol=1e-7), name
        wrong |= not torch.allclose(param, before * other + student * (1 - other), rtol=1e-6, atol=1e-7)
        moved |= not torch.equal(param, before)
    assert moved and wrong


def test_head_warm_up_keeps_the_backbone_to_the_bit_while_the_heads_learn(tmp_path):
    method = make(head_warmup_steps=2)
    start = {k: v.clone() for k, v in method.state_dict().items()}
    loop = Loop(method, image_folder(tmp_path / "images", n=4), LoopConfig(steps=3, batch_size=4), tmp_path / "run")
    loop.step(0)
    loop.step(1)
    state = method.state_dict()
    backbone = [k for k in start if k.startswith("student.")]
    assert backbone and all(torch.equal(state[k], start[k]) for k in backbone)
    for head in ("dino_head", "ibot_head"):
        assert not torch.equal(state[f"{head}.mlp.0.weight"], start[f"{head}.mlp.0.weight"])
        assert not torch.equal(state[f"{head}.last_layer.weight"], start[f"{head}.last_layer.weight"])
    loop.step(2)
    assert not all(torch.equal(state[k], start[k]) for k in backbone)


def test_the_gram_teacher_is_state_only_with_gram_and_stays_the_starting_backbone(tmp_path):
    assert not any(k.startswith("gram_teacher.") for k in make().state_dict())
    method = make(gram=True)
    start = {k: v.clone() for k, v in method.student.state_dict().items()}
    assert {k for k in method.state_dict() if k.startswith("gram_teacher.")} == {f"gram_teacher.{k}" for k in start}
    files = image_folder(tmp_path / "images", n=4)
    batch = make_batch(method, files, 4, seed=0, step=0)
    loss, parts = method(batch, 0)
    assert set(parts) == {"dino_global", "dino_local", "ibot", "koleo", "gram"} and torch.isfinite(parts["gram"])
    weighted = 2 / 6 * parts["dino_global"] + 4 / 6 * parts["dino_local"] + 0.2 * parts["koleo"] + parts["ibot"]
    assert loss.item() == pytest.approx((weighted + parts["gram"]).item(), rel=1e-6)
    with torch.no_grad():  # the student's masked global patches against the starting backbone's, image by image
        patches = method.student.forward_features(batch["global_crops"], masks=batch["masks"])[:, PREFIX:]
        target = method.gram_teacher.forward_features(batch["global_crops"])[:, PREFIX:]
        by_hand = GramLoss(apply_norm=True, remove_neg=False)(patches, target, img_level=True)
    assert by_hand.item() == pytest.approx(parts["gram"].item(), rel=1e-6)
    Loop(method, files, LoopConfig(steps=1, batch_size=4), tmp_path / "run").run()
    gram = method.gram_teacher.state_dict()
    assert all(torch.equal(gram[k], start[k]) for k in start)
    assert not all(torch.equal(method.student.state_dict()[k], start[k]) for k in start)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(head_warmup_steps=3), "head_warmup_steps 3 must be"),
        (dict(warmup_steps=3), "warmup_steps 3 must be"),
        (dict(local_size=40), "local_size 40 is not a multiple"),
        (dict(global_size=50), "global_size 50 is not a multiple"),
        (dict(mask_ratio=(0.5, 0.1)), "mask_ratio"),
    ],
)
def test_settings_that_cannot_run_are_refused_naming_the_option(changes, match):
    with pytest.raises(ValueError, match=match):
        make(steps=3, **changes)


def run(out: Path, files: list[Path], steps: int, save_every: int = 0, resume: bool = False, seed: int = 0):
    """A run of the 3-step schedule, with the Gram teacher, stopped after `steps` (or resumed from `out`)."""
    method = make(steps=3, seed=seed, gram=True)
    loop = Loop(method, files, LoopConfig(steps=steps, batch_size=4, save_every=save_every), out)
    if resume:
        loop.resume(out)
    return [(r.loss, r.parts) for r in loop.run()], method


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list, dict]:
    """3 steps on one process: the images, each step's loss and parts, and the method's state after."""
    root = tmp_path_factory.mktemp("ssl")
    files = image_folder(root / "images")
    records, method = run(root / "straight", files, steps=3)
    return files, records, {k: v.clone() for k, v in method.state_dict().items()}


def test_a_resumed_run_gives_the_uninterrupted_run_s_losses_and_state_to_the_bit(tmp_path, straight):
    files, records, state = straight
    cut, _ = run(tmp_path / "cut", files, steps=2, save_every=2)  # the checkpoint after step 1
    assert cut == records[:2]
    rest, resumed = run(tmp_path / "cut", files, steps=3, resume=True, seed=99)  # other weights until loaded
    assert rest == records[2:]
    found = resumed.state_dict()
    assert found.keys() == state.keys()
    assert all(torch.equal(found[k], state[k]) for k in state)  # teachers and centres included


def ranks_worker(rank: int, port: int, files: list[Path], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        records, method = run(Path(out), files, steps=3)
        if rank == 0:
            torch.save({k: v.clone() for k, v in method.state_dict().items()}, Path(out) / "state.pt")
            (Path(out) / "records.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_train_as_one_process_on_the_same_global_batch(tmp_path, straight):
    files, records, state = straight
    mp.spawn(ranks_worker, args=(free_port(), files, str(tmp_path)), nprocs=2, join=True)
    two = json.loads((tmp_path / "records.json").read_text())
    for (loss, parts), (one_loss, one_parts) in zip(two, records, strict=True):
        assert loss == pytest.approx(one_loss, rel=1e-5)
        # every part, and the teacher's entropy (a mean over rows); a rank's feature spread is its own batch's
        assert parts.pop("student_cls_std") > 0
        assert parts == pytest.approx({k: v for k, v in one_parts.items() if k != "student_cls_std"}, rel=1e-5)
    found, start = torch.load(tmp_path / "state.pt", weights_only=True), make(gram=True).state_dict()
    # AdamW scales the last bits of a near-zero gradient up to a step's size, element by element: the two runs'
    # distance is held to a share of how far the weights went, summed over each tensor
    for key in state:
        one, two, begin = (t[key].double() for t in (state, found, start))
        assert (two - one).abs().sum() <= 1e-3 * (one - begin).abs().sum() + 1e-9 * one.numel(), key
