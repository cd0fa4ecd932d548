"""Every command reads image files through one reader (`tools.dense.open_image`): a crafted file given to the
probe (an image, a mask), the demo (`--image`) or the reader itself is one line naming the file and the fix,
exit 2, and nothing written."""

from __future__ import annotations

import struct
import zlib

import pytest
from PIL import Image
from test_probe_cli import draw_scenes

from timm_layerscale.probe import data
from timm_layerscale.tools import dense
from timm_ls.main import main

CRAFTED = {
    "not an image": b"not a png",
    "a cut PNG": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00",
    "empty": b"",
}


def bomb(path) -> None:
    """A PNG whose header claims 20000 x 20000 px (past the 100 megapixel limit), its data one pixel."""
    Image.new("L", (1, 1)).save(path)
    raw = bytearray(path.read_bytes())
    ihdr = struct.pack(">II", 20000, 20000) + bytes(raw[24:29])
    raw[16:33] = ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_file_is_one_line_from_every_reader(tmp_path, case):
    path = tmp_path / "x.png"
    path.write_bytes(CRAFTED[case])
    for read in (dense.read_image, dense.image_size, data.load_image, data.header_size):
        with pytest.raises(ValueError) as caught:
            read(path)
        line = str(caught.value)
        assert line.startswith(f"cannot read image {path} (") and line.endswith("; pass a PNG or JPEG file")
        assert "\n" not in line
    with pytest.raises(ValueError, match=rf"^cannot read mask {path} \(.*\); pass a PNG of class indices$"):
        data.read_mask(path)


def test_a_huge_header_is_refused_before_decoding_in_the_callers_words(tmp_path):
    path = tmp_path / "huge.png"
    bomb(path)
    with pytest.raises(ValueError, match=rf"^image {path} is too large \(400,000,000 pixels\); at most 100,000,000"):
        data.load_image(path)
    with pytest.raises(ValueError, match=rf"^mask {path} is too large"):
        data.read_mask(path)


def test_a_mask_of_colours_is_refused_naming_its_mode(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "m.png")
    with pytest.raises(ValueError, match=r"^mask .*m\.png is a RGB image; a mask is a one-channel PNG of class"):
        data.read_mask(tmp_path / "m.png")
    Image.new("P", (4, 3)).save(tmp_path / "p.png")
    assert data.read_mask(tmp_path / "p.png").shape == (3, 4)


def test_the_probe_refuses_a_crafted_mask_in_one_line(tmp_path, capsys):
    root = tmp_path / "data"
    draw_scenes(root, {"train": 2})
    (root / "train" / "masks" / "001.png").write_bytes(b"not a png")
    args = ["probe", str(root), "--task", "segmentation", "--model", "vit_ls_small_patch16_dinov3"]
    assert main([*args, "--model-kwargs", "depth=1", "embed_dim=32", "num_heads=1", "--out", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"timm-ls: error: cannot read mask {root / 'train' / 'masks' / '001.png'} (")
    assert line.endswith("pass a PNG of class indices") and not (tmp_path / "o").exists()


def test_the_demo_refuses_a_crafted_image_in_one_line(tmp_path, capsys):
    image, weights = tmp_path / "x.png", tmp_path / "w.safetensors"
    image.write_bytes(b"not a png")
    weights.write_bytes(b"unread: the images are read first")
    assert main(["--checkpoint", str(weights), "--image", str(image), "--no-plot", "--out", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"timm-ls: error: cannot read image {image} (") and line.endswith("pass a PNG or JPEG file")
    assert not (tmp_path / "o").exists()
