"""What `export --int8` is asked, checked without torch: the mode, the dtype it quantizes, the image folders it
reads and `--min-cosine`. The command's front and the package's `export_onnx` ask the same questions here, so
both refuse in the same words.

A folder of images is the image files directly in it (by suffix, in name order; subfolders are not read), at
most `MAX_IMAGES` of them.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .paths import IMAGE_SUFFIXES

INT8_MODES = ("dynamic", "static")
MAX_IMAGES = 64  # calibration and the fidelity report read at most this many, in name order


def parse_min_cosine(value: str | float | None) -> float | None:
    """`--min-cosine`: a number from 0 to 1, or a `ValueError` naming the bounds."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not 0.0 <= number <= 1.0:  # NaN fails both
        raise ValueError(f"--min-cosine: got {value!r}; pass a cosine similarity from 0 to 1, e.g. 0.99")
    return number


def int8_problem(
    int8: str | None, dtype: str, calibrate: str | Path | None, images: str | Path | None, min_cosine: object
) -> str | None:
    """The one line refusing a combination of the int8 options, or None."""
    if int8 is not None and int8 not in INT8_MODES:
        return f"unknown int8 mode {int8!r}; pass --int8 one of {', '.join(INT8_MODES)}"
    if int8 is None:
        given = [flag for flag, value in (("--calibrate", calibrate), ("--images", images)) if value is not None]
        if min_cosine is not None:
            given.append("--min-cosine")
        if given:
            return f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for --int8 exports; add --int8"
        return None
    if dtype != "fp32":
        return f"--int8 quantizes the fp32 graph; drop --dtype {dtype} (or export {dtype} without --int8)"
    if int8 == "static" and calibrate is None:
        return "--int8 static needs --calibrate DATA, a folder of images to calibrate on (or use --int8 dynamic)"
    if int8 == "dynamic" and calibrate is not None:
        return "--calibrate is for --int8 static; with --int8 dynamic pass --images DATA for the fidelity report"
    if int8 == "static" and images is not None:
        return "--images is for --int8 dynamic; --int8 static reports its fidelity on the --calibrate images"
    return None


def image_folder_files(folder: str | Path, flag: str) -> list[Path]:
    """The image files of `folder` (at most `MAX_IMAGES`), or a `ValueError` naming what is wrong."""
    path = Path(folder)
    if not path.exists():
        raise ValueError(f"{flag} {folder} does not exist; pass a folder of images")
    if not path.is_dir():
        raise ValueError(f"{flag} {folder} is not a folder; pass a folder of images")
    found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not found:
        raise ValueError(f"{flag} {folder} holds no images ({', '.join(IMAGE_SUFFIXES)}); pass a folder of images")
    return found[:MAX_IMAGES]


def add_int8_options(parser: argparse.ArgumentParser) -> None:
    """`export`'s --int8, --calibrate, --images and --min-cosine."""
    parser.add_argument(
        "--int8",
        metavar="{" + ",".join(INT8_MODES) + "}",
        help="write int8 weights (the Linear layers' MatMul/Gemm, per output channel) with ONNX Runtime's "
        "quantizer: dynamic quantizes activations at run time, static calibrates them on --calibrate's images "
        "(QDQ). The fp32 graph is exported first (and checked, with --check), then quantized; the file also "
        "outputs tokens, and a fidelity line compares it with PyTorch fp32",
    )
    parser.add_argument(
        "--calibrate",
        metavar="DATA",
        help=f"--int8 static: a folder of images (its first {MAX_IMAGES} by name) to calibrate on and to "
        "report the fidelity on, resized and normalised as the model's pretrained config says",
    )
    parser.add_argument(
        "--images",
        metavar="DATA",
        help="--int8 dynamic: a folder of images to report the fidelity on (default: 8 rendered images)",
    )
    parser.add_argument(
        "--min-cosine",
        metavar="X",
        help="with --int8: write nothing and exit 2 when the int8 file's pooled or patch cosine similarity to "
        "PyTorch fp32 falls below X (0 to 1) on some image",
    )
