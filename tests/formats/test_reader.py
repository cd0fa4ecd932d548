"""The lazy reader: every source it reads, which weights set each gives, and that it reads one key at a time."""

import argparse
import shutil

import pytest
import timm
import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file
from support import mapped_ranges
from support.dcp import ITERATION, meta_arch, meta_training_state, prefixed, stored_items, tiny_backbone
from timm.models import save_for_hf
from transformers import DINOv3ViTConfig, DINOv3ViTModel

from timm_layerscale.checkpoints import CheckpointError, TensorInfo
from timm_layerscale.checkpoints.read.dcp.reader import read_metadata, tensor_reader
from timm_layerscale.checkpoints.read.reader import open_checkpoint
from timm_layerscale.checkpoints.read.weights_sets import TRAINING_STATE


def backbone(value: float) -> dict[str, torch.Tensor]:
    return {"cls_token": torch.full((1, 1, 8), value), "blocks.0.ls1.gamma": torch.full((8,), value)}


def equal(a: dict[str, torch.Tensor], b) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize(
    ("weights", "taken", "value"),
    [("auto", "state_dict_ema", 2.0), ("ema", "state_dict_ema", 2.0), ("raw", "state_dict", 1.0)],
)
def test_timm_training_checkpoint_sets(tmp_path, weights, taken, value):
    path = tmp_path / "last.pth.tar"
    optimizer = {"state": {0: {"exp_avg": torch.zeros(8)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    args = argparse.Namespace(model="vit_ls_small_patch16_dinov3", lr=0.1)
    checkpoint = {"epoch": 3, "args": args, "optimizer": optimizer}
    torch.save({**checkpoint, "state_dict": backbone(1.0), "state_dict_ema": backbone(2.0)}, path)
    with open_checkpoint(path, weights) as ckpt:
        assert (ckpt.kind, ckpt.weights) == ("torch file", taken)
        assert sorted(ckpt) == ["blocks.0.ls1.gamma", "cls_token"]
        assert ckpt.info("cls_token").shape == (1, 1, 8)
        assert torch.equal(ckpt["blocks.0.ls1.gamma"], torch.full((8,), value))


@pytest.mark.parametrize(("weights", "taken", "value"), [("auto", "model_ema", 3.0), ("raw", "student", 1.0)])
def test_meta_training_sets_flat_in_safetensors(tmp_path, weights, taken, value):
    heads = {"dino_head.mlp.0.weight": torch.zeros(4, 8)}
    flat = {
        **prefixed("student.backbone.", {**backbone(1.0), **heads}),
        **prefixed("teacher.backbone.", backbone(2.0)),
        **prefixed("model_ema.backbone.", backbone(3.0)),
        "dino_loss.center": torch.zeros(1, 4),
    }
    save_file(flat, tmp_path / "ckpt.safetensors")
    with open_checkpoint(tmp_path / "ckpt.safetensors", weights) as ckpt:
        assert (ckpt.kind, ckpt.weights) == ("safetensors file", taken)
        assert sorted(ckpt) == ["blocks.0.ls1.gamma", "cls_token"]
        assert torch.equal(ckpt["cls_token"], torch.full((1, 1, 8), value))


def test_plain_state_dict_keeps_keys_that_look_like_set_names(tmp_path):
    """transformers files put blocks under `model.layer.`: that is not a `model` weights set."""
    sd = {"embeddings.cls_token": torch.zeros(1, 1, 8), "model.layer.0.norm1.weight": torch.ones(8)}
    save_file(sd, tmp_path / "hf.safetensors")
    with open_checkpoint(tmp_path / "hf.safetensors") as ckpt:
        assert ckpt.weights == "the only weights set"
        assert sorted(ckpt) == sorted(sd)


@pytest.mark.parametrize("wrappers", ["module._orig_mod.", "_orig_mod.module.backbone."])
def test_ddp_and_compile_prefixes_are_stripped(wrappers):
    ckpt = open_checkpoint(prefixed(wrappers, backbone(1.0)))
    assert sorted(ckpt) == ["blocks.0.ls1.gamma", "cls_token"]


def test_nothing_to_read_in_memory():
    with pytest.raises(CheckpointError, match=r"^the checkpoint holds no tensors \(got dict\); pass a weights"):
        open_checkpoint({})


def test_a_set_that_holds_sets_is_looked_into():
    """`{"model": {"teacher.backbone.*", "student.backbone.*"}}`: the choice is among the inner sets."""
    tree = {"model": {**prefixed("teacher.backbone.", backbone(2.0)), **prefixed("student.", backbone(1.0))}}
    assert open_checkpoint({**tree, "iteration": 7}).weights == "teacher"
    assert open_checkpoint(tree, "ema").weights == "teacher"
    assert torch.equal(open_checkpoint(tree, "raw")["cls_token"], torch.full((1, 1, 8), 1.0))
    only_teacher = {"model": {**prefixed("teacher.backbone.", backbone(2.0)), "dino_loss.center": torch.zeros(2)}}
    assert open_checkpoint(only_teacher).weights == "teacher"
    with pytest.raises(CheckpointError, match="holds only EMA or teacher weights; pass --weights ema"):
        open_checkpoint(only_teacher, "raw")


@pytest.mark.parametrize("name", TRAINING_STATE)
def test_training_state_beside_a_set_is_not_weights(name):
    """Optimizer moments and the like sit beside the weights sets; they never make the file a plain set."""
    ckpt = open_checkpoint({name: {"state.0.exp_avg": torch.zeros(8)}, "state_dict": backbone(1.0)})
    assert (ckpt.weights, sorted(ckpt)) == ("state_dict", ["blocks.0.ls1.gamma", "cls_token"])


def test_a_wrapper_is_stripped_when_it_holds_at_least_half_the_keys():
    half = {**prefixed("backbone.", backbone(1.0)), "neck.a": torch.zeros(1), "neck.b": torch.zeros(1)}
    assert sorted(open_checkpoint(half)) == ["blocks.0.ls1.gamma", "cls_token"]
    less = {**half, "neck.c": torch.zeros(1), "neck.d": torch.zeros(1)}  # a detector: the backbone is one part
    assert sorted(open_checkpoint(less)) == sorted(less)


def test_ema_requested_but_absent_is_an_error(tmp_path):
    save_file(backbone(1.0), tmp_path / "plain.safetensors")
    with pytest.raises(CheckpointError, match="holds no EMA or teacher weights; pass --weights raw"):
        open_checkpoint(tmp_path / "plain.safetensors", "ema")
    torch.save({"model": backbone(1.0), "epoch": 2}, tmp_path / "model.pth")
    with pytest.raises(CheckpointError, match="holds no EMA or teacher weights; pass --weights raw"):
        open_checkpoint(tmp_path / "model.pth", "ema")
    with pytest.raises(CheckpointError, match="weights must be one of auto, ema, raw; got 'best'"):
        open_checkpoint(tmp_path / "model.pth", "best")


# Files torch and the Hub write.


def test_legacy_torch_file_is_read_without_mmap(tmp_path):
    sd = tiny_backbone()
    torch.save({"model": sd}, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    with open_checkpoint(tmp_path / "old.pth") as ckpt:
        assert (ckpt.kind, ckpt.weights) == ("legacy torch file", "model")
        assert equal(sd, ckpt)


def test_meta_eval_teacher_checkpoint(tmp_path):
    """`eval/<iteration>/teacher_checkpoint.pth` holds `{"teacher": EMA backbone and heads}`; its folder reads too."""
    sd = tiny_backbone()
    eval_dir = tmp_path / "eval" / f"training_{ITERATION}"
    eval_dir.mkdir(parents=True)
    torch.save({"teacher": meta_arch(sd)}, eval_dir / "teacher_checkpoint.pth")
    for source in (eval_dir / "teacher_checkpoint.pth", eval_dir):
        with open_checkpoint(source, "ema") as ckpt:
            assert (ckpt.kind, ckpt.weights, ckpt.files) == (
                "torch file",
                "teacher",
                (eval_dir / "teacher_checkpoint.pth",),
            )
            assert equal(sd, ckpt)
    with pytest.raises(CheckpointError, match="holds only EMA or teacher weights"):
        open_checkpoint(eval_dir, "raw")


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_sharded_checkpoint_as_index_or_folder(tmp_path, safe):
    sd = tiny_backbone()
    save_torch_state_dict(sd, tmp_path, max_shard_size=40_000, safe_serialization=safe)
    index = tmp_path / ("model.safetensors.index.json" if safe else "pytorch_model.bin.index.json")
    shards = sorted(tmp_path.glob("model-*.safetensors" if safe else "pytorch_model-*.bin"))
    assert len(shards) > 2
    for source in (index, tmp_path):
        with open_checkpoint(source) as ckpt:
            assert ckpt.kind == ("sharded safetensors" if safe else "sharded torch files")
            assert ckpt.files == (index, *shards)
            assert equal(sd, ckpt)


def test_a_folder_with_one_index_of_any_name(tmp_path):
    sd = tiny_backbone()
    save_torch_state_dict(sd, tmp_path, max_shard_size=40_000)
    (tmp_path / "model.safetensors.index.json").rename(tmp_path / "weights.safetensors.index.json")
    with open_checkpoint(tmp_path) as ckpt:
        assert (ckpt.kind, ckpt.files[0]) == ("sharded safetensors", tmp_path / "weights.safetensors.index.json")
        assert equal(sd, ckpt)
    shutil.copy(tmp_path / "weights.safetensors.index.json", tmp_path / "ema.safetensors.index.json")
    with pytest.raises(CheckpointError, match=r"holds 2 sharded indexes \(ema\.safetensors\.index\.json, weights\."):
        open_checkpoint(tmp_path)


def test_transformers_hub_folder(tmp_path):
    config = DINOv3ViTConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256, num_register_tokens=4
    )
    model = DINOv3ViTModel(config)
    model.save_pretrained(tmp_path)
    with open_checkpoint(tmp_path) as ckpt:
        assert (ckpt.kind, ckpt.weights, ckpt.files) == (
            "Hub folder",
            "the only weights set",
            (tmp_path / "model.safetensors", tmp_path / "config.json"),
        )
        assert ckpt.hub_config["model_type"] == "dinov3_vit" and ckpt.hub_config["hidden_size"] == 64
        # transformers 5 saves its `model.layer.N` blocks as `layer.N`, the Hub files' spelling
        assert equal({k.removeprefix("model."): v for k, v in model.state_dict().items()}, ckpt)


def test_timm_hub_folder_and_bin(tmp_path):
    model = timm.create_model("vit_small_patch16_dinov3", embed_dim=64, num_heads=4, depth=2)
    save_for_hf(model, tmp_path / "safetensors", safe_serialization=True)
    save_for_hf(model, tmp_path / "bin", safe_serialization=False)
    for folder, weights in (("safetensors", "model.safetensors"), ("bin", "pytorch_model.bin")):
        with open_checkpoint(tmp_path / folder) as ckpt:
            assert (ckpt.kind, ckpt.files) == (
                "Hub folder",
                (tmp_path / folder / weights, tmp_path / folder / "config.json"),
            )
            assert ckpt.hub_config["architecture"] == "vit_small_patch16_dinov3"
            assert equal(model.state_dict(), ckpt)


# torch.distributed.checkpoint folders as Meta's DINOv3 training writes them.


@pytest.mark.parametrize(
    ("weights", "taken", "values"),
    [("auto", "model_ema", "teacher"), ("ema", "model_ema", "teacher"), ("raw", "student", "student")],
)
def test_meta_dcp_training_checkpoint(meta_run, weights, taken, values):
    assert sorted(p.name for p in meta_run["ckpt"].iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    with open_checkpoint(meta_run["ckpt"], weights) as ckpt:
        files = tuple(meta_run["ckpt"] / name for name in (".metadata", "__0_0.distcp", "__1_0.distcp"))
        assert (ckpt.kind, ckpt.weights, ckpt.files) == ("distributed checkpoint", taken, files)
        expected = meta_run[values]
        assert all(ckpt.info(k) == TensorInfo(v.shape, v.dtype) for k, v in expected.items())
        assert ckpt.nbytes == sum(v.nbytes for v in expected.values())
        assert equal(expected, ckpt)  # every tensor assembled from both ranks' chunks


def test_meta_dcp_eval_teacher(meta_run):
    """`eval/<iteration>/sharded_teacher_checkpoint/` holds the EMA teacher under `model.`; so does its folder."""
    for source in (meta_run["sharded"], meta_run["sharded"].parent):
        with open_checkpoint(source, "ema") as ckpt:
            assert (ckpt.kind, ckpt.weights) == ("distributed checkpoint", "teacher")
            assert equal(meta_run["teacher"], ckpt)
    with pytest.raises(CheckpointError, match="holds only EMA or teacher weights"):
        open_checkpoint(meta_run["sharded"], "raw")


def test_meta_run_folders_name_what_to_pass(meta_run):
    with pytest.raises(CheckpointError, match=f"pass one of them, e.g. {meta_run['ckpt']}$"):
        open_checkpoint(meta_run["ckpt"].parent)
    with pytest.raises(CheckpointError, match=r"for a DINOv3 training run pass .*/ckpt/<iteration> or"):
        open_checkpoint(meta_run["root"])


def test_distillation_takes_the_students_ema(tmp_path):
    """With distillation `teacher` is the big model distilled from: auto takes `model_ema`, the student's EMA."""
    student, teacher, ema = tiny_backbone(1), tiny_backbone(2), tiny_backbone(3)
    dcp.save(meta_training_state(student, teacher, ema), checkpoint_id=tmp_path, no_dist=True)
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.weights == "model_ema"
        assert equal(ema, ckpt)


def test_a_set_inside_a_set_is_named_by_its_path():
    """An EMA whose wrapper keeps its model under `model.`: raw is the outer model, not the EMA's inner one."""
    raw, ema = tiny_backbone(1), tiny_backbone(2)
    state = {"model_ema": {"model": ema}, "model": raw, "optimizer": {"step": torch.tensor(3)}}
    for weights, taken, values in [("auto", "model_ema.model", ema), ("raw", "model", raw)]:
        with open_checkpoint(state, weights) as ckpt:
            assert ckpt.weights == taken
            assert equal(values, ckpt)


def test_dcp_of_a_plain_model_is_its_only_set(tmp_path):
    """A DCP folder saved from `{"model": model.state_dict()}`, as Meta's checkpointer does for a plain model."""
    sd = tiny_backbone()
    dcp.save({"iteration": 3, "model": sd}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    with open_checkpoint(tmp_path / "ckpt", "raw") as ckpt:
        assert ckpt.weights == "model"
        assert equal(sd, ckpt)


def test_dcp_reads_only_the_requested_key(meta_run, tmp_path):
    """Every stored item but one key's chunks is overwritten: that key still reads, all listing works, others fail."""
    folder = shutil.copytree(meta_run["ckpt"], tmp_path / "ckpt")
    wanted = "model.model_ema.backbone.blocks.1.ls2.gamma"
    for fqn, name, offset, length in stored_items(read_metadata(folder)):
        if fqn != wanted:
            with (folder / name).open("r+b") as f:
                f.seek(offset)
                f.write(b"\0" * length)
    with open_checkpoint(folder) as ckpt:
        assert ckpt.nbytes == sum(v.nbytes for v in meta_run["teacher"].values())
        assert torch.equal(ckpt["blocks.1.ls2.gamma"], meta_run["teacher"]["blocks.1.ls2.gamma"])
        with pytest.raises(
            CheckpointError,
            match=r"ckpt is a truncated or corrupt distributed checkpoint: its tensor model\.model_ema\.backbone\."
            r"cls_token failed \(Unsupported operand 0\); copy the whole folder again$",
        ):
            ckpt["cls_token"]


class Walked(dict):
    """A dict that counts how often all its keys are gone through."""

    walks = 0

    def keys(self):
        Walked.walks += 1
        return super().keys()

    def __iter__(self):
        Walked.walks += 1
        return super().__iter__()

    def items(self):
        Walked.walks += 1
        return super().items()


def test_a_dcp_read_plans_its_own_key_only(meta_run):
    """Reading one tensor never goes through every key of the checkpoint (which made reading all N take N^2)."""
    metadata = read_metadata(meta_run["ckpt"])
    metadata.state_dict_metadata = Walked(metadata.state_dict_metadata)
    read = tensor_reader(meta_run["ckpt"], metadata)  # lists the tensors once
    Walked.walks = 0
    for key in ("model.teacher.backbone.cls_token", "model.model_ema.backbone.blocks.1.ls2.gamma"):
        read(key)
    assert Walked.walks == 0


def test_a_dcp_folder_without_a_data_file_its_metadata_lists(meta_run, tmp_path):
    folder = shutil.copytree(meta_run["ckpt"], tmp_path / "ckpt")
    (folder / "__1_0.distcp").rename(folder / "elsewhere")
    with pytest.raises(
        CheckpointError, match=r"lacks __1_0\.distcp, which its \.metadata lists; copy the whole folder"
    ):
        open_checkpoint(folder)


# Lazy reads: tensors are views of the mapped file, not copies.


def test_torch_files_are_memory_mapped(tmp_path):
    torch.save(backbone(1.0), tmp_path / "plain.pth")
    with open_checkpoint(tmp_path / "plain.pth") as ckpt:
        address = ckpt["cls_token"].data_ptr()
        assert any(address in r for r in mapped_ranges(tmp_path / "plain.pth"))  # a view of the file's pages


def test_safetensors_reads_are_views_of_the_mapped_file(tmp_path):
    sd = tiny_backbone()
    save_file(sd, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path / "model.safetensors") as ckpt:
        tensor = ckpt["blocks.1.mlp.fc1.weight"]
        assert torch.equal(tensor, sd["blocks.1.mlp.fc1.weight"])
        assert any(tensor.data_ptr() in r for r in mapped_ranges(tmp_path / "model.safetensors"))


def test_safetensors_files_too_large_to_map_are_read_tensor_by_tensor(tmp_path):
    """The fallback for a file the kernel will not map whole (a 27 GB 7B on a 24 GB machine) reads the same."""
    from timm_layerscale.checkpoints.read.reader import _flat_safetensors_read

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.tensor([True, False]),
        "e": torch.randn(2, 2).half(),
        "f": torch.tensor(2.5),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    flat = _flat_safetensors_read(tmp_path / "w.safetensors")
    assert set(flat.infos) == set(tensors)
    for key, value in tensors.items():
        assert flat.infos[key] == TensorInfo(value.shape, value.dtype)
        assert torch.equal(flat.read(key), value), key
    flat.close()
    flat.close()
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-4])
    with pytest.raises(
        CheckpointError, match=r"cut.safetensors is a truncated or corrupt safetensors file \(\w+ is cut"
    ):
        _flat_safetensors_read(tmp_path / "cut.safetensors")
    (tmp_path / "bad.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match=r"truncated or corrupt safetensors file \(header length"):
        _flat_safetensors_read(tmp_path / "bad.safetensors")
