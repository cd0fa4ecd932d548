"""`--check`: ONNX Runtime against PyTorch fp32 on random inputs, every output compared, relative to its scale."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..checkpoints.dtypes import cast_dtype
from .errors import CheckRow, OnnxCheckError
from .graph import INPUT_NAME, ExportedForward, output_names

# Largest relative error (max |ORT - PyTorch fp32| over max |PyTorch fp32|) a check accepts.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2}
CHECK_PATCHES = ((14, 14), (12, 18), (18, 12))  # square, wide, tall: 224x224, 192x288, 288x192 at patch 16
CHECK_BATCHES = (1, 2)


def check_onnx(
    path: str | Path,
    reference: nn.Module,
    kind: str,
    blocks: Sequence[int],
    dtype: str = "fp32",
    batch: int | None = None,
    size: tuple[int, int] | None = None,
    sizes: Sequence[tuple[int, int]] | None = None,
    seed: int = 0,
    with_tokens: bool = False,
) -> list[CheckRow]:
    """ONNX Runtime against `reference` (PyTorch, fp32) on random inputs: square, wide and tall sides (or
    the static size), two batch sizes when the batch is dynamic. Max absolute and relative errors, per output
    (`with_tokens`: an int8 export's fp32 graph, with its added `tokens` output)."""
    import onnxruntime as ort  # the `export` extra, imported on use: the package imports without it

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    forward = ExportedForward(reference, kind, blocks, with_tokens).eval()
    p = reference.patch_size
    sizes = [size] if size is not None else sizes or [(h * p, w * p) for h, w in CHECK_PATCHES]
    generator = torch.Generator().manual_seed(seed)
    was_training = reference.training
    rows = []
    for batch_size in [batch] if batch else CHECK_BATCHES:
        for height, width in sizes:
            x = torch.randn(batch_size, reference.in_chans, height, width, generator=generator)
            with torch.no_grad():
                expected = forward(x)
            expected = expected if isinstance(expected, tuple) else (expected,)
            got = session.run(None, {INPUT_NAME: x.to(cast_dtype(dtype)).numpy()})
            for name, want, have in zip(output_names(kind, blocks, with_tokens), expected, got, strict=True):
                diff = (torch.from_numpy(have).float() - want.float()).abs().max().item()
                scale = want.float().abs().max().item() or 1.0
                rows.append(CheckRow(height, width, batch_size, name, diff, diff / scale))
    reference.train(was_training)
    return rows


def verdict(rows: list[CheckRow], dtype: str) -> None:
    """Raises `OnnxCheckError` naming the worst output when any is beyond the tolerance."""
    worst = max(rows, key=lambda r: r.max_rel)
    if worst.max_rel > TOLERANCE[dtype]:
        raise OnnxCheckError(
            f"ONNX Runtime differs from PyTorch fp32 by {worst.max_rel:.2e} relative (tolerance "
            f"{TOLERANCE[dtype]:g}) at {worst.height}x{worst.width}, batch {worst.batch}, output "
            f"{worst.output}; nothing was written",
            rows,
        )
