"""KoLeoLoss and GramLoss: hand values, invariants, and Meta's values and gradients."""

import math

import pytest
import torch
from pretrain_fixture import assert_meta, meta

from timm_layerscale.pretrain.losses import GramLoss, KoLeoLoss, KoLeoLossDistributed


def test_koleo_of_equidistant_points():
    """±e1, ±e2: every point's nearest neighbours are sqrt(2) away, at any scale."""
    points = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    for scale in (1.0, 7.5):
        assert KoLeoLoss()(points * scale).item() == pytest.approx(-math.log(math.sqrt(2)), abs=1e-6)
        assert KoLeoLossDistributed()(points * scale).item() == pytest.approx(-math.log(math.sqrt(2)), abs=1e-6)
    simplex = torch.eye(3) - 1 / 3  # a regular triangle: all sides sqrt(2) before normalising
    side = (simplex[0] / simplex[0].norm() - simplex[1] / simplex[1].norm()).norm().item()
    assert KoLeoLoss()(simplex).item() == pytest.approx(-math.log(side), abs=1e-6)


def test_koleo_prefers_spread_points():
    crowded = torch.tensor([[1.0, 0.0], [1.0, 0.01], [0.0, 1.0], [0.01, 1.0]])
    spread = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    assert KoLeoLoss()(crowded) > KoLeoLoss()(spread)


def test_koleo_is_metas():
    x = meta("r1.koleo.x")
    for name, module in (
        ("koleo", KoLeoLoss()),
        ("dist_top1", KoLeoLossDistributed()),
        ("dist_top2", KoLeoLossDistributed(topk=2)),
    ):
        x_ = x.clone().requires_grad_(True)
        value = module(x_)
        value.backward()
        assert_meta(value, f"r1.koleo.{name}")
        assert_meta(x_.grad, f"r1.koleo.{name}_grad")


def test_gram_is_zero_on_identical_features_and_scale_free_when_normalised():
    feats = torch.randn(2, 5, 4)
    for kwargs in (dict(), dict(remove_neg=False), dict(apply_norm=False, remove_neg=False)):
        for img_level in (True, False):
            assert GramLoss(**kwargs)(feats, feats.clone(), img_level=img_level).item() == 0.0
    assert GramLoss()(feats * 3.0, feats).item() == pytest.approx(0.0, abs=1e-12)
    assert GramLoss(apply_norm=False, remove_neg=False)(feats * 2.0, feats).item() > 0


def test_gram_by_hand():
    """Two unit features per image: student orthogonal, teacher at 60 degrees. Gram entries off the diagonal
    differ by cos 60 = 1/2; two of the four entries: MSE = 2 * (1/2)^2 / 4."""
    student = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    teacher = torch.tensor([[[1.0, 0.0], [0.5, math.sqrt(3) / 2]]])
    assert GramLoss()(student, teacher).item() == pytest.approx(0.125, abs=1e-7)
    # opposite student features: a -1 similarity, clipped to 0 by remove_neg, kept otherwise
    opposite = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]])
    assert GramLoss()(opposite, teacher).item() == pytest.approx(0.125, abs=1e-7)
    assert GramLoss(remove_neg=False)(opposite, teacher).item() == pytest.approx(2 * 1.5**2 / 4, abs=1e-6)
    with pytest.raises(ValueError, match="cannot both"):
        GramLoss(remove_neg=True, remove_only_teacher_neg=True)


def test_gram_is_metas():
    s, t = meta("r1.gram.student"), meta("r1.gram.teacher")
    configs = {
        "default": dict(),
        "keep_neg": dict(remove_neg=False),
        "only_teacher_neg": dict(remove_neg=False, remove_only_teacher_neg=True),
        "no_norm": dict(apply_norm=False, remove_neg=False),
    }
    for name, kwargs in configs.items():
        for img_level in (True, False):
            s_ = s.clone().requires_grad_(True)
            value = GramLoss(**kwargs)(s_, t, img_level=img_level)
            value.backward()
            assert_meta(value, f"r1.gram.{name}_img{int(img_level)}")
            assert_meta(s_.grad, f"r1.gram.{name}_img{int(img_level)}_grad")
