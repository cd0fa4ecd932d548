"""Fine-tuning with timm's own training parts, as train.py strings them together, and LayerScale's switches.

The data is a small image folder this file writes: noisy images of two classes that differ in their
dominant colour, which a tiny model learns in a few steps even while LayerScale mutes its blocks.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file
from support import TINY, assert_compiled_matches_eager, move_off_init_
from timm.data import create_dataset, create_loader, create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.task import ClassificationTask, load_task_ema_checkpoint, resume_task_checkpoint
from timm.utils import CheckpointSaver

NAME = "vit_ls_small_patch16_dinov3"
INIT = 1e-4
EPOCHS = 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for name, channel in (("red", 0), ("blue", 2)):
        (root / "train" / name).mkdir(parents=True)
        for i in range(16):
            pixels = rng.integers(0, 160, (32, 32, 3))
            pixels[..., channel] += 64
            Image.fromarray(pixels.astype(np.uint8)).save(root / "train" / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def backbone_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A "pretrained" backbone: Meta's layout, nested as in Meta's files, gammas far from any init."""
    torch.manual_seed(0)
    source = move_off_init_(timm.create_model(NAME, **TINY))
    path = tmp_path_factory.mktemp("backbone") / "backbone.pth"
    torch.save({"model": source.state_dict()}, path)
    return path


def gammas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith(".gamma")}


def create(backbone_file: Path | None = None, **kwargs) -> torch.nn.Module:
    """What train.py's `--pretrained --pretrained-path FILE --num-classes 2 --gp avg` asks timm for."""
    overlay = dict(file=str(backbone_file), num_classes=-1) if backbone_file else None
    pretrained = backbone_file is not None
    return timm.create_model(
        NAME, pretrained, pretrained_cfg_overlay=overlay, num_classes=2, global_pool="avg", **TINY, **kwargs
    )


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return create_optimizer_v2(model, "adamw", lr=3e-3, weight_decay=0.05, layer_decay=0.75)


def loader(image_folder: Path):
    dataset = create_dataset("", root=str(image_folder), split="train", is_training=True)
    return create_loader(
        dataset, (3, 32, 32), 8, is_training=True, no_aug=True, use_prefetcher=False, num_workers=0, device=CPU
    )


def train(task, optimizer, scheduler, batches, epochs: int) -> list[float]:
    """train.py's loop: the task's loss, optimizer and scheduler steps, EMA updates; mean loss per epoch."""
    model, losses, step = task.get_trainable_module().train(), [], 0
    for epoch in range(epochs):
        epoch_losses = []
        for images, labels in batches:
            loss = task(images, labels)["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            task.update_ema(step=step)
            scheduler.step_update(num_updates=step)
            epoch_losses.append(loss.item())
        scheduler.step(epoch + 1)
        losses.append(sum(epoch_losses) / len(epoch_losses))
    model.eval()
    return losses


def reinit_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "timm_layerscale" and "re-initialised" in r.getMessage()]


def test_fine_tune_resume_and_layer_scale_switches(image_folder, backbone_file, tmp_path, ls_log):
    torch.manual_seed(0)
    model = create(backbone_file, init_values=INIT, reinit_layer_scale=True, drop_path_rate=0.1)
    assert all(torch.equal(g, torch.full((64,), INIT)) for g in gammas(model).values())  # re-initialised
    [record] = reinit_lines(ls_log)  # said once, as a warning
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "LayerScale: re-initialised 4 gammas to init_values (reinit_layer_scale=True)"
    backbone = torch.load(backbone_file, weights_only=True)["model"]
    assert torch.equal(model.blocks[1].attn.qkv.weight, backbone["blocks.1.attn.qkv.weight"])  # the rest loaded

    model.set_grad_checkpointing(True)
    task = ClassificationTask(model, criterion=LabelSmoothingCrossEntropy(0.1), device=CPU, verbose=False)
    optimizer = optimizer_for(model)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=EPOCHS, updates_per_epoch=4)
    task.setup_ema(decay=0.9)
    saver = CheckpointSaver(model, optimizer, checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path), task=task)
    losses = train(task, optimizer, scheduler, loader(image_folder), EPOCHS)
    saver.save_checkpoint(EPOCHS - 1, metric=losses[-1])
    assert losses[-1] < 0.6 * losses[0], losses  # it learns
    trained, ema = gammas(model), gammas(task.get_trainable_module(ema=True).module)
    assert all((g - INIT).abs().max() > 10 * INIT for g in trained.values())  # the gammas moved
    assert all(not torch.equal(ema[k], trained[k]) for k in trained)

    # --resume on a model that train.py built from the pretrained backbone again, re-initialise switch on
    resumed = create(backbone_file, init_values=INIT, reinit_layer_scale=True)
    resumed_task = ClassificationTask(resumed, criterion=LabelSmoothingCrossEntropy(0.1), device=CPU, verbose=False)
    resumed_optimizer = optimizer_for(resumed)
    assert resume_task_checkpoint(resumed_task, str(tmp_path / "last.pth.tar"), optimizer=resumed_optimizer) == EPOCHS
    resumed_task.setup_ema(decay=0.9)
    load_task_ema_checkpoint(resumed_task, str(tmp_path / "last.pth.tar"))
    assert all(torch.equal(v, trained[k]) for k, v in gammas(resumed).items())
    resumed_ema = resumed_task.get_trainable_module(ema=True).module
    assert all(torch.equal(v, ema[k]) for k, v in gammas(resumed_ema).items())
    gamma, resumed_gamma = model.blocks[0].ls1.gamma, resumed.blocks[0].ls1.gamma
    assert torch.equal(optimizer.state[gamma]["exp_avg"], resumed_optimizer.state[resumed_gamma]["exp_avg"])

    # --initial-checkpoint keeps the saved gammas too, whatever the switch says
    last = str(tmp_path / "last.pth.tar")
    initial = create(backbone_file, init_values=INIT, reinit_layer_scale=True, checkpoint_path=last)
    assert all(torch.equal(v, ema[k]) for k, v in gammas(initial).items())  # timm prefers the EMA weights
    assert len(reinit_lines(ls_log)) == 3  # one per pretrained load, none for the checkpoints

    # freeze: the gammas stay, everything else trains, and the optimiser never sees them
    frozen = create(backbone_file, freeze_layer_scale=True)
    before = {k: v.clone() for k, v in frozen.state_dict().items()}
    frozen_optimizer = optimizer_for(frozen)
    grouped = {id(p) for group in frozen_optimizer.param_groups for p in group["params"]}
    assert not any(id(m.gamma) in grouped for m in frozen.modules() if hasattr(m, "gamma"))
    frozen_task = ClassificationTask(frozen, criterion=LabelSmoothingCrossEntropy(0.1), device=CPU, verbose=False)
    scheduler, _ = create_scheduler_v2(frozen_optimizer, "cosine", num_epochs=1, updates_per_epoch=4)
    train(frozen_task, frozen_optimizer, scheduler, loader(image_folder), 1)
    after = frozen.state_dict()
    trainable = [k for k in before if k.endswith((".weight", ".gamma"))]
    assert all(torch.equal(after[k], before[k]) == k.endswith(".gamma") for k in trainable)
    assert torch.equal(after["blocks.0.ls1.gamma"], backbone["blocks.0.ls1.gamma"])  # the pretrained ones


def test_gammas_survive_timm_export_without_the_switches(backbone_file, tmp_path):
    """The switches act on the model being trained: a saved model does not pass them on to its users."""
    model = create(backbone_file, reinit_layer_scale=True, freeze_layer_scale=True)
    with torch.no_grad():
        model.blocks[0].ls1.gamma.fill_(0.5)  # "trained"
    timm.models.save_for_hf(model, tmp_path / "export", safe_serialization=True)
    reloaded = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True)
    assert torch.equal(reloaded.blocks[0].ls1.gamma, torch.full((64,), 0.5))
    assert reloaded.blocks[0].ls1.gamma.requires_grad
    assert reloaded.config.depth == TINY["depth"]


def test_layer_decay_gives_each_block_its_group_and_no_decay_to_tokens_and_gammas():
    model = timm.create_model(NAME, embed_dim=64, num_heads=4, depth=3, num_classes=2)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.5)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    seen = {name: group_of[id(p)] for name, p in model.named_parameters() if p.requires_grad}
    assert len(seen) == len([p for p in model.parameters() if p.requires_grad])  # every parameter grouped once
    scale = {name: g["lr_scale"] for name, g in seen.items()}
    assert scale["cls_token"] == scale["patch_embed.proj.weight"] == 0.5**4  # stem, then blocks, then the head
    for i in range(3):
        block_groups = {id(g) for name, g in seen.items() if name.startswith(f"blocks.{i}.")}
        assert len(block_groups) == 2  # one with weight decay, one without
        assert scale[f"blocks.{i}.attn.qkv.weight"] == scale[f"blocks.{i}.ls1.gamma"] == 0.5 ** (3 - i)
    assert scale["head.weight"] == 1.0
    no_decay = [n for n, g in seen.items() if g["weight_decay"] == 0]
    assert {"cls_token", "storage_tokens", "mask_token"} <= set(no_decay)
    assert {f"blocks.{i}.ls{j}.gamma" for i in range(3) for j in (1, 2)} <= set(no_decay)
    assert seen["blocks.0.mlp.fc1.weight"]["weight_decay"] == 0.05


def test_drop_path_schedule_and_sample_drop_from_train_flags():
    linear = timm.create_model(NAME, embed_dim=64, num_heads=4, depth=4, drop_path_rate=0.3)
    rates = [getattr(b.drop_path, "drop_prob", 0.0) for b in linear.blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])  # timm's linear rule, as train.py's --drop-path gives
    uniform = timm.create_model(
        NAME, embed_dim=64, num_heads=4, depth=4, drop_path_rate=0.3, stochastic_depth="sample_drop"
    )
    assert [b.sample_drop_rate for b in uniform.blocks] == [0.3] * 4  # DINOv3's uniform rate
    assert all(isinstance(b.drop_path, torch.nn.Identity) for b in uniform.blocks)


def test_bf16_autocast_trains():
    """train.py's `--amp --amp-dtype bfloat16`: autocast forward, fp32 parameters and gradients."""
    model = move_off_init_(timm.create_model(NAME, embed_dim=64, num_heads=4, depth=1, num_classes=2)).train()
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    reference = F.cross_entropy(model(images), labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
    loss.backward()
    assert logits.dtype == torch.bfloat16
    assert abs(loss.item() - reference.item()) < 0.05 * reference.item()
    gamma = model.blocks[0].ls1.gamma
    assert gamma.dtype == gamma.grad.dtype == torch.float32 and gamma.grad.abs().sum() > 0


def test_torch_compile_traces_the_whole_model_with_gradients(images):
    """train.py's `--torchcompile`: one graph, no breaks, same loss and gradients as eager."""
    model = move_off_init_(timm.create_model(NAME, num_classes=2, drop_path_rate=0.2, **TINY)).train()
    assert_compiled_matches_eager(model, images)


# ------------------------------------------------------------------------------------ timm's data pipeline


@pytest.mark.parametrize(
    "kwargs, size",
    [
        ({}, (256, 256)),  # the released resolution; a dynamic model takes any size
        ({"dynamic_img_size": False}, (224, 224)),
        ({"dynamic_img_size": False, "img_size": (64, 96)}, (64, 96)),
        ({"dynamic_img_size": False, "pretrained": True}, (224, 224)),
    ],
)
@torch.no_grad()
def test_timms_data_pipeline_makes_inputs_the_model_accepts(kwargs, size, tmp_path) -> None:
    """resolve_data_config + create_transform, as train.py and validate.py call them, from the pretrained cfg."""
    if kwargs.pop("pretrained", False):
        torch.manual_seed(0)
        save_file(move_off_init_(timm.create_model(NAME, **TINY)).state_dict(), tmp_path / "w.safetensors")
        kwargs.update(pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "w.safetensors")))
    model = timm.create_model(f"{NAME}.lvd1689m", **TINY, **kwargs).eval()
    config = resolve_data_config({}, model=model)
    assert config["input_size"] == (3, *size)
    x = create_transform(**config)(Image.new("RGB", (300, 200), (90, 120, 30)))
    assert x.shape == (3, *size)
    assert model(x[None]).shape == (1, TINY["embed_dim"])
    assert model.forward_features(x[None]).shape == (1, 5 + size[0] // 16 * (size[1] // 16), TINY["embed_dim"])
