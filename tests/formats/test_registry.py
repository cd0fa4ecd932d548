"""The format registry: a format is one module's `Format` and one `register_format` call. A made-up one,
defined here, is written by `convert_checkpoint` and read back by recognition, with nothing else changed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from support import TINY, VARIANT, assert_fp32_close, move_off_init_

from timm_layerscale import FORMATS, CheckpointError, Format, convert_checkpoint, register_format
from timm_layerscale.checkpoints.formats import recognise
from timm_layerscale.checkpoints.formats.base import NATIVE_KEYS, Job, PreparedWrite, not_held_report
from timm_layerscale.checkpoints.mapping.keys import KeyTable, row
from timm_layerscale.checkpoints.write.writers import write_safetensors
from timm_ls.names import FILE, FormatSpec


def _flat(key: str) -> str:
    """`blocks.{i}.ls1.gamma` -> `trunk.{i}.scale_attn`; everything else under `trunk.`."""
    key = key.replace("blocks.{i}.ls1.gamma", "blocks.{i}.scale_attn").replace(
        "blocks.{i}.ls2.gamma", "blocks.{i}.scale_mlp"
    )
    return "trunk." + key.removeprefix("blocks.")


class Flat(Format):
    spec = FormatSpec(
        "flat", "a made-up format: everything under trunk., gammas as scale_attn/scale_mlp", FILE, (".flat",)
    )
    title = "made-up flat keys"
    table = KeyTable(
        tuple(
            row(key, _flat(key))
            for key in NATIVE_KEYS
            if not key.startswith(("mask_token", "rope_")) and key != "blocks.{i}.attn.qkv.bias_mask"
        )
    )

    def recognise(self, keys: Sequence[str]) -> bool:
        return any(key.startswith("trunk.") for key in keys)

    def prepare_write(self, job: Job) -> PreparedWrite:
        out, unheld = self.table.from_native(job.tensors)
        not_held, warnings = not_held_report(unheld, self.name)
        return PreparedWrite(out, lambda tmp, bar: write_safetensors(tmp, out, progress=bar), not_held, warnings)


@pytest.fixture
def flat():
    checkpoint_format = register_format(Flat())
    yield checkpoint_format
    del FORMATS[checkpoint_format.name]


def source(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model(VARIANT["mlp"], num_classes=0, **TINY)).eval()
    save_file(model.state_dict(), tmp_path / "ours.safetensors")
    return tmp_path / "ours.safetensors", model


@torch.no_grad()
def test_a_registered_format_converts_both_ways(flat, tmp_path):
    path, model = source(tmp_path)
    out = convert_checkpoint(path, tmp_path / "model.flat", to="flat", model=VARIANT["mlp"], model_kwargs=TINY)
    written = load_file(tmp_path / "model.flat")
    assert out.target == "flat" and all(key.startswith("trunk.") for key in written)
    assert torch.equal(written["trunk.1.scale_mlp"], model.blocks[1].ls2.gamma)
    assert "rope_embed.periods (recomputed in fp32 there)" in out.not_held and "mask_token" in " ".join(out.not_held)
    back = convert_checkpoint(
        tmp_path / "model.flat",
        tmp_path / "native",
        to="native",
        model=VARIANT["mlp"],
        model_kwargs=dict(TINY, rope_periods_bf16=True),
    )
    assert back.source_format == "flat" and back.keys == "made-up flat keys"
    again = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 48)
    assert_fp32_close(again.forward_features(x), model.forward_features(x))


def test_an_unregistered_format_is_named_as_unknown(tmp_path):
    path, _ = source(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"unknown target 'flat'; pass --to one of native, meta, meta-train, hf, timm, sapiens2$"
    ):
        convert_checkpoint(path, tmp_path / "model.flat", to="flat")


def test_register_format_takes_formats_only():
    with pytest.raises(TypeError, match="register_format takes a Format"):
        register_format("flat")


class Marked(Flat):
    """Native keys with one more: recognised by the shipped meta format too, so only the order decides."""

    spec = FormatSpec("marked", "a made-up format: native keys and a marker", FILE, (".marked",))
    title = "made-up marked keys"

    def recognise(self, keys: Sequence[str]) -> bool:
        return "marker" in keys


def test_a_format_registered_later_is_asked_before_the_shipped_ones():
    checkpoint_format = register_format(Marked())
    try:
        keys = {"storage_tokens": torch.zeros(1, 4, 8), "blocks.0.ls1.gamma": torch.zeros(8), "marker": torch.zeros(1)}
        assert recognise(keys) is checkpoint_format
        assert recognise({k: v for k, v in keys.items() if k != "marker"}).name == "meta"
    finally:
        del FORMATS[checkpoint_format.name]


def test_transformers_blocks_are_recognised_as_transformers_5_names_them_in_memory():
    keys = {"model.layer.0.norm1.weight": torch.zeros(8), "model.layer.0.attention.q_proj.weight": torch.zeros(8, 8)}
    assert recognise(keys).name == "hf"
