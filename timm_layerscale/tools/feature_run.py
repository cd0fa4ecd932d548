"""`timm-ls features` as one application function: `write_feature_pictures(loaded, jobs, out, settings)` plans
the run (its memory against what is available, its spool against the disk), then runs the forwards and draws
the pictures into a staged folder put in place whole, as `convert_checkpoint` is for `timm-ls convert`.

The command parses the flags, builds the model (`Loaded`) and plans the images from their headers; the
streamed run is `feature_pictures`', its memory count `feature_memory`'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from timm.data import resolve_data_config
from torch import nn

from timm_ls.cpu import bf16_units, cpu_flags
from timm_ls.errors import CliError

from ..checkpoints.errors import CheckpointError
from ..checkpoints.write.writers import atomic_destination, staged_into
from .feature_memory import Peak, available_memory, largest_size, peak_bytes, spool_bytes
from .feature_pictures import SPOOL_NAME, ImageJob, Spool, draw_all, free_disk, run_forwards

__all__ = ["DTYPES", "FeatureSettings", "Loaded", "Need", "need", "precision", "run_line", "write_feature_pictures"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Loaded:
    """The model and what the command says of it: its name, where its weights came from, its patch size and
    how many prefix tokens (CLS, storage) come before its patches."""

    model: nn.Module
    name: str
    source: str
    patch: int
    prefix: int


@dataclass(frozen=True)
class FeatureSettings:
    """What the run is asked: the block read (`layer`: an index, negative from the end, or `last`), the images
    per forward, the dtype (a name of `DTYPES`), one PCA per image or one for all, DINOv2's foreground, the
    features saved beside the pictures, and whether an existing folder is written into."""

    layer: str = "last"
    batch: int = 8
    dtype: str = "fp32"
    per_image: bool = False
    foreground: bool = False
    save: bool = False
    overwrite: bool = False

    def joint(self, jobs: Sequence[ImageJob]) -> bool:
        """Whether one PCA is fitted on all the images together."""
        return not self.per_image and len(jobs) > 1


@dataclass(frozen=True)
class Need:
    """The bytes the run holds at its peak above what is held now: the model's weights where they move to
    another device (on the CPU they are loaded already) and the run's own peak."""

    weights: int
    peak: Peak

    @property
    def total(self) -> int:
        return self.weights + self.peak.bytes


def block_index(text: str, depth: int) -> int:
    """`--layer`: an index (negative from the end) or `last`, checked against the model's depth."""
    index = depth - 1 if text == "last" else int(text)
    index = index + depth if index < 0 else index
    if not 0 <= index < depth:
        raise CliError(f"--layer {text}: the model has {depth} blocks; pass 0 to {depth - 1}, -1 or last")
    return index


def available(device: torch.device) -> int | None:
    """The memory free on `device`; None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory() if device.type == "cpu" else None


def weights_bytes(model: nn.Module, element: int) -> int:
    return sum(t.numel() for t in [*model.parameters(), *model.buffers()]) * element


def need(loaded: Loaded, jobs: Sequence[ImageJob], settings: FeatureSettings, device: torch.device) -> Need:
    """What the run will hold at its peak above what is held now, and where that peak is."""
    element = DTYPES[settings.dtype].itemsize
    dim, joint = loaded.model.embed_dim, settings.joint(jobs)
    peak = peak_bytes(jobs, settings.batch, dim, element, loaded.prefix, joint, settings.foreground)
    return Need(weights_bytes(loaded.model, element) if device.type != "cpu" else 0, peak)


def run_line(loaded: Loaded, jobs: list[ImageJob], settings: FeatureSettings, device: torch.device, out: Path) -> str:
    """What the run will hold at its peak, in one line; a run that would not fit in memory is refused with the
    largest --size that does, one whose spool would not fit on the disk beside `out` too."""
    counted = need(loaded, jobs, settings, device)
    free = available(device)
    job, n = counted.peak.job, counted.peak.batch
    if free is not None and counted.total > free:
        fits = lambda planned: need(loaded, planned, settings, device).total <= free  # noqa: E731
        side = largest_size(jobs, fits) if counted.weights < free else 0
        fix = f"pass --size {side} or less (the largest shorter side that fits)" if side else "free memory"
        raise CliError(
            f"{job.path} at {job.crop[0]}x{job.crop[1]} px is {job.patches} patches; {_count(n, 'image')} of it "
            f"take about {counted.total / 2**30:.2f} GiB at the peak ({counted.peak.phase}) and "
            f"{free / 2**30:.2f} GiB is available; {fix}" + (" or a smaller --batch" if n > 1 else "")
        )
    check_disk(jobs, loaded.model.embed_dim, settings.save, out)
    where = f" of {free / 2**30:.1f} GiB available" if free is not None else ""
    return (
        f"plan: {_count(len(jobs), 'image')}; at the peak ({counted.peak.phase} {_count(n, 'image')} of "
        f"{job.crop[0]}x{job.crop[1]} px, {job.patches} patches each) about {counted.total / 2**30:.2f} GiB{where}; "
        + precision(settings.dtype, device)
    )


def precision(dtype: str, device: torch.device, flags: set[str] | None = None) -> str:
    """The run's dtype and where it runs; for bf16 on a CPU, whether the CPU (its `flags`, else
    /proc/cpuinfo's) has bf16 matrix units, without which bf16 is slower than fp32."""
    if dtype != "bf16" or device.type != "cpu":
        return f"{dtype} on {device.type}"
    units = bf16_units(cpu_flags() if flags is None else flags)
    if units:
        return f"bf16 on this CPU's bf16 matrix units ({units})"
    return "bf16 on a CPU without bf16 matrix units (no amx_bf16 or avx512_bf16): slower than --dtype fp32 here"


def check_disk(jobs: Sequence[ImageJob], dim: int, save: bool, out: Path) -> None:
    """The spool (and with `save` the features) must fit on the destination's disk while the command runs."""
    spooled = spool_bytes(jobs, dim) * (2 if save else 1)
    disk = free_disk(Path(out).absolute().parent)
    if spooled > disk:
        raise CliError(
            f"the features of {_count(len(jobs), 'image')} take {spooled / 2**30:.1f} GiB on disk while the "
            f"command runs and {disk / 2**30:.1f} GiB is free beside {out}; pass fewer images or a smaller --size"
        )


@contextmanager
def output_folder(out: Path, overwrite: bool) -> Iterator[Path]:
    """The folder the results go into, staged beside `out`: a new `out` appears whole, an existing one
    (`overwrite`) gets every file at once; an error or a signal leaves `out` as it was."""
    try:
        with staged_into(out) if out.is_dir() and overwrite else atomic_destination(out, folder=True) as staged:
            yield staged
    except CheckpointError as exc:
        raise CliError(str(exc)) from None


def write_feature_pictures(
    loaded: Loaded,
    jobs: list[ImageJob],
    out: Path,
    settings: FeatureSettings,
    device: torch.device,
    say: Callable[[str], None] = print,
) -> list[str]:
    """The planned run of a loaded model into `out`: the model and the plan said (before any forward), the
    forwards streamed, the pictures staged, then put in place. Returns the lines of what was written."""
    model, dtype = loaded.model, DTYPES[settings.dtype]
    layer = block_index(settings.layer, len(model.blocks))
    data_cfg = resolve_data_config({}, model=model)
    say(f"model: {loaded.name}; weights: {loaded.source}")
    say(run_line(loaded, jobs, settings, device, out))
    model.to(device, dtype)
    joint = settings.joint(jobs)
    with output_folder(out, settings.overwrite) as staged:
        spool = Spool(staged / SPOOL_NAME)
        try:
            streamed = run_forwards(
                model, jobs, layer, data_cfg, batch=settings.batch, dtype=dtype, device=device, spool=spool, joint=joint
            )
            about = dict(model=loaded.name, source=loaded.source, layer=str(layer), depth=str(len(model.blocks)))
            lines = draw_all(staged, jobs, streamed, masked=settings.foreground, save=settings.save, about=about)
        finally:
            spool.close()
    fitted = "per image" if not joint else f"fitted on all {len(jobs)} images together"
    summary = (
        f"features: block {layer} of {len(model.blocks)} (0-based), normed patch tokens (the {loaded.prefix} prefix "
        f"tokens left out); PCA {fitted}"
    )
    return [summary, *lines, f"wrote {out}"]


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"
