"""What `timm-ls features` holds at its peak, counted before it starts, from the images' headers and the model.

The run has three phases, one batch or one image at a time, and the peak is the largest of them over the run,
plus what lasts through it (the joint PCA's `C x C` sums and the foreground's masks). Each term is the arrays
the code makes (`tools/feature_pictures.py`), in bytes: PIL holds a decoded RGB image at 4 bytes a pixel; a
forward takes `forward_bytes` (fitted to the measured peak of a forward); features leave the model as
float32 and are fitted in float64. The spooled features are in the page cache, not the process's memory.
`benchmarks/features_memory.py` measures the peak `RssAnon` of the run against this count.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .feature_pictures import MAX_PATCHES, ImageJob, batches

PIL_PIXEL = 4  # bytes a decoded RGB pixel takes in PIL
F32, F64 = 4, 8
# Fitted to the peak RssAnon of `forward_intermediates` (one block's normed tokens, stop_early; fp32 and bf16,
# ViT-S/16 and ViT-B/16, batch 1 to 8, 1,300 to 5,400 tokens): peak = FIXED + this * tokens * embed_dim * batch
# for 4-byte activations (half precision halves it), within 25% of each measured point, above more than below.
INTERMEDIATES_BYTES_PER_ELEMENT = 50.0
INTERMEDIATES_FIXED_BYTES = 48 * 2**20
MEMINFO = Path("/proc/meminfo")


def forward_bytes(tokens: int, embed_dim: int, batch: int = 1, element_size: int = 4) -> int:
    """The peak memory a forward of `batch` images of `tokens` tokens takes above its weights."""
    per_token = INTERMEDIATES_BYTES_PER_ELEMENT * embed_dim * element_size / F32
    return int(INTERMEDIATES_FIXED_BYTES + per_token * tokens * batch)


@dataclass(frozen=True)
class Peak:
    """The largest phase of the run: its bytes, the phase, and the job (and batch size) it is at."""

    bytes: int
    phase: str
    job: ImageJob
    batch: int = 1


def decode_bytes(job: ImageJob, batch: int) -> int:
    """Reading one image into its batch: the file decoded and converted, resized, cropped, and the batch's pixels."""
    source, resized = job.source[0] * job.source[1], job.resized[0] * job.resized[1]
    return 2 * PIL_PIXEL * source + PIL_PIXEL * (resized + job.pixels) + 3 * job.pixels + 3 * job.pixels * F32 * batch


def forward_phase_bytes(job: ImageJob, batch: int, dim: int, element: int, prefix: int, joint: bool) -> int:
    """A forward of `batch` images of the job's crop and each output spooled (and fitted where `joint`)."""
    pixels = 3 * job.pixels * batch * (F32 + (element if element != F32 else 0))
    features = job.patches * dim * (F32 + (2 * F64 if joint else 0))
    return (
        pixels + forward_bytes(job.patches + prefix, dim, batch, element) + features + (dim * dim * F64 if joint else 0)
    )


def picture_bytes(job: ImageJob, dim: int, alone: bool) -> int:
    """Colouring one image: its features projected in float64, the picture side by side and its PNG; fitted
    on the image alone, its own PCA too."""
    fitted = job.patches * dim * 2 * F64 + 3 * dim * dim * F64 if alone else 0
    return job.patches * dim * 2 * F64 + fitted + job.pixels * (3 * 3 + 2 * PIL_PIXEL)


def peak_bytes(
    jobs: Sequence[ImageJob], batch: int, dim: int, element: int, prefix: int, joint: bool, masked: bool
) -> Peak:
    """The run's peak above what is held before it starts (the model's weights already loaded)."""
    lasting = (2 * dim * dim * F64 if joint else 0) + (sum(j.patches for j in jobs) if joint and masked else 0)
    phases = []
    for group in batches(jobs, batch):
        first = jobs[group[0]]
        phases.append(Peak(max(decode_bytes(jobs[i], len(group)) for i in group), "reading", first, len(group)))
        forward = forward_phase_bytes(first, len(group), dim, element, prefix, joint)
        phases.append(Peak(forward, "the forward of", first, len(group)))
    phases += [Peak(picture_bytes(job, dim, not joint), "drawing", job) for job in jobs]
    worst = max(phases, key=lambda p: p.bytes)
    return Peak(worst.bytes + lasting, worst.phase, worst.job, worst.batch)


def spool_bytes(jobs: Sequence[ImageJob], dim: int) -> int:
    """What the spool writes to disk: each image as the model saw it and its float32 features."""
    return sum(job.pixels * 3 + job.patches * dim * F32 for job in jobs)


def largest_size(jobs: Sequence[ImageJob], fits: Callable[[list[ImageJob]], bool]) -> int:
    """The largest `--size` (a multiple of the patch) at which every job is within the patch bound and `fits`
    holds of them all; 0 if none is."""
    patch, side = jobs[0].patch, 0
    while True:
        replanned = [job.at(side + patch) for job in jobs]
        if any(job.patches > MAX_PATCHES for job in replanned) or not fits(replanned):
            return side
        side += patch


def available_memory(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is no such file (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None
