"""Files that are not checkpoints, or are damaged: one line naming what the file is and the fix, and nothing run.

Each case goes through the reader, `timm.create_model(..., pretrained=True, pretrained_cfg_overlay=dict(file=...))`
and `timm-ls --checkpoint`, which must all give the same line.
"""

import io
import json
import pickle
import pickletools
import random
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from support import REPO, Exploit

from timm_layerscale.checkpoints import CheckpointError
from timm_layerscale.checkpoints.errors import reason
from timm_layerscale.checkpoints.read.reader import open_checkpoint
from timm_ls.main import main

NAME = "vit_ls_small_patch16_dinov3"
ASSETS = REPO / "timm_layerscale" / "assets"
README = REPO / "README.md"


def weights() -> dict[str, torch.Tensor]:
    return {"cls_token": torch.randn(1, 1, 64), "blocks.0.attn.qkv.weight": torch.randn(192, 64)}


def legacy_header() -> bytes:
    """What torch.save's legacy format writes before the object: its magic number, protocol and sizes."""
    buffer = io.BytesIO()
    torch.save(1, buffer, _use_new_zipfile_serialization=False)
    data, end = buffer.getvalue(), 0
    for _ in range(3):  # three pickles, each ending at its STOP opcode
        end += 1 + max(pos for _, _, pos in pickletools.genops(data[end:]))
    return data[:end]


def image_bytes(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


def safetensors_of(dtype: str, shape: list[int], nbytes: int) -> bytes:
    header = json.dumps({"x": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(nbytes)


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def make_safetensors(path: Path) -> bytes:
    save_file(weights(), path)
    return path.read_bytes()


def make_torch(path: Path) -> bytes:
    torch.save(weights(), path)
    return path.read_bytes()


def make_zip(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, b"hello")
    return path


def make_tar(path: Path) -> Path:
    with tarfile.open(path, "w") as archive:
        archive.add(README, "README.md")
    return path


def make_index(folder: Path, shards: dict[str, str], saved: dict[str, dict[str, torch.Tensor]]) -> Path:
    folder.mkdir()
    for name, sd in saved.items():
        save_file(sd, folder / name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return folder / "model.safetensors.index.json"


def header_only(data: bytes) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file, without its tensors."""
    return data[: 8 + int.from_bytes(data[:8], "little")]


def folder_with(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir()
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return folder


# (case, builds the input in a temp folder, expected message with {path} for the input's path)
CASES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("missing", lambda d: d / "absent.safetensors", "checkpoint {path} does not exist; pass a weights file"),
    ("empty", lambda d: write(d / "empty.pth", b""), "{path} is empty (0 bytes): its save or download did not"),
    (
        "safetensors cut in the data",
        lambda d: write(d / "cut.safetensors", make_safetensors(d / "full.safetensors")[:-100]),
        "{path} is a truncated or corrupt safetensors file (Error while deserializing header: incomplete metadata",
    ),
    (
        "safetensors cut in the header",
        lambda d: write(d / "cut.safetensors", make_safetensors(d / "full.safetensors")[:60]),
        "{path} is a truncated safetensors file: its header needs",
    ),
    (
        "safetensors cut one byte into its header",
        lambda d: write(d / "cut.safetensors", header_only(make_safetensors(d / "full.safetensors"))[:-1]),
        "{path} is a truncated safetensors file: its header needs",
    ),
    (
        "safetensors header overwritten",
        lambda d: write(d / "bad.safetensors", b"\x20\x00\x00\x00\x00\x00\x00\x00{" + b"\x00" * 64),
        "{path} is a truncated or corrupt safetensors file (Error while deserializing header",
    ),
    (
        "torch zip cut short",
        lambda d: write(d / "cut.pth", make_torch(d / "full.pth")[:700]),
        "{path} is a truncated or corrupt zip file (",
    ),
    (
        "torch zip with its pickle overwritten",
        lambda d: write(d / "bad.pth", make_torch(d / "full.pth").replace(b"\x80\x02}q", b"\x80\x02\x00\x00")),
        "{path} is a truncated or corrupt torch checkpoint (Unsupported operand 0); save or download it again",
    ),
    (
        "legacy torch cut short",
        lambda d: write(d / "cut.pth", b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.\x80\x02M\xe9"),
        "{path} is a truncated or corrupt torch checkpoint (unpack requires a buffer of 2 bytes); save or",
    ),
    (
        "zip of other files",
        lambda d: make_zip(d / "photos.zip", ["a.jpg", "b.jpg", "c.jpg", "d.jpg"]),
        "{path} is a zip archive but not a torch checkpoint (it holds a.jpg, b.jpg, c.jpg, ...); unpack it",
    ),
    (
        "empty zip",
        lambda d: make_zip(d / "empty.zip", []),
        "{path} is a zip archive but not a torch checkpoint (it holds nothing); unpack it",
    ),
    (
        "empty safetensors",
        lambda d: (save_file({}, d / "empty.safetensors"), d / "empty.safetensors")[1],
        "{path} holds no tensors (an empty safetensors file); pass a weights file",
    ),
    (
        "npz",
        lambda d: (np.savez(d / "arrays.npz", a=np.zeros(3)), d / "arrays.npz")[1],
        "{path} is a NumPy .npz archive, not a torch checkpoint",
    ),
    (
        "random bytes",
        lambda d: write(d / "random.pth", random.Random(0).randbytes(10_000)),
        "{path} is not a checkpoint: it is neither safetensors nor a torch file (it starts with bytes "
        "cd 07 2c d8 be 6f 9f 62)",
    ),
    ("short notes", lambda d: write(d / "notes.txt", b"lr 1e-4 looked best\n"), "{path} is a text file, not a"),
    (
        "notes without a suffix",
        lambda d: write(d / "notes", b"model: vit_ls_small_patch16_dinov3\nTODO: fine-tune \xc3\xa9\n" * 3),
        "{path} is a text file, not a checkpoint; pass a weights file (.safetensors, .pth, .bin) or a checkpoint "
        "folder",
    ),
    ("README", lambda d: write(d / "README.md", README.read_bytes()), "{path} is a Markdown file, not a checkpoint"),
    (
        "long text named .pth",
        lambda d: write(d / "model.pth", README.read_bytes() * 10),
        "{path} is a text file (Markdown or a script?), not a checkpoint",
    ),
    (
        "YAML",
        lambda d: write(d / "variant.yaml", b"base: vit_ls_small_patch16_dinov3\nmodel:\n  depth: 2\n"),
        "{path} is a YAML file, not a checkpoint",
    ),
    ("JSON", lambda d: write(d / "results.json", b'{"top1": 84.1}'), "{path} is a JSON file, not a checkpoint"),
    ("broken JSON", lambda d: write(d / "results.json", b'{"top1": 8'), "{path} is a JSON file, not a checkpoint"),
    (
        "JSON list without a suffix",
        lambda d: write(d / "results", b' [{"top1": 84.1}]'),
        "{path} is a JSON file, not a checkpoint",
    ),
    (
        "a Hub config instead of its folder",
        lambda d: folder_with(d / "repo", {"config.json": b'{"model_type": "dinov3_vit"}'}) / "config.json",
        "{path} is a JSON file, not a checkpoint; pass a weights file (.safetensors, .pth, .bin) or a checkpoint "
        "folder (config.json is a model config: pass its folder",
    ),
    ("PNG", lambda d: write(d / "shapes.png", (ASSETS / "shapes_256x256.png").read_bytes()), "{path} is a PNG image"),
    ("JPEG", lambda d: write(d / "photo.pth", image_bytes("JPEG")), "{path} is a JPEG image, not a checkpoint"),
    ("GIF", lambda d: write(d / "anim.gif", image_bytes("GIF")), "{path} is a GIF image, not a checkpoint"),
    (
        "tar",
        lambda d: make_tar(d / "ckpt.tar"),
        "{path} is a tar archive, not a checkpoint; unpack it and pass the weights file inside",
    ),
    ("npy", lambda d: (np.save(d / "w.npy", np.zeros(3)), d / "w.npy")[1], "{path} is a NumPy .npy array, not a"),
    (
        "PDF",
        lambda d: write(d / "paper.pdf", b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj"),
        "{path} is a PDF document, not a",
    ),
    (
        "Latin-1 text",
        lambda d: write(d / "notes.txt", "caf\u00e9 r\u00e9sum\u00e9\n".encode("latin-1") * 20),
        "{path} is not a checkpoint: it is neither safetensors nor a torch file",
    ),
    (
        "UTF-8 text cut mid-character by the sample",
        lambda d: write(d / "notes", b"x" * 4095 + "\u00e9\n".encode() * 10),
        "{path} is a text file, not a checkpoint",
    ),
    (
        "text with a NUL byte",
        lambda d: write(d / "notes.txt", b"lr 1e-4 looked best\n" * 50 + b"\x00"),
        "{path} is not a checkpoint: it is neither safetensors nor a torch file",
    ),
    (
        "UTF-8 text with a 4-byte character cut by the sample",
        lambda d: write(d / "notes", b"x" * 4093 + "\U0001f600\n".encode() * 3),
        "{path} is a text file, not a checkpoint",
    ),
    (
        "a stray byte just before the end of the sample",
        lambda d: write(d / "notes", b"x" * 4092 + b"\xff" + b"x" * 100),
        "{path} is not a checkpoint: it is neither safetensors nor a torch file",
    ),
    (
        "text with a brace where a safetensors header starts",
        lambda d: write(d / "notes", b"results {top1: 84.1}\n"),
        "{path} is a text file, not a checkpoint",
    ),
    (
        "JSON object without a suffix",
        lambda d: write(d / "results", b'{"top1": 84.1, "top5": 97.0}'),
        "{path} is a JSON file, not a checkpoint",
    ),
    (
        "text with a few control bytes",
        lambda d: write(d / "log", (b"step 1 loss 0.5\x07\n" + b"a" * 85) * 40),
        "{path} is a text file, not a checkpoint",
    ),
    (
        "binary with control bytes",
        lambda d: write(d / "blob", (b"\x01\x02ab" + b"c" * 96) * 40),
        "{path} is not a checkpoint: it is neither safetensors nor a torch file",
    ),
    (
        "gzip",
        lambda d: write(d / "model.pth.gz", b"\x1f\x8b\x08\x00" + b"\x00" * 40),
        "{path} is a gzip archive, not a checkpoint",
    ),
    *(
        (
            f"plain pickle, protocol {protocol}",
            lambda d, protocol=protocol: write(d / "w.pth", pickle.dumps({"w": Exploit(d / "marker")}, protocol)),
            "refused to read {path}: it is a Python pickle, not a torch or safetensors checkpoint",
        )
        for protocol in (2, 3, 5)
    ),
    (
        "plain pickle",
        lambda d: write(d / "weights.pkl", pickle.dumps({"cls_token": Exploit(d / "marker")})),
        "refused to read {path}: it is a Python pickle, not a torch or safetensors checkpoint, and unpickling it "
        "could run code (nothing was run)",
    ),
    (
        "torch zip with code in it",
        lambda d: (torch.save({"model": weights(), "x": Exploit(d / "marker")}, d / "evil.pth"), d / "evil.pth")[1],
        "refused to load {path}: it is a pickle that needs objects other than tensors (io.open), which could "
        "run code (nothing was run)",
    ),
    (
        "legacy torch with code in it",
        lambda d: (
            torch.save({"x": Exploit(d / "marker")}, d / "evil.pth", _use_new_zipfile_serialization=False),
            d / "evil.pth",
        )[1],
        "refused to load {path}: it is a pickle that needs objects other than tensors (io.open)",
    ),
    (
        "legacy torch that builds a dict",
        lambda d: write(d / "odd.pth", legacy_header() + b"\x80\x02}}b."),
        "refused to load {path}: it is a pickle that needs objects other than tensors, which could run code",
    ),
    (
        "torch file holding a list",
        lambda d: (torch.save([1, 2], d / "list.pth"), d / "list.pth")[1],
        "{path} holds no tensors (got list); pass a weights file",
    ),
    (
        "safetensors of a dtype torch lacks",
        lambda d: write(d / "fp6.safetensors", safetensors_of("F6_E2M3", [4], 3)),
        "{path} stores x as F6_E2M3, which has no torch dtype here; save it as F32, BF16 or F16",
    ),
    (
        "torch file without tensors",
        lambda d: (torch.save({"epoch": 3, "arch": "vit"}, d / "meta.pth"), d / "meta.pth")[1],
        "{path} holds no tensors (got dict with keys epoch, arch); pass a weights file",
    ),
    (
        "one DCP data file",
        lambda d: write(d / "__0_0.distcp", make_torch(d / "full.pth")),
        "{path} is one data file of a distributed checkpoint (torch.distributed.checkpoint); pass its folder",
    ),
    (
        "folder without weights",
        lambda d: folder_with(d / "run", {"log.txt": b"loss 1.0\n", "config.json": b"{}"}),
        "{path} is a folder with no checkpoint in it (no .metadata, model.safetensors, pytorch_model.bin or "
        "*.safetensors.index.json); pass a weights file",
    ),
    (
        "folder with one loose weights file",
        lambda d: folder_with(d / "run", {"log.txt": b"loss\n", "last.pth": b"x"}),
        "{path} is a folder with no checkpoint in it (no .metadata, model.safetensors, pytorch_model.bin or "
        "*.safetensors.index.json); pass the file {path}/last.pth",
    ),
    ("a device", lambda d: Path("/dev/null"), "/dev/null is not a regular file (a device or pipe?); pass a"),
    (
        "Hub folder with a broken config",
        lambda d: folder_with(
            d / "repo", {"config.json": b'{"model_type": ', "pytorch_model.bin": make_torch(d / "w.pth")}
        ),
        "{path}/config.json is not valid JSON (Expecting value",
    ),
    (
        "Hub folder with a config that is a list",
        lambda d: folder_with(d / "repo", {"config.json": b"[1]", "pytorch_model.bin": make_torch(d / "w.pth")}),
        "{path}/config.json is not a model config (a JSON object); download it again",
    ),
    (
        "index naming a missing shard",
        lambda d: make_index(
            d / "repo", {"cls_token": "a.safetensors", "x": "b.safetensors"}, {"a.safetensors": weights()}
        ),
        "{path} names shard b.safetensors, which is missing; download every shard it lists",
    ),
    (
        "index naming a key its shard lacks",
        lambda d: make_index(d / "repo", {"pos_embed": "a.safetensors"}, {"a.safetensors": weights()}),
        "{path} puts pos_embed in a.safetensors, which does not hold it; the index and shards do not match",
    ),
    (
        "index naming a shard outside its folder",
        lambda d: make_index(d / "repo", {"cls_token": "../a.safetensors"}, {}),
        "{path} names shard '../a.safetensors' outside its folder; the index is corrupt",
    ),
    (
        "index without a weight map",
        lambda d: write(d / "model.safetensors.index.json", b'{"metadata": {}}'),
        "{path} has no weight_map of keys to shard files",
    ),
    (
        "index that is a list",
        lambda d: write(d / "model.safetensors.index.json", b"[1]"),
        "{path} has no weight_map of keys to shard files",
    ),
    (
        "index with an empty weight map",
        lambda d: write(d / "model.safetensors.index.json", b'{"weight_map": {}}'),
        "{path} has no weight_map of keys to shard files",
    ),
    (
        "index that is not JSON",
        lambda d: write(d / "model.safetensors.index.json", b'{"weight_map": '),
        "{path} is not a valid JSON index (Expecting value",
    ),
]


@pytest.fixture(params=CASES, ids=[case[0] for case in CASES])
def bad_input(request, tmp_path) -> tuple[Path, str]:
    _, build, expected = request.param
    path = build(tmp_path)
    return path, expected.format(path=path)


def test_the_reader_names_what_the_file_is(bad_input, tmp_path):
    path, expected = bad_input
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert not (tmp_path / "marker").exists()


def test_create_model_gives_the_same_line(bad_input, tmp_path):
    path, expected = bad_input
    with pytest.raises(CheckpointError) as info:
        timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), depth=1)
    assert expected in str(info.value)
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("case", ["short notes", "README", "random bytes", "torch zip with code in it", "missing"])
def test_cli_prints_one_line_and_exits_2(case, tmp_path, capsys):
    _, build, expected = next(c for c in CASES if c[0] == case)
    path = build(tmp_path)
    assert main(["--checkpoint", str(path), "--model-kwargs", "depth=1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"timm-ls: error: {expected.format(path=path)}") and err.count("\n") == 1
    assert not (tmp_path / "marker").exists()


def test_reasons_stay_short():
    assert reason(ValueError("x" * 200)) == "x" * 200
    assert reason(ValueError("x" * 201)) == "x" * 200 + "..."
    assert reason(ValueError("first part. second\n  part")) == "first part"
    assert reason(ValueError("")) == "ValueError"


@pytest.mark.parametrize(
    "name", ["last.pt", "last.pth", "last.pth.tar", "last.ckpt", "pytorch_model-1.bin", "w.safetensors"]
)
def test_a_folder_names_its_one_weights_file(tmp_path, name):
    folder = folder_with(tmp_path / "run", {"log.txt": b"loss\n", name: b"x"})
    with pytest.raises(CheckpointError, match=f"; pass the file {folder / name}$"):
        open_checkpoint(folder)


@pytest.mark.parametrize(
    ("config", "hint"),
    [
        ({"model_type": "dinov3_vit"}, True),
        ({"architecture": "vit_small_patch16_dinov3", "notes": "x" * 5000}, True),
        ({"top1": 84.1}, False),
        ([{"model_type": "dinov3_vit"}], False),
    ],
)
def test_a_config_file_points_at_its_folder(tmp_path, config, hint):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path / "config.json")
    tail = "; pass a weights file (.safetensors, .pth, .bin) or a checkpoint folder"
    folder_hint = f" (config.json is a model config: pass its folder {tmp_path} to read the weights beside it)"
    assert str(info.value).endswith(tail + (folder_hint if hint else ""))
