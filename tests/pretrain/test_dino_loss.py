"""DINOLoss: hand values, its centre, and Meta's values."""

import math

import pytest
import torch
from pretrain_fixture import assert_meta, meta

from timm_layerscale.pretrain.losses import DINOLoss

K = 16


def test_identical_sharp_distributions_cost_nothing():
    target = torch.eye(K)[:4]  # [batch, K], one-hot
    loss = DINOLoss(K)(student_logits=(target * 10)[None].repeat(2, 1, 1), teacher_probs=target[None].repeat(3, 1, 1))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


def test_uniform_student_costs_log_k_and_student_temp_sharpens():
    teacher = torch.softmax(torch.randn(2, 3, K), dim=-1)
    assert DINOLoss(K)(torch.zeros(2, 3, K), teacher).item() == pytest.approx(math.log(K), abs=1e-6)
    logits = torch.zeros(1, 1, K)
    logits[..., 0] = 1.0
    teacher = torch.eye(K)[:1][None]
    for temp in (0.1, 0.5):
        # -log softmax(logits / temp)[0] = log(e^(1/temp) + K - 1) - 1/temp
        expected = math.log(math.exp(1 / temp) + K - 1) - 1 / temp
        assert DINOLoss(K, student_temp=temp)(logits, teacher).item() == pytest.approx(expected, abs=1e-5)


def test_ignore_diagonal_leaves_out_the_same_crop_pairs():
    """Two crops, one sample: pair (s, t) costs c[s, t]; the diagonal pairs are dropped from sum and count."""
    student = torch.randn(2, 1, K)
    teacher = torch.softmax(torch.randn(2, 1, K), dim=-1)
    logp = torch.log_softmax(student / 0.1, dim=-1)
    cost = -torch.einsum("sk,tk->st", logp[:, 0], teacher[:, 0])
    loss = DINOLoss(K)
    assert loss(student, teacher).item() == pytest.approx(cost.mean().item(), abs=1e-5)
    off = (cost[0, 1] + cost[1, 0]) / 2
    assert loss(student, teacher, ignore_diagonal=True).item() == pytest.approx(off.item(), abs=1e-5)


def test_centre_is_nan_until_init_then_a_moving_average():
    loss = DINOLoss(4, center_momentum=0.9)
    assert torch.isnan(loss.center).all() and loss.center.shape == (1, 4)
    loss.init_weights()
    batch = torch.tensor([[1.0, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 0.0]])
    loss.update_center(batch)
    assert torch.equal(loss.center, torch.zeros(1, 4))  # applied lazily, on the next softmax
    probs = loss.softmax_center_teacher(batch, teacher_temp=0.5)
    torch.testing.assert_close(loss.center, torch.full((1, 4), 0.2), atol=1e-7, rtol=0)
    torch.testing.assert_close(probs, torch.softmax((batch - 0.2) / 0.5, dim=-1))
    loss.softmax_center_teacher(batch, teacher_temp=0.5)  # no pending update: the centre stays
    torch.testing.assert_close(loss.center, torch.full((1, 4), 0.2), atol=1e-7, rtol=0)
    assert list(loss.state_dict()) == ["center"]


def test_losses_and_centre_are_metas():
    loss = DINOLoss(K)
    probs = meta("r1.dino.sk_0.07").unflatten(0, (2, 4))
    student_global, student_local = meta("r1.dino.student_global"), meta("r1.dino.student_local")
    assert_meta(loss(student_local, probs), "r1.dino.loss_local")
    assert_meta(loss(student_global, probs), "r1.dino.loss_global")
    assert_meta(loss(student_global, probs, ignore_diagonal=True), "r1.dino.loss_global_ignore_diagonal")
    assert_meta(loss(student_local, probs, ignore_diagonal=True), "r1.dino.loss_local_ignore_diagonal")
    loss.init_weights()
    for step, temp in ((1, 0.07), (2, 0.04)):
        logits = meta("r1.dino.teacher_logits" + ("" if step == 1 else "_2"))
        loss.update_center(logits)
        assert_meta(loss.softmax_center_teacher(logits, teacher_temp=temp), f"r1.dino.centred_{step}")
        assert_meta(loss.center, f"r1.dino.center_{step}")
