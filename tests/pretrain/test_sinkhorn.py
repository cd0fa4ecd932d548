"""Sinkhorn-Knopp centring: its sums, hand-made cases, and Meta's values (DINO's and iBOT's)."""

import math

import torch
from pretrain_fixture import assert_meta, meta

from timm_layerscale.pretrain.losses import DINOLoss, iBOTPatchLoss, sinkhorn_knopp


def test_rows_sum_to_one_and_prototypes_to_their_share():
    logits = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    q = sinkhorn_knopp(logits, teacher_temp=0.5, n_samples=12, n_iterations=3)
    assert q.shape == (12, 5) and q.dtype == torch.float32
    torch.testing.assert_close(q.sum(1), torch.ones(12), atol=1e-6, rtol=0)
    # the last step balances the samples; the prototypes' totals are n_samples / K up to the residue
    torch.testing.assert_close(q.sum(0), torch.full((5,), 12 / 5), atol=0.2, rtol=0)
    many = sinkhorn_knopp(logits, teacher_temp=0.5, n_samples=12, n_iterations=200)
    torch.testing.assert_close(many.sum(0), torch.full((5,), 12 / 5), atol=1e-5, rtol=0)


def test_separable_logits_give_uniform_assignments():
    """exp(logits / T) = a_i * b_k: one row and one column scaling make it uniform, 1/K everywhere."""
    sample, prototype = torch.tensor([0.3, -1.0, 2.0]), torch.tensor([0.5, 0.0, -0.7, 1.1])
    q = sinkhorn_knopp(sample[:, None] + prototype[None, :], teacher_temp=0.1, n_samples=3)
    torch.testing.assert_close(q, torch.full((3, 4), 0.25), atol=1e-6, rtol=0)


def test_two_by_two_by_hand():
    """One iteration on exp(x / T): each prototype's total to 1/2, then each sample's to 1 (after the scaling
    by n_samples)."""
    x = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    e = math.e
    # prototypes by samples: [[e, 1], [1, 1]]; each prototype's row to 1/K = 1/2
    p = torch.tensor([[e / (e + 1), 1 / (e + 1)], [1 / 2, 1 / 2]]) / 2
    col = p.sum(0)  # per sample
    expected = (p / col).t()  # samples to 1/2, then times n_samples = 2
    q = sinkhorn_knopp(x, teacher_temp=1.0, n_samples=2, n_iterations=1)
    torch.testing.assert_close(q, expected, atol=1e-7, rtol=0)


def test_dino_sinkhorn_knopp_teacher_is_metas():
    loss = DINOLoss(16)
    for temp in (0.07, 0.04):
        assert_meta(
            loss.sinkhorn_knopp_teacher(meta("r1.dino.teacher_logits"), teacher_temp=temp), f"r1.dino.sk_{temp}"
        )


def test_ibot_sinkhorn_knopp_teacher_is_metas_and_leaves_the_count():
    logits = meta("r1.ibot.masked_teacher_logits")
    count = torch.full((1,), len(logits), dtype=torch.long)
    assert_meta(iBOTPatchLoss(16).sinkhorn_knopp_teacher(logits, 0.07, count), "r1.ibot.sk_0.07")
    assert count.item() == len(logits)


def test_the_shared_function_defaults_to_metas_three_iterations():
    logits = meta("r1.dino.teacher_logits")
    assert_meta(sinkhorn_knopp(logits, 0.07, n_samples=len(logits)), "r1.dino.sk_0.07")
    two = sinkhorn_knopp(logits, 0.07, n_samples=len(logits), n_iterations=2)
    assert (two - meta("r1.dino.sk_0.07")).abs().max() > 1e-4


def test_the_sample_count_only_scales_and_cancels():
    """Meta's count (the world's samples) divides each sample's column and multiplies it back at the end: any
    positive count gives the same assignments, up to rounding."""
    logits = meta("r1.dino.teacher_logits")
    torch.testing.assert_close(sinkhorn_knopp(logits, 0.07, 8), sinkhorn_knopp(logits, 0.07, 1000), atol=1e-6, rtol=0)
