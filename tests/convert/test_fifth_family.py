"""Adding a family is its record, its YAML variant, and a format only where its keys are its own: a made-up fifth
family, registered from this file alone (no package file changed), is built, refused where its record says,
written in its own keys, read back by its own rule and given its outputs, and refused by every format it has no
place in, in one line naming those that hold it.

The made-up family, "toyvit": a qk-norm over LayerNorm (a switch no shipped family has), LayerScale on the MLP
branch only, and keys of its own (`layers.N.*`, the MLP gamma as `layers.N.ffn_scale`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import timm
import torch
from safetensors.torch import load_file
from support import assert_fp32_close, forget_timm_model, format_destination, move_off_init_

from timm_layerscale import (
    FAMILIES,
    FORMATS,
    VARIANTS,
    CheckpointError,
    FamilyRecord,
    Format,
    Holding,
    convert_checkpoint,
    register_family,
    register_format,
    register_variant,
)
from timm_layerscale.checkpoints.formats.base import (
    NATIVE_KEYS,
    Job,
    PreparedWrite,
    gamma_branches,
    not_held_report,
    with_all_gammas,
)
from timm_layerscale.checkpoints.mapping.keys import KeyTable, row
from timm_layerscale.checkpoints.write.writers import write_safetensors
from timm_layerscale.config import VitLsConfig
from timm_layerscale.docs_tables import variant_families
from timm_layerscale.publish import save_native
from timm_ls.names import FILE, FormatSpec

NAME = "vit_ls_toy_patch16_toyvit"
VARIANT_YAML = """description: a made-up fifth family, qk-norm over LayerNorm and LayerScale on the MLP branch only
model:
  family: toyvit
  embed_dim: 64
  depth: 2
  num_heads: 4
  qk_norm: true
  norm_eps: 1.0e-6
  init_values: {attn: off, mlp: 1.0e-4}
"""
IMAGES = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))


def _toy_key(native: str) -> str:
    """Native key -> the family's own: blocks under `layers.`, the MLP gamma as `ffn_scale`."""
    return native.replace("blocks.", "layers.").replace("ls2.gamma", "ffn_scale")


class ToyFormat(Format):
    spec = FormatSpec("toyvit", "a made-up family's own keys in one .safetensors file", FILE, (".safetensors",))
    title = "toyvit keys"
    table = KeyTable(
        (
            *(row(k, _toy_key(k)) for k in NATIVE_KEYS if not k.startswith("head.") and "ls1" not in k),
            row("blocks.{i}.attn.q_norm.bias", "layers.{i}.attn.q_norm.bias"),  # LayerNorm's: a bias too
            row("blocks.{i}.attn.k_norm.bias", "layers.{i}.attn.k_norm.bias"),
        )
    )
    may_drop = frozenset({"head"})

    def recognise(self, keys: Sequence[str]) -> bool:
        return any(k.endswith(".ffn_scale") for k in keys)

    def prepare_write(self, job: Job) -> PreparedWrite:
        config = job.config
        self.holding(config)  # what its family's record says it holds
        full = with_all_gammas(job.tensors, config.depth, config.embed_dim, job.fill_dtype, gamma_branches(config))
        out, unheld = self.table.from_native(full)
        self.check_holds(config, unheld)
        not_held, warnings = not_held_report(unheld, self.name)
        return PreparedWrite(out, lambda tmp, bar: write_safetensors(tmp, out, progress=bar), not_held, warnings)


RECORD = FamilyRecord(
    "toyvit",
    "a made-up family",
    formats={"native": Holding(), "toyvit": Holding({"norm_eps": 1e-6})},
    switches={"qk_norm": (True,), "norm_layer": ("layernorm",)},
    layer_scale=("mlp",),
    # Its rule for keys without a record: a qk-norm with a bias (LayerNorm's), which no shipped family has.
    recognise=lambda keys: "blocks.0.attn.q_norm.bias" in keys,
)


@pytest.fixture(scope="module")
def toyvit(tmp_path_factory):
    yaml = tmp_path_factory.mktemp("toy") / f"{NAME}.yaml"
    yaml.write_text(VARIANT_YAML)
    register_family(RECORD)
    register_format(ToyFormat())
    register_variant(yaml)
    yield NAME
    del FAMILIES["toyvit"], FORMATS["toyvit"], VARIANTS[NAME]
    forget_timm_model(NAME)


def toy_model(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(NAME, num_classes=0, **kwargs)).eval()


def test_its_record_refuses_what_is_not_one_of_it_when_built(toyvit):
    with pytest.raises(ValueError) as refused:
        toy_model(init_values=1e-4)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("family=toyvit: init_values: LayerScale on the attn branch"), line
    assert "family=dinov3 or family=lingbot holds it" in line, line
    with pytest.raises(ValueError, match=r"^family=toyvit: qk_norm: got False; a toyvit model has True; "):
        toy_model(qk_norm=False)


@torch.no_grad()
def test_it_is_written_in_its_own_keys_read_back_by_its_own_rule_and_refused_elsewhere(toyvit, tmp_path):
    model = toy_model()
    assert model.config.family == "toyvit"
    save_native(model, tmp_path / "src")
    result = convert_checkpoint(tmp_path / "src", tmp_path / "toy.safetensors", to="toyvit")
    written = load_file(tmp_path / "toy.safetensors")
    assert result.not_held == [] and not any(k.startswith("blocks.") for k in written), result.not_held
    assert torch.equal(written["layers.1.ffn_scale"], model.blocks[1].ls2.gamma) and "layers.0.ls1.gamma" not in written

    # Read back with no record beside it: its format by its keys, its family by its record's rule, so only
    # its variant is ranked, and the weights give the model's outputs.
    back = convert_checkpoint(tmp_path / "toy.safetensors", tmp_path / "native", to="native")
    assert back.source_format == "toyvit" and back.variant == NAME, (back.source_format, back.variant)
    again = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    assert again.config.family == "toyvit"
    assert_fp32_close(again.forward_features(IMAGES), model.forward_features(IMAGES))

    for to in (name for name in FORMATS if name not in RECORD.formats):  # every registered format it has no place in
        dst = format_destination(to, tmp_path)
        with pytest.raises(CheckpointError) as refused:
            convert_checkpoint(tmp_path / "src", dst, to=to)
        line = str(refused.value)
        assert "\n" not in line and "cannot hold a toyvit model" in line, line
        assert line.endswith("convert --to native or toyvit instead"), line
        assert not dst.exists()


def test_the_docs_and_the_configs_refusal_name_it_from_its_record(toyvit):
    """No table beside the record: the README's family column takes its title (EUPE's tag prefix aside), and a
    family no record has is refused naming it among the registered ones."""
    assert variant_families(NAME, []) == ["a made-up family"]
    assert variant_families("vit_ls_base_patch16_dinov3", ["lvd1689m", "eupe_lvd1689m"]) == ["DINOv3", "EUPE"]
    with pytest.raises(ValueError, match=r"family: got 'toy'; allowed: a registered family: dinov3, .*toyvit"):
        VitLsConfig(family="toy")
