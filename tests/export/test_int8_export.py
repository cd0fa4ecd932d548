"""`export --int8 {dynamic,static}`: every Linear's MatMul quantized, the fidelity report measured on the images
given, `--min-cosine` writing nothing below it, and the refusals of the torch-free front and the package."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import timm
import timm.data
import torch
from PIL import Image
from support import TINY, VARIANT, move_off_init_

from timm_layerscale import export_onnx, save_native
from timm_layerscale.export import ExportError, FidelityError
from timm_layerscale.fidelity import Outputs, compare, model_outputs, rendered_images
from timm_layerscale.model import VisionTransformerLS
from timm_ls.main import main

CLI = [sys.executable, "-m", "timm_ls"]


def tiny(seed: int = 0, **kwargs) -> VisionTransformerLS:
    torch.manual_seed(seed)
    return move_off_init_(timm.create_model(VARIANT["mlp"], **{**TINY, **kwargs}), seed).eval()


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path)).graph


def weight_matmuls(g: onnx.GraphProto) -> int:
    """MatMul and Gemm nodes that multiply by a stored weight (the Linear layers)."""
    weights = {i.name for i in g.initializer}
    return sum(1 for n in g.node if n.op_type in ("MatMul", "Gemm") and any(i in weights for i in n.input))


def int8_weights(g: onnx.GraphProto) -> int:
    """int8 matrices stored (per-channel zero points are int8 vectors)."""
    return sum(1 for i in g.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2)


def per_channel(g: onnx.GraphProto, op: str, weight: int, scale: int) -> bool:
    """Every `op` node's weight (input `weight`) has one scale or zero point (input `scale`) per output column."""
    values = {i.name: i for i in g.initializer}
    nodes = [n for n in g.node if n.op_type == op and n.input[weight] in values]
    return bool(nodes) and all(
        list(values[n.input[scale]].dims) == [values[n.input[weight]].dims[-1]] and values[n.input[weight]].dims[-1] > 1
        for n in nodes
    )


def write_pngs(folder: Path, count: int, seed: int = 0) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(count):
        pixels = rng.integers(0, 256, (40 + 8 * i, 56, 3), dtype=np.uint8)
        pixels[: 20 + i] = rng.integers(0, 256, 3, dtype=np.uint8)  # a flat band: not only noise
        Image.fromarray(pixels).save(folder / f"img{i}.png")
    return folder


def folder_images(model: VisionTransformerLS, folder: Path, size: tuple[int, int] | None = None) -> torch.Tensor:
    """The folder's PNGs as the model's pretrained config prepares them (timm's eval transform), at `size`."""
    cfg = timm.data.resolve_data_config({}, model=model)
    if size is not None:
        cfg["input_size"] = (3, *size)
    transform = timm.data.create_transform(**cfg, is_training=False)
    return torch.stack([transform(Image.open(p).convert("RGB")) for p in sorted(folder.glob("*.png"))])


def file_outputs(path: Path, model: VisionTransformerLS, x: torch.Tensor) -> Outputs:
    """The file's outputs read here, apart from the code under test: its tokens, pooled by the model's head."""
    names = [o.name for o in graph(path).output]
    got = dict(zip(names, session(path).run(None, {"pixel_values": x.numpy()}), strict=True))
    tokens = torch.from_numpy(got["tokens"])
    with torch.no_grad():
        pooled = model.forward_head(tokens, pre_logits=True)
        logits = torch.from_numpy(got["pooled"]) if model.num_classes else None
    return Outputs(pooled, tokens[:, model.num_prefix_tokens :], logits)


def main_run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny model's folder, weights moved off their inits: the CLI streams it into the graph."""
    return save_native(tiny(seed=3), tmp_path_factory.mktemp("ckpt") / "native")


@pytest.fixture(scope="module")
def pngs(tmp_path_factory) -> Path:
    return write_pngs(tmp_path_factory.mktemp("data") / "pngs", 4)


# ------------------------------------------------------------------------------------------------- dynamic


def test_dynamic_quantizes_every_linear_and_stays_close(tmp_path):
    model = tiny()
    fp32 = export_onnx(model, tmp_path / "fp32.onnx")
    result = export_onnx(model, tmp_path / "int8.onnx", int8="dynamic", check=True, check_sizes=[(32, 48)])
    before, after = graph(tmp_path / "fp32.onnx"), graph(tmp_path / "int8.onnx")
    ops = Counter(n.op_type for n in after.node)
    linears = weight_matmuls(before)
    assert linears == 4 * TINY["depth"]  # qkv, proj, fc1, fc2 per block
    assert ops["MatMulInteger"] == linears and weight_matmuls(after) == 0 and int8_weights(after) == linears
    assert ops["DynamicQuantizeLinear"] >= 1 and ops["MatMul"] == 2 * TINY["depth"]  # q @ k, attn @ v stay fp32
    assert per_channel(after, "MatMulInteger", weight=1, scale=3)  # b_zero_point per output channel
    assert [o.name for o in after.output] == ["pooled", "tokens"] and result.outputs == ["pooled", "tokens"]
    assert os.path.getsize(tmp_path / "int8.onnx") < 0.7 * os.path.getsize(tmp_path / "fp32.onnx")
    assert fp32.fidelity is None and result.int8 == "dynamic" and result.check  # the fp32 graph, checked
    x = rendered_images(8, timm.data.resolve_data_config({}, model=model)["input_size"][-1])
    want, got = model_outputs(model, x), file_outputs(tmp_path / "int8.onnx", model, x)
    assert compare(want, got) == result.fidelity  # the report is the file's, on the rendered images
    assert result.fidelity.images == 8 and result.fidelity.patch_cosine_min >= 0.99
    assert result.fidelity.pooled_cosine_min >= 0.99 and result.fidelity.top1_agreement is None
    assert "int8 dynamic" in result.summary() and "8 rendered images" in result.summary()
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "int8.onnx")).metadata_props}
    assert meta["int8"] == "dynamic" and meta["int8_fidelity"].startswith(result.fidelity.line())
    assert sorted(os.listdir(tmp_path)) == ["fp32.onnx", "int8.onnx"]


def test_a_head_and_feature_outputs_are_measured_from_the_file(tmp_path, pngs):
    model = tiny(num_classes=5)
    result = export_onnx(model, tmp_path / "h.onnx", int8="dynamic", images=pngs, outputs="features:0")
    assert result.outputs == ["features_0", "tokens"]
    x = folder_images(model, pngs)
    tokens = torch.from_numpy(session(tmp_path / "h.onnx").run(["tokens"], {"pixel_values": x.numpy()})[0])
    with torch.no_grad():
        got = Outputs(
            model.forward_head(tokens, pre_logits=True),
            tokens[:, model.num_prefix_tokens :],
            model.forward_head(tokens),
        )
    assert result.fidelity == compare(model_outputs(model, x), got) and result.fidelity.images == 4
    assert result.fidelity.top1_agreement is not None


def test_a_static_batch_measures_every_image_once(tmp_path, pngs):
    model = tiny(num_classes=5)
    result = export_onnx(model, tmp_path / "b.onnx", int8="dynamic", images=pngs, batch=3, size=(48, 64))
    x = folder_images(model, pngs, (48, 64))
    runs = [x[:3], torch.cat([x[3:], x[:2]])]
    outs = [session(tmp_path / "b.onnx").run(None, {"pixel_values": r.numpy()}) for r in runs]
    logits = torch.from_numpy(np.concatenate([outs[0][0], outs[1][0][:1]]))
    tokens = torch.from_numpy(np.concatenate([outs[0][1], outs[1][1][:1]]))
    with torch.no_grad():
        got = Outputs(model.forward_head(tokens, pre_logits=True), tokens[:, model.num_prefix_tokens :], logits)
    assert result.fidelity == compare(model_outputs(model, x), got) and result.fidelity.images == 4


# -------------------------------------------------------------------------------------------------- static


def qdq_weights(g: onnx.GraphProto) -> int:
    """Weight MatMuls whose weight comes from a DequantizeLinear of an int8 initializer."""
    int8 = {i.name for i in g.initializer if i.data_type == onnx.TensorProto.INT8}
    dequantized = {n.output[0] for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in int8}
    return sum(1 for n in g.node if n.op_type == "MatMul" and any(i in dequantized for i in n.input))


def test_static_calibrates_on_the_folder_and_reports(tmp_path, checkpoint, pngs):
    dst = tmp_path / "s.onnx"
    code, out, err = main_run("export", str(checkpoint), str(dst), "--int8", "static", "--calibrate", str(pngs))
    assert code == 0, err
    fidelity_line, summary = out.splitlines()
    assert fidelity_line.startswith("fidelity vs fp32 on 4 images: pooled cosine mean")
    assert "int8 static (QDQ" in summary and f"4 images of {pngs}" in summary
    g = graph(dst)
    ops = Counter(n.op_type for n in g.node)
    assert ops["QuantizeLinear"] >= 4 * TINY["depth"] and ops["DequantizeLinear"] >= ops["QuantizeLinear"]
    assert qdq_weights(g) == 4 * TINY["depth"] == int8_weights(g) and weight_matmuls(g) == 0
    assert per_channel(g, "DequantizeLinear", weight=0, scale=1)
    dequantized = {n.output[0] for n in g.node if n.op_type == "DequantizeLinear"}
    fed = [n for n in g.node if n.op_type == "MatMul" and any(i in dequantized for i in n.input)]
    assert len(fed) == 4 * TINY["depth"]  # the Linear layers; attention's two MatMuls stay fp32
    model = tiny(seed=3)  # the checkpoint's model
    x = folder_images(model, pngs)
    fidelity = compare(model_outputs(model, x), file_outputs(dst, model, x))
    assert fidelity_line == fidelity.line() and fidelity.patch_cosine_min > 0.95
    assert sorted(os.listdir(tmp_path)) == ["s.onnx"]


def scales(path: Path) -> list[float]:
    """The activation scales the calibration fixed (QuantizeLinear's scale inputs)."""
    g = graph(path)
    values = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer}
    return [float(values[n.input[1]]) for n in g.node if n.op_type == "QuantizeLinear"]


def test_the_calibration_reads_the_images_given(tmp_path):
    model = tiny()
    first, other = write_pngs(tmp_path / "a", 3, seed=1), write_pngs(tmp_path / "b", 3, seed=2)
    for name, folder in (("a1", first), ("a2", first), ("b", other)):
        export_onnx(model, tmp_path / f"{name}.onnx", int8="static", calibrate=folder)
    assert scales(tmp_path / "a1.onnx") == scales(tmp_path / "a2.onnx")
    assert scales(tmp_path / "a1.onnx") != scales(tmp_path / "b.onnx")


def test_an_unreadable_image_is_skipped_and_said(tmp_path, checkpoint):
    data = write_pngs(tmp_path / "data", 2)
    (data / "broken.png").write_bytes(b"not a png")
    dst = tmp_path / "s.onnx"
    code, out, err = main_run("export", str(checkpoint), str(dst), "--int8", "static", "--calibrate", str(data))
    assert code == 0 and out.startswith("fidelity vs fp32 on 2 images")
    assert err.startswith(f"timm-ls: skipped cannot read image {data / 'broken.png'}") and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------------------ --min-cosine


def test_below_the_bar_nothing_is_written_and_an_old_file_stays(tmp_path, checkpoint):
    dst = tmp_path / "m.onnx"
    dst.write_bytes(b"mine")
    args = ["export", str(checkpoint), str(dst), "--int8", "dynamic", "--overwrite"]
    code, out, err = main_run(*args, "--min-cosine", "0.999999999")
    assert code == 2 and out.startswith("fidelity vs fp32 on 8 images") and len(out.splitlines()) == 1
    assert len(err.splitlines()) == 1 and err.startswith("timm-ls: error: fidelity on 8 images falls short")
    assert "try --int8 static --calibrate DATA" in err and "was not written" in err
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"] and dst.read_bytes() == b"mine"
    code, out, err = main_run(*args, "--min-cosine", "0.5")
    assert code == 0, err
    assert len(out.splitlines()) == 2 and session(dst).get_outputs()[1].name == "tokens"


def test_the_api_raises_below_the_bar_with_the_fidelity(tmp_path):
    with pytest.raises(FidelityError, match="falls short") as caught:
        export_onnx(tiny(), tmp_path / "m.onnx", int8="dynamic", min_cosine=1.0)
    assert caught.value.fidelity.pooled_cosine_min < 1.0 and os.listdir(tmp_path) == []
    result = export_onnx(tiny(), tmp_path / "m.onnx", int8="dynamic", min_cosine=0.0)
    assert result.fidelity.below(0.0) is None


# --------------------------------------------------------------------------------------------------- refusals

SMALL = ["--model-kwargs", *(f"{k}={v}" for k, v in TINY.items())]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--int8", "dynamic", "--dtype", "fp16"], "--int8 quantizes the fp32 graph; drop --dtype fp16"),
        (["--int8", "static"], "--int8 static needs --calibrate DATA"),
        (["--int8", "dynamic", "--calibrate", "{data}"], "--calibrate is for --int8 static"),
        (["--int8", "static", "--calibrate", "{data}", "--images", "{data}"], "--images is for --int8 dynamic"),
        (["--calibrate", "{data}"], "--calibrate is for --int8 exports; add --int8"),
        (["--min-cosine", "0.5"], "--min-cosine is for --int8 exports"),
        (["--int8", "int4"], "unknown int8 mode 'int4'"),
        (["--int8", "static", "--calibrate", "{dir}/absent"], "does not exist; pass a folder of images"),
        (["--int8", "static", "--calibrate", "{dir}/empty"], "holds no images"),
        (["--int8", "static", "--calibrate", "{dir}/notes.txt"], "is not a folder"),
        (["--int8", "static", "--calibrate", "{dir}/garbage"], "holds no readable image (the first: cannot read"),
        (["--int8", "dynamic", "--images", "{dir}/garbage"], "--images"),
        (["--int8", "dynamic", "--min-cosine", "2"], "--min-cosine: got '2'; pass a cosine similarity from 0 to 1"),
        (["--int8", "dynamic", "--min-cosine", "abc"], "--min-cosine: got 'abc'"),
        (["--int8", "dynamic", "--min-cosine", "-0.1"], "--min-cosine: got '-0.1'"),
        (["--int8", "dynamic", "--min-cosine", "nan"], "--min-cosine: got 'nan'"),
    ],
    ids=[
        "fp16", "static-alone", "dynamic-calibrate", "static-images", "calibrate-alone", "min-cosine-alone",
        "mode", "absent", "empty", "file", "garbage", "images-garbage", "above-1", "text", "negative", "nan",
    ],
)  # fmt: skip
def test_refusals_are_one_line_exit_2_and_nothing_written(args, message, tmp_path):
    data = write_pngs(tmp_path / "data", 1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("notes")
    (tmp_path / "garbage").mkdir()
    for i in range(2):
        (tmp_path / "garbage" / f"x{i}.png").write_bytes(os.urandom(64))
    before = sorted(os.listdir(tmp_path))
    filled = [a.format(data=data, dir=tmp_path) for a in args]
    code, out, err = main_run("export", VARIANT["mlp"], str(tmp_path / "m.onnx"), *SMALL, *filled)
    assert code == 2 and out == "" and err.startswith("timm-ls: error: ")
    assert len(err.splitlines()) == 1 and message in err
    assert sorted(os.listdir(tmp_path)) == before


def test_refusals_in_their_own_interpreter_have_no_traceback(tmp_path):
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "x.png").write_bytes(os.urandom(64))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for extra in (["--calibrate", str(tmp_path / "garbage")], ["--min-cosine", "abc"]):
        run = subprocess.run(
            [*CLI, "export", VARIANT["mlp"], str(tmp_path / "m.onnx"), *SMALL, "--int8", "static", *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr
    assert os.listdir(tmp_path) == ["garbage"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(int8="static"), "--int8 static needs --calibrate"),
        (dict(int8="dynamic", dtype="fp16"), "drop --dtype fp16"),
        (dict(int8="dynamic", min_cosine=1.5), "--min-cosine"),
        (dict(min_cosine=0.5), "for --int8 exports"),
    ],
)
def test_the_api_refuses_before_anything_is_read(kwargs, message, tmp_path):
    with pytest.raises(ExportError, match=message):
        export_onnx(tiny(), tmp_path / "m.onnx", **kwargs)
    assert os.listdir(tmp_path) == []
