"""Dense distillation: the features it reads from timm models, the loss against its definition, the frozen
teacher outside the state, resume to the bit, and the input sizes it refuses."""

from __future__ import annotations

import pytest
import timm
import torch
from support import image_folder
from torch.nn import functional as F

import timm_layerscale  # noqa: F401  (registers the vit_ls models)
from timm_layerscale.pretrain.distill import Distill, DistillSettings, features
from timm_layerscale.pretrain.loop import Loop, LoopConfig

SIZE = 64


def teacher(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("vit_ls_tiny_patch16_dinov3", num_classes=0, depth=2, img_size=SIZE)
    with torch.no_grad():  # gammas, biases and norms far from their inits, so every block shows in the output
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if name.endswith(("gamma", "weight")) else 0.0, 0.5)
    return model


def convnext(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("convnext_atto", num_classes=0)


def test_a_vit_s_features_are_its_pooled_output_and_its_patch_tokens_on_the_grid():
    model, images = teacher().eval(), torch.rand(2, 3, SIZE, SIZE)
    found = features(model, images)
    tokens = model.forward_features(images)
    assert torch.equal(found.pooled, model(images))
    assert found.dense.shape == (2, model.num_features, 4, 4)
    # patch (row 1, column 2) is token prefix + 1 * 4 + 2
    assert torch.equal(found.dense[:, :, 1, 2], tokens[:, model.num_prefix_tokens + 6])


def test_a_convnet_s_features_are_its_pooled_output_and_its_last_map():
    model, images = convnext().eval(), torch.rand(2, 3, SIZE, SIZE)
    found = features(model, images)
    assert torch.equal(found.pooled, model(images))
    assert torch.equal(found.dense, model.forward_features(images))


def half_normalised_convnext() -> torch.nn.Module:
    student = convnext()
    student.pretrained_cfg = {**student.pretrained_cfg, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    return student


def test_the_loss_is_the_cosine_distance_of_pooled_and_of_resized_patch_features():
    method = Distill(half_normalised_convnext(), teacher(), DistillSettings(steps=4, size=SIZE, dense_weight=0.5))
    method.eval()
    images = torch.rand(3, 3, SIZE, SIZE)
    loss, parts = method({"images": images}, 0)
    norm = method.student_norm
    target = features(method.teacher, method.teacher_norm(images))
    ours = features(method.student, norm(images))
    pooled = method.heads.pooled(ours.pooled)
    dense = F.interpolate(method.heads.dense(ours.dense), size=(4, 4), mode="bilinear", align_corners=False)
    expected_global = 1 - (F.normalize(pooled, dim=-1) * F.normalize(target.pooled, dim=-1)).sum(-1).mean()
    patch_cos = (F.normalize(dense, dim=1) * F.normalize(target.dense, dim=1)).sum(1)
    expected_dense = 1 - patch_cos.mean()
    torch.testing.assert_close(parts["global"], expected_global.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts["dense"], expected_dense.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected_global + 0.5 * expected_dense, rtol=1e-5, atol=1e-6)
    # the student's map (2x2 at stride 32) went up to the teacher's 4x4 grid
    assert ours.dense.shape[-2:] == (2, 2) and target.dense.shape[-2:] == (4, 4)


def test_each_model_sees_the_crop_in_its_own_normalisation():
    method = Distill(half_normalised_convnext(), teacher(), DistillSettings(steps=2, size=SIZE))
    image = torch.full((1, 3, 2, 2), 0.75)
    assert torch.allclose(method.student_norm(image), torch.full_like(image, 0.5))
    assert not torch.allclose(method.teacher_norm(image), torch.full_like(image, 0.5))


def run(out, files, steps, resume=False, save_every=0):
    method = Distill(convnext(), teacher(), DistillSettings(steps=steps, size=SIZE, warmup_steps=1, lr=3e-3))
    loop = Loop(method, files, LoopConfig(steps=steps, batch_size=4, save_every=save_every), out)
    if resume:
        loop.resume(out)
    return [r.loss for r in loop.run()], method


def test_the_teacher_is_frozen_and_outside_the_state_and_the_student_learns(tmp_path):
    files = image_folder(tmp_path / "images", size=SIZE)
    before = {k: v.clone() for k, v in teacher().state_dict().items()}
    losses, method = run(tmp_path / "run", files, steps=8)
    assert not any(key.startswith("teacher") or "_teacher" in key for key in method.state_dict())
    params = {id(p) for group in method.param_groups() for p in group["params"]}
    assert not params & {id(p) for p in method.teacher.parameters()}
    assert all(torch.equal(v, method.teacher.state_dict()[k]) for k, v in before.items())
    assert losses[-1] < losses[0] - 0.05, losses


def test_a_resumed_distillation_gives_the_uninterrupted_run_s_losses_to_the_bit(tmp_path):
    files = image_folder(tmp_path / "images", size=SIZE)
    straight, _ = run(tmp_path / "straight", files, steps=4)
    run(tmp_path / "cut", files, steps=2, save_every=2)
    rest, _ = run(tmp_path / "cut", files, steps=4, resume=True)
    assert rest == straight[2:]


@pytest.mark.parametrize("size", [40, 72])
def test_a_size_the_patch_size_does_not_divide_is_refused_naming_the_option(size):
    with pytest.raises(ValueError, match=r"the teacher cannot take .*--size"):
        Distill(convnext(), teacher(), DistillSettings(steps=2, size=size))


def test_warm_up_as_long_as_the_run_is_refused():
    with pytest.raises(ValueError, match="--warmup-steps 3 must be fewer than --steps 3"):
        Distill(convnext(), teacher(), DistillSettings(steps=3, size=SIZE, warmup_steps=3))
