"""The docs stay true: every flag of every command is on that command's page (docs/commands/<command>.md), and
every relative link in README.md and docs/ reaches a file (and a heading, for `#anchor` links)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from support import REPO

from timm_ls.parsers import make_parser


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each `timm-ls` command's parser by name: the one place this test learns where the parsers live."""
    (commands,) = (a for a in make_parser("version")._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted({opt for a in parser._actions for opt in a.option_strings if opt.startswith("--")} - {"--help"})


def missing_flags(text: str, wanted: list[str]) -> list[str]:
    """The flags not written in code on the page (`--model` does not count for `--model-kwargs`)."""
    return [flag for flag in wanted if not re.search(rf"`{re.escape(flag)}(?![\w-])", text)]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets `-1`, `-2`, ... as on GitHub."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in prose_lines(page.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(f"{base}-{n}" if n else base)
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file (or heading) does not exist, as `target: why`."""
    broken = []
    for line in prose_lines(page.read_text()):
        for target in LINK_TARGET.findall(CODE_SPAN.sub("", line)):
            if SCHEME.match(target):
                continue
            path, _, anchor = unquote(target).partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{target}: no such file")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("command", sorted(command_parsers()))
def test_every_flag_of_a_command_is_on_its_page(command):
    page = DOCS / "commands" / f"{command}.md"
    assert page.is_file(), f"{page.relative_to(REPO)} is missing: write one page per command"
    assert missing_flags(page.read_text(), flags(command_parsers()[command])) == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_checks_see_a_missing_flag_and_a_broken_link(tmp_path):
    assert missing_flags("`--model NAME` and `--model-kwargs K=V`", ["--model", "--model-kwargs"]) == []
    assert missing_flags("only `--model-kwargs K=V`", ["--model", "--model-kwargs"]) == ["--model"]
    (tmp_path / "there.md").write_text("# A heading: with `code`\n\n## A heading: with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-with-code-1) [file](missing.md) [anchor](there.md#nowhere) [web](https://x.org)\n"
        "```\n[in code](missing-too.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md: no such file", "there.md#nowhere: no heading #nowhere in there.md"]
