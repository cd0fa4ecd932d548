"""Every format through every loading path, and the errors for what cannot load."""

import pickle

import pytest
import timm
import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file
from support import (
    FIXTURES,
    TINY,
    assert_fp32_close,
    build_from_meta_file,
    eva_reference,
    max_diff,
    move_off_init_,
    transformers_reference,
)
from timm.models import load_checkpoint, save_for_hf

from timm_layerscale import CheckpointError, convert_state_dict

NAME = "vit_ls_small_patch16_dinov3"


def source_model(**kwargs):
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(NAME, **{**TINY, **kwargs})).eval()


def from_file(path, name=NAME, **kwargs):
    return timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **{**TINY, **kwargs}
    ).eval()


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: {"model": sd},
        lambda sd: {"state_dict": {f"module.{k}": v for k, v in sd.items()}},
        lambda sd: {
            "teacher": {
                **{f"backbone.{k}": v for k, v in sd.items()},
                "dino_head.mlp.0.weight": torch.ones(2, 2),
            }
        },
        lambda sd: {
            "model": {f"teacher.backbone.{k}": v for k, v in sd.items()} | {"teacher.ibot_head.w": torch.ones(1)},
            "iteration": 7,
        },
    ],
    ids=["model", "state_dict+module", "teacher+backbone+head", "training-checkpoint"],
)
@torch.no_grad()
def test_wrapped_meta_checkpoints_load(wrap, tmp_path, images):
    source = source_model()
    torch.save(wrap(source.state_dict()), tmp_path / "ckpt.pth")
    assert max_diff(from_file(tmp_path / "ckpt.pth").forward_features(images), source.forward_features(images)) == 0


def layout_file(layout: str, root):
    """A checkpoint file in each layout the package reads, and what its source model computes."""
    if layout == "transformers":
        reference = transformers_reference("mlp")
        reference.save_pretrained(root)
        return root / "model.safetensors", lambda x: reference(pixel_values=x).last_hidden_state
    if layout == "timm-eva":
        reference = eva_reference("mlp")
        save_file(reference.state_dict(), root / "eva.safetensors")
        return root / "eva.safetensors", reference.forward_features
    reference = source_model(rope_periods_bf16=False)
    torch.save({"teacher": {f"backbone.{k}": v for k, v in reference.state_dict().items()}}, root / "meta.pth")
    return root / "meta.pth", reference.forward_features


KWARGS = dict(TINY, num_classes=5, rope_periods_bf16=False)


def validate_checkpoint(path):
    model = timm.create_model(NAME, **KWARGS)
    load_checkpoint(model, str(path), use_ema=False)
    return model


# What train.py and validate.py do with a file path, with a new head for `--num-classes 5`.
LOADERS = {
    "--pretrained --pretrained-path": lambda path: timm.create_model(
        NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=-1), **KWARGS
    ),
    "--initial-checkpoint": lambda path: timm.create_model(NAME, checkpoint_path=str(path), **KWARGS),
    "validate.py --checkpoint": validate_checkpoint,
}


@pytest.mark.parametrize("layout", ["meta", "transformers", "timm-eva"])
@torch.no_grad()
def test_every_loading_flag_reads_every_layout(layout, tmp_path, images):
    path, reference = layout_file(layout, tmp_path)
    expected = reference(images)
    for flag, load in LOADERS.items():
        model = load(path).eval()
        assert_fp32_close(model.forward_features(images), expected, what=flag)
        assert model(images).shape == (2, 5), flag


@pytest.mark.parametrize("folder", ["transformers", "timm"])
@torch.no_grad()
def test_hub_folders_load_as_pretrained_files(folder, tmp_path, images):
    """A Hub folder given as the pretrained file loads directly, like its weights file."""
    if folder == "transformers":
        reference = transformers_reference("mlp")
        reference.save_pretrained(tmp_path / "ckpt")
        expected = reference(pixel_values=images).last_hidden_state
    else:
        reference = source_model(rope_periods_bf16=False)
        save_for_hf(reference, tmp_path / "ckpt", safe_serialization=True)
        expected = reference.forward_features(images)
    model = from_file(tmp_path / "ckpt", rope_periods_bf16=False)
    assert_fp32_close(model.forward_features(images), expected)


@torch.no_grad()
def test_training_folders_and_indexes_load(tmp_path, images):
    """A DCP training folder and a sharded index load as they are; nothing needs converting first."""
    source = source_model()
    expected = source.forward_features(images)
    dcp.save(
        {"model": source.state_dict()}, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt" / "99"), no_dist=True
    )
    assert max_diff(from_file(tmp_path / "ckpt" / "99").forward_features(images), expected) == 0
    (tmp_path / "sharded").mkdir()
    save_torch_state_dict(source.state_dict(), tmp_path / "sharded", max_shard_size=20_000)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    for path in (tmp_path / "sharded", tmp_path / "sharded" / "model.safetensors.index.json"):
        assert max_diff(from_file(path).forward_features(images), expected) == 0
    with pytest.raises(CheckpointError, match="does not exist"):
        from_file(tmp_path / "nope.pth")


@torch.no_grad()
def test_a_folder_with_or_without_config_loads(tmp_path, images):
    source = source_model()
    save_file(source.state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"architecture": "vit_ls_small_patch16_dinov3"}')
    expected = source.forward_features(images)
    assert max_diff(from_file(tmp_path).forward_features(images), expected) == 0
    (tmp_path / "config.json").unlink()  # weights alone in a folder
    assert max_diff(from_file(tmp_path).forward_features(images), expected) == 0
    assert max_diff(from_file(tmp_path / "model.safetensors").forward_features(images), expected) == 0


@torch.no_grad()
def test_legacy_torch_file_loads(tmp_path, images):
    source = source_model()
    torch.save({"model": source.state_dict()}, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    assert max_diff(from_file(tmp_path / "old.pth").forward_features(images), source.forward_features(images)) == 0


@torch.no_grad()
def test_an_overlay_without_a_file_loads_as_timm_does(images):
    source = source_model()
    overlay = dict(state_dict=source.state_dict())  # timm's other pretrained source besides file=
    model = timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=overlay, **TINY).eval()
    assert max_diff(model.forward_features(images), source.forward_features(images)) == 0


def test_unrecognised_layout_names_what_it_saw(tmp_path):
    save_file({"conv1.weight": torch.zeros(2, 2), "fc.bias": torch.zeros(2)}, tmp_path / "resnet.safetensors")
    with pytest.raises(CheckpointError, match=r"unrecognised checkpoint format \(first keys: conv1.weight, fc.bias\)"):
        from_file(tmp_path / "resnet.safetensors")


def test_wrong_architecture_names_first_mismatch(tmp_path):
    save_file(source_model(embed_dim=128).state_dict(), tmp_path / "wide.safetensors")
    with pytest.raises(CheckpointError) as info:
        from_file(tmp_path / "wide.safetensors")
    message = str(info.value)
    assert (
        "the checkpoint (Meta DINOv3 keys) does not fit vit_ls_small_patch16_dinov3: cls_token is [1, 1, 128]"
        in message
    )
    assert "but [1, 1, 64] in the model" in message and "\n" not in message


def test_untied_norm_checkpoint_into_tied_model_is_refused(tmp_path):
    save_file(source_model(cls_norm=True).state_dict(), tmp_path / "untied.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"has cls_norm.bias \[64\] that vit_ls_small_patch16_dinov3 does not hold .*with cls_norm=True",
    ):
        from_file(tmp_path / "untied.safetensors")


@torch.no_grad()
def test_strict_loaders_get_the_models_own_head(tmp_path, images):
    source = source_model()
    torch.save(source.state_dict(), tmp_path / "backbone.pth")
    model = timm.create_model(NAME, num_classes=10, **TINY).eval()
    fresh_head = model.head.weight.clone()
    load_checkpoint(model, str(tmp_path / "backbone.pth"), strict=True)  # train.py --initial-checkpoint
    assert torch.equal(model.head.weight, fresh_head)
    assert max_diff(model.forward_features(images), source.forward_features(images)) == 0
    classifier = source_model(num_classes=1000)
    torch.save(classifier.state_dict(), tmp_path / "in1k.pth")
    load_checkpoint(model, str(tmp_path / "in1k.pth"), strict=True)  # wrongly shaped head
    assert torch.equal(model.head.weight, fresh_head)


@torch.no_grad()
def test_local_cls_norm_round_trips_and_fills(tmp_path, images, ls_log):
    sat = source_model(local_cls_norm=True)
    save_file(sat.state_dict(), tmp_path / "sat.safetensors")
    loaded = from_file(tmp_path / "sat.safetensors", local_cls_norm=True)
    assert all(torch.equal(v, sat.state_dict()[k]) for k, v in loaded.state_dict().items())
    lvd = from_file(tmp_path / "sat.safetensors")  # LVD-shaped model: the training-only norm is dropped, logged
    assert "dropped local_cls_norm" in ls_log.text
    assert max_diff(lvd.forward_features(images), sat.forward_features(images)) == 0
    save_file(lvd.state_dict(), tmp_path / "lvd.safetensors")
    filled = from_file(tmp_path / "lvd.safetensors", local_cls_norm=True)
    assert torch.equal(filled.local_cls_norm.weight, lvd.norm.weight)
    assert "local_cls_norm from norm" in ls_log.text


def test_sat_large_tag_loads_meta_layout_losslessly(tmp_path):
    """The .sat493m tag builds local_cls_norm, so a SAT-L file saves back identical (7B shapes on meta)."""
    meta_sd = load_file(FIXTURES / "meta_swiglu.safetensors")
    model = timm.create_model(
        "vit_ls_large_patch16_dinov3.sat493m",
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(FIXTURES / "meta_swiglu.safetensors")),
        embed_dim=64,
        num_heads=4,
        depth=3,
        ffn_layer="swiglu",
        ffn_ratio=6,
        qkv_bias=False,
        cls_norm=True,
    )
    assert set(model.state_dict()) == set(meta_sd)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in meta_sd.items())


def test_malicious_pickle_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"cls_token": Exploit()}, protocol=2))
    with pytest.raises(CheckpointError, match=r"refused to read .*evil.pth: it is a Python pickle.*nothing was run"):
        from_file(tmp_path / "evil.pth")
    refused = (pickle.UnpicklingError, RuntimeError)  # timm wraps the refusal in RuntimeError since 1.0.26
    with pytest.raises(refused, match=r"(?i)weights.only"):
        load_checkpoint(timm.create_model(NAME, **TINY), str(tmp_path / "evil.pth"))
    assert not marker.exists()


def test_conversion_is_idempotent_and_complete():
    model = timm.create_model(NAME, **TINY)
    native, report = convert_state_dict(source_model().state_dict(), model)
    again, _ = convert_state_dict(native, model)
    assert list(native) == list(model.state_dict()) == list(again)
    assert report[0] == "loaded a checkpoint with Meta DINOv3 keys"


def test_the_report_names_the_keys_as_users_do():
    """Not "a meta checkpoint" (the meta device? Meta's file?): the format as its users call it."""
    headless = timm.create_model(NAME, **TINY)
    sources = {
        "Meta DINOv3 keys": load_file(FIXTURES / "meta_mlp.safetensors"),
        "transformers DINOv3ViTModel or Sapiens2Model keys": transformers_reference("mlp").state_dict(),
        "timm eva keys": eva_reference("mlp").state_dict(),
    }
    for keys, state in sources.items():
        model = build_from_meta_file("meta_mlp") if keys == "Meta DINOv3 keys" else headless
        _, report = convert_state_dict(state, model)
        assert report[0] == f"loaded a checkpoint with {keys}", keys
    # A classifier head: a timm-layerscale model's own state dict (timm's train.py saves these).
    classifier = timm.create_model(NAME, num_classes=3, **TINY)
    _, report = convert_state_dict(classifier.state_dict(), classifier)
    assert report[0] == "loaded a checkpoint with timm-layerscale keys"


def test_fit_to_model_still_takes_and_gives_the_old_name_layout():
    """`format_title` was `layout`: the keyword and the attribute keep working."""
    from timm_layerscale.checkpoints import fit_to_model, open_checkpoint, recognise

    source = open_checkpoint(source_model().state_dict())
    native = recognise(source).table.to_native(source)
    model = timm.create_model(NAME, **TINY)
    fitted = fit_to_model(native, model.state_dict(), layout="Meta DINOv3 keys", model_name=NAME)
    assert fitted.format_title == fitted.layout == "Meta DINOv3 keys"
    with pytest.raises(TypeError, match="format_title"):  # one of the two names is still required
        fit_to_model(native, model.state_dict(), model_name=NAME)
