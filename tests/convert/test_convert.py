"""`convert_checkpoint`: every layout in, every target out, loaded where it lands by the ecosystem's own code.

Sources are models moved off their inits: ours (saved in Meta's keys, and as a native folder),
transformers' DINOv3ViTModel and timm's eva DINOv3. transformers and eva compute RoPE periods in fp32
without Meta's bf16 rounding, so our sources use `rope_periods_bf16=False`, as the parity tests do.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import weakref
from argparse import Namespace
from pathlib import Path

import pytest
import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support import (
    EVA,
    FIXTURES,
    TINY,
    VARIANT,
    assert_fp32_close,
    mapped_ranges,
    max_diff,
    move_off_init_,
    transformers_reference,
)
from support.hub_server import LocalHub, hub_env
from timm.utils import CheckpointSaver
from transformers import DINOv3ViTModel

from timm_layerscale import (
    CheckpointError,
    VisionTransformerLS,
    convert_checkpoint,
    fold_layer_scale,
    rename_layer_scale,
)
from timm_layerscale.checkpoints import LazyCheckpoint, TensorInfo, open_checkpoint
from timm_layerscale.checkpoints.formats.hf import HF
from timm_layerscale.checkpoints.formats.meta import META
from timm_layerscale.checkpoints.formats.sapiens2 import SAPIENS2
from timm_layerscale.checkpoints.formats.timm import TIMM
from timm_layerscale.checkpoints.mapping.gamma_keys import GAMMA_SPELLINGS
from timm_layerscale.families import family_record
from timm_layerscale.identity import expected_state, identify
from timm_layerscale.publish import save_native
from timm_layerscale.variants import VARIANTS
from timm_ls.names import MODEL_CARD_TAGS

KWARGS = dict(TINY)


@torch.no_grad()
def ours(ffn: str = "mlp", **kwargs) -> VisionTransformerLS:
    torch.manual_seed(0)
    model = timm.create_model(VARIANT[ffn], rope_periods_bf16=False, num_classes=0, **TINY, **kwargs)
    return move_off_init_(model).eval()


def eva_model(ffn: str = "mlp") -> torch.nn.Module:
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(EVA[ffn], global_pool="token", **TINY)).eval()


def contiguous(sd):
    return {k: v.contiguous() for k, v in sd.items()}


@torch.no_grad()
def make_source(kind: str, root: Path, ffn: str = "mlp"):
    """(path of the source file, a function giving its model's normed tokens)."""
    if kind in ("meta", "native"):
        model = ours(ffn)
        if kind == "meta":
            save_file(contiguous(model.state_dict()), root / "meta.safetensors")
            return root / "meta.safetensors", model.forward_features
        save_native(model, root / "native")
        return root / "native" / "model.safetensors", model.forward_features
    if kind == "hf":
        model = transformers_reference(ffn)
        model.save_pretrained(root / "hf-src")
        return root / "hf-src" / "model.safetensors", lambda x: model(pixel_values=x).last_hidden_state
    model = eva_model(ffn)
    save_file(contiguous(model.state_dict()), root / "eva.safetensors")
    return root / "eva.safetensors", model.forward_features


@torch.no_grad()
def tokens_from(target: str, dst: Path, ffn: str):
    """Normed tokens of the converted weights, loaded by the target ecosystem's own code."""
    if target in ("native", "timm"):
        return timm.create_model(f"local-dir:{dst}", pretrained=True).eval().forward_features
    if target == "hf":
        model = DINOv3ViTModel.from_pretrained(dst).eval()
        return lambda x: model(pixel_values=x).last_hidden_state
    state = torch.load(dst, weights_only=True) if dst.suffix == ".pth" else load_file(dst)
    model = VisionTransformerLS(VARIANTS[VARIANT[ffn]].config.replace(**TINY)).eval()
    model.load_state_dict(state, strict=True)
    return model.forward_features


def convert(src, dst, to, ffn="mlp", **kwargs):
    return convert_checkpoint(src, dst, to=to, model=VARIANT[ffn], model_kwargs=KWARGS, **kwargs)


TARGET_PATHS = {"native": "out", "meta": "out.pth", "hf": "out", "timm": "out"}


@pytest.mark.parametrize("target", ["native", "meta", "hf", "timm"])
@pytest.mark.parametrize("source", ["meta", "native", "hf", "timm"])
def test_every_direction_loads_where_it_lands_with_the_sources_outputs(source, target, tmp_path, images):
    src, expected = make_source(source, tmp_path)
    dst = tmp_path / TARGET_PATHS[target]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = convert(src, dst, target)
    assert result.source_format == {"meta": "meta", "native": "meta", "hf": "hf", "timm": "timm"}[source]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, dst.name])  # nothing else left
    assert_fp32_close(tokens_from(target, dst, "mlp")(images), expected(images))


def test_a_dcp_training_folder_converts_its_ema_backbone(tmp_path, images):
    """Meta's training saves `ckpt/<iter>/` with torch.distributed.checkpoint: the EMA backbone lands in hf."""
    import torch.distributed.checkpoint as dcp

    ema, student = ours(), move_off_init_(ours(), seed=7)
    model = {
        **{f"student.backbone.{k}": v for k, v in student.state_dict().items()},
        **{f"model_ema.backbone.{k}": v for k, v in ema.state_dict().items()},
        "dino_loss.center": torch.zeros(1, 16),
    }
    folder = tmp_path / "ckpt" / "99"
    dcp.save({"iteration": 99, "model": model}, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    result = convert(folder, tmp_path / "hf", "hf")
    assert (result.source_format, result.weights) == ("meta", "model_ema")
    assert result.layout == result.source_format  # the old name, still read
    assert "distributed checkpoint" in result.summary()
    assert_fp32_close(tokens_from("hf", tmp_path / "hf", "mlp")(images), ema.forward_features(images))


@pytest.mark.parametrize(("source", "target"), [("meta", "hf"), ("meta", "timm"), ("hf", "meta"), ("timm", "native")])
def test_swiglu_directions(source, target, tmp_path, images):
    src, expected = make_source(source, tmp_path, "swiglu")
    dst = tmp_path / TARGET_PATHS[target]
    convert(src, dst, target, "swiglu")
    assert_fp32_close(tokens_from(target, dst, "swiglu")(images), expected(images))


def meta_fixture_kwargs(name: str) -> tuple[str, dict]:
    meta = json.loads((FIXTURES / "meta_configs.json").read_text())["models"][name]
    variant = VARIANT[meta["ffn_layer"]]
    return variant, dict(embed_dim=64, depth=meta["depth"], num_heads=meta["num_heads"], ffn_ratio=meta["ffn_ratio"])


@pytest.mark.parametrize("name", ["meta_mlp", "meta_swiglu"])
@pytest.mark.parametrize("released_mask", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_to_native_to_meta_is_lossless(name, released_mask, dtype, tmp_path):
    """Every key, value and dtype of Meta's own state dict, the loaded bias_mask included."""
    meta_sd = load_file(FIXTURES / f"{name}.safetensors")
    meta_sd = {k: v if k.endswith("periods") else v.to(dtype) for k, v in meta_sd.items()}
    if released_mask:  # released checkpoints carry an all-zero mask
        meta_sd = {k: torch.zeros_like(v) if k.endswith("bias_mask") else v for k, v in meta_sd.items()}
    save_file(meta_sd, tmp_path / "meta.safetensors")
    variant, kwargs = meta_fixture_kwargs(name)
    convert_checkpoint(
        tmp_path / "meta.safetensors", tmp_path / "native", to="native", model=variant, model_kwargs=kwargs
    )
    back = tmp_path / "back.pth"
    convert_checkpoint(tmp_path / "native" / "model.safetensors", back, to="meta", model=variant, model_kwargs=kwargs)
    for path in (tmp_path / "native" / "model.safetensors", back):
        again = torch.load(path, weights_only=True) if path.suffix == ".pth" else load_file(path)
        assert set(again) == set(meta_sd)
        for key, value in meta_sd.items():
            assert again[key].dtype == value.dtype, key
            assert torch.equal(again[key], value), key


def test_native_folder_records_every_arg_and_rebuilds_the_model(tmp_path, images):
    model = ours(init_values={"attn": 1e-5, "mlp": "off"}, local_cls_norm=True)
    save_native(model, tmp_path / "native")
    config = json.loads((tmp_path / "native" / "config.json").read_text())
    assert config["architecture"] == VARIANT["mlp"]
    assert config["model_args"]["init_values"] == {"attn": 1e-5, "mlp": "off"}
    assert config["model_args"]["local_cls_norm"] is True and config["model_args"]["depth"] == 2
    again = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    assert again.config == model.config
    assert max_diff(again.forward_features(images), model.forward_features(images)) == 0


def test_fold_layer_scale_is_recorded_by_a_later_save(tmp_path, images):
    model = fold_layer_scale(ours())
    save_native(model, tmp_path / "fused")
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["model_args"]["init_values"] == 0
    again = timm.create_model(f"local-dir:{tmp_path / 'fused'}", pretrained=True).eval()
    assert not any(k.endswith("gamma") for k in again.state_dict())
    assert max_diff(again.forward_features(images), model.forward_features(images)) == 0


@pytest.mark.parametrize("target", ["native", "hf", "meta"])
def test_fuse_layerscale(target, tmp_path, images):
    src, expected = make_source("meta", tmp_path)
    dst = tmp_path / TARGET_PATHS[target]
    result = convert(src, dst, target, fuse_layerscale=True)
    assert "folded 4 gammas" in result.report[-1]
    if target == "native":
        assert json.loads((dst / "config.json").read_text())["model_args"]["init_values"] == 0
        assert not any(k.endswith("gamma") for k in load_file(dst / "model.safetensors"))
    elif target == "hf":  # transformers always has LayerScale: gammas of 1
        gammas = {k: v for k, v in load_file(dst / "model.safetensors").items() if k.endswith("lambda1")}
        assert len(gammas) == 4 and all(torch.equal(g, torch.ones(64)) for g in gammas.values())
    assert_fp32_close(tokens_from(target, dst, "mlp")(images), expected(images))


def test_dtype_casts_weights_and_keeps_periods(tmp_path):
    src, _ = make_source("meta", tmp_path)
    periods = load_file(src)["rope_embed.periods"]
    convert(src, tmp_path / "out", "native", dtype="bf16")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(written["rope_embed.periods"], periods) and periods.dtype == torch.float32
    assert {v.dtype for k, v in written.items() if k != "rope_embed.periods"} == {torch.bfloat16}


def test_hf_shards_above_the_limit_with_an_index(tmp_path, images):
    src, expected = make_source("meta", tmp_path)
    convert(src, tmp_path / "hf", "hf", max_shard_size="100KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / "hf" / s).is_file() for s in shards)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert_fp32_close(tokens_from("hf", tmp_path / "hf", "mlp")(images), expected(images))


@torch.no_grad()
def test_effective_biases_pick_the_eva_architecture(tmp_path, images):
    """Released Meta files carry non-zero-looking biases under an all-zero mask: eva gets no bias at all."""
    model = ours()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(len(model.blocks)):
        state[f"blocks.{i}.attn.qkv.bias_mask"].zero_()  # the biases stay non-zero in the file
    save_file(state, tmp_path / "released.safetensors")
    model.load_state_dict(state)  # folds the masks: no qkv bias is added
    convert(tmp_path / "released.safetensors", tmp_path / "timm", "timm")
    assert json.loads((tmp_path / "timm" / "config.json").read_text())["architecture"] == "vit_small_patch16_dinov3"
    assert_fp32_close(tokens_from("timm", tmp_path / "timm", "mlp")(images), model.forward_features(images))
    convert(tmp_path / "released.safetensors", tmp_path / "hf", "hf")
    biases = {k: v for k, v in load_file(tmp_path / "hf" / "model.safetensors").items() if k.endswith("proj.bias")}
    assert all(not v.any() for k, v in biases.items() if ".q_proj" in k or ".v_proj" in k)


@torch.no_grad()
def test_non_zero_k_bias_is_kept_by_transformers_and_refused_by_eva(tmp_path, images):
    model = ours()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    for i in range(len(model.blocks)):  # a model trained without k-masking: k biases and a mask of ones
        state[f"blocks.{i}.attn.qkv.bias_mask"].fill_(1.0)
        bias = state[f"blocks.{i}.attn.qkv.bias"]
        bias.copy_(torch.randn(bias.shape, generator=generator) * 0.5)
    save_file(state, tmp_path / "kbias.safetensors")
    model.load_state_dict(state)
    convert(tmp_path / "kbias.safetensors", tmp_path / "hf", "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["key_bias"] is True
    assert_fp32_close(tokens_from("hf", tmp_path / "hf", "mlp")(images), model.forward_features(images))
    with pytest.raises(CheckpointError, match=r"no k bias and blocks 0, 1 .* convert --to native or hf"):
        convert(tmp_path / "kbias.safetensors", tmp_path / "timm", "timm")
    assert not (tmp_path / "timm").exists()


def test_what_a_target_cannot_hold_is_summarised_or_refused(tmp_path):
    model = ours(local_cls_norm=True)
    save_file(contiguous(model.state_dict()), tmp_path / "sat.safetensors")
    summary = convert(tmp_path / "sat.safetensors", tmp_path / "timm", "timm").summary()
    for name in ("mask_token", "rope_embed.periods", "local_cls_norm"):
        assert name in summary.split("not held by timm: ")[1]
    hf_summary = convert(tmp_path / "sat.safetensors", tmp_path / "hf", "hf").summary()
    assert "mask_token" not in hf_summary and "local_cls_norm" in hf_summary
    untied = ours(cls_norm=True)
    save_file(contiguous(untied.state_dict()), tmp_path / "untied.safetensors")
    for to in ("timm", "hf"):
        with pytest.raises(CheckpointError, match="no place for this model's cls_norm"):
            convert(tmp_path / "untied.safetensors", tmp_path / f"{to}2", to)
        assert not (tmp_path / f"{to}2").exists()
    native = convert(tmp_path / "sat.safetensors", tmp_path / "native", "native")
    assert "not held" not in native.summary()
    args = json.loads((tmp_path / "native" / "config.json").read_text())["model_args"]
    assert args["local_cls_norm"] is True


def test_a_shape_eva_has_no_architecture_for_fails_clearly(tmp_path):
    state = expected_state(VARIANTS["vit_ls_large_plus_patch16_dinov3"].config.replace(depth=1, num_classes=0))
    weights = {k: torch.ones(v.shape) if k.endswith("periods") else torch.zeros(v.shape) for k, v in state.items()}
    save_file(weights, tmp_path / "lplus.safetensors")  # zeros but the periods, which must be positive
    with pytest.raises(CheckpointError, match="timm's eva has no DINOv3 architecture for vit_ls_large_plus"):
        convert_checkpoint(tmp_path / "lplus.safetensors", tmp_path / "timm", to="timm", model_kwargs={"depth": 1})
    assert not (tmp_path / "timm").exists()


# The registered variant nearest the tests' 64-wide weights by shape: EUPE's ViT-T, 192 wide.
NEAREST_TINY = "vit_ls_tiny_patch16_dinov3"
# LingBot-Vision S/B/L have DINOv3's shapes and keys: their weights are named the DINOv3 variant.
SHARED_SHAPES = {f"vit_ls_{s}_patch16_lingbot": f"vit_ls_{s}_patch16_dinov3" for s in ("small", "base", "large")}


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("layout", [META, HF, TIMM, SAPIENS2])
def test_variant_is_inferred_from_the_shapes(name, layout):
    """Released shapes (the 7B and 5B too) on the meta device, in each layout of its family: the variant
    comes back, and a Sapiens2 is never named a DINOv3 variant nor the reverse."""
    config = VARIANTS[name].config.replace(num_classes=0)
    family = family_record(config.family).layout
    if (layout is SAPIENS2) != (family == "sapiens2") and layout is not HF and layout is not TIMM:
        pytest.skip("a layout of the other family")
    state = dict(expected_state(config))
    state["rope_embed.periods"] = torch.ones(state["rope_embed.periods"].shape)  # the one value inference reads
    if layout is not META:
        options = dict(qkv_bias=True, dim=config.embed_dim, layout=family, k_bias=family == "sapiens2")
        state = dict(layout.table.from_native(state, **options)[0].items())
    probe = LazyCheckpoint(
        Path("probe"),
        "state dict",
        "all",
        {k: TensorInfo(v.shape, v.dtype) for k, v in state.items()},
        state.__getitem__,
    )
    native = layout.table.to_native(probe)
    resolved = identify(native, unheld=layout.unheld_args if layout is SAPIENS2 else frozenset())
    assert resolved.name == SHARED_SHAPES.get(name, name) and "from the shapes" in resolved.reason


def test_shapes_of_no_variant_name_the_nearest_and_the_key(tmp_path):
    src, _ = make_source("meta", tmp_path)
    with pytest.raises(CheckpointError) as info:
        convert_checkpoint(src, tmp_path / "out", to="native")
    message = str(info.value)
    assert f"match no registered variant; the nearest is {NEAREST_TINY}: cls_token is [1, 1, 64]" in message
    assert "--model" in message and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- streaming


class Recorder:
    """A lazy checkpoint that records its reads and how many of the tensors it handed out are still alive."""

    def __init__(self, path: Path) -> None:
        self.inner = open_checkpoint(path)
        self.reads: list[str] = []
        self.alive_at_read: list[int] = []
        self.handed_out: list[weakref.ref] = []
        infos = {k: self.inner.info(k) for k in self.inner}
        self.checkpoint = LazyCheckpoint(path, "recorded", self.inner.weights, infos, self.read)

    def read(self, key: str) -> torch.Tensor:
        self.alive_at_read.append(sum(ref() is not None for ref in self.handed_out))
        self.reads.append(key)
        tensor = self.inner[key].clone()  # a private copy: alive only while the conversion holds it
        self.handed_out.append(weakref.ref(tensor))
        return tensor


@pytest.mark.parametrize("target", ["hf", "timm", "native", "meta"])
def test_conversion_streams_one_tensor_at_a_time(target, tmp_path):
    src, _ = make_source("meta", tmp_path)
    recorder = Recorder(src)
    convert(recorder.checkpoint, tmp_path / TARGET_PATHS[target], target)
    unheld = ["mask_token"] if target == "timm" else []
    weights = [k for k in recorder.inner if len(recorder.inner.info(k).shape) >= 2 and k not in unheld]
    reads = [i for i, key in enumerate(recorder.reads) if key in weights]
    assert sorted(recorder.reads[i] for i in reads) == sorted(weights)  # each weight read once
    # When the next weight is read, nothing read before is held any more: one tensor at a time.
    assert [recorder.alive_at_read[i] for i in reads] == [0] * len(weights)


def test_lazy_reader_is_the_path_taken(tmp_path, monkeypatch):
    """Through `convert_checkpoint(path)`: the torch file is memory-mapped, never loaded whole, and each tensor is
    read from the file only when its turn comes: bytes changed on disk after the first read land in the output."""
    src, _ = make_source("meta", tmp_path)
    path = tmp_path / "meta.pth"
    torch.save(load_file(src), path)
    late = "blocks.1.mlp.fc2.weight"
    old = load_file(src)[late]
    new = -2 * old
    offset = path.read_bytes().find(old.numpy().tobytes())
    assert offset > 0 and path.read_bytes().count(old.numpy().tobytes()) == 1
    reads, mapped = [], []

    def opened(source, weights, **kwargs):
        ckpt = open_checkpoint(source, weights, **kwargs)
        inner = ckpt._read

        def read(key):
            if not reads and key != late:  # after the first read, the late tensor changes on disk
                with path.open("r+b") as f:
                    f.seek(offset)
                    f.write(new.numpy().tobytes())
            reads.append(key)
            tensor = inner(key)
            mapped.append(any(tensor.data_ptr() in r for r in mapped_ranges(path)))
            return tensor

        ckpt._read = read
        return ckpt

    monkeypatch.setattr("timm_layerscale.convert.open_checkpoint", opened)
    result = convert(path, tmp_path / "out", "hf")
    assert reads[0] != late and late in reads
    assert all(mapped)  # every tensor a view of the file's mapped pages
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert result.tensors == len(written)
    assert torch.equal(written["layer.1.mlp.down_proj.weight"], new)  # read after the change, not before
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


# ---------------------------------------------------------------------------------------------- safety


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_existing_destination_is_kept_unless_overwrite(tmp_path):
    src, _ = make_source("meta", tmp_path)
    before = digest(src)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists; pass --overwrite"):
        convert(src, tmp_path / "out", "native")
    with pytest.raises(CheckpointError, match=r"holds keep\.txt, which --to native does not write"):
        convert(src, tmp_path / "out", "native", overwrite=True)  # not a file it writes
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    (tmp_path / "out" / "keep.txt").rename(tmp_path / "out" / "README.md")  # a name it writes, not its card
    with pytest.raises(CheckpointError, match=r"holds README\.md, which --to native does not write"):
        convert(src, tmp_path / "out", "native", overwrite=True)
    (tmp_path / "out" / "README.md").write_text(f"---\n{MODEL_CARD_TAGS}\n---\n")  # a card of ours
    convert(src, tmp_path / "out", "native", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.safetensors", "out"]  # the old one is gone
    assert digest(src) == before
    with pytest.raises(CheckpointError, match="would replace the source"):
        convert(src, src, "meta", overwrite=True)


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_error_mid_write_leaves_nothing_behind(overwrite, tmp_path):
    src, _ = make_source("meta", tmp_path)
    inner = open_checkpoint(src)
    reads = []

    def failing_read(key):
        reads.append(key)
        if len(reads) == 12:
            raise OSError("disk went away")
        return inner[key]

    broken = LazyCheckpoint(src, "broken", "all", {k: inner.info(k) for k in inner}, failing_read)
    dst = tmp_path / "nested" / "out"
    dst.parent.mkdir()
    if overwrite:
        dst.mkdir()
        (dst / "config.json").write_text("old")
    with pytest.raises(OSError, match="disk went away"):
        convert(broken, dst, "hf", overwrite=overwrite)
    if overwrite:
        assert sorted(p.name for p in dst.parent.iterdir()) == ["out"] and (dst / "config.json").read_text() == "old"
    else:
        assert list(dst.parent.iterdir()) == []


def test_a_destination_under_a_missing_folder_is_refused_before_any_read(tmp_path):
    src, _ = make_source("meta", tmp_path)
    with pytest.raises(CheckpointError, match=r"the folder .*nested does not exist; create it first"):
        convert_checkpoint(LazyCheckpoint(src, "unread", "all", {}, lambda key: 1 / 0), tmp_path / "nested" / "out")
    assert not (tmp_path / "nested").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_gammas_warn_and_fail_under_strict(value, tmp_path):
    state = contiguous(ours().state_dict())
    state["blocks.1.ls2.gamma"][3] = value
    save_file(state, tmp_path / "broken.safetensors")
    result = convert(tmp_path / "broken.safetensors", tmp_path / "out", "native")
    assert result.warnings == ["LayerScale gammas are NaN or Inf in blocks 1.mlp: the checkpoint is broken"]
    with pytest.raises(CheckpointError, match=r"NaN or Inf in blocks 1.mlp.*--strict"):
        convert(tmp_path / "broken.safetensors", tmp_path / "strict", "native", strict=True)
    assert not (tmp_path / "strict").exists()
    fused = convert(tmp_path / "broken.safetensors", tmp_path / "fused", "native", fuse_layerscale=True)
    assert fused.warnings == result.warnings  # folded gammas are checked too


@pytest.mark.parametrize("weights", ["auto", "ema", "raw"])
def test_the_summary_names_the_weights_set_taken(weights, tmp_path):
    student, teacher = ours().state_dict(), fold_layer_scale(ours()).state_dict()
    torch.save({"student": student, "teacher": teacher, "iteration": 3}, tmp_path / "train.pth")
    result = convert(tmp_path / "train.pth", tmp_path / "out", "native", weights=weights)
    taken = "student" if weights == "raw" else "teacher"
    assert result.weights == taken and f"weights: {taken})" in result.summary()
    has_gammas = any(k.endswith("gamma") for k in load_file(tmp_path / "out" / "model.safetensors"))
    assert has_gammas == (weights == "raw")


# ------------------------------------------------------------------------------------------------- Hub

LOAD_FROM_HUB = """
import sys
import timm, timm_layerscale, torch
from safetensors.torch import load_file, save_file

x = load_file(sys.argv[1])["x"]
with torch.no_grad():
    tokens = {name: timm.create_model(name, pretrained=True).eval().forward_features(x) for name in sys.argv[3:]}
save_file(tokens, sys.argv[2])
"""


def test_converted_folders_load_from_the_hub(tmp_path, images):
    """`hf-hub:` through the real huggingface_hub client, against the local stand-in for the Hub."""
    src, expected = make_source("meta", tmp_path)
    repos = {"native": "someone/vit-ls-tiny", "timm": "someone/eva-tiny"}
    (tmp_path / "hub" / "someone").mkdir(parents=True)
    for target, repo in repos.items():
        convert(src, tmp_path / "hub" / repo, target)
    save_file({"x": images}, tmp_path / "x.safetensors")
    names = [f"hf-hub:{repo}" for repo in repos.values()]
    with LocalHub(tmp_path / "hub") as hub:
        args = [sys.executable, "-c", LOAD_FROM_HUB, str(tmp_path / "x.safetensors"), str(tmp_path / "out.safetensors")]
        env = hub_env(hub, tmp_path / "hf_home")
        result = subprocess.run([*args, *names], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for repo in repos.values():
        assert f"GET /{repo}/resolve/main/config.json" in hub.requests
        assert f"GET /{repo}/resolve/main/model.safetensors" in hub.requests
    tokens = load_file(tmp_path / "out.safetensors")
    with torch.no_grad():
        for name in names:
            assert_fp32_close(tokens[name], expected(images))


# ------------------------------------------------------------------------------------ other families


def test_a_foreign_family_is_named_when_loading_too(tmp_path):
    dinov2 = timm.create_model("vit_small_patch14_dinov2", depth=1, embed_dim=64, num_heads=4, img_size=56)
    save_file(contiguous(dinov2.state_dict()), tmp_path / "dinov2.safetensors")
    with pytest.raises(CheckpointError, match=r"^this is a DINOv2 checkpoint: .*vit_\*_patch14_dinov2"):
        timm.create_model(
            VARIANT["mlp"], pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "dinov2.safetensors"))
        )


@pytest.mark.parametrize("to", list(GAMMA_SPELLINGS))
def test_rename_layer_scale_between_spellings(to):
    spelled = {
        "lsN.gamma": ["blocks.0.ls1.gamma", "blocks.0.ls2.gamma"],
        "gamma_N": ["blocks.0.gamma_1", "blocks.0.gamma_2"],
        "layer_scaleN.lambda1": ["blocks.0.layer_scale1.lambda1", "blocks.0.layer_scale2.lambda1"],
    }
    for source, keys in spelled.items():
        state = {"cls_token": 0, keys[0]: 1, "blocks.0.attn.proj.weight": 2, keys[1]: 3, "blocks.0.gamma": 4}
        renamed = rename_layer_scale(state, to)
        assert list(renamed) == [
            "cls_token",
            spelled[to][0],
            "blocks.0.attn.proj.weight",
            spelled[to][1],
            "blocks.0.gamma",
        ]
        assert list(renamed.values()) == [0, 1, 2, 3, 4], source


def test_rename_layer_scale_refuses_ambiguity():
    with pytest.raises(ValueError, match=r"allowed: lsN\.gamma, gamma_N, layer_scaleN\.lambda1"):
        rename_layer_scale({}, "ls_N")
    with pytest.raises(ValueError, match="under two spellings"):
        rename_layer_scale({"blocks.0.ls1.gamma": 0, "blocks.0.gamma_1": 1}, "lsN.gamma")
    hf = transformers_reference().state_dict()
    assert sum(k.endswith("ls1.gamma") for k in rename_layer_scale(hf, "lsN.gamma")) == TINY["depth"]


# ---------------------------------------------------------------------------------- variants and config


@pytest.mark.parametrize("source", ["hf", "native", "timm"])
def test_a_folders_config_json_names_the_architecture(source, tmp_path, images):
    """No --model: transformers' config gives the heads (the variant is the nearest by shape), ours and timm's
    record the variant and its args."""
    src, expected = make_source(source if source != "timm" else "meta", tmp_path)
    folder = src.parent
    if source == "timm":
        convert(src, tmp_path / "eva", "timm")
        folder = tmp_path / "eva"
    result = convert_checkpoint(folder, tmp_path / "out", to="native")
    recorded = source != "hf"
    assert result.reason.startswith("recorded in config.json" if recorded else "from the shapes and config.json")
    assert result.variant == ("vit_ls_small_patch16_dinov3" if recorded else NEAREST_TINY)
    assert result.model_args["num_heads"] == 4  # from the config (the variant's own is 6)
    assert_fp32_close(tokens_from("native", tmp_path / "out", "mlp")(images), expected(images))


def train_py_checkpoint(model: torch.nn.Module, folder: Path, model_kwargs: dict) -> Path:
    """What timm's train.py saves, by timm's own CheckpointSaver: `arch`, its args and the state dicts."""
    folder.mkdir()
    args = Namespace(model=VARIANT["mlp"], model_kwargs=model_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = CheckpointSaver(model, optimizer, args=args, checkpoint_dir=str(folder), recovery_dir=str(folder))
    saver.save_checkpoint(epoch=0, metric=0.5)
    return folder / "last.pth.tar"


def test_the_architecture_a_checkpoint_records_names_its_variant(tmp_path, images):
    """A train.py checkpoint records `arch` (and the model kwargs it was built with): that names the variant,
    the recorded kwargs complete it, and the caller's --model-kwargs never name another."""
    model = ours()
    ckpt = train_py_checkpoint(model, tmp_path / "run", dict(TINY))
    result = convert_checkpoint(ckpt, tmp_path / "out.pth", to="meta")
    assert result.variant == VARIANT["mlp"] and result.reason.startswith("recorded in the checkpoint")
    assert_fp32_close(tokens_from("meta", tmp_path / "out.pth", "mlp")(images), model.forward_features(images))
    again = convert_checkpoint(ckpt, tmp_path / "again.pth", to="meta", model_kwargs=dict(TINY))
    assert again.variant == VARIANT["mlp"]
    bare = train_py_checkpoint(model, tmp_path / "bare", {})  # the arch alone: its shapes are not the weights'
    with pytest.raises(CheckpointError, match=f"the checkpoint records {VARIANT['mlp']}, whose shapes differ"):
        convert_checkpoint(bare, tmp_path / "bare.pth", to="meta")
    assert convert_checkpoint(bare, tmp_path / "b.pth", to="meta", model_kwargs=dict(TINY)).variant == VARIANT["mlp"]


def test_model_kwargs_complete_the_nearest_variant_and_never_pick_another(tmp_path):
    """Kwargs that make every variant the weights' shape leave the one nearest the weights alone named."""
    src, _ = make_source("meta", tmp_path)
    with pytest.raises(CheckpointError, match=f"the nearest is {NEAREST_TINY}"):
        convert_checkpoint(src, tmp_path / "refused.pth", to="meta")
    result = convert_checkpoint(src, tmp_path / "out.pth", to="meta", model_kwargs=dict(TINY))
    assert result.variant == NEAREST_TINY and result.reason.startswith("from the shapes")


def test_a_yaml_variant_converts_without_being_registered(tmp_path, images):
    yaml_file = tmp_path / "my_tiny_vit.yaml"
    yaml_file.write_text("base: vit_ls_small_patch16_dinov3\nmodel:\n  embed_dim: 64\n  depth: 2\n  num_heads: 4\n")
    src, expected = make_source("meta", tmp_path)
    result = convert_checkpoint(src, tmp_path / "out", to="native", model=str(yaml_file))
    assert result.variant == "my_tiny_vit" and "my_tiny_vit" not in VARIANTS
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architecture"] in VARIANTS and config["model_args"]["embed_dim"] == 64  # a shipped name
    assert_fp32_close(tokens_from("native", tmp_path / "out", "mlp")(images), expected(images))


def test_a_large_conversion_shows_progress(tmp_path, capsys):
    src, _ = make_source("meta", tmp_path)
    convert(src, tmp_path / "out", "hf", progress=True)
    err = capsys.readouterr().err
    assert "hf out" in err and "100%" in err
    convert(src, tmp_path / "quiet", "hf")  # small and not on a terminal: no bar
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------ values, not just outputs


@torch.no_grad()
def test_imported_qkv_biases_keep_metas_conventions(tmp_path):
    """A layout without a k bias gives a zero one under Meta's mask (ones, k third zero)."""
    for source in ("hf", "timm"):
        (tmp_path / source).mkdir()
        src, _ = make_source(source, tmp_path / source)
        convert(src, tmp_path / f"{source}.pth", "meta")
        state = torch.load(tmp_path / f"{source}.pth", weights_only=True)
        for i in range(TINY["depth"]):
            q, k, v = state[f"blocks.{i}.attn.qkv.bias"].chunk(3)
            assert q.any() and v.any() and not k.any()
            assert state[f"blocks.{i}.attn.qkv.bias_mask"].tolist() == [1.0] * 64 + [0.0] * 64 + [1.0] * 64


@torch.no_grad()
def test_a_transformers_k_bias_is_read_back(tmp_path, images):
    model = transformers_reference()
    model.config.key_bias = True
    with_k = DINOv3ViTModel(model.config).eval()
    with_k.load_state_dict(model.state_dict(), strict=False)
    for layer in with_k.model.layer:
        layer.attention.k_proj.bias.normal_()
    with_k.save_pretrained(tmp_path / "hf-k")
    convert(tmp_path / "hf-k" / "model.safetensors", tmp_path / "native", "native")
    expected = with_k(pixel_values=images).last_hidden_state
    assert_fp32_close(tokens_from("native", tmp_path / "native", "mlp")(images), expected)


@torch.no_grad()
def test_a_model_without_a_bias_mask_loads_the_masked_bias(images):
    """The mask is folded into the bias when the model has none: Meta's outputs, not the raw bias's."""
    meta_sd = load_file(FIXTURES / "meta_mlp.safetensors")
    variant, kwargs = meta_fixture_kwargs("meta_mlp")
    outputs = load_file(FIXTURES / "meta_mlp_outputs.safetensors")
    model = timm.create_model(variant, mask_k_bias=False, **kwargs).eval()
    model.load_state_dict(meta_sd)
    assert not any(k.endswith("bias_mask") for k in model.state_dict())
    assert_fp32_close(model(outputs["input"]), outputs["forward"])


@torch.no_grad()
def test_fold_layer_scale_is_recorded_by_timms_own_save(tmp_path, images):
    model = timm.create_model(VARIANT["mlp"], init_values=1e-5, num_classes=0, **TINY)
    move_off_init_(model).eval()
    fold_layer_scale(model)
    timm.models.save_for_hf(model, str(tmp_path / "timm-save"), safe_serialization=True)
    assert model._model_args["init_values"] == 0
    config = json.loads((tmp_path / "timm-save" / "config.json").read_text())
    if "model_args" not in config:
        pytest.skip("this timm's save_for_hf writes no model args")
    assert config["model_args"]["init_values"] == 0
    again = timm.create_model(f"local-dir:{tmp_path / 'timm-save'}", pretrained=True).eval()
    assert max_diff(again.forward_features(images), model.forward_features(images)) == 0


def test_fills_take_the_checkpoints_dtype(tmp_path):
    model = ours().to(torch.bfloat16)
    save_file(contiguous(model.state_dict()), tmp_path / "bf16.safetensors")
    convert(tmp_path / "bf16.safetensors", tmp_path / "hf", "hf", fuse_layerscale=True)
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_native_folder_writes_layer_scale_off_as_zero_and_keeps_what_exists(tmp_path):
    """timm drops keyword arguments that are None: LayerScale off is written as 0."""
    model = VisionTransformerLS(VARIANTS[VARIANT["mlp"]].config.replace(init_values=None, **TINY))
    save_native(model, tmp_path / "off")
    assert json.loads((tmp_path / "off" / "config.json").read_text())["model_args"]["init_values"] == 0
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        save_native(model, tmp_path / "off")
    save_native(model, tmp_path / "off", overwrite=True)


def test_a_failed_rename_restores_the_destination(tmp_path, monkeypatch):
    src, _ = make_source("meta", tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("old")
    replace = os.replace

    def refuse_new(source, target):
        if ".tmp-" in str(source) and not Path(source).name.startswith(".old-"):  # the new folder, not the kept one
            raise OSError("rename refused")
        replace(source, target)

    monkeypatch.setattr(os, "replace", refuse_new)
    with pytest.raises(OSError, match="rename refused"):
        convert(src, tmp_path / "out", "native", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["meta.safetensors", "out"])
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["config.json"]
    assert (tmp_path / "out" / "config.json").read_text() == "old"


def test_a_timm_config_of_fixed_size_becomes_dynamic(tmp_path):
    """timm's Hub configs of eva DINOv3 say fixed_input_size; the folder written runs at any size."""
    src, _ = make_source("meta", tmp_path)
    convert(src, tmp_path / "eva", "timm")
    config = json.loads((tmp_path / "eva" / "config.json").read_text())
    config["pretrained_cfg"]["fixed_input_size"] = True
    (tmp_path / "eva" / "config.json").write_text(json.dumps(config))
    convert_checkpoint(tmp_path / "eva", tmp_path / "again", to="timm")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["pretrained_cfg"]["fixed_input_size"] is False and again["model_args"]["dynamic_img_size"] is True


@torch.no_grad()
def test_a_saved_model_never_passes_its_training_switches_on(tmp_path):
    """A folder saved from a model fine-tuned with reinit_layer_scale loads with its trained gammas."""
    model = move_off_init_(
        VisionTransformerLS(
            VARIANTS[VARIANT["mlp"]].config.replace(reinit_layer_scale=True, freeze_layer_scale=True, **TINY)
        )
    )
    save_native(model, tmp_path / "tuned")
    args = json.loads((tmp_path / "tuned" / "config.json").read_text())["model_args"]
    assert "reinit_layer_scale" not in args and "freeze_layer_scale" not in args
    again = timm.create_model(f"local-dir:{tmp_path / 'tuned'}", pretrained=True)
    assert torch.equal(again.blocks[1].ls2.gamma, model.blocks[1].ls2.gamma)
    assert again.blocks[1].ls2.gamma.requires_grad


# ------------------------------------------------------------------------- what a config beside the weights says


def test_a_folders_data_config_travels_with_its_weights(tmp_path):
    """The pretrained cfg in a folder's config.json (mean, std, licence) is what the converted folder carries."""
    save_native(ours(), tmp_path / "native")
    config = json.loads((tmp_path / "native" / "config.json").read_text())
    config["pretrained_cfg"].update(mean=[0.43, 0.411, 0.296], std=[0.213, 0.156, 0.143], license="my-licence")
    (tmp_path / "native" / "config.json").write_text(json.dumps(config))
    convert_checkpoint(tmp_path / "native", tmp_path / "eva", to="timm")
    written = json.loads((tmp_path / "eva" / "config.json").read_text())["pretrained_cfg"]
    assert written["mean"] == [0.43, 0.411, 0.296] and written["license"] == "my-licence"


@torch.no_grad()
def test_transformers_rope_theta_is_read_and_written(tmp_path, images):
    transformers_reference().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_theta": 50.0}))
    model = DINOv3ViTModel.from_pretrained(tmp_path / "hf").eval()  # its RoPE from the config's base
    result = convert_checkpoint(tmp_path / "hf", tmp_path / "native", to="native")
    assert result.model_args["rope_base"] == 50.0
    convert_checkpoint(tmp_path / "native", tmp_path / "back", to="hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_theta"] == 50.0
    expected = model(pixel_values=images).last_hidden_state
    assert_fp32_close(tokens_from("native", tmp_path / "native", "mlp")(images), expected)


def test_an_option_of_another_format_is_named_with_its_format(tmp_path):
    src, _ = make_source("meta", tmp_path)
    with pytest.raises(CheckpointError, match=r"^distill_teacher is an option of meta-train, not of native$"):
        convert(src, tmp_path / "out", "native", distill_teacher=True)
    assert not (tmp_path / "out").exists()
