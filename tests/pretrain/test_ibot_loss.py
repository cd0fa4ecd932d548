"""iBOTPatchLoss: hand values, the dense and gathered forms agreeing, its centre, and Meta's values."""

import math

import pytest
import torch
from pretrain_fixture import assert_meta, meta

from timm_layerscale.pretrain.losses import iBOTPatchLoss

K = 16


def test_each_masked_image_counts_the_same_and_unmasked_ones_add_zero():
    """Image 0: one masked patch at cost log K; image 1: three at cost 0; image 2: none. Mean over 3 images."""
    student = torch.zeros(3, 4, K)
    teacher = torch.softmax(torch.randn(3, 4, K), dim=-1)
    masks = torch.zeros(3, 4, dtype=torch.bool)
    masks[0, 1] = True
    masks[1, :3] = True
    student[1, :, 0] = 1000.0
    teacher[1] = torch.eye(K)[0]
    loss = iBOTPatchLoss(K)
    expected = math.log(K) / 3
    assert loss(student, teacher, masks).item() == pytest.approx(expected, abs=1e-6)
    gathered = loss.forward_masked(student[masks], teacher[masks], masks)
    assert gathered.item() == pytest.approx(expected, abs=1e-6)


def test_forward_masked_drops_padding_rows_with_given_weights():
    masks = torch.tensor([[True, False, True], [False, False, True]])
    student, teacher = torch.randn(2, 3, K), torch.softmax(torch.randn(2, 3, K), dim=-1)
    loss = iBOTPatchLoss(K)
    padded_s = torch.cat([student[masks], torch.randn(2, K)])
    padded_t = torch.cat([teacher[masks], torch.randn(2, K)])
    weight = torch.tensor([0.5, 0.5, 1.0])
    value = loss.forward_masked(padded_s, padded_t, masks, n_masked_patches=3, masks_weight=weight)
    torch.testing.assert_close(value, loss(student, teacher, masks))


def test_centre_is_the_mean_over_patches_and_images():
    loss = iBOTPatchLoss(3, center_momentum=0.5)
    loss.init_weights()
    tokens = torch.arange(2 * 2 * 3, dtype=torch.float32).reshape(2, 2, 3)
    loss.update_center(tokens)
    loss.apply_center_update()
    torch.testing.assert_close(loss.center, 0.5 * tokens.mean((0, 1))[None, None])
    assert loss.center.shape == (1, 1, 3)


def test_losses_and_centre_are_metas():
    loss = iBOTPatchLoss(K)
    s, t, masks = meta("r1.ibot.student"), meta("r1.ibot.teacher_probs"), meta("r1.ibot.masks").bool()
    assert_meta(loss(s, t, masks), "r1.ibot.loss")
    assert_meta(loss.forward_masked(s[masks], t[masks], masks), "r1.ibot.loss_masked")
    weight = (1 / masks.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(masks)[masks]
    padded = loss.forward_masked(
        meta("r1.ibot.padded_student"),
        meta("r1.ibot.padded_teacher"),
        masks,
        n_masked_patches=int(masks.sum()),
        masks_weight=weight,
    )
    assert_meta(padded, "r1.ibot.loss_masked_padded")
    loss.init_weights()
    tokens = meta("r1.ibot.teacher_patch_logits")
    loss.update_center(tokens)
    assert_meta(loss.softmax_center_teacher(tokens, teacher_temp=0.07), "r1.ibot.centred_1")
    assert_meta(loss.center, "r1.ibot.center_1")
