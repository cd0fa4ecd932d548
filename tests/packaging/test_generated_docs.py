"""The README's and the docs' generated sections say what the registry and the parsers say now: the variants
`timm-ls list` counts and the first rows it prints, the formats `convert --to` takes, every command's usage as
its `--help` gives it. A variant, format or flag added without running
`python -m timm_layerscale.docs_tables --write` fails here, and so does a page whose generated lines were edited."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

from timm_layerscale.checkpoints.formats import FORMATS
from timm_layerscale.docs_tables import MARKED, OPENING, PAGES, REGENERATE, render, rendered_sections, stale_pages
from timm_layerscale.families import FAMILIES
from timm_ls.parsers import COMMANDS

# Each page and the sections it must keep (a section whose markers were deleted would otherwise never differ):
# the README its tables, each command's page its usage line, and the pages that show more.
SECTIONS_ON = {
    "README.md": {"variants", "formats"},
    **{f"docs/commands/{command}.md": {f"{command}-usage"} for command in COMMANDS},
}
SECTIONS_ON["docs/commands/convert.md"].add("formats")
SECTIONS_ON["docs/commands/list.md"].add("list-output")


@pytest.fixture(scope="module")
def sections() -> dict[str, str]:
    """Every section as the registry and the parsers give it, rendered once for the module's tests."""
    return rendered_sections()


def copy_pages(root: Path) -> None:
    for page in PAGES:
        (root / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, root / page)


FAKE_VARIANT = """description: a made-up DINOv3 shape the README does not list
model: {embed_dim: 96, depth: 3, num_heads: 3, ffn_layer: mlp, ffn_ratio: 4, qkv_bias: true, init_values: 1.0e-5}
"""


def test_every_generated_section_agrees_with_the_registry(sections):
    assert (
        set(PAGES)
        == set(SECTIONS_ON)
        == {"README.md", *(str(p.relative_to(REPO)) for p in REPO.glob("docs/commands/*.md"))}
    )
    for page in PAGES:
        assert set(OPENING.findall((REPO / page).read_text())) == SECTIONS_ON[page], page
    assert list(stale_pages(REPO, sections=sections)) == [], f"regenerate with: {REGENERATE}"


def test_each_usage_section_is_what_the_command_s_help_says(sections):
    """The generated usage holds every word of `timm-ls COMMAND --help`'s usage, the choices included."""
    for command in COMMANDS:
        page = (REPO / f"docs/commands/{command}.md").read_text()
        (usage,) = [m.group("body") for m in MARKED.finditer(page) if m.group("name") == f"{command}-usage"]
        help_usage = subprocess.run(
            [sys.executable, "-m", "timm_ls", command, "--help"], capture_output=True, text=True, check=True
        ).stdout.split("\n\n")[0]
        wanted = re.findall(r"[^\s\[\]|]+", help_usage.removeprefix("usage: "))
        found = re.findall(r"[^\s\[\]|]+", usage.removeprefix("```text\n").removesuffix("```\n"))
        assert sorted(set(wanted) - {"-h", command, "timm-ls"}) == sorted(set(found) - {command, "timm-ls"}), command
    assert "--to {native,meta,meta-train,hf,timm,sapiens2}" in sections["convert-usage"]


@pytest.mark.parametrize("page", PAGES)
def test_a_page_with_one_generated_line_changed_is_stale(page, sections, tmp_path, capsys):
    """A copy of the pages with one line of one page's generated section edited: the check names that page
    alone, and `--write` puts the line back."""
    copy_pages(tmp_path)
    text = (tmp_path / page).read_text()
    body = next(MARKED.finditer(text)).group("body")
    line = next(line for line in body.splitlines() if line.strip() and not line.startswith("```"))
    edited = line.replace("-", "+", 1) if "-" in line else line + " (edited)"
    (tmp_path / page).write_text(text.replace(line, edited, 1))
    assert list(stale_pages(tmp_path, sections=sections)) == [page]
    assert stale_pages(tmp_path, sections=sections)[page] == (REPO / page).read_text()


def test_the_readme_lists_every_family_and_every_format_the_command_takes():
    readme = (REPO / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `vit_ls_")]
    families = {family for row in rows for family in row.split(" | ")[1].split(", ")}
    assert families == {title for record in FAMILIES.values() for title in record.title.split(", ")}
    for name in FORMATS:  # every registered format, from the registry
        assert f"- `{name}`: " in readme, name
    assert f"--to {{{','.join(FORMATS)}}}" in (REPO / "docs/commands/convert.md").read_text()


def test_a_removed_row_or_an_unknown_section_is_seen(sections):
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
    copy_pages(tmp_path)
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
