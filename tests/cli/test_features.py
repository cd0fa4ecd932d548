"""`timm-ls features`: the PCA picture against numpy's SVD of `forward_intermediates`' tokens, the saved
features, the foreground, the memory estimate and every bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import timm
import torch
from PIL import Image, ImageDraw
from safetensors import safe_open
from safetensors.torch import save_file
from support import move_off_init_
from test_front import front, imported
from torchvision.transforms.functional import normalize, to_tensor

from timm_layerscale.tools import dense, feature_run
from timm_layerscale.tools import feature_memory as memory
from timm_layerscale.tools import feature_pictures as pictures
from timm_ls import cpu
from timm_ls.main import main

OURS = "vit_ls_small_patch16_dinov3"
DINOV2 = "vit_small_patch14_dinov2"
DEIT3, EVA = "deit3_small_patch16_224", "vit_small_patch16_dinov3"  # timm's DeiT-III and eva's DINOv3


def draw_image(path, size, seed):
    """Shapes on a gradient, drawn from a seed (nothing downloaded)."""
    rng = np.random.default_rng(seed)
    width, height = size
    ramp = np.linspace(0, 255, width, dtype=np.uint8)
    image = Image.fromarray(np.stack([np.tile(ramp, (height, 1))] * 3, -1))
    pen = ImageDraw.Draw(image)
    for _ in range(4):
        x, y = rng.integers(0, max(1, width - 20)), rng.integers(0, max(1, height - 20))
        pen.ellipse((x, y, x + rng.integers(10, 40), y + rng.integers(10, 40)), fill=tuple(rng.integers(0, 255, 3)))
    image.save(path)
    return path


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Two-block models moved off their inits, saved as files `--checkpoint` takes."""
    folder = tmp_path_factory.mktemp("weights")
    found = {}
    for name in (OURS, DINOV2, DEIT3, EVA):
        torch.manual_seed(0)
        model = move_off_init_(timm.create_model(name, depth=2, dynamic_img_size=True)).eval()
        save_file(model.state_dict(), folder / f"{name}.safetensors")
        found[name] = (model, folder / f"{name}.safetensors")
    return found


def numpy_colours(tokens: list[np.ndarray]) -> list[np.ndarray]:
    """Meta's colouring from the SVD alone: centred, whitened by the singular values, largest loading positive."""
    x = np.concatenate(tokens).astype(np.float64)
    u, _, vt = np.linalg.svd(x - x.mean(0), full_matrices=False)
    signs = np.sign(vt[np.arange(3), np.abs(vt[:3]).argmax(1)])
    projected = u[:, :3] * signs * np.sqrt(len(x) - 1)
    rgb = np.rint(255 / (1 + np.exp(-2 * projected)))
    return np.split(rgb, np.cumsum([len(t) for t in tokens])[:-1])


def model_tokens(model, path, patch):
    """The last block's normed patch tokens, `[h * w, C]`, of an image already a multiple of the patch."""
    cfg = timm.data.resolve_data_config({}, model=model)
    x = normalize(to_tensor(Image.open(path).convert("RGB")), cfg["mean"], cfg["std"]).unsqueeze(0)
    with torch.no_grad():
        (out,) = model.forward_intermediates(x, indices=[len(model.blocks) - 1], norm=True, intermediates_only=True)
    return out[0].flatten(1).T.numpy()


def right_half_at_patch_centres(png, patch):
    pixels = np.asarray(Image.open(png))
    width = pixels.shape[1] // 2
    right = pixels[:, width:]
    return right[patch // 2 :: patch, patch // 2 :: patch].reshape(-1, 3).astype(np.float64)


@pytest.mark.parametrize(("name", "patch"), [(OURS, 16), (DINOV2, 14), (DEIT3, 16), (EVA, 16)])
def test_the_picture_is_the_svd_of_the_tokens_fitted_on_both_images(name, patch, weights, tmp_path):
    model, file = weights[name]
    images = [
        draw_image(tmp_path / "a.png", (8 * patch, 6 * patch), 1),
        draw_image(tmp_path / "b.png", (10 * patch, 4 * patch), 2),
    ]
    out = tmp_path / "out"
    args = ["features", *map(str, images), "--model", name, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", "native", "--out", str(out)]) == 0
    expected = numpy_colours([model_tokens(model, p, patch) for p in images])
    for image, colours in zip(images, expected):
        got = right_half_at_patch_centres(out / f"{image.stem}_pca.png", patch)
        assert got.shape == colours.shape
        assert np.abs(got - colours).max() <= 1  # one level of 255 for fp32 rounding
        assert colours.std(0).min() > 10  # the colours vary: a constant picture would pass the line above


def test_per_image_fits_each_alone_and_differs_from_the_joint_fit(weights, tmp_path):
    model, file = weights[OURS]
    images = [draw_image(tmp_path / "a.png", (128, 96), 1), draw_image(tmp_path / "b.png", (160, 64), 2)]
    base = ["features", *map(str, images), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*base, "--size", "native", "--out", str(tmp_path / "alone"), "--per-image"]) == 0
    assert main([*base, "--size", "native", "--out", str(tmp_path / "joint")]) == 0
    for image in images:
        (alone,) = numpy_colours([model_tokens(model, image, 16)])
        got = right_half_at_patch_centres(tmp_path / "alone" / f"{image.stem}_pca.png", 16)
        assert np.abs(got - alone).max() <= 1
        joint = right_half_at_patch_centres(tmp_path / "joint" / f"{image.stem}_pca.png", 16)
        assert np.abs(joint - alone).max() > 20


def test_save_writes_the_tokens_with_grid_layer_and_model(weights, tmp_path, capsys):
    model, file = weights[OURS]
    image = draw_image(tmp_path / "a.png", (200, 150), 3)  # resized to a shorter side of 64: 85x64, cropped 80x64
    args = ["features", str(image), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", "64", "--layer", "0", "--out", str(tmp_path / "out"), "--save"]) == 0
    plan = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plan: 1 image"))
    assert plan.endswith("; fp32 on cpu")
    with safe_open(tmp_path / "out" / "a_features.safetensors", "pt") as saved:
        meta, tokens = saved.metadata(), saved.get_tensor("features")
    assert tokens.shape == (4, 5, 384)
    assert meta["grid"] == "4x5" and meta["layer"] == "0" and meta["model"] == OURS and str(file) in meta["source"]
    assert meta["input_size"] == "64x80" and meta["patch_size"] == "16"
    (job,) = pictures.measure_images([image], 64, 16)
    pixels = np.empty((1, 3, 64, 80), np.float32)
    seen = pictures.decode(job, timm.data.resolve_data_config(model=model), pixels[0])
    x = torch.from_numpy(pixels)
    with torch.no_grad():
        (expected,) = model.forward_intermediates(x, indices=[0], norm=True, intermediates_only=True)
    assert torch.allclose(tokens, expected[0].permute(1, 2, 0), atol=1e-5 * expected.abs().max().item())
    resized = Image.open(image).convert("RGB").resize((85, 64), Image.BICUBIC).crop((2, 0, 82, 64))
    assert np.array_equal(seen, np.asarray(resized))  # timm's eval transform: resize, centre crop


def test_foreground_keeps_the_side_away_from_the_borders_and_draws_the_rest_black(tmp_path, capsys):
    # Features: a bright square in the middle of the grid, far from the background around it.
    grid = (8, 8)
    rng = np.random.default_rng(0)
    feats = rng.normal(0, 0.1, (64, 16))
    middle = np.zeros(grid, bool)
    middle[2:6, 2:6] = True
    feats[middle.reshape(-1)] += 5 * rng.normal(size=16)
    for flip in (1, -1):
        masks = dense.foreground([feats * flip], [grid])
        assert np.array_equal(masks[0], middle.reshape(-1)), "the middle is the foreground, whatever the sign"
    (rgb,) = dense.pca_colours([feats], masks)
    assert (rgb[~middle.reshape(-1)] == 0).all() and (rgb[middle.reshape(-1)] > 0).all()
    line = dense.Foreground(int(masks[0].sum()), masks[0].size).line()
    assert "the first PCA component > 0" in line and "16 of 64 patches" in line


def test_foreground_through_the_command_prints_its_rule(weights, tmp_path, capsys):
    _, file = weights[OURS]
    image = draw_image(tmp_path / "a.png", (128, 96), 1)
    args = ["features", str(image), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", "native", "--out", str(tmp_path / "out"), "--foreground"]) == 0
    assert "foreground: DINOv2's rule, the first PCA component > 0" in capsys.readouterr().out
    right = right_half_at_patch_centres(tmp_path / "out" / "a_pca.png", 16)
    assert 0 < (right.sum(1) == 0).sum() < len(right)  # some patches black, not all


def test_the_sign_rule_makes_the_largest_loading_positive():
    x = np.random.default_rng(1).normal(size=(50, 6)) * [5, 4, 3, 1, 1, 1]
    for flip in (1, -1):
        pca = dense.fit_pca(x * flip)
        assert (pca.components[np.arange(3), np.abs(pca.components).argmax(1)] > 0).all()
        assert np.allclose(pca.project(x * flip).std(0, ddof=1), 1)  # whitened
    assert np.allclose(dense.fit_pca(x).components, dense.fit_pca(-x).components)  # the sign is the rule's


def test_the_estimate_is_linear_in_tokens_and_the_largest_side_fits():
    one = memory.forward_bytes(1000, 384)
    assert memory.forward_bytes(2000, 384) - one == one - memory.INTERMEDIATES_FIXED_BYTES
    assert memory.forward_bytes(1000, 384, element_size=2) < one < memory.forward_bytes(1000, 384, batch=2)
    side = dense.largest_side_where(lambda patches: patches <= 1000, 16, 1.5)
    tokens = lambda s: (s // 16) * int(s * 1.5 // 16)  # noqa: E731
    assert side % 16 == 0 and side > 0
    assert tokens(side) <= 1000 < tokens(side + 16)


def test_mem_available_is_read_from_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert memory.available_memory(tmp_path / "meminfo") == 2048 * 1024
    assert memory.available_memory(tmp_path / "absent") is None


def test_too_large_for_memory_is_refused_with_the_largest_size_that_fits(weights, tmp_path, capsys, monkeypatch):
    _, file = weights[OURS]
    image = draw_image(tmp_path / "a.png", (128, 96), 1)  # at --size 1024: 1360x1024 px, 85x64 patches
    free = memory.forward_bytes(2000, 384)
    monkeypatch.setattr(feature_run, "available_memory", lambda: free)
    args = ["features", str(image), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", "1024", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at 1360x1024 px is 5440 patches" in err[0], err
    side = int(err[0].split("pass --size ")[1].split()[0])
    assert 0 < side < 1024 and side % 16 == 0
    assert not (tmp_path / "out").exists()
    assert main([*args, "--size", str(side + 16), "--out", str(tmp_path / "out")]) == 2  # the largest: one more is not
    capsys.readouterr()
    assert main([*args, "--size", str(side), "--out", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize(("size", "image", "largest"), [("2048", (128, 96), 1760), ("224", (16, 6000), 96)])
def test_an_image_of_too_many_patches_is_refused_before_it_is_read(size, image, largest, weights, tmp_path, capsys):
    """The time bound: at most MAX_PATCHES patches an image, from the header alone, with the largest --size within."""
    _, file = weights[OURS]
    path = draw_image(tmp_path / "a.png", image, 1)
    args = ["features", str(path), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", size, "--out", str(tmp_path / "out")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert f"an image may have at most {pictures.MAX_PATCHES:,}" in err and f"pass --size {largest} or less" in err
    assert not (tmp_path / "out").exists()
    (job,) = pictures.measure_images([path], largest, 16)
    assert job.patches <= pictures.MAX_PATCHES < job.at(largest + 16).patches


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("case", "line"),
    [
        ("missing", "image file {d}/absent.png does not exist; pass the path of an image file or of a folder"),
        ("empty folder", "{d}/empty holds no images"),
        ("destination exists", "{d}/taken exists; pass --overwrite to replace it"),
        ("bad size", "--size: got 'big'; pass the shorter side in pixels"),
        ("bad layer", "--layer: got 'first'; pass a block index"),
        ("same stem", "{d}/a.png and {d}/sub/a.jpg would both write a_pca.png"),
    ],
)
def test_bad_input_before_torch_is_one_line_and_writes_nothing(case, line, tmp_path):
    draw_image(tmp_path / "a.png", (64, 64), 0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "sub").mkdir()
    draw_image(tmp_path / "sub" / "a.jpg", (64, 64), 0)
    image, out, extra = str(tmp_path / "a.png"), str(tmp_path / "out"), []
    if case == "missing":
        image = str(tmp_path / "absent.png")
    elif case == "empty folder":
        image = str(tmp_path / "empty")
    elif case == "destination exists":
        out = str(tmp_path / "taken")
    elif case == "bad size":
        extra = ["--size", "big"]
    elif case == "bad layer":
        extra = ["--layer", "first"]
    elif case == "same stem":
        extra = [str(tmp_path / "sub")]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    run = front("features", image, *extra, "--model", OURS, "--out", out)
    error = run.stderr.strip().splitlines()[:-1]
    assert run.returncode == 2 and run.stdout == "" and len(error) == 1, run.stderr
    assert error[0].startswith("timm-ls: error: " + line.format(d=tmp_path)), error
    assert imported(run) == "-"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    ("case", "line"),
    [
        ("unreadable", "cannot read image {d}/bad.png"),
        ("below a patch", "--size 8 is below one patch (16 px) of the model; pass --size 16 or more"),
        (
            "native below a patch",
            "{d}/tiny.png is 12x9 px, smaller than one patch (16 px) of the model; pass --size 16",
        ),
        ("layer out of range", "--layer 5: the model has 2 blocks; pass 0 to 1, -1 or last"),
        ("not a vit", "resnet18 has no forward_intermediates and blocks"),
        ("bad device", "--device: got 'gpu0'; pass cpu, cuda, cuda:N or mps"),
        ("absent device", "--device cuda:7: this machine has no such device; pass --device cpu"),
    ],
)
def test_bad_input_after_torch_is_one_line_and_writes_nothing(case, line, tmp_path, capsys):
    draw_image(tmp_path / "a.png", (64, 48), 0)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    image, extra, model = tmp_path / "a.png", ["--size", "64"], OURS
    if case == "unreadable":
        image = tmp_path / "bad.png"
    elif case == "below a patch":
        extra = ["--size", "8"]
    elif case == "native below a patch":
        image, extra = draw_image(tmp_path / "tiny.png", (12, 9), 0), ["--size", "native"]
    elif case == "layer out of range":
        extra += ["--layer", "5"]
    elif case == "not a vit":
        model = "resnet18"
    elif case in ("bad device", "absent device"):
        extra += ["--device", "gpu0" if case == "bad device" else "cuda:7"]
    kwargs = [] if model == "resnet18" else ["--model-kwargs", "depth=2"]
    args = ["features", str(image), "--model", model, *kwargs, "--out", str(tmp_path / "out"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line.format(d=tmp_path) in err[0], err
    assert not (tmp_path / "out").exists()


def test_overwrite_writes_into_an_existing_folder(weights, tmp_path):
    _, file = weights[OURS]
    image = draw_image(tmp_path / "a.png", (64, 48), 0)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("kept")
    args = ["features", str(image), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", "48", "--out", str(tmp_path / "out"), "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a_pca.png", "mine.txt"]


def huge_png_header(path, width: int, height: int):
    """A small PNG whose header claims `width` x `height`: what is read before decoding decides."""
    import struct
    import zlib

    Image.new("L", (4, 4)).save(path)
    data = bytearray(path.read_bytes())
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:33] = ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("side", [20_000, 12_000])
def test_an_image_too_large_to_read_is_one_line_among_good_ones(side, tmp_path, capsys):
    """Checked from the header before decoding, against this package's limit, not PIL's warning or error."""
    good = draw_image(tmp_path / "a.png", (64, 48), 0)
    huge = huge_png_header(tmp_path / "huge.png", side, side)
    args = [
        "features",
        str(good),
        str(huge),
        "--model",
        OURS,
        "--model-kwargs",
        "depth=2",
        "--out",
        str(tmp_path / "o"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning must not reach the user either
        assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    size = f"{side}x{side} px" if side * side <= 2 * 89_478_485 else f"{side * side:,} pixels"  # ours, or PIL's count
    assert err == [
        f"timm-ls: error: image {huge} is too large ({size}); at most 100,000,000 pixels are read: downscale it first"
    ], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("mode", "values"),
    [
        ("I;16", np.linspace(1000, 1200, 48 * 64).reshape(48, 64).astype(np.uint16)),
        ("I", np.linspace(-70_000, 90_000, 48 * 64).reshape(48, 64).astype(np.int32)),
        ("F", np.linspace(0.001, 0.004, 48 * 64).reshape(48, 64).astype(np.float32)),
    ],
)
def test_wide_images_are_shown_by_their_range(mode, values, tmp_path, capsys):
    """16-bit, 32-bit integer and float images: lowest value black, highest white, as viewers show them (PIL's
    RGB conversion clips a 16-bit image to white and a float image in [0, 1] to black)."""
    path = tmp_path / ("wide.png" if mode == "I;16" else "wide.tif")
    Image.fromarray(values).save(path)
    assert Image.open(path).mode.startswith(mode[0])
    grey = np.asarray(dense.read_image(path))[..., 0].astype(np.float64)
    expected = (values - values.min()) / (values.max() - values.min()) * 255
    assert np.abs(grey - expected).max() <= 0.5 + 1e-9
    out = tmp_path / "out"
    args = ["features", str(path), "--model", OURS, "--model-kwargs", "depth=2", "--size", "64", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    shown = np.asarray(Image.open(next(out.glob("*_pca.png"))))[:, :64]
    assert shown.min() < 30 and shown.max() > 225  # the whole range, not clipped to one end


def test_the_foreground_over_two_images_is_dinov2s_rule_by_numpys_svd(weights, tmp_path, capsys):
    """Joint: one first component over both images, its sign from both images' borders, the colours fitted on
    the foreground of both; computed here from numpy's SVD of the model's tokens."""
    model, file = weights[OURS]
    # Seeds whose border patches are not split evenly (26 of 48 above the threshold): the vote decides the sign.
    images = [draw_image(tmp_path / "a.png", (128, 96), 5), draw_image(tmp_path / "b.png", (96, 128), 6)]
    args = ["features", *map(str, images), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", "native", "--out", str(tmp_path / "out"), "--foreground"]) == 0
    tokens = [model_tokens(model, p, 16).astype(np.float64) for p in images]
    grids = [(6, 8), (8, 6)]
    x = np.concatenate(tokens)
    _, _, vt = np.linalg.svd(x - x.mean(0), full_matrices=False)
    first = (x - x.mean(0)) @ (vt[0] * np.sign(vt[0][np.abs(vt[0]).argmax()]))  # the sign rule, then the borders'
    edges = np.concatenate([np.split(first, [48])[i][dense.border(g)] for i, g in enumerate(grids)])
    keep = -first > 0 if (edges > 0).mean() > 0.5 else first > 0
    kept = x[keep]
    _, singular, vt = np.linalg.svd(kept - kept.mean(0), full_matrices=False)
    signs = np.sign(vt[np.arange(3), np.abs(vt[:3]).argmax(1)])
    projected = (x - kept.mean(0)) @ (vt[:3] * signs[:, None]).T / (singular[:3] / np.sqrt(len(kept) - 1))
    rgb = np.rint(255 / (1 + np.exp(-2 * projected))) * keep[:, None]
    assert f"{int(keep.sum())} of 96 patches" in capsys.readouterr().out
    assert 0 < keep.sum() < len(keep)
    for image, expected in zip(images, np.split(rgb, [48])):
        got = right_half_at_patch_centres(tmp_path / "out" / f"{image.stem}_pca.png", 16)
        assert np.abs(got - expected).max() <= 1


def test_images_of_one_size_in_one_batch_are_fitted_together(weights, tmp_path):
    """Two images of one size share a forward; the joint PCA still takes every image's patches."""
    model, file = weights[OURS]
    images = [draw_image(tmp_path / f"{n}.png", (128, 96), seed) for n, seed in (("a", 1), ("b", 2), ("c", 3))]
    args = ["features", *map(str, images), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", "native", "--batch", "3", "--out", str(tmp_path / "out")]) == 0
    expected = numpy_colours([model_tokens(model, p, 16) for p in images])
    for image, colours in zip(images, expected):
        got = right_half_at_patch_centres(tmp_path / "out" / f"{image.stem}_pca.png", 16)
        assert np.abs(got - colours).max() <= 1


def test_the_plan_says_whether_bf16_runs_on_the_cpus_matrix_units():
    cpu = torch.device("cpu")
    amx = feature_run.precision("bf16", cpu, {"avx2", "avx512_bf16", "amx_bf16"})
    assert amx == "bf16 on this CPU's bf16 matrix units (AMX-BF16 tiles)"
    assert feature_run.precision("bf16", cpu, {"avx512_bf16"}).endswith("(AVX-512 BF16 dot products (vdpbf16ps))")
    assert "without bf16 matrix units" in feature_run.precision("bf16", cpu, {"avx2", "avx512f"})
    assert feature_run.precision("fp32", cpu, set()) == "fp32 on cpu"
    assert feature_run.precision("bf16", torch.device("cuda"), set()) == "bf16 on cuda"


def test_a_bf16_run_names_this_cpus_bf16_path_in_its_plan(weights, tmp_path, capsys):
    _, file = weights[OURS]
    image = draw_image(tmp_path / "a.png", (64, 64), 4)
    args = ["features", str(image), "--model", OURS, "--checkpoint", str(file), "--model-kwargs", "depth=2"]
    assert main([*args, "--size", "32", "--dtype", "bf16", "--out", str(tmp_path / "out")]) == 0
    plan = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plan: "))
    assert plan.endswith("; " + feature_run.precision("bf16", torch.device("cpu")))
    assert "bf16 on " in plan


def test_the_cpu_flags_are_the_first_processors_and_none_without_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    first = "processor\t: 0\nmodel name\t: Some Xeon\nvmx flags\t: ept\nflags\t\t: fpu avx512_bf16 amx_bf16\n\n"
    info.write_text(first + "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu.cpu_flags(str(info)) == {"fpu", "avx512_bf16", "amx_bf16"}
    assert cpu.cpu_model(str(info)) == "Some Xeon"
    assert cpu.bf16_units(cpu.cpu_flags(str(info))) == "AMX-BF16 tiles"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # an Arm CPU's cpuinfo has no flags line
    assert cpu.cpu_flags(str(info)) == set() and cpu.bf16_units(set()) is None
    assert cpu.cpu_flags(str(tmp_path / "none")) == set()


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}, "AMX"),
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "AVX-512 BF16"),  # AMX without int8 tiles
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX-512 BF16"),
        ({"avx2", "avx512f"}, "AVX-512"),
        ({"avx2", "fma"}, "AVX2"),
        ({"sse4_2"}, "older than AVX2"),
        (set(), "older than AVX2"),
    ],
)
def test_the_cpu_class_is_the_most_capable_one_all_of_whose_flags_are_there(flags, expected):
    assert cpu.cpu_class(flags) == expected
