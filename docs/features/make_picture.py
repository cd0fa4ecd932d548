"""A doc picture from `timm-ls features`: the command's PNG for one image, shrunk to a small PNG.

    python docs/features/make_picture.py docs/features/random_vits16_1024.png -- \\
        "$(python -c "import matplotlib.cbook as c; print(c.get_sample_data('grace_hopper.jpg', asfileobj=False))")" \\
        --model vit_ls_small_patch16_dinov3 --size 1024

Everything after `--` goes to `timm-ls features` (any `--model`, `--checkpoint` folder, `--layer`, ...);
its `--out` is a temporary folder. The side-by-side PNG is resized to at most --width pixels across and
reduced to 256 colours, so that it stays under --max-kb.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from PIL import Image

from timm_ls.main import main as timm_ls


def shrink(src: Path, dst: Path, width: int, max_kb: int) -> int:
    """`src` at most `width` across, 256 colours, at `dst`; narrower until under `max_kb`. Its size in bytes."""
    picture = Image.open(src).convert("RGB")
    while True:
        scale = min(1.0, width / picture.width)
        small = picture.resize((round(picture.width * scale), round(picture.height * scale)), Image.LANCZOS)
        small.quantize(256, method=Image.Quantize.MEDIANCUT).save(dst, optimize=True)
        if dst.stat().st_size <= max_kb * 1024 or width < 200:
            return dst.stat().st_size
        width = int(width * 0.8)


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dst", type=Path, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1024, help="pixels across at most (default 1024)")
    parser.add_argument("--max-kb", type=int, default=190, help="the largest file (default 190 KB)")
    args = parser.parse_args(argv[:split])
    features = argv[split + 1 :]
    with tempfile.TemporaryDirectory() as tmp:
        code = timm_ls(["features", *features, "--out", str(Path(tmp) / "out")])
        if code:
            return code
        (written,) = sorted((Path(tmp) / "out").glob("*_pca.png"))
        size = shrink(written, args.dst, args.width, args.max_kb)
    print(f"{args.dst}: {size / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
