"""`--to meta-train`: the checkpoints Meta's DINOv3 trainer resumes, distils and Gram-anchors from.

Meta's side is the committed fixture `meta_train_keys.json`: the key names, shapes and dtypes of Meta's
`ModuleDict(backbone=DinoVisionTransformer, dino_head=DINOHead, ibot_head=DINOHead)`, built with Meta's code
(tests/fixtures/README.md). A module with exactly those keys must accept what is written with `strict=True`.
"""

from __future__ import annotations

import io
import json
import pickle
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import timm
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file, save_file
from support import EVA, FIXTURES, VARIANT, assert_fp32_close, max_diff, move_off_init_
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from transformers import DINOv3ViTConfig, DINOv3ViTModel

from timm_layerscale import CheckpointError, convert_checkpoint
from timm_layerscale.checkpoints import TensorInfo, open_checkpoint
from timm_layerscale.checkpoints.formats.meta_train import (
    DEFAULT_HEADS,
    RELEASED_HEADS,
    HeadSize,
    MetaHeads,
    heads_from_config,
)
from timm_layerscale.checkpoints.read.dcp.reader import METADATA_FILE, MetadataUnpickler, read_metadata
from timm_layerscale.checkpoints.write.dcp import write_dcp
from timm_layerscale.identity import IdentifiedModel
from timm_layerscale.publish import save_native
from timm_layerscale.variants import VARIANTS
from timm_ls.main import main

KEYS = json.loads((FIXTURES / "meta_train_keys.json").read_text())["models"]
BACKBONES = json.loads((FIXTURES / "meta_configs.json").read_text())["models"]
SHAPE = dict(embed_dim=64, depth=2, num_heads=2)  # the meta_mlp fixture's


# ------------------------------------------------------------------------------------------ helpers


def meta_module(name: str) -> nn.Module:
    """A module whose state dict has exactly the keys, shapes and dtypes of Meta's ModuleDict `name`."""
    root = nn.Module()
    for key, (shape, dtype) in KEYS[name]["state_dict"].items():
        *path, leaf = key.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        module.register_buffer(leaf, torch.full(shape, float("nan"), dtype=getattr(torch, dtype)))
    return root


def head_yaml(name: str, path: Path) -> Path:
    sections = {}
    for section in ("dino", "ibot"):
        head = KEYS[name][f"{section}_head"]
        sections[section] = {
            "head_n_prototypes": head["out_dim"],
            "head_bottleneck_dim": head["bottleneck_dim"],
            "head_hidden_dim": head["hidden_dim"],
            "head_nlayers": head["nlayers"],
        }
    path.write_text(yaml.safe_dump({**sections, "student": {"arch": "vit_large"}}))
    return path


def model_args(backbone: str) -> tuple[str, dict]:
    meta = BACKBONES[backbone]
    kwargs = dict(embed_dim=64, depth=meta["depth"], num_heads=meta["num_heads"], ffn_ratio=meta["ffn_ratio"])
    return VARIANT[meta["ffn_layer"]], kwargs


def meta_source(name: str, tmp_path: Path) -> Path:
    """Meta's backbone fixture for the ModuleDict `name`, its gammas dropped where that module has none."""
    state = load_file(FIXTURES / f"{KEYS[name]['backbone']}.safetensors")
    if KEYS[name]["layerscale_init"] is None:
        state = {k: v for k, v in state.items() if ".ls" not in k}
    path = tmp_path / f"{name}-source.safetensors"
    save_file(state, path)
    return path


def to_meta_train(src, dst: Path, name: str, tmp_path: Path, **kwargs):
    variant, margs = model_args(KEYS[name]["backbone"])
    kwargs.setdefault("meta_config", head_yaml(name, tmp_path / f"{name}-heads.yaml"))
    return convert_checkpoint(src, dst, to="meta-train", model=variant, model_kwargs=margs, **kwargs)


def read_pth(path: Path) -> dict[str, torch.Tensor]:
    data = torch.load(path, weights_only=True)
    assert list(data) == ["teacher"]
    return data["teacher"]


def read_dcp(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """What Meta's load_checkpoint does, strict: every key of Meta's module must be in the folder."""
    wanted = {k: torch.empty(s, dtype=getattr(torch, d)) for k, (s, d) in KEYS[name]["state_dict"].items()}
    state = {"model": wanted}
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=DefaultLoadPlanner(allow_partial_load=False))
    return state["model"]


def written(path: Path, name: str) -> dict[str, torch.Tensor]:
    return read_pth(path) if path.suffix == ".pth" else read_dcp(path, name)


def run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def cli_args(name: str, src: Path, dst: Path, tmp_path: Path, *extra: str) -> list[str]:
    variant, margs = model_args(KEYS[name]["backbone"])
    kwargs = [f"{k}={v}" for k, v in margs.items()]
    config = head_yaml(name, tmp_path / f"{name}-heads.yaml")
    return ["convert", str(src), str(dst), "--to", "meta-train", "--model", variant, "--model-kwargs", *kwargs,
            "--meta-config", str(config), *extra]  # fmt: skip


# --------------------------------------------------------------------------------- Meta's modules load it


@pytest.mark.parametrize("name", list(KEYS))
@pytest.mark.parametrize("suffix", [".pth", ""])
def test_meta_modules_load_new_heads_strictly(name, suffix, tmp_path):
    dst = tmp_path / f"train{suffix}"
    to_meta_train(meta_source(name, tmp_path), dst, name, tmp_path)
    state = written(dst, name)
    assert {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()} == {
        k: tuple(v) for k, v in KEYS[name]["state_dict"].items()
    }
    module = meta_module(name)
    module.load_state_dict(state, strict=True)
    assert not any(t.isnan().any() for t in module.state_dict().values())
    source = load_file(FIXTURES / f"{KEYS[name]['backbone']}.safetensors")
    for key, value in state.items():
        if key.startswith("backbone."):
            assert torch.equal(value, source[key.removeprefix("backbone.")]), key


@pytest.mark.parametrize("name", ["meta_mlp", "meta_swiglu"])
@pytest.mark.parametrize(("first", "second"), [(".pth", ""), ("", ".pth"), (".pth", ".pth"), ("", "")])
def test_meta_modules_load_carried_heads_strictly_and_losslessly(name, first, second, tmp_path):
    """meta-train -> meta-train: every key, value and dtype, heads included, from either file kind to either."""
    a, b = tmp_path / f"a{first}", tmp_path / f"b{second}"
    to_meta_train(meta_source(name, tmp_path), a, name, tmp_path, seed=3)
    result = to_meta_train(a, b, name, tmp_path, meta_config=None)
    assert "heads carried: " in result.summary() and "heads new" not in result.summary()
    before, after = written(a, name), written(b, name)
    assert list(after) == list(before) == list(KEYS[name]["state_dict"])
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    meta_module(name).load_state_dict(after, strict=True)


def test_bf16_is_kept_through_meta_train_to_meta_train(tmp_path):
    name = "meta_mlp"
    a, b = tmp_path / "a.pth", tmp_path / "b"
    first = to_meta_train(meta_source(name, tmp_path), a, name, tmp_path, dtype="bf16")
    assert "written in bfloat16" in first.summary()
    again = to_meta_train(a, b, name, tmp_path, meta_config=None, dtype="keep")
    assert "written in bfloat16" in again.summary()
    before = read_pth(a)
    assert before["backbone.rope_embed.periods"].dtype == torch.float32  # Meta's periods stay fp32
    assert before["dino_head.last_layer.weight"].dtype == torch.bfloat16
    metadata = read_metadata(b)
    for key, value in before.items():
        item = metadata.state_dict_metadata[f"model.{key}"]
        assert item.properties.dtype == value.dtype, key
    with open_checkpoint(b, heads=True) as ckpt:
        for key, value in before.items():
            inner = key.removeprefix("backbone.")
            got = ckpt.heads[key] if key.startswith(("dino_head.", "ibot_head.")) else ckpt[inner]
            assert got.dtype == value.dtype and torch.equal(got, value), key


@torch.no_grad()
@pytest.mark.parametrize("suffix", [".pth", ""])
def test_meta_train_to_native_gives_the_source_backbones_outputs(suffix, tmp_path):
    name = "meta_swiglu"
    variant, margs = model_args("meta_swiglu")
    to_meta_train(meta_source(name, tmp_path), tmp_path / f"train{suffix}", name, tmp_path)
    convert_checkpoint(tmp_path / f"train{suffix}", tmp_path / "native", to="native", model=variant, model_kwargs=margs)
    again = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    direct = timm.create_model(variant, cls_norm=True, local_cls_norm=True, **margs).eval()
    direct.load_state_dict(load_file(FIXTURES / "meta_swiglu.safetensors"))
    outputs = load_file(FIXTURES / "meta_swiglu_outputs.safetensors")
    assert max_diff(again.forward_features(outputs["input"]), direct.forward_features(outputs["input"])) == 0
    assert_fp32_close(again(outputs["input"]), outputs["forward"])  # Meta's own output


# ------------------------------------------------------------------------------------------ new heads


def test_new_heads_are_deterministic_for_a_seed_and_have_metas_init_statistics(tmp_path):
    sizes = {"head_bottleneck_dim": 64, "head_hidden_dim": 96, "head_nlayers": 2}
    big = {"dino": {"head_n_prototypes": 4096, **sizes}, "ibot": {"head_n_prototypes": 2048, **sizes}}
    config = tmp_path / "big.yaml"
    config.write_text(yaml.safe_dump(big))
    src = meta_source("meta_mlp", tmp_path)
    made = {}
    for tag, seed, suffix in (("a", 5, ".pth"), ("b", 5, ""), ("c", 6, ".pth")):
        to_meta_train(src, tmp_path / f"{tag}{suffix}", "meta_mlp", tmp_path, meta_config=config, seed=seed)
        path = tmp_path / f"{tag}{suffix}"
        with open_checkpoint(path, heads=True) as ckpt:
            made[tag] = {k: ckpt.heads[k].clone() for k in ckpt.heads}
    assert list(made["a"]) == list(made["b"])
    weights = [k for k in made["a"] if k.endswith(".weight")]
    assert len(weights) == 6 and all(torch.equal(made["a"][k], made["b"][k]) for k in made["a"])  # same seed
    assert not any(torch.equal(made["a"][k], made["c"][k]) for k in weights)  # another seed
    tensors = [made["a"][k] for k in weights]
    assert len({t.flatten()[:8].tolist().__repr__() for t in tensors}) == 6  # each tensor its own draw
    for key, tensor in made["a"].items():
        if key.endswith(".bias"):
            assert torch.equal(tensor, torch.zeros_like(tensor)), key
            continue
        n = tensor.numel()
        assert abs(tensor.mean().item()) < 4 * 0.02 / n**0.5, key
        assert abs(tensor.std().item() - 0.02) < 0.02 * 6 / (2 * n) ** 0.5 + 1e-4, key
        assert tensor.abs().max().item() < 0.02 * 6, key  # a normal draw, not a uniform or a constant
    assert made["a"]["dino_head.last_layer.weight"].shape == (4096, 64)


def test_head_sizes_come_from_the_config_merged_over_metas_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("train:\n  batch_size_per_gpu: 8\n")
    assert heads_from_config(empty) == DEFAULT_HEADS
    partial = tmp_path / "partial.yaml"
    partial.write_text("dino:\n  head_n_prototypes: 1024\nibot:\n  head_hidden_dim: 512\n")
    assert heads_from_config(partial) == MetaHeads(HeadSize(1024, 256, 2048, 3), HeadSize(65536, 256, 512, 3))
    released = tmp_path / "vit7b.yaml"
    released.write_text(
        "dino:\n  head_n_prototypes: 262144\n  head_bottleneck_dim: 512\n  head_hidden_dim: 8192\n"
        "ibot:\n  head_n_prototypes: 98304\n  head_bottleneck_dim: 384\n  head_hidden_dim: 4096\n"
    )
    assert heads_from_config(released) == RELEASED_HEADS
    assert MetaHeads(HeadSize(65536, 256, 2048, 3), HeadSize(65536, 256, 2048, 3)) == DEFAULT_HEADS


def test_released_shapes_get_the_released_heads():
    for name in ("vit_ls_small_patch16_dinov3", "vit_ls_7b_patch16_dinov3", "vit_ls_huge_plus_patch16_dinov3"):
        config = VARIANTS[name].config
        assert IdentifiedModel(name, None, config, "given").released
        smaller = type(config).from_dict({**config.to_dict(), "depth": 2})
        assert not IdentifiedModel(name, None, smaller, "given").released
        wider = type(config).from_dict({**config.to_dict(), "embed_dim": config.embed_dim * 2})
        assert not IdentifiedModel(name, None, wider, "given").released


# ----------------------------------------------------------------------------------- the DCP folder


def test_the_dcp_folder_is_metas_layout_and_reads_back_through_our_reader(tmp_path):
    name = "meta_mlp"
    to_meta_train(meta_source(name, tmp_path), tmp_path / "a.pth", name, tmp_path)
    to_meta_train(meta_source(name, tmp_path), tmp_path / "ckpt", name, tmp_path)
    with (tmp_path / "ckpt" / METADATA_FILE).open("rb") as f:
        metadata = MetadataUnpickler(f).load()  # the allow-list refuses nothing in it
    assert isinstance(metadata.state_dict_metadata["iteration"], BytesStorageMetadata)
    assert set(metadata.state_dict_metadata) == {"iteration", *(f"model.{k}" for k in KEYS[name]["state_dict"])}
    assert read_metadata(tmp_path / "ckpt").state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    expected = read_pth(tmp_path / "a.pth")
    with open_checkpoint(tmp_path / "ckpt", heads=True) as ckpt:
        assert sorted(ckpt.heads) == sorted(k for k in expected if not k.startswith("backbone."))
        assert sorted(ckpt) == sorted(k.removeprefix("backbone.") for k in expected if k.startswith("backbone."))
        for key, value in expected.items():
            got = ckpt[key.removeprefix("backbone.")] if key.startswith("backbone.") else ckpt.heads[key]
            assert torch.equal(got, value), key
    read = read_dcp(tmp_path / "ckpt", name)
    assert all(torch.equal(read[k], v) for k, v in expected.items())


def test_ordinary_loads_still_drop_the_heads(tmp_path):
    name = "meta_mlp"
    to_meta_train(meta_source(name, tmp_path), tmp_path / "ckpt", name, tmp_path)
    for path in (tmp_path / "ckpt",):
        with open_checkpoint(path) as ckpt:
            assert ckpt.heads is None
            assert not any("head" in k for k in ckpt)
    variant, margs = model_args("meta_mlp")
    model = timm.create_model(
        variant, pretrained=True, pretrained_cfg_overlay={"file": str(tmp_path / "ckpt")}, **margs
    )
    assert not any("head" in k for k in model.state_dict() if k.startswith(("dino", "ibot")))


def test_the_weights_set_picks_whose_heads_are_carried():
    """Meta's ckpt/<iteration> folders hold student and teacher, each with heads, and the loss centers."""
    torch.manual_seed(0)

    def one_set(scale: float) -> dict:
        # More head keys than backbone keys: the heads must not decide which wrapper is stripped.
        head = {"mlp": {"0": {"weight": torch.full((3, 4), scale), "bias": torch.full((3,), scale)}},
                "last_layer": {"weight": torch.full((6, 2), scale)}}  # fmt: skip
        return {"backbone": {"cls_token": torch.full((1, 1, 4), scale)}, "dino_head": head, "ibot_head": head}

    state = {"model": {"student": one_set(1.0), "teacher": one_set(2.0), "dino_loss": {"center": torch.ones(6)}}}
    for weights, value in (("raw", 1.0), ("ema", 2.0), ("auto", 2.0)):
        with open_checkpoint(state, weights, heads=True) as ckpt:
            assert list(ckpt) == ["cls_token"] and ckpt["cls_token"].max() == value
            assert len(ckpt.heads) == 6 and "ibot_head.mlp.0.bias" in ckpt.heads
            assert ckpt.heads["dino_head.last_layer.weight"].max() == value


# ------------------------------------------------------------------------------- what Meta cannot hold


def test_a_classifier_layer_scale_off_in_some_branches_and_init_values_per_branch_are_listed(tmp_path):
    model = move_off_init_(
        timm.create_model(VARIANT["mlp"], embed_dim=64, depth=2, num_heads=2, num_classes=3, init_values=1e-5)
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "blocks.1.ls2.gamma"}
    save_file(state, tmp_path / "finetuned.safetensors")
    kwargs = dict(model=VARIANT["mlp"], meta_config=head_yaml("meta_mlp", tmp_path / "h.yaml"))
    kwargs["model_kwargs"] = dict(embed_dim=64, depth=2, num_heads=2, init_values=[1e-5, {"attn": 1e-6, "mlp": 0}])
    result = convert_checkpoint(tmp_path / "finetuned.safetensors", tmp_path / "out.pth", to="meta-train", **kwargs)
    held = ", ".join(result.not_held)
    assert "no classifier in Meta's backbone" in held
    assert "LayerScale off in some branches only (1.mlp)" in held
    assert "LayerScale init values per branch (1e-06, 1e-05)" in held
    assert len(result.warnings) == 3
    out = read_pth(tmp_path / "out.pth")
    assert torch.equal(out["backbone.blocks.1.ls2.gamma"], torch.ones(64))  # the identity Meta's block needs
    meta_module("meta_mlp").load_state_dict(out, strict=True)
    for flag in range(3):  # each one alone is refused with strict
        state_one = dict(state)
        args = dict(kwargs, model_kwargs=dict(embed_dim=64, depth=2, num_heads=2, num_classes=0))
        if flag == 0:
            args["model_kwargs"]["num_classes"] = 3
            state_one["blocks.1.ls2.gamma"] = torch.ones(64)
        elif flag == 1:
            state_one = {k: v for k, v in state.items() if not k.startswith("head.")}
        else:
            state_one = {k: v for k, v in state.items() if not k.startswith("head.")}
            state_one["blocks.1.ls2.gamma"] = torch.ones(64)
            args["model_kwargs"]["init_values"] = [1e-5, {"attn": 1e-6, "mlp": 1e-5}]
        save_file(state_one, tmp_path / f"one{flag}.safetensors")
        with pytest.raises(CheckpointError, match="--strict refuses"):
            convert_checkpoint(tmp_path / f"one{flag}.safetensors", tmp_path / f"x{flag}.pth", to="meta-train",
                               strict=True, **args)  # fmt: skip
        assert not (tmp_path / f"x{flag}.pth").exists()


def test_layer_scale_off_everywhere_writes_metas_identity_blocks(tmp_path):
    name = "meta_mlp_no_layerscale"
    code, out, err = run(cli_args(name, meta_source(name, tmp_path), tmp_path / "out.pth", tmp_path, "--strict"))
    assert code == 0, err
    lines = yaml.safe_load(out[out.index("dino:") :])
    assert lines["student"]["layerscale"] is None
    meta_module(name).load_state_dict(read_pth(tmp_path / "out.pth"), strict=True)


def test_distilling_from_a_teacher_whose_heads_are_new(tmp_path):
    name = "meta_mlp"
    src = meta_source(name, tmp_path)
    code, _, err = run(cli_args(name, src, tmp_path / "t.pth", tmp_path, "--distill-teacher", "--strict"))
    assert code == 2 and err.count("\n") == 1 and "a distillation teacher needs trained heads" in err
    assert not (tmp_path / "t.pth").exists()
    code, _, err = run(cli_args(name, src, tmp_path / "t.pth", tmp_path, "--distill-teacher"))
    assert code == 0 and err.startswith("timm-ls: warning: a distillation teacher needs trained heads")
    code, _, err = run(cli_args(name, tmp_path / "t.pth", tmp_path / "t2", tmp_path, "--distill-teacher", "--strict"))
    assert code == 0 and err == "", err  # carried heads: a teacher as it was trained


# ------------------------------------------------------------------------------------ what it prints


def test_the_summary_and_metas_yaml_lines(tmp_path):
    name = "meta_swiglu"
    code, out, err = run(cli_args(name, meta_source(name, tmp_path), tmp_path / "ckpt", tmp_path, "--seed", "7"))
    assert code == 0 and err == "", err
    summary = next(line for line in out.splitlines() if line.startswith("converted "))
    assert "heads new (seed 7, --meta-config): dino 72/8/32 x2, ibot 56/8/- x1" in summary
    assert "warm them up with the backbone frozen before joint training" in summary
    assert "written in float32" in summary and " 65 tensors" in summary
    lines = yaml.safe_load(out[out.index("dino:") :])
    path = str((tmp_path / "ckpt").resolve())
    assert lines["student"]["resume_from_teacher_chkpt"] == path
    assert lines["gram"] == {"use_loss": True, "ema_teacher": False, "ckpt": path}
    assert lines["distillation"]["enabled"] is True and lines["distillation"]["checkpoint_path"] == path
    assert lines["dino"] == {
        "head_n_prototypes": 72,
        "head_bottleneck_dim": 8,
        "head_hidden_dim": 32,
        "head_nlayers": 2,
    }
    assert lines["ibot"] == {
        "separate_head": True,
        "head_n_prototypes": 56,
        "head_bottleneck_dim": 8,
        "head_nlayers": 1,
    }
    meta = BACKBONES["meta_swiglu"]
    assert lines["student"]["qkv_bias"] is meta["qkv_bias"] and lines["student"]["layerscale"] == 1e-5
    assert lines["student"]["untie_cls_and_patch_norms"] is True and lines["student"]["n_storage_tokens"] == 4
    assert lines["student"]["untie_global_and_local_cls_norm"] is True
    assert lines["student"]["mask_k_bias"] is meta["mask_k_bias"]  # moot without a qkv bias: as Meta built it
    code, out, _ = run(cli_args("meta_mlp", meta_source("meta_mlp", tmp_path), tmp_path / "m.pth", tmp_path))
    assert yaml.safe_load(out[out.index("dino:") :])["student"]["mask_k_bias"] is True
    code, out, _ = run([*cli_args(name, tmp_path / "ckpt", tmp_path / "bf.pth", tmp_path), "--dtype", "bf16"])
    summary = next(line for line in out.splitlines() if line.startswith("converted "))
    assert "heads carried: dino 72/8/32 x2, ibot 56/8/- x1" in summary and "written in bfloat16" in summary


# -------------------------------------------------------------------------------------------- bad input


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    name = "meta_mlp"
    src = meta_source(name, tmp_path)
    (tmp_path / "exists.pth").write_text("mine")
    (tmp_path / "not-yaml.yaml").write_bytes(b"dino: [\x00\x01 {")
    (tmp_path / "list.yaml").write_text("- dino\n- ibot\n")
    torch.save({"teacher": {"dino_head.last_layer.weight": torch.ones(4, 2)}}, tmp_path / "heads-only.pth")
    to_meta_train(src, tmp_path / "carried.pth", name, tmp_path)
    cases = {}
    ok = cli_args(name, src, tmp_path / "x.pth", tmp_path)
    at = ok.index("--meta-config") + 1
    for size, value in (("n_prototypes", 0), ("bottleneck_dim", -4), ("hidden_dim", "big"), ("nlayers", True)):
        path = tmp_path / f"bad-{size}.yaml"
        path.write_text(yaml.safe_dump({"ibot": {f"head_{size}": value}}))
        cases[size] = ([*ok[:at], str(path)], f"ibot.head_{size} is {value!r}; it must be a positive integer")
    cases["not_yaml"] = ([*ok[:at], str(tmp_path / "not-yaml.yaml")], "not-yaml.yaml is not a readable YAML file")
    cases["list"] = ([*ok[:at], str(tmp_path / "list.yaml")], "list.yaml holds a list, not a config mapping")
    cases["absent_yaml"] = (
        [*ok[:at], str(tmp_path / "absent.yaml")],
        f"Meta training YAML {tmp_path}/absent.yaml does not exist",
    )
    cases["exists"] = (cli_args(name, src, tmp_path / "exists.pth", tmp_path), "exists; pass --overwrite")
    cases["no_backbone"] = (
        cli_args(name, tmp_path / "heads-only.pth", tmp_path / "x.pth", tmp_path),
        "heads-only.pth holds no backbone (only dino_head); pass a checkpoint with the backbone's weights",
    )
    cases["suffix"] = (cli_args(name, src, tmp_path / "x.safetensors", tmp_path), "name it .pth or give a folder")
    other = tmp_path / "other.yaml"
    other.write_text("dino:\n  head_n_prototypes: 97\n")
    cases["carried_differ"] = (
        [*cli_args(name, tmp_path / "carried.pth", tmp_path / "x", tmp_path)[:at], str(other)],
        "the source's heads are dino 96/16/48 x3, ibot 80/12/40 x3",
    )
    cases["other_target"] = (
        ["convert", str(src), str(tmp_path / "x"), "--to", "native", "--meta-config", str(other)],
        "--meta-config is for --to meta-train",
    )
    cases["other_target_options"] = (
        ["convert", str(src), str(tmp_path / "x"), "--to", "hf", "--seed", "3", "--distill-teacher"],
        "--seed and --distill-teacher are for --to meta-train",
    )
    return cases


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path):
    cases = bad_inputs(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for case, (args, expected) in cases.items():
        code, out, err = run(args)
        assert code == 2, (case, out, err)
        assert err.count("\n") == 1 and err.startswith("timm-ls: error: ") and expected in err, (case, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, case
    assert (tmp_path / "exists.pth").read_text() == "mine"


def test_the_written_metadata_has_nothing_the_allow_list_refuses(tmp_path):
    """The same unpickler that refuses foreign globals reads ours, and it does refuse one."""
    to_meta_train(meta_source("meta_mlp", tmp_path), tmp_path / "ckpt", "meta_mlp", tmp_path)
    raw = (tmp_path / "ckpt" / METADATA_FILE).read_bytes()
    MetadataUnpickler(io.BytesIO(raw)).load()
    with pytest.raises(pickle.UnpicklingError):
        MetadataUnpickler(io.BytesIO(pickle.dumps(print))).load()


# ------------------------------------------------------------------------------------ every source


def sources(root: Path, images: torch.Tensor) -> dict[str, tuple[Path, str, torch.Tensor]]:
    """(path, weights, the source model's normed tokens) for each kind of source the package reads."""
    torch.manual_seed(0)
    found = {}
    config = DINOv3ViTConfig(
        hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=256, num_register_tokens=4
    )
    hf = move_off_init_(DINOv3ViTModel(config)).eval()
    hf.save_pretrained(root / "hf")
    found["transformers folder"] = (root / "hf", "auto", hf(pixel_values=images).last_hidden_state)
    eva = move_off_init_(timm.create_model(EVA["mlp"], global_pool="token", **SHAPE)).eval()
    timm.models.save_for_hf(eva, str(root / "eva"), safe_serialization=True)
    found["timm eva folder"] = (root / "eva", "auto", eva.forward_features(images))
    raw = move_off_init_(timm.create_model(VARIANT["mlp"], num_classes=0, **SHAPE), seed=1).eval()
    ema = move_off_init_(timm.create_model(VARIANT["mlp"], num_classes=0, **SHAPE), seed=2).eval()
    torch.save({"epoch": 3, "arch": VARIANT["mlp"], "state_dict": raw.state_dict(), "state_dict_ema": ema.state_dict()},
               root / "model_best.pth.tar")  # fmt: skip
    found["train.py ema"] = (root / "model_best.pth.tar", "ema", ema.forward_features(images))
    found["train.py raw"] = (root / "model_best.pth.tar", "raw", raw.forward_features(images))
    save_native(ema, root / "native")
    found["native folder"] = (root / "native", "auto", ema.forward_features(images))
    meta = timm.create_model(VARIANT["mlp"], num_classes=0, **SHAPE).eval()
    meta.load_state_dict(load_file(FIXTURES / "meta_mlp.safetensors"))
    torch.save(load_file(FIXTURES / "meta_mlp.safetensors"), root / "dinov3_pretrain.pth")
    found["Meta's release"] = (root / "dinov3_pretrain.pth", "auto", meta.forward_features(images))
    return found


@torch.no_grad()
def test_every_source_becomes_a_checkpoint_metas_modules_load(tmp_path, images):
    for kind, (src, weights, expected) in sources(tmp_path, images).items():
        dst = tmp_path / f"{kind.replace(' ', '-')}.pth"
        result = to_meta_train(src, dst, "meta_mlp", tmp_path, weights=weights)
        assert "heads new" in result.summary(), kind
        meta_module("meta_mlp").load_state_dict(read_pth(dst), strict=True)
        native = tmp_path / f"{kind.replace(' ', '-')}-native"
        convert_checkpoint(dst, native, to="native", model=VARIANT["mlp"], model_kwargs=SHAPE)
        again = timm.create_model(f"local-dir:{native}", pretrained=True).eval()
        assert_fp32_close(again.forward_features(images), expected, what=kind)


def test_the_dtype_is_fp32_by_default_and_keep_keeps_the_sources(tmp_path):
    fp32 = load_file(meta_source("meta_mlp", tmp_path))
    state = {k: v if k.endswith("periods") else v.bfloat16() for k, v in fp32.items()}
    save_file(state, tmp_path / "bf16.safetensors")
    for dtype, expected in ((None, torch.float32), ("keep", torch.bfloat16)):
        dst = tmp_path / f"{dtype}.pth"
        to_meta_train(tmp_path / "bf16.safetensors", dst, "meta_mlp", tmp_path, dtype=dtype)
        out = read_pth(dst)
        assert {v.dtype for k, v in out.items() if not k.endswith("periods")} == {expected}, dtype
        assert out["backbone.rope_embed.periods"].dtype == torch.float32


@pytest.mark.parametrize(
    ("heads", "expected"),
    [
        ({"dino_head.last_layer.weight": (96, 16)}, "carries dino_head but no ibot_head"),
        ({"ibot_head.last_layer.weight": (96, 16)}, "carries ibot_head but no dino_head"),
        ({"dino_head.mlp.0.weight": (48, 64), "ibot_head.mlp.0.weight": (40, 64)}, "dino_head is not a DINOHead"),
        ({"dino_head.last_layer.weight": (9, 4), "ibot_head.last_layer.weight": (9, 4)}, "dino_head is not a DINOHead"),
        ("no_bias", "dino_head differs from Meta's DINOHead of in_dim 64 at mlp.2.bias"),
        ("in_dim", "dino_head differs from Meta's DINOHead of in_dim 64 at mlp.0.weight"),
    ],
)
def test_carried_heads_that_are_not_metas_are_refused(heads, expected, tmp_path):
    name = "meta_mlp"
    to_meta_train(meta_source(name, tmp_path), tmp_path / "a.pth", name, tmp_path)
    state = read_pth(tmp_path / "a.pth")
    if heads == "no_bias":
        del state["dino_head.mlp.2.bias"]
    elif heads == "in_dim":
        state["dino_head.mlp.0.weight"] = torch.zeros(48, 32)
    else:
        state = {k: v for k, v in state.items() if k.startswith("backbone.")}
        state.update({k: torch.zeros(shape) for k, shape in heads.items()})
    torch.save({"teacher": state}, tmp_path / "b.pth")
    with pytest.raises(CheckpointError, match=expected):
        to_meta_train(tmp_path / "b.pth", tmp_path / "c.pth", name, tmp_path, meta_config=None)
    assert not (tmp_path / "c.pth").exists()


def test_a_config_without_a_separate_ibot_head_is_refused(tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("ibot:\n  separate_head: false\n")
    with pytest.raises(CheckpointError, match=r"ibot\.separate_head: False; Meta's trainer requires true"):
        heads_from_config(path)


def test_a_qkv_bias_without_metas_mask_is_written_without_one(tmp_path):
    """Meta builds the bias_mask buffer only with student.mask_k_bias: the printed line must follow the keys."""
    model = move_off_init_(timm.create_model(VARIANT["mlp"], mask_k_bias=False, num_classes=0, **SHAPE))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "unmasked.safetensors")
    name = "meta_mlp"
    args = cli_args(name, tmp_path / "unmasked.safetensors", tmp_path / "out.pth", tmp_path, "--model-kwargs")
    code, out, err = run([*args, "mask_k_bias=False"])
    assert code == 0, err
    assert yaml.safe_load(out[out.index("dino:") :])["student"]["mask_k_bias"] is False
    written_keys = read_pth(tmp_path / "out.pth")
    assert "backbone.blocks.0.attn.qkv.bias" in written_keys
    assert not any(k.endswith("bias_mask") for k in written_keys)


def test_carried_heads_keep_their_own_dtype_with_keep(tmp_path):
    name = "meta_mlp"
    to_meta_train(meta_source(name, tmp_path), tmp_path / "a.pth", name, tmp_path)
    state = {k: v.bfloat16() if k.startswith("dino_head.") else v for k, v in read_pth(tmp_path / "a.pth").items()}
    torch.save({"teacher": state}, tmp_path / "mixed.pth")
    to_meta_train(tmp_path / "mixed.pth", tmp_path / "b.pth", name, tmp_path, meta_config=None, dtype="keep")
    out = read_pth(tmp_path / "b.pth")
    assert all(out[k].dtype == v.dtype and torch.equal(out[k], v) for k, v in state.items())


def test_the_dcp_writer_refuses_a_tensor_unlike_its_plan(tmp_path):
    class Liar(dict):
        def info(self, key: str) -> TensorInfo:
            return TensorInfo(torch.Size([3]), torch.float32)

    with pytest.raises(RuntimeError, match=r"w: planned \[3\] torch.float32, made \[4\] torch.float32"):
        write_dcp(tmp_path / "out", Liar(w=torch.zeros(4)), "model")


def test_a_source_failing_mid_write_raises_its_own_error(tmp_path):
    class Broken(dict):
        def info(self, key: str) -> TensorInfo:
            return TensorInfo(torch.Size([3]), torch.float32)

        def __getitem__(self, key: str) -> torch.Tensor:
            raise CheckpointError("src.pth is truncated; download it again")

    with pytest.raises(CheckpointError, match=r"src\.pth is truncated"):
        write_dcp(tmp_path / "out", Broken(w=None), "model")
