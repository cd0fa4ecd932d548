"""A family whose keys are its own is its record, its YAML variant and one format module, from this file alone: the
format declares the family its keys are and its gamma spelling, and nothing else is told. Its files are written,
read back with nothing beside them (identity takes the family from the format that read the keys, with the
record's layout left at its default and no rule of its own), give the model's outputs, and `timm-ls inspect`
reports their gammas in the format's spelling and the variant they are.

The made-up family, "trunkvit": DINOv3's architecture under keys `trunk.N.*`, LayerScale as `trunk.N.scale1` and
`trunk.N.scale2`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from contextlib import redirect_stderr, redirect_stdout

import pytest
import timm
import torch
from safetensors.torch import load_file
from support import assert_fp32_close, forget_timm_model, move_off_init_

from timm_layerscale import (
    FAMILIES,
    FORMATS,
    VARIANTS,
    FamilyRecord,
    Format,
    Holding,
    convert_checkpoint,
    register_family,
    register_format,
    register_variant,
)
from timm_layerscale.checkpoints.formats.base import NATIVE_KEYS, Job, PreparedWrite, not_held_report
from timm_layerscale.checkpoints.mapping.gamma_keys import SPELLING_PATTERNS
from timm_layerscale.checkpoints.mapping.keys import KeyTable, row
from timm_layerscale.checkpoints.write.writers import write_safetensors
from timm_layerscale.publish import save_native
from timm_ls.main import main
from timm_ls.names import FILE, FormatSpec

NAME = "vit_ls_toy_patch16_trunkvit"
VARIANT_YAML = """description: a made-up family with keys of its own
model:
  family: trunkvit
  embed_dim: 64
  depth: 2
  num_heads: 4
  num_classes: 0
"""
IMAGES = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0))


def _trunk_key(native: str) -> str:
    return native.replace("blocks.", "trunk.").replace("ls1.gamma", "scale1").replace("ls2.gamma", "scale2")


class TrunkFormat(Format):
    spec = FormatSpec("trunkvit", "a made-up family's own keys in one .safetensors file", FILE, (".safetensors",))
    title = "trunkvit keys"
    table = KeyTable(tuple(row(k, _trunk_key(k)) for k in NATIVE_KEYS if not k.startswith("head.")))
    may_drop = frozenset({"head"})
    family = "trunkvit"  # its keys are this family's: identity ranks its variants only
    gamma_spelling = "scaleN"

    def recognise(self, keys: Sequence[str]) -> bool:
        return any(k.startswith("trunk.") for k in keys)

    def prepare_write(self, job: Job) -> PreparedWrite:
        self.holding(job.config)
        out, unheld = self.table.from_native(job.tensors)
        self.check_holds(job.config, unheld)
        not_held, warnings = not_held_report(unheld, self.name)
        return PreparedWrite(out, lambda tmp, bar: write_safetensors(tmp, out, progress=bar), not_held, warnings)


# Its layout is its own name (the default) and it has no rule for native keys: its format says whose keys they are.
RECORD = FamilyRecord("trunkvit", "a family with keys of its own", {"native": Holding(), "trunkvit": Holding()})


@pytest.fixture(scope="module")
def trunkvit(tmp_path_factory):
    yaml = tmp_path_factory.mktemp("trunk") / f"{NAME}.yaml"
    yaml.write_text(VARIANT_YAML)
    register_family(RECORD)
    register_format(TrunkFormat())
    register_variant(yaml)
    yield NAME
    del FAMILIES["trunkvit"], FORMATS["trunkvit"], VARIANTS[NAME], SPELLING_PATTERNS["scaleN"]
    forget_timm_model(NAME)


@torch.no_grad()
def trunk_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(NAME)).eval()


def cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@torch.no_grad()
def test_its_files_are_written_in_its_keys_and_read_back_as_it_with_nothing_beside_them(trunkvit, tmp_path):
    model = trunk_model()
    save_native(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "trunk.safetensors", to="trunkvit")
    written = load_file(tmp_path / "trunk.safetensors")
    assert not any(k.startswith("blocks.") for k in written) and "trunk.1.scale2" in written
    assert torch.equal(written["trunk.1.scale2"], model.blocks[1].ls2.gamma)

    back = convert_checkpoint(tmp_path / "trunk.safetensors", tmp_path / "native", to="native")
    assert back.source_format == "trunkvit" and back.variant == NAME, (back.source_format, back.variant)
    again = timm.create_model(f"local-dir:{tmp_path / 'native'}", pretrained=True).eval()
    assert again.config.family == "trunkvit"
    assert_fp32_close(again.forward_features(IMAGES), model.forward_features(IMAGES))


@torch.no_grad()
def test_inspect_reads_its_gammas_by_the_formats_spelling(trunkvit, tmp_path):
    model = trunk_model()
    save_native(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "trunk.safetensors", to="trunkvit")
    code, out, err = cli("inspect", tmp_path / "trunk.safetensors", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["spellings"] == ["scaleN"] and report["gammas_read"] == 4, report
    assert report["model"].startswith(NAME), report
    for i, block in enumerate(model.blocks):
        assert report["blocks"][i]["attn"]["max"] == pytest.approx(block.ls1.gamma.abs().max().item(), rel=1e-6)
        assert report["blocks"][i]["mlp"]["mean"] == pytest.approx(
            block.ls2.gamma.abs().double().mean().item(), rel=1e-6
        )


def test_a_format_whose_spelling_marks_no_branch_is_refused_when_registered():
    class NoBranch(TrunkFormat):
        spec = FormatSpec("nobranch", "a spelling without N", FILE, (".safetensors",))
        gamma_spelling = "scale"

    with pytest.raises(ValueError, match=r"^gamma spelling 'scale': N marks the branch"):
        register_format(NoBranch())
    assert "nobranch" not in FORMATS
