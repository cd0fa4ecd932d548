"""`--to meta` and `--to meta-train` files that Meta's own builders load with `strict=True`.

timm's plain `vit_*_patch16_dinov3` files leave out Meta's all-zero qkv biases (eva's plain architectures
have none). Converted back to Meta's layout, they get the zero biases and Meta's `bias_mask` again, so every
key and shape is what Meta's builder for that shape and tag holds (tests/fixtures/meta_builders.json, made
with Meta's code), for all seven shipped shapes on the meta device; and at small widths built by the same
rules (tests/fixtures/meta_rule_*, Meta's tiny models with released-style zero biases and masks) the
converted file gives Meta's recorded outputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support import FIXTURES, META_CONFIGS, VARIANT, assert_fp32_close

from timm_layerscale import VARIANTS, VisionTransformerLS, convert_checkpoint
from timm_layerscale.checkpoints import LazyCheckpoint, TensorInfo, open_checkpoint
from timm_layerscale.checkpoints.formats.hf import HF
from timm_layerscale.checkpoints.formats.meta_train import META_ARCHS, META_SWIGLU
from timm_layerscale.checkpoints.formats.timm import TIMM
from timm_layerscale.convert import prepare_conversion
from timm_layerscale.identity import expected_state

BUILDERS = json.loads((FIXTURES / "meta_builders.json").read_text())["builders"]
RULES = json.loads((FIXTURES / "meta_rules.json").read_text())["rules"]
# Every shipped shape with each tag its Meta builder stands for (L+ has no public weights: its bare name).
CASES = [
    (builder, f"{entry['our_variant']}.{tag}" if tag else entry["our_variant"])
    for builder, entry in BUILDERS.items()
    for tag in entry["our_tags"] or [None]
]
SMALL_ENOUGH_TO_MAKE = 1 << 16  # elements: gammas and biases are made for the checks that read them


def timm_plain_file(name: str, layout=TIMM, **options) -> LazyCheckpoint:
    """What timm's plain eva file of a variant holds (or another format's, `layout`), by key, shape and dtype, on
    the meta device: no qkv biases, no mask token, periods or local-cls norm. Only the small tensors a
    conversion reads are made."""
    variant, _, tag = name.partition(".")
    args = {**VARIANTS[variant].model_args, **VARIANTS[variant].tag_model_args(tag or None), "num_classes": 0}
    state = expected_state(VARIANTS[variant].config.replace(**args))
    options = {**(options or {"qkv_bias": False}), "dim": VARIANTS[variant].config.embed_dim}
    eva, _ = layout.table.from_native(state, **options)
    infos = {k: eva.info(k) for k in eva}

    def read(key: str) -> torch.Tensor:
        info = infos[key]
        if info.shape.numel() <= SMALL_ENOUGH_TO_MAKE:
            return torch.full(info.shape, 0.5, dtype=info.dtype)
        return torch.empty(info.shape, dtype=info.dtype, device="meta")

    return LazyCheckpoint(Path(f"{name}.safetensors"), "state dict", "the only weights set", infos, read)


def meta_keys(builder: str) -> dict[str, TensorInfo]:
    return {
        key: TensorInfo(torch.Size(v["shape"]), getattr(torch, v["dtype"]))
        for key, v in BUILDERS[builder]["state_dict"].items()
    }


@pytest.mark.parametrize(("builder", "name"), CASES, ids=[name for _, name in CASES])
def test_a_timm_plain_file_to_meta_has_every_key_of_metas_builder(builder, name):
    planned = prepare_conversion(timm_plain_file(name), "out.pth", to="meta", model=name, dtype="fp32")
    written = planned.prepared_write.tensors.infos
    expected = meta_keys(builder)
    assert sorted(written) == sorted(expected), set(written) ^ set(expected)
    assert all(written[k] == expected[k] for k in expected), [k for k in expected if written[k] != expected[k]]
    assert "zero qkv biases" in " ".join(planned.fitted.filled) or not planned.identity.config.qkv_bias


@pytest.mark.parametrize("name", ["vit_ls_large_patch16_dinov3.sat493m", "vit_ls_7b_patch16_dinov3.sat493m"])
def test_a_transformers_file_to_meta_takes_the_local_crop_norm_from_the_tag(name):
    """DINOv3ViTModel has no local-crop norm: Meta's SAT builders' local_cls_norm comes from the tag (from norm)."""
    builder = next(
        b
        for b, entry in BUILDERS.items()
        if name.partition(".")[0] == entry["our_variant"] and name.partition(".")[2] in entry["our_tags"]
    )
    source = timm_plain_file(name, HF, k_bias=False)
    assert not any("local_cls_norm" in key for key in source)
    planned = prepare_conversion(source, "out.pth", to="meta", model=name, dtype="fp32")
    assert set(planned.prepared_write.tensors.infos) == set(meta_keys(builder))
    assert "local_cls_norm from norm" in planned.fitted.filled


@pytest.mark.parametrize(("builder", "name"), CASES[:1] + CASES[-1:], ids=["small", "7b-sat"])
def test_a_timm_plain_file_to_meta_train_has_metas_backbone_keys(builder, name):
    planned = prepare_conversion(timm_plain_file(name), "train.pth", to="meta-train", model=name)
    backbone = {
        k.removeprefix("backbone."): v.shape for k, v in planned.prepared_write.tensors.infos.items() if "head" not in k
    }
    assert backbone == {k: v.shape for k, v in meta_keys(builder).items()}
    student = planned.prepared_write.text
    assert f"arch: {RULE_ARCH[name.partition('.')[0]]}" in student


RULE_ARCH = {"vit_ls_small_patch16_dinov3": "vit_small", "vit_ls_7b_patch16_dinov3": "vit_7b"}


def rule_model_kwargs(rule: str) -> tuple[str, dict]:
    """Our variant and tag for a rule, and the model args of Meta's tiny model."""
    kwargs = RULES[rule]["kwargs"]
    builder = RULES[rule]["made_like"]
    entry = BUILDERS[builder]
    name = entry["our_variant"] + (f".{entry['our_tags'][0]}" if entry["our_tags"] else "")
    ours = {k: kwargs[k] for k in ("embed_dim", "depth", "num_heads")}
    if kwargs["ffn_layer"].startswith("swiglu"):
        ours.update(ffn_layer="swiglu", swiglu_align_to=int(kwargs["ffn_layer"].removeprefix("swiglu") or 8))
    return name, {**ours, "rope_periods_bf16": True}  # Meta's trained periods are bf16-rounded


@pytest.mark.parametrize("rule", sorted(RULES))
@torch.no_grad()
def test_metas_tiny_models_through_timm_and_back_give_metas_outputs(rule, tmp_path):
    """Meta's file (zero qkv biases and masks) -> timm's plain eva -> Meta's layout: Meta's keys, zero biases
    with Meta's mask, and Meta's recorded outputs from the file written."""
    original = load_file(FIXTURES / f"meta_rule_{rule}.safetensors")
    outputs = load_file(FIXTURES / f"meta_rule_{rule}_outputs.safetensors")
    name, kwargs = rule_model_kwargs(rule)
    convert_checkpoint(
        FIXTURES / f"meta_rule_{rule}.safetensors", tmp_path / "eva", "timm", model=name, model_kwargs=kwargs
    )
    assert not any(k.endswith(("q_bias", "v_bias")) for k in load_file(tmp_path / "eva" / "model.safetensors"))
    convert_checkpoint(tmp_path / "eva", tmp_path / "meta.safetensors", "meta", model=name, model_kwargs=kwargs)
    written = load_file(tmp_path / "meta.safetensors")
    assert sorted(written) == sorted(original)  # what Meta's strict load_state_dict asks for
    assert all(written[k].shape == original[k].shape for k in original)
    for key in (k for k in written if k.endswith("attn.qkv.bias")):
        assert not written[key].any()
        third = written[key].numel() // 3
        assert written[key + "_mask"].tolist() == [1.0] * third + [0.0] * third + [1.0] * third
    args = {**VARIANTS[name.partition(".")[0]].model_args, **kwargs, "num_classes": 0}
    model = VisionTransformerLS(**{**args, "local_cls_norm": "local_cls_norm.weight" in written}).eval()
    model.load_state_dict(written)
    x = outputs["input"]
    tokens = model.forward_features(x)
    assert_fp32_close(model(x), outputs["forward"], what="forward")
    assert_fp32_close(tokens[:, 0], outputs["x_norm_clstoken"], what="cls")
    assert_fp32_close(tokens[:, 1:5], outputs["x_storage_tokens"], what="storage")
    assert_fp32_close(tokens[:, 5:], outputs["x_norm_patchtokens"], what="patches")


def test_a_meta_file_without_qkv_bias_keeps_none():
    """Meta writes the bias of every model built with one: a Meta file without it is a model without, as the
    7B is, and stays so (its builder would refuse biases it has no place for)."""
    planned = prepare_conversion(
        LazyCheckpoint(Path("m.safetensors"), "state dict", "all", *_meta_infos("swiglu64")),
        "o.pth",
        to="meta",
        model_kwargs=dict(embed_dim=64, depth=2, num_heads=4, ffn_layer="swiglu", swiglu_align_to=64),
    )
    assert not any(k.endswith("qkv.bias") for k in planned.prepared_write.tensors.infos)


def _meta_infos(rule: str):
    state = load_file(FIXTURES / f"meta_rule_{rule}.safetensors")
    return {k: TensorInfo(v.shape, v.dtype) for k, v in state.items()}, state.__getitem__


STUDENT = json.loads((FIXTURES / "meta_train_student.json").read_text())


def test_the_arch_table_is_metas():
    archs = {
        name: tuple(arch[k] for k in ("embed_dim", "depth", "num_heads", "ffn_ratio"))
        for name, arch in STUDENT["archs"].items()
    }
    assert set(archs) == set(META_ARCHS)
    assert all(math.isclose(a, b, rel_tol=1e-6) for name in archs for a, b in zip(archs[name], META_ARCHS[name]))
    assert set(META_SWIGLU.values()) | {"mlp"} == set(STUDENT["ffn_layer_values"])


def student(name: str) -> dict[str, str]:
    """The `student:` block printed for a timm plain file of a shipped variant, as a mapping."""
    planned = prepare_conversion(timm_plain_file(name), "train.pth", to="meta-train", model=name)
    block = planned.prepared_write.text.split("student:", 1)[1].split("\ngram:")[0]
    assert yaml.safe_load("student:" + block)  # Meta's config loader reads it
    pairs = [line.strip().split(": ", 1) for line in block.splitlines()[1:] if not line.strip().startswith("#")]
    return {key: value.split("  #")[0] for key, value in pairs} | {"#": block}


@pytest.mark.parametrize(
    ("name", "arch", "ffn_layer", "local"),
    [
        ("vit_ls_small_patch16_dinov3.lvd1689m", "vit_small", "mlp", "false"),
        ("vit_ls_base_patch16_dinov3.lvd1689m", "vit_base", "mlp", "false"),
        ("vit_ls_large_patch16_dinov3.sat493m", "vit_large", "mlp", "true"),
        ("vit_ls_7b_patch16_dinov3.lvd1689m", "vit_7b", "swiglu64", "true"),
    ],
)
def test_the_student_block_names_metas_arch_and_every_key_the_trainer_reads(name, arch, ffn_layer, local):
    block = student(name)
    read = set(STUDENT["build_model"]["student_keys_read_in_order"])
    assert block["arch"] == arch and block["ffn_layer"] == ffn_layer
    assert block["untie_global_and_local_cls_norm"] == local and block["untie_cls_and_patch_norms"] == "false"
    assert (
        block["norm_layer"] == "layernormbf16" and block["n_storage_tokens"] == "4" and block["mask_k_bias"] == "true"
    )
    assert block["pos_embed_rope_base"] == "100.0" and block["pos_embed_rope_normalize_coords"] == "separate"
    assert "cannot express" not in block["#"]
    # What is not printed is left to the training recipe (drop path, fp8) or has no value here (Meta's
    # min/max periods, unset for every released model: the base sets the periods).
    unprinted = {"drop_path_rate", "fp8_enabled", "pos_embed_rope_min_period", "pos_embed_rope_max_period"}
    assert read - unprinted <= set(block)


@pytest.mark.parametrize("name", ["vit_ls_small_plus_patch16_dinov3.lvd1689m", "vit_ls_huge_plus_patch16_dinov3"])
def test_a_shape_no_arch_names_gets_the_nearest_and_one_line_saying_so(name):
    block = student(name)
    assert block["arch"] in META_ARCHS
    (line,) = [line for line in block["#"].splitlines() if "cannot express" in line]
    assert "MLP ratio 6" in line and f"the nearest, {block['arch']}" in line


# Meta's RoPE rescaling in pretraining: every released builder's, and every release training config's
# (`dinov3_*.yaml`; the test and linear-probe configs leave it unset).
RELEASE_TRAINING = {
    path: config["constructor_kwargs_student"]
    for path, config in STUDENT["train_configs"].items()
    if Path(path).name.startswith("dinov3_")
}
RESCALE = {entry["dinovisiontransformer_kwargs"]["pos_embed_rope_rescale_coords"] for entry in BUILDERS.values()}
RESCALE |= {kwargs["pos_embed_rope_rescale_coords"] for kwargs in RELEASE_TRAINING.values()}


@pytest.mark.parametrize(("builder", "name"), CASES)
def test_the_student_block_has_metas_rope_rescale_and_this_models_rope_dtype(builder, name):
    block = student(name)
    kwargs = BUILDERS[builder]["dinovisiontransformer_kwargs"]
    assert len(RELEASE_TRAINING) == 4 and RESCALE == {kwargs["pos_embed_rope_rescale_coords"]} == {2}
    assert float(block["pos_embed_rope_rescale_coords"]) == kwargs["pos_embed_rope_rescale_coords"]
    assert "sets no rope_rescale_coords" in block["#"]  # our variants train without it unless asked
    assert block["pos_embed_rope_dtype"] == kwargs["pos_embed_rope_dtype"] == "fp32"
    assert BUILDERS[builder]["derived"]["rope_periods_dtype"] == "float32"


def test_a_backbone_with_its_own_rescale_gets_it_and_no_note():
    name = "vit_ls_small_patch16_dinov3.lvd1689m"
    planned = prepare_conversion(
        timm_plain_file(name), "train.pth", to="meta-train", model=name, model_kwargs={"rope_rescale_coords": 1.5}
    )
    text = planned.prepared_write.text
    assert "  pos_embed_rope_rescale_coords: 1.5\n" in text and "sets no rope_rescale_coords" not in text


def test_a_meta_file_with_bf16_rounded_periods_still_says_rope_dtype_fp32():
    """Meta's own tiny model (built with pos_embed_rope_dtype fp32), whose periods read as bf16-rounded."""
    kwargs = {k: META_CONFIGS["meta_mlp"][k] for k in ("embed_dim", "depth", "num_heads", "ffn_ratio")}
    with open_checkpoint(FIXTURES / "meta_mlp.safetensors") as source:
        text = prepare_conversion(
            source, "t.pth", to="meta-train", model=VARIANT["mlp"], model_kwargs=kwargs
        ).prepared_write.text
    (line,) = [line for line in text.splitlines() if "pos_embed_rope_dtype" in line]
    assert line.startswith(f"  pos_embed_rope_dtype: {META_CONFIGS['meta_mlp']['pos_embed_rope_dtype']}  # ")


@pytest.mark.parametrize("periods_bf16", [True, False])
def test_the_models_rope_is_fp32_whatever_rope_periods_bf16_says(periods_bf16):
    """What `pos_embed_rope_dtype: fp32` claims: the rotation is computed in fp32, also in a bf16 model."""
    model = VisionTransformerLS(
        VARIANTS["vit_ls_small_patch16_dinov3"].config.replace(depth=1, rope_periods_bf16=periods_bf16)
    ).bfloat16()
    sin, cos = model.rope_embed(4, 4)
    assert sin.dtype == cos.dtype == model.rope_embed.periods.dtype == torch.float32
