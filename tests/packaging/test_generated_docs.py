"""The README's and the docs' generated sections say what the registry says now: the variants `timm-ls list`
counts, the formats `convert --to` takes, the command's usage. A variant or format added without running
`python -m timm_layerscale.docs_tables --write` fails here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from support import REPO

from timm_layerscale.docs_tables import OPENING, PAGES, REGENERATE, generated_sections, render, stale_pages

# Each page and the sections it must keep (a section whose markers were deleted would otherwise never differ).
SECTIONS_ON = {"README.md": {"variants", "formats"}, "docs/commands/convert.md": {"convert-usage", "formats"}}

FAKE_VARIANT = """description: a made-up DINOv3 shape the README does not list
model: {embed_dim: 96, depth: 3, num_heads: 3, ffn_layer: mlp, ffn_ratio: 4, qkv_bias: true, init_values: 1.0e-5}
"""


def test_every_generated_section_agrees_with_the_registry():
    for page in PAGES:
        assert set(OPENING.findall((REPO / page).read_text())) == SECTIONS_ON[page], page
    assert list(stale_pages(REPO)) == [], f"regenerate with: {REGENERATE}"


def test_the_readme_lists_every_family_and_every_format_the_command_takes():
    readme = (REPO / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `vit_ls_")]
    families = {family for row in rows for family in row.split(" | ")[1].split(", ")}
    assert families == {"DINOv3", "EUPE", "LingBot-Vision", "Sapiens2"}
    for name in ("native", "meta", "meta-train", "hf", "timm", "sapiens2"):
        assert f"- `{name}`: " in readme, name
    assert "--to {native,meta,meta-train,hf,timm,sapiens2}" in (REPO / "docs/commands/convert.md").read_text()


def test_a_removed_row_or_an_unknown_section_is_seen():
    sections = {name: make() for name, make in generated_sections().items()}
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `vit_ls_tiny_patch16_dinov3`"))
    assert render(readme.replace(row + "\n", ""), sections) == readme
    with pytest.raises(ValueError, match="no generated section is named 'colours'"):
        render("<!-- generated: colours -->\n<!-- end generated -->\n", sections, "page.md")
    with pytest.raises(ValueError, match="'formats' has no `<!-- end generated -->`"):
        render("<!-- generated: formats -->\n- `native`\n", sections, "page.md")


def test_a_variant_added_without_regenerating_fails_the_check(tmp_path):
    """A checkout with one more variant YAML: the check names the README and exits 1, `--write` adds its row,
    and the check then passes."""
    shutil.copytree(REPO / "timm_layerscale", tmp_path / "timm_layerscale", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    for page in PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, tmp_path / page)
    (tmp_path / "configs" / "vit_ls_fake_patch16_dinov3.yaml").write_text(FAKE_VARIANT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "tests")])}
    command = [sys.executable, "-m", "timm_layerscale.docs_tables", "--root", str(tmp_path)]

    def check(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([*command, *flags], env=env, cwd=tmp_path, capture_output=True, text=True)

    found = check()
    assert (found.returncode, found.stdout) == (1, "differs from the registry: README.md\n"), found.stderr
    assert REGENERATE in found.stderr
    assert check("--write").returncode == 0
    assert "| `vit_ls_fake_patch16_dinov3` | DINOv3 | 96 | 3 | 3 |" in (tmp_path / "README.md").read_text()
    again = check()
    assert (again.returncode, again.stdout) == (0, ""), again.stderr
