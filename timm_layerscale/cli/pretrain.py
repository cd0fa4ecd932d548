"""`timm-ls pretrain DATA --out DIR`: a model adapted to a folder of unlabeled images.

The front checks the flags, the data and the run's folder into a `PretrainRequest` (`timm_ls.pretrain_request`;
a resumed run's from its checkpoint's record). This module builds the models (as `timm-ls features` loads them,
or any timm model as a distillation's student), the method (`pretrain.ssl.DINOv3`, `pretrain.distill.Distill`)
and the loop (`pretrain.loop.Loop`), shows the progress and writes the final backbone to DIR/model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import timm
import torch
from torch import nn
from tqdm import tqdm

from timm_ls.model_source import ModelSource
from timm_ls.names import is_variant_file
from timm_ls.pretrain_request import PretrainRequest, unlabeled_images

from ..checkpoints.write.writers import atomic_destination
from ..model import VisionTransformerLS
from ..pretrain import distributed
from ..pretrain.distill import Distill, DistillSettings
from ..pretrain.loop import METRICS_FILE, Loop, LoopConfig, StepRecord, keep_metrics_until
from ..pretrain.method import Method
from ..pretrain.ssl import DINOv3, SSLSettings
from ..publish import save_native
from ..variants import VARIANTS
from .common import CliError, parse_model_kwargs, warn
from .features import find_device, load_model

MODEL_DIR = "model"
LOCAL_TO_GLOBAL = 96 / 224  # Meta's local and global crop sizes


def is_ours_or_a_vit(name: str | None) -> bool:
    if name is None or is_variant_file(name) or name.partition(".")[0] in VARIANTS:
        return True
    with torch.device("meta"):  # the architecture alone, before any weights are built or fetched
        return timm.is_model(name.partition(".")[0]) and hasattr(timm.create_model(name), "blocks")


def any_timm_model(name: str, source: ModelSource) -> nn.Module:
    """A distillation's student that is no ViT (a ConvNeXt, say), without its classifier."""
    if not timm.is_model(name.partition(".")[0]):
        raise CliError(f"unknown model {name!r}; pass a vit_ls name (`timm-ls list`) or a timm model name")
    kwargs = {"num_classes": 0, **parse_model_kwargs(source.model_kwargs)}
    if source.checkpoint:
        overlay = dict(file=source.checkpoint)
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    return timm.create_model(name, pretrained=source.pretrained, **kwargs)


def backbone(name: str | None, source: ModelSource, role: str) -> nn.Module:
    """The model `name` from `source`, its classifier left out (said so where it had one)."""
    model = load_model(name, source).model if is_ours_or_a_vit(name) else any_timm_model(name, source)
    classes = getattr(model, "num_classes", 0)
    if classes and role == "student":
        warn(f"the {role}'s classifier ({classes} classes) is left out: pretraining trains the backbone")
        model.reset_classifier(0)
    return model


def student_source(request: PretrainRequest) -> ModelSource:
    return ModelSource(request.checkpoint, request.pretrained, request.model_kwargs)


def input_size(model: nn.Module, request: PretrainRequest) -> int:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return request.size or int(cfg.get("input_size", (3, 224, 224))[-1])


def schedule(request: PretrainRequest) -> dict:
    """The optimiser's schedule: the same fields in both methods' settings."""
    return {
        "steps": request.steps,
        "lr": request.lr,
        "min_lr": request.min_lr,
        "warmup_steps": request.warmup_steps,
        "weight_decay": request.weight_decay,
    }


def dinov3_method(request: PretrainRequest, device: torch.device) -> Method:
    student = backbone(request.model, student_source(request), "student")
    if not isinstance(student, VisionTransformerLS) or student.mask_token is None:
        raise CliError("--method dinov3 trains a vit_ls model with a mask token (iBOT masks patches): pass one")
    size = input_size(student, request)
    patch = student.get_patch_size()[0]
    if size % patch:
        raise CliError(f"--size {size} is not a multiple of the model's patch size {patch}; pass one that is")
    local = max(patch, round(size * LOCAL_TO_GLOBAL / patch) * patch)
    settings = SSLSettings(
        **schedule(request),
        global_size=size,
        local_size=local,
        local_crops=request.local_crops,
        prototypes=request.prototypes,
        gram=request.gram,
        head_warmup_steps=request.head_warmup_steps,
    )
    return DINOv3(student.to(device), settings)


def distill_method(request: PretrainRequest, device: torch.device) -> Method:
    source = ModelSource(request.teacher_checkpoint, request.teacher_pretrained)
    teacher = backbone(request.teacher, source, "teacher").to(device)
    if request.bf16:
        teacher = teacher.to(torch.bfloat16)
    student = backbone(request.model, student_source(request), "student").to(device)
    settings = DistillSettings(
        **schedule(request),
        size=input_size(teacher, request),
    )
    return Distill(student, teacher, settings).to(device)


def save_backbone(model: nn.Module, folder: Path) -> None:
    """Ours as a native folder (`timm.create_model("local-dir:...")`, convert and probe read it); any other
    timm model as timm's `save_for_hf` writes it. Whole or nothing, as every write."""
    if isinstance(model, VisionTransformerLS):
        save_native(model, folder, overwrite=True)
        return
    with atomic_destination(folder, overwrite=True, folder=True, what="pretrain", ours=["*"]) as staged:
        timm.models.save_for_hf(model, str(staged), safe_serialization=True)


def shown(record: StepRecord) -> dict[str, str]:
    parts = {name: f"{value:.4g}" for name, value in record.parts.items()}
    return {"loss": f"{record.loss:.4g}", **parts, "img/s": f"{record.images_per_s:.1f}"}


def run_loop(loop: Loop, request: PretrainRequest) -> StepRecord | None:
    start = loop.resume(Path(request.out)) if request.resume else 0
    if start >= request.steps:
        raise CliError(f"--resume {request.out}: the run is at step {start} of {request.steps}; pass a larger --steps")
    if not request.resume and loop.is_writer:
        keep_metrics_until(Path(request.out) / METRICS_FILE, -1)  # --overwrite: the old run's lines go
    quiet = None if loop.is_writer else True
    with tqdm(total=request.steps, initial=start, unit="step", file=sys.stderr, disable=quiet) as bar:

        def on_step(record: StepRecord) -> None:
            bar.set_postfix(shown(record), refresh=False)
            bar.update(1)

        records = loop.run(on_step)
    return records[-1] if records else None


def execute(request: PretrainRequest) -> int:
    device = find_device(request.device)
    if request.threads:
        torch.set_num_threads(request.threads)
    files = unlabeled_images(Path(request.data))
    with distributed.process_group_from_environment(device):
        if device.type == "cuda" and distributed.is_distributed():
            device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(request.seed)  # random-init weights and heads are the same on every rank and resume
        build = dinov3_method if request.method == "dinov3" else distill_method
        method = build(request, device).to(device)
        config = LoopConfig(request.steps, request.batch_size, request.seed, request.save_every, bf16=request.bf16)
        loop = Loop(method, files, config, Path(request.out), {"request": request.settings()}, device)
        last = run_loop(loop, request)
        writer = loop.is_writer
        if writer:
            save_backbone(method.backbone(), Path(request.out) / MODEL_DIR)
    if writer:
        summary = ", ".join(f"{k} {v}" for k, v in shown(last).items()) if last else ""
        print(f"{request.method}: {len(files)} images, step {request.steps}: {summary}")
        print(f"wrote {Path(request.out) / MODEL_DIR} (timm.create_model('local-dir:{Path(request.out) / MODEL_DIR}'))")
    return 0
