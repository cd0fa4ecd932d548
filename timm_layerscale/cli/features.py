"""`timm-ls features IMAGE ... [--model NAME] --out DIR`: the PCA of a block's patch features as RGB, per image.

The model is a vit_ls variant (random, `--pretrained` or `--checkpoint` weights, a checkpoint read by the one
identity rule of every command: `--model` > what it records > its family > its shapes), a YAML variant file,
or any timm ViT with `forward_intermediates` (DINOv2, DeiT-III, eva), built with `dynamic_img_size=True`.
The run itself, streamed a batch at a time, is `tools.feature_pictures`'; its memory count `tools.feature_memory`'.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
from timm.data import resolve_data_config
from torch import nn

from timm_ls.names import is_variant_file
from timm_ls.paths import image_files

from ..checkpoints.errors import CheckpointError
from ..checkpoints.write.writers import atomic_destination, staged_into
from ..tools.feature_memory import Peak, available_memory, largest_size, peak_bytes, spool_bytes
from ..tools.feature_pictures import SPOOL_NAME, ImageJob, Spool, draw_all, free_disk, plan_images, run_forwards
from ..variants import VARIANTS
from .common import (
    CliError,
    build,
    build_from_checkpoint,
    count,
    load_report,
    parse_model_kwargs,
    resolve_variant,
    warn,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Loaded:
    """The model and what the command says of it."""

    model: nn.Module
    name: str
    source: str
    patch: int
    prefix: int


def _timm_model(args: argparse.Namespace, name: str, kwargs: dict) -> tuple[nn.Module, str]:
    kwargs = {"dynamic_img_size": True, **kwargs}
    if args.checkpoint:
        overlay = dict(file=args.checkpoint)
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs), args.checkpoint
    if args.pretrained:
        return timm.create_model(name, pretrained=True, **kwargs), "timm's pretrained weights (the Hub)"
    return timm.create_model(name, **kwargs), "random init (no --checkpoint or --pretrained given)"


def _check_vit(name: str, model: nn.Module) -> None:
    if not hasattr(model, "forward_intermediates") or not hasattr(model, "blocks"):
        raise CliError(f"{name} has no forward_intermediates and blocks; pass a ViT (vit_ls_*, vit_*, deit3_*, eva)")


def load_model(args: argparse.Namespace) -> Loaded:
    """Ours through the commands' one `build` (a checkpoint through the identity rule, `--model` optional);
    timm's own ViTs through `timm.create_model`."""
    name = args.model
    if name is None or is_variant_file(name) or name.partition(".")[0] in VARIANTS:
        with load_report() as report:
            if args.checkpoint:
                model, source, name = build_from_checkpoint(args, name)
            else:
                variant, tag = resolve_variant(name)
                model, source = build(args, variant, tag)
                name = f"{variant.name}.{tag}" if tag else variant.name
        for line in report:
            if line.startswith("warning: "):
                warn(line.removeprefix("warning: "))
    elif timm.is_model(name.partition(".")[0]):
        with torch.device("meta"):  # the architecture alone, checked before any weights are built or fetched
            _check_vit(name, timm.create_model(name))
        model, source = _timm_model(args, name, parse_model_kwargs(args.model_kwargs))
    else:
        close = difflib.get_close_matches(name.partition(".")[0], [*VARIANTS, *timm.list_models()], n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CliError(f"unknown model {name!r}; {hint}pass a vit_ls name (`timm-ls list`) or a timm ViT")
    patch = model.patch_embed.patch_size
    patch = patch if isinstance(patch, int) else patch[0]
    return Loaded(model.eval(), name, source, patch, getattr(model, "num_prefix_tokens", 1))


def block_index(text: str, depth: int) -> int:
    """`--layer`: an index (negative from the end) or `last`, checked against the model's depth."""
    index = depth - 1 if text == "last" else int(text)
    index = index + depth if index < 0 else index
    if not 0 <= index < depth:
        raise CliError(f"--layer {text}: the model has {depth} blocks; pass 0 to {depth - 1}, -1 or last")
    return index


def available(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory() if device.type == "cpu" else None


def weights_bytes(model: nn.Module, element: int) -> int:
    return sum(t.numel() for t in [*model.parameters(), *model.buffers()]) * element


def need(loaded: Loaded, jobs: list[ImageJob], args: argparse.Namespace, device: torch.device) -> tuple[int, Peak]:
    """The bytes the run will hold at its peak above what is held now, and where that peak is."""
    element = DTYPES[args.dtype].itemsize
    joint = not args.per_image and len(jobs) > 1
    peak = peak_bytes(jobs, args.batch, loaded.model.embed_dim, element, loaded.prefix, joint, args.foreground)
    weights = weights_bytes(loaded.model, element) if device.type != "cpu" else 0
    return weights + peak.bytes, peak


def plan(loaded: Loaded, jobs: list[ImageJob], args: argparse.Namespace, device: torch.device) -> str:
    """What the run will hold at its peak, in one line; a run that would not fit is refused with the largest
    --size that does. On a GPU the model's weights count there too (on the CPU they are loaded already)."""
    weights = weights_bytes(loaded.model, DTYPES[args.dtype].itemsize) if device.type != "cpu" else 0
    total, peak = need(loaded, jobs, args, device)
    free = available(device)
    job, n = peak.job, peak.batch
    if free is not None and total > free:
        fits = lambda planned: need(loaded, planned, args, device)[0] <= free  # noqa: E731
        side = largest_size(jobs, fits) if weights < free else 0
        fix = f"pass --size {side} or less (the largest shorter side that fits)" if side else "free memory"
        raise CliError(
            f"{job.path} at {job.crop[0]}x{job.crop[1]} px is {job.patches} patches; {count(n, 'image')} of it "
            f"take about {total / 2**30:.2f} GiB at the peak ({peak.phase}) and {free / 2**30:.2f} GiB is "
            f"available; {fix}" + (" or a smaller --batch" if n > 1 else "")
        )
    check_disk(jobs, loaded.model.embed_dim, args)
    where = f" of {free / 2**30:.1f} GiB available" if free is not None else ""
    return (
        f"plan: {count(len(jobs), 'image')}; at the peak ({peak.phase} {count(n, 'image')} of "
        f"{job.crop[0]}x{job.crop[1]} px, {job.patches} patches each) about {total / 2**30:.2f} GiB{where}"
    )


def check_disk(jobs: list[ImageJob], dim: int, args: argparse.Namespace) -> None:
    """The spool (and with --save the features) must fit on the destination's disk while the command runs."""
    spooled = spool_bytes(jobs, dim) * (2 if args.save else 1)
    disk = free_disk(Path(args.out).absolute().parent)
    if spooled > disk:
        raise CliError(
            f"the features of {count(len(jobs), 'image')} take {spooled / 2**30:.1f} GiB on disk while the command "
            f"runs and {disk / 2**30:.1f} GiB is free beside {args.out}; pass fewer images or a smaller --size"
        )


def find_device(name: str) -> torch.device:
    """`--device`, checked before any work: a name torch knows, on a machine that has it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CliError(f"--device: got {name!r}; pass cpu, cuda, cuda:N or mps") from None
    present = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available}.get(device.type, lambda: True)
    if not present() or (device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count()):
        raise CliError(f"--device {name}: this machine has no such device; pass --device cpu")
    return device


@contextmanager
def output_folder(out: Path, overwrite: bool) -> Iterator[Path]:
    """The folder the results go into, staged beside `out`: a new `out` appears whole, an existing one
    (--overwrite) gets every file at once; an error or a signal leaves `out` as it was."""
    try:
        with staged_into(out) if out.is_dir() and overwrite else atomic_destination(out, folder=True) as staged:
            yield staged
    except CheckpointError as exc:
        raise CliError(str(exc)) from None


def execute(args: argparse.Namespace) -> int:
    device = find_device(args.device)
    size = None if args.size == "native" else int(args.size)
    paths = image_files(args.images)
    torch.manual_seed(0)  # a random-init model gives the same picture on every run
    loaded = load_model(args)
    return run(args, loaded, plan_images(paths, size, loaded.patch), device)


def run(args: argparse.Namespace, loaded: Loaded, jobs: list[ImageJob], device: torch.device) -> int:
    """The planned run of a loaded model: the plan said, the forwards, the pictures staged, then in place."""
    layer = block_index(args.layer, len(loaded.model.blocks))
    data_cfg = resolve_data_config({}, model=loaded.model)
    print(f"model: {loaded.name}; weights: {loaded.source}")
    print(plan(loaded, jobs, args, device))
    loaded.model.to(device, DTYPES[args.dtype])
    out, joint = Path(args.out), not args.per_image and len(jobs) > 1
    with output_folder(out, args.overwrite) as staged:
        spool = Spool(staged / SPOOL_NAME)
        try:
            streamed = run_forwards(
                loaded.model,
                jobs,
                layer,
                data_cfg,
                batch=args.batch,
                dtype=DTYPES[args.dtype],
                device=device,
                spool=spool,
                joint=joint,
            )
            about = dict(model=loaded.name, source=loaded.source, layer=str(layer), depth=str(len(loaded.model.blocks)))
            lines = draw_all(staged, jobs, streamed, masked=args.foreground, save=args.save, about=about)
        finally:
            spool.close()
    fitted = "per image" if not joint else f"fitted on all {len(jobs)} images together"
    print(
        f"features: block {layer} of {len(loaded.model.blocks)} (0-based), normed patch tokens (the "
        f"{loaded.prefix} prefix tokens left out); PCA {fitted}"
    )
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0
