"""`timm-ls inspect`: per block and branch |gamma| statistics from files in every layout, names and variants."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from support import FIXTURES, TINY, move_off_init_
from transformers import DINOv3ViTConfig, DINOv3ViTModel

from timm_layerscale.tools.gammas import BlockGammas, BranchStats, gamma_stats
from timm_layerscale.tools.plots import gamma_figure
from timm_ls.main import main

NAME = "vit_ls_small_patch16_dinov3"
# Gammas chosen so that every statistic is known exactly: (attn, mlp) per block, |gamma| stats below.
SET_GAMMAS = {
    0: (torch.tensor([-2.0, 1e-4, 0.5, -1e-5]).repeat(16), torch.full((64,), 0.25)),
    1: (torch.tensor([3.0, -1.0, 2.0, 0.0]).repeat(16), torch.linspace(-1.0, 1.0, 64)),
}
EXPECTED = {
    0: (
        dict(mean=(2 + 1e-4 + 0.5 + 1e-5) / 4, median=(1e-4 + 0.5) / 2, min=1e-5, max=2.0, muted=0.5),
        dict(mean=0.25, median=0.25, min=0.25, max=0.25, muted=0.0),
    ),
    # |linspace(-1, 1, 64)|: each odd k/63 twice, so the middle two are 31/63 and 33/63, and so is the mean.
    1: (
        dict(mean=1.5, median=1.5, min=0.0, max=3.0, muted=0.25),
        dict(mean=32 / 63, median=32 / 63, min=1 / 63, max=1.0, muted=0.0),
    ),
}


def inspect(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def inspect_json(capsys, *args: str) -> dict:
    code, out, err = inspect(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def expected_stats(gamma: torch.Tensor) -> dict[str, float]:
    """Independent of the code under test: quantile's linear interpolation gives the middle-two median."""
    g = gamma.detach().double().abs().flatten()
    return dict(
        mean=g.mean().item(),
        median=torch.quantile(g, 0.5).item(),
        min=g.min().item(),
        max=g.max().item(),
        muted=(g < 1e-3).double().mean().item(),
    )


def assert_stats(found: dict, expected: dict[str, float]) -> None:
    for key, value in expected.items():
        assert found[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (key, found, expected)


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "ours.safetensors"
    sd = timm.create_model(NAME, **TINY).state_dict()
    for block, (attn, mlp) in SET_GAMMAS.items():
        sd[f"blocks.{block}.ls1.gamma"], sd[f"blocks.{block}.ls2.gamma"] = attn, mlp
    save_file({k: v.contiguous() for k, v in sd.items()}, path)
    return path


def test_numbers_of_gammas_the_test_set(ours, capsys):
    result = inspect_json(capsys, ours)
    assert result["source"] == str(ours) and result["spellings"] == ["lsN.gamma"]
    assert result["gammas_read"] == 4 and result["muted_below"] == 1e-3
    assert [b["block"] for b in result["blocks"]] == ["0", "1"]
    for block, (attn, mlp) in EXPECTED.items():
        assert_stats(result["blocks"][block]["attn"], attn)
        assert_stats(result["blocks"][block]["mlp"], mlp)
        assert result["blocks"][block]["attn"]["channels"] == 64


def test_table_shows_the_same_numbers(ours, capsys):
    code, out, _ = inspect(capsys, ours)
    assert code == 0
    assert "read only the 4 gamma tensors" in out
    rows = [line.split() for line in out.splitlines() if line[:2] in ("0 ", "1 ")]
    assert rows == [
        ["0", "0.625", "0.25", "2", "50%", "0.25", "0.25", "0.25", "0%"],
        ["1", "1.5", "1.5", "3", "25%", "0.508", "0.508", "1", "0%"],
    ]
    assert "attn: mean |gamma| from 0.625 (block 0) to 1.5 (block 1); 37.5% of channels muted" in out


def test_png_is_a_valid_image_with_both_branches(ours, tmp_path, capsys):
    code, out, _ = inspect(capsys, ours, "--plot", tmp_path / "gammas.png")
    assert code == 0 and f"plot: {tmp_path / 'gammas.png'}" in out
    image = Image.open(tmp_path / "gammas.png")
    assert image.format == "PNG" and image.size == (850, 420)
    colours = {pixel[:3] for _, pixel in image.convert("RGB").getcolors(1 << 20)}
    assert (31, 119, 180) in colours and (255, 127, 14) in colours  # the attn and mlp lines
    assert not list(tmp_path.glob(".gammas*"))  # no temporary file left


def test_muted_means_strictly_below_one_thousandth():
    stats = BranchStats.of(torch.tensor([1e-3, -9.99e-4, 0.0, -2e-3]))
    assert stats.muted == 0.5 and stats.channels == 4 and stats.min == 0.0


def test_the_figure_draws_each_branch_on_a_log_axis(ours):
    from safetensors.torch import load_file

    blocks = gamma_stats(load_file(ours))
    before = gamma_stats({k: torch.full_like(v, 1e-5) for k, v in load_file(ours).items() if k.endswith("gamma")})
    ax = gamma_figure(blocks, "title", before=before).axes[0]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "block"
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines["attn mean |gamma|"] == pytest.approx([EXPECTED[0][0]["mean"], EXPECTED[1][0]["mean"]], rel=1e-5)
    assert lines["mlp mean |gamma|"] == pytest.approx([EXPECTED[0][1]["mean"], EXPECTED[1][1]["mean"]], rel=1e-5)
    assert lines["attn before"] == pytest.approx([1e-5, 1e-5])
    bars = [segment[:, 1] for segment in ax.collections[0].get_segments()]  # attn: min to max, per block
    assert [v for bar in bars for v in bar] == pytest.approx([1e-5, 2.0, 1e-8, 3.0])  # block 1's 0 drawn at 1e-8


@pytest.mark.parametrize(
    ("model", "spelling", "keys"),
    [
        ("vit_small_patch16_dinov3", "gamma_N", ("gamma_1", "gamma_2")),  # timm eva
        ("deit3_small_patch16_224", "lsN.gamma", ("ls1.gamma", "ls2.gamma")),  # timm vision_transformer
    ],
)
def test_timm_eva_and_deit3_checkpoints(model, spelling, keys, tmp_path, capsys):
    torch.manual_seed(0)
    reference = move_off_init_(timm.create_model(model, depth=3))
    with torch.no_grad():
        reference.blocks[1].get_parameter(keys[1])[:40] = 1e-4  # a muted share to count
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "timm.safetensors")
    result = inspect_json(capsys, tmp_path / "timm.safetensors")
    assert result["spellings"] == [spelling] and len(result["blocks"]) == 3
    for i, block in enumerate(reference.blocks):
        attn, mlp = (block.get_parameter(k) for k in keys)
        assert_stats(result["blocks"][i]["attn"], expected_stats(attn))
        assert_stats(result["blocks"][i]["mlp"], expected_stats(mlp))
    assert result["blocks"][1]["mlp"]["muted"] == pytest.approx(40 / 384)


def test_a_checkpoint_no_variant_fits_names_no_model(ours, capsys):
    """The same rule as convert's: without a config to complete them, 64-wide weights are no variant."""
    assert "model" not in inspect_json(capsys, ours)


def test_cait_lists_its_class_attention_blocks_after_the_trunk(tmp_path, capsys):
    torch.manual_seed(0)
    kwargs = dict(depth=2, depth_token_only=1, embed_dim=64, num_heads=4, img_size=64)
    reference = move_off_init_(timm.create_model("cait_xxs24_224", **kwargs))
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "cait.safetensors")
    result = inspect_json(capsys, tmp_path / "cait.safetensors")
    assert [b["block"] for b in result["blocks"]] == ["blocks.0", "blocks.1", "blocks_token_only.0"]
    for found, block in zip(result["blocks"], [*reference.blocks, *reference.blocks_token_only]):
        assert_stats(found["attn"], expected_stats(block.gamma_1))
        assert_stats(found["mlp"], expected_stats(block.gamma_2))


@pytest.mark.parametrize("prefix", ["", "model."])
def test_transformers_checkpoint(prefix, tmp_path, capsys):
    """Hub files say `layer.N.`; transformers 5 names the same blocks `model.layer.N.` in memory."""
    config = DINOv3ViTConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256, num_register_tokens=4
    )
    torch.manual_seed(0)
    reference = move_off_init_(DINOv3ViTModel(config))
    sd = {prefix + k.removeprefix("model."): v.contiguous() for k, v in reference.state_dict().items()}
    assert f"{prefix}layer.1.layer_scale2.lambda1" in sd
    save_file(sd, tmp_path / "hf.safetensors")
    result = inspect_json(capsys, tmp_path / "hf.safetensors")
    assert result["spellings"] == ["layer_scaleN.lambda1"] and [b["block"] for b in result["blocks"]] == ["0", "1"]
    for i in range(2):
        assert_stats(result["blocks"][i]["attn"], expected_stats(sd[f"{prefix}layer.{i}.layer_scale1.lambda1"]))
        assert_stats(result["blocks"][i]["mlp"], expected_stats(sd[f"{prefix}layer.{i}.layer_scale2.lambda1"]))


def test_a_hub_folder_is_read_through_its_weights_file(tmp_path, capsys):
    config = DINOv3ViTConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256, num_register_tokens=4
    )
    torch.manual_seed(0)
    reference = move_off_init_(DINOv3ViTModel(config))
    reference.save_pretrained(tmp_path / "hf")
    result = inspect_json(capsys, tmp_path / "hf")
    assert result["weights"].startswith("Hub folder")
    # transformers' config completes the arguments; the variant is the registered one nearest the weights' shapes
    assert "(from the shapes and config.json, with " in result["model"]
    for i, layer in enumerate(reference.model.layer):
        assert_stats(result["blocks"][i]["attn"], expected_stats(layer.layer_scale1.lambda1))
        assert_stats(result["blocks"][i]["mlp"], expected_stats(layer.layer_scale2.lambda1))


@pytest.mark.parametrize(("weights", "value"), [("auto", 2.0), ("raw", 0.5)])
def test_training_checkpoint_takes_the_weights_set_asked_for(weights, value, tmp_path, capsys):
    sd = timm.create_model(NAME, **TINY).state_dict()
    scaled = lambda v: {k: torch.full_like(t, v) if k.endswith("gamma") else t for k, t in sd.items()}  # noqa: E731
    torch.save({"epoch": 3, "state_dict": scaled(0.5), "state_dict_ema": scaled(2.0)}, tmp_path / "last.pth.tar")
    result = inspect_json(capsys, tmp_path / "last.pth.tar", "--weights", weights)
    assert result["weights"] == f"torch file, {'state_dict_ema' if weights == 'auto' else 'state_dict'}"
    assert {b["attn"]["mean"] for b in result["blocks"]} == {value}


def test_name_with_checkpoint_reads_the_file_and_checks_it_fits(ours, capsys):
    result = inspect_json(
        capsys, NAME, "--checkpoint", ours, "--model-kwargs", "embed_dim=64", "num_heads=4", "depth=2"
    )
    assert result["source"] == NAME and result["weights"].startswith(f"{ours} (safetensors file")
    assert_stats(result["blocks"][1]["attn"], EXPECTED[1][0])
    code, _, err = inspect(
        capsys, NAME, "--checkpoint", ours, "--model-kwargs", "depth=2", "embed_dim=128", "num_heads=4"
    )
    assert code == 2 and "it has LayerScale in 2 blocks of width [64], " in err and " in 2 of width [128]" in err
    code, _, err = inspect(capsys, NAME, "--checkpoint", ours)
    assert code == 2
    assert err == (
        f"timm-ls: error: {ours} does not fit {NAME}: it has LayerScale in 2 blocks of width [64], {NAME} in 12 "
        f"of width [384]; inspect the file alone (`timm-ls inspect {ours}`) or name the model it was made for\n"
    )


def test_random_init_names_and_variant_files_show_their_init_values(tmp_path, capsys):
    per_block = inspect_json(
        capsys, NAME, "--model-kwargs", "depth=4", "init_values=[1e-6, {attn: 0.1, mlp: off}, off, {attn: 1, mlp: 2}]"
    )
    assert per_block["weights"] == "random init: every gamma is its init value"
    assert [(b["attn"] and b["attn"]["mean"], b["mlp"] and b["mlp"]["max"]) for b in per_block["blocks"]] == [
        (1e-6, 1e-6),
        (0.1, None),
        (None, None),
        (1.0, 2.0),
    ]
    (tmp_path / "deep.yaml").write_text("base: vit_ls_small_patch16_dinov3\nmodel: {depth: 30, init_values: auto}\n")
    deep = inspect_json(capsys, tmp_path / "deep.yaml")
    assert deep["source"] == "deep" and len(deep["blocks"]) == 30
    assert {b["mlp"]["median"] for b in deep["blocks"]} == {1e-6}  # CaiT's rule past depth 24
    cait = inspect_json(capsys, "cait_xxs24_224", "--model-kwargs", "depth=2")  # a timm model, built
    assert [b["block"] for b in cait["blocks"]] == [
        "blocks.0",
        "blocks.1",
        "blocks_token_only.0",
        "blocks_token_only.1",
    ]
    assert {b["attn"]["max"] for b in cait["blocks"]} == {1e-5}
    seven_b = inspect_json(capsys, "vit_ls_7b_patch16_dinov3")  # from the config: nothing is built
    assert len(seven_b["blocks"]) == 40 and seven_b["blocks"][0]["attn"]["channels"] == 4096


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["absent.safetensors"], "checkpoint absent.safetensors does not exist"),
        (["vit_ls_smal_patch16_dinov3"], "did you mean vit_ls_small_patch16_dinov3"),
        (["vit_small_patch16_224", "--model-kwargs", "depth=1"], "has no LayerScale gammas"),
        (["{ours}", "--pretrained"], "is a file: inspect it alone"),
        (["{ours}", "--model-kwargs", "depth=3"], "is a file: inspect it alone"),
        (["{ours}", "--plot", "gammas.jpg"], "--plot writes one file: name it .png (got gammas.jpg)"),
        (["{truncated}"], "is a truncated safetensors file"),
    ],
)
def test_bad_input_is_one_error_line(args, expected, ours, tmp_path, capsys):
    (tmp_path / "truncated.safetensors").write_bytes(ours.read_bytes()[:3000])
    args = [a.format(ours=ours, truncated=tmp_path / "truncated.safetensors") for a in args]
    code, out, err = inspect(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("timm-ls: error: ") and err.count("\n") == 1 and expected in err, err


def sparse_safetensors(path: Path, shapes: dict[str, torch.Size], written: dict[str, torch.Tensor]) -> None:
    """A bf16 safetensors file of these shapes whose only bytes on disk are `written`; the rest is a hole."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = shape.numel() * 2
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for key, tensor in written.items():
            f.seek(8 + len(blob) + header[key]["data_offsets"][0])
            f.write(tensor.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
        f.truncate(8 + len(blob) + offset)


MEASURE = """
import json, resource, sys
from timm_ls.main import main
from timm_layerscale.tools.gammas import BlockGammas, BranchStats, gamma_stats
from timm_layerscale.tools.plots import gamma_figure
code = main(sys.argv[1:])
print(json.dumps({"code": code, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), file=sys.stderr)
"""


def test_a_7b_checkpoint_reads_only_its_gammas(tmp_path):
    shapes = {k: v.shape for k, v in timm.create_model("vit_ls_7b_patch16_dinov3", device="meta").state_dict().items()}
    # Exact in bf16: a quarter of the channels at 2**-12 (muted), the rest at a per-block value.
    gammas = {}
    for block in range(40):
        for branch, value in ((1, (block + 1) / 16), (2, -(2.0 ** -(block % 8)))):
            gammas[f"blocks.{block}.ls{branch}.gamma"] = torch.cat(
                [torch.full((1024,), 2.0**-12), torch.full((3072,), value)]
            )
    path = tmp_path / "vit7b.safetensors"
    sparse_safetensors(path, shapes, gammas)
    assert path.stat().st_size > 13e9 and path.stat().st_blocks * 512 < 50e6  # the 13.4 GB are mostly a hole
    args = ["inspect", "vit_ls_7b_patch16_dinov3", "--checkpoint", str(path), "--json"]
    result = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True, timeout=300)
    measured = json.loads(result.stderr.strip().splitlines()[-1])
    assert measured["code"] == 0, result.stderr
    assert measured["maxrss_kib"] * 1024 < 2.5e9  # reading every tensor would take 13.4 GB
    blocks = json.loads(result.stdout)["blocks"]
    assert len(blocks) == 40 and json.loads(result.stdout)["gammas_read"] == 80
    for block in (0, 17, 39):
        attn, mlp = (block + 1) / 16, 2.0 ** -(block % 8)
        assert_stats(blocks[block]["attn"], dict(mean=(2.0**-12 + 3 * attn) / 4, median=attn, max=attn, muted=0.25))
        assert_stats(blocks[block]["mlp"], dict(mean=(2.0**-12 + 3 * mlp) / 4, median=mlp, max=mlp, muted=0.25))


# ------------------------------------------------------------------------------------------ readable plots


def flat(labels: list[str], value: float = 1e-5) -> list[BlockGammas]:
    """Blocks whose gammas all still equal their init, as a random-init CaiT or DeiT-III has them."""
    stats = BranchStats.of(torch.full((192,), value))
    return [BlockGammas(label, f"blocks.{label}", stats, stats) for label in labels]


def drawn(fig):
    """The figure laid out and drawn, as it is saved: its renderer, for where each piece of text landed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig.canvas.get_renderer()


def shown_tick_labels(ax, axis: str) -> list:
    low, high = ax.get_ylim() if axis == "y" else ax.get_xlim()
    ticks = ax.yaxis.get_major_ticks() if axis == "y" else ax.xaxis.get_major_ticks()
    return [t.label1 for t in ticks if low <= t.get_loc() <= high and t.label1.get_visible() and t.label1.get_text()]


def overlapping(boxes) -> list[tuple[int, int]]:
    return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]


def test_stats_reduce_in_float64_so_the_mean_lies_between_min_and_max():
    for channels in (192, 384, 1536):  # CaiT-XXS, ViT-S, ViT-L: float32 means of 1e-5 fall below or above it
        stats = BranchStats.of(torch.full((channels,), 1e-5))
        assert stats.mean == stats.median == stats.min == stats.max == 1e-05, channels
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        stats = BranchStats.of(torch.rand(1536, generator=generator) * 1e-3 + 1e-5)
        assert stats.min <= stats.mean <= stats.max and stats.min <= stats.median <= stats.max


@pytest.mark.parametrize("spread", [0.0, 1e-6])  # all equal, or nearly (1e-5 and 1.00001e-5)
def test_a_flat_series_gets_a_readable_log_axis(spread):
    cait = [f"blocks.{i}" for i in range(24)] + ["blocks_token_only.0", "blocks_token_only.1"]
    stats = BranchStats.of(torch.tensor([1e-5, 1e-5 * (1 + spread)]).repeat(96))
    fig = gamma_figure([BlockGammas(label, label, stats, stats) for label in cait], "cait")
    ax = fig.axes[0]
    drawn(fig)
    low, high = ax.get_ylim()
    assert low < 1e-5 < high and high / low >= 100  # two decades at least around the one value
    labels = [t.get_text() for t in shown_tick_labels(ax, "y")]
    assert len(labels) >= 2 and len(set(labels)) == len(labels), labels  # not four ticks all "10x10^-6"


@pytest.mark.parametrize(
    "labels",
    [
        [f"blocks.{i}" for i in range(24)] + ["blocks_token_only.0", "blocks_token_only.1"],  # CaiT
        [str(i) for i in range(40)],  # the 7B's 40 blocks
        [str(i) for i in range(12)],
    ],
)
def test_block_labels_do_not_overlap(labels):
    fig = gamma_figure(flat(labels), "title")
    renderer = drawn(fig)
    shown = shown_tick_labels(fig.axes[0], "x")
    assert [t.get_text() for t in shown] == labels[:: math.ceil(len(labels) / len(shown))]
    assert len(shown) >= min(len(labels), 20)
    assert overlapping([t.get_window_extent(renderer) for t in shown]) == []


def test_equal_series_and_their_before_lines_stay_visible_side_by_side():
    blocks = flat([str(i) for i in range(4)])
    fig = gamma_figure(blocks, "title", before=blocks)
    renderer = drawn(fig)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == ["attn before", "attn mean |gamma|", "mlp before", "mlp mean |gamma|"]
    for kind in ("mean |gamma|", "before"):
        attn, mlp = lines[f"attn {kind}"], lines[f"mlp {kind}"]
        assert list(attn.get_ydata()) == list(mlp.get_ydata())  # the same values...
        assert all(m - a > 0.2 for a, m in zip(attn.get_xdata(), mlp.get_xdata()))  # ...side by side
        assert attn.get_marker() != mlp.get_marker() and attn.get_linestyle() != mlp.get_linestyle()
        assert [round(x) for x in attn.get_xdata()] == [0, 1, 2, 3]  # each beside its own block
    assert lines["attn before"].get_linestyle() != lines["attn mean |gamma|"].get_linestyle()
    assert lines["attn before"].get_markerfacecolor() == "none"  # hollow: before, never mistaken for after
    # min-to-max bars: one per block and branch, never on top of each other, so never blended
    bars = [x for collection in ax.collections for x in (s[0][0] for s in collection.get_segments())]
    assert len(bars) == 8 and min(abs(a - b) for i, a in enumerate(bars) for b in bars[i + 1 :]) > 0.2
    # the legend sits beside the axes, off the data
    legend = fig.legends[0].get_window_extent(renderer)
    assert not legend.overlaps(ax.get_window_extent(renderer))


def test_cait_summary_names_its_blocks_once_and_says_when_every_block_is_equal(tmp_path, capsys):
    torch.manual_seed(0)
    kwargs = dict(depth=2, depth_token_only=1, embed_dim=64, num_heads=4, img_size=64)
    model = timm.create_model("cait_xxs24_224", **kwargs)
    with torch.no_grad():
        model.blocks_token_only[0].gamma_1.fill_(0.5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "cait.safetensors")
    code, out, _ = inspect(capsys, tmp_path / "cait.safetensors")
    assert code == 0
    assert "attn: mean |gamma| from 1e-05 (blocks.0) to 0.5 (blocks_token_only.0); " in out
    assert "mlp: mean |gamma| 1e-05 in every block; 100.0% of channels muted" in out


def test_a_model_without_layer_scale_blocks_says_so(capsys):
    code, _, err = inspect(capsys, "resnet10t")
    assert code == 2 and err.count("\n") == 1
    assert "resnet10t has no LayerScale blocks: it has no transformer blocks with attention" in err
    code, _, err = inspect(capsys, NAME, "--model-kwargs", "depth=2", "init_values=off")  # a ViT, LayerScale off
    assert code == 2 and "LayerScale is off there or was folded into the projections" in err


def test_a_sapiens2_checkpoint_shows_its_attention_gammas_and_no_mlp_layer_scale(capsys):
    """Upstream Sapiens2's own keys (`blocks.N.attn.gamma.weight`, no FFN gamma), from tests/fixtures."""
    path = FIXTURES / "sapiens2_fixture.safetensors"
    state = load_file(path)
    result = inspect_json(capsys, path)
    assert result["spellings"] == ["attn.gamma.weight"] and len(result["blocks"]) == 18
    for i, block in enumerate(result["blocks"]):
        assert_stats(block["attn"], expected_stats(state[f"blocks.{i}.attn.gamma.weight"]))
        assert block["mlp"] is None
    code, out, _ = inspect(capsys, path)
    assert code == 0 and "LayerScale: attn.gamma.weight in 18 blocks" in out
    assert out.splitlines()[-1] == "mlp: no LayerScale in any block"
