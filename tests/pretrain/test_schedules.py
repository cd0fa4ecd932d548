"""The schedules and the EMA teacher against Meta's values (tests/fixtures/meta_schedules.json)."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from timm_layerscale.pretrain.ema import EmaTeacher
from timm_layerscale.pretrain.schedules import (
    CosineScheduler,
    ScheduleConfig,
    build_schedules,
    linear_warmup_cosine_decay,
)

META = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "meta_schedules.json").read_text())
NAMES = ("lr", "weight_decay", "momentum", "teacher_temp", "last_layer_lr")


def assert_values(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (i, a, b)


@pytest.mark.parametrize("case", META["cosine"], ids=lambda c: "-".join(f"{k}={v}" for k, v in c["kwargs"].items()))
def test_cosine_scheduler_is_metas(case):
    scheduler = CosineScheduler(**case["kwargs"])
    assert_values(scheduler.schedule, case["schedule"])
    assert_values([scheduler[i] for i in range(len(scheduler))], case["schedule"])
    assert scheduler[case["kwargs"]["total_iters"] + 3] == case["past_end"]


@pytest.mark.parametrize("case", META["warmup_cosine"], ids=lambda c: str(c["kwargs"]["total_iterations"]))
def test_linear_warmup_cosine_decay_is_metas(case):
    assert_values(linear_warmup_cosine_decay(**case["kwargs"]), case["schedule"])


@pytest.mark.parametrize("case", META["build"], ids=lambda c: f"length{c['epoch_length']}")
def test_build_schedules_reads_metas_config_keys(case):
    cfg = ScheduleConfig(epoch_length=case["epoch_length"], **case["optim"], **case["teacher"])
    schedules = build_schedules(cfg)
    for name in NAMES:
        scheduler = getattr(schedules, name)
        assert_values([scheduler[i] for i in range(len(case[name]))], case[name])


def test_the_shape_of_a_schedule_by_hand():
    """Two frozen zeros, warm-up 0.2 -> 1.0 in three steps, then the half cosine 1.0 -> 0.0 over four."""
    s = CosineScheduler(1.0, 0.0, total_iters=9, warmup_iters=3, start_warmup_value=0.2, freeze_iters=2)
    expected = [0.0, 0.0, 0.2, 0.6, 1.0] + [0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(4)]
    assert_values(s.schedule, expected)
    assert s[9] == s[100] == 0.0


def test_a_warmup_ends_on_its_peak_exactly():
    """numpy's linspace puts its end point in place; 0.3 + 10 * (0.6 / 10) alone would miss 0.9 by one unit."""
    s = CosineScheduler(0.9, 0.1, total_iters=20, warmup_iters=11, start_warmup_value=0.3)
    assert s.schedule[10] == 0.9 and s.schedule[0] == 0.3


def test_a_truncated_cosine_still_ends_at_its_final_value():
    s = CosineScheduler(1.0, 0.25, total_iters=20, trunc_extra=0.5)
    plain = CosineScheduler(1.0, 0.25, total_iters=20)
    assert s.schedule[0] == pytest.approx(1.0) and s.schedule[-1] == pytest.approx(0.25)
    assert plain.schedule[-1] > 0.25  # the plain cosine stops one step short of its final value
    assert all(a >= b for a, b in zip(s.schedule, s.schedule[1:]))


def test_the_default_config_is_metas():
    """ssl_default_config.yaml: lr 1e-3 to 1e-6 over 100 epochs of 1250 after 10 warm-up epochs, momentum
    0.992 to 1, teacher temperature 0.04 to 0.07 over 30 epochs, the last layer frozen for one epoch."""
    s = build_schedules(ScheduleConfig())
    assert len(s.lr) == 125_000 and s.lr[0] == 0.0 and s.lr[12_500] == pytest.approx(1e-3)
    assert s.momentum[0] == pytest.approx(0.992) and s.momentum[10**6] == 1.0
    assert s.teacher_temp[0] == pytest.approx(0.04) and s.teacher_temp[37_499] == pytest.approx(0.07)
    assert s.teacher_temp[37_500] == 0.07 and len(s.teacher_temp) == 37_500
    assert s.last_layer_lr[1249] == 0.0 and s.last_layer_lr[1250] == s.lr[1250] > 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: CosineScheduler(1.0, 0.0, total_iters=5, warmup_iters=4, freeze_iters=2),
        lambda: CosineScheduler(1.0, 0.0, total_iters=5, warmup_iters=-1),
        lambda: linear_warmup_cosine_decay(0.0, 1.0, 0.0, warmup_iterations=5, total_iterations=8, cosine_iterations=4),
    ],
)
def test_a_schedule_that_cannot_fit_is_refused(make):
    with pytest.raises(ValueError, match="iterations"):
        make()


def _module() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2, bias=False))


def _load(module: nn.Module, values: dict) -> None:
    module.load_state_dict({k: torch.tensor(v) for k, v in values.items()})


def test_ema_update_is_metas():
    ema = META["ema"]
    teacher, student = _module(), _module()
    _load(teacher, ema["teacher"])
    _load(student, ema["student"])
    update = EmaTeacher(teacher, student)
    update.update(ema["momentum_1"])
    for key, value in teacher.state_dict().items():
        torch.testing.assert_close(value, torch.tensor(ema["after_1"][key]), rtol=0, atol=1e-7)
    _load(student, ema["student_2"])  # in place: the pairs made once still see the student's new values
    update.update(ema["momentum_2"])
    for key, value in teacher.state_dict().items():
        torch.testing.assert_close(value, torch.tensor(ema["after_2"][key]), rtol=0, atol=1e-7)


def test_ema_momentum_one_keeps_the_teacher_and_zero_copies_the_student():
    teacher, student = _module(), _module()
    kept = {k: v.clone() for k, v in teacher.state_dict().items()}
    EmaTeacher(teacher, student).update(1.0)
    assert all(torch.equal(v, kept[k]) for k, v in teacher.state_dict().items())
    EmaTeacher(teacher, student).update(0.0)
    assert all(torch.equal(v, student.state_dict()[k]) for k, v in teacher.state_dict().items())
    assert not any(p.requires_grad is False for p in student.parameters())


def test_ema_leaves_buffers_and_refuses_other_modules():
    teacher, student = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    student.running_mean.fill_(5.0)
    EmaTeacher(teacher, student).update(0.5)
    assert torch.equal(teacher.running_mean, torch.zeros(3))
    with pytest.raises(ValueError, match="differ in their parameters"):
        EmaTeacher(_module(), nn.Linear(3, 4))
    with pytest.raises(ValueError, match="shape"):
        EmaTeacher(nn.Linear(3, 4), nn.Linear(3, 5))
