"""The README's and the docs' generated sections, written from the registry and the commands' parsers: the
shipped variants as `timm-ls list` counts them, the formats `convert --to` takes, the first lines `timm-ls list`
prints and every command's usage line (its page's `<!-- generated: COMMAND-usage -->`), each between two marker
comments:

    <!-- generated: variants -->
    ...
    <!-- end generated -->

Regenerate them after adding a variant, a format or a flag: `python -m timm_layerscale.docs_tables --write`.
`--check` (the default) names each page that differs and exits 1; tests/packaging/test_generated_docs.py runs
it, so a variant, format or flag added without regenerating fails the tests.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from timm_ls import paths
from timm_ls.names import FORMATS
from timm_ls.parsers import COMMANDS, DEFAULT_COMMAND, make_parser

from .cli.listing import licence_text, listing, registered_variants
from .families import family_record
from .variants import VARIANTS

__all__ = ["PAGES", "generated_sections", "main", "render", "rendered_sections", "stale_pages"]

# The README and each command's page (docs/commands/<command>.md, which holds its usage line).
PAGES = ("README.md", *(f"docs/commands/{command}.md" for command in sorted(COMMANDS)))
MARKED = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.DOTALL)
OPENING = re.compile(r"<!-- generated: ([\w-]+) -->")
REGENERATE = "python -m timm_layerscale.docs_tables --write"

# A variant's family is the one its config records, named by its record's title; a tag's weights are of another
# family sharing that record where the tag starts with one of WEIGHT_FAMILIES (EUPE's weights in DINOv3's
# architecture), which the title names too ("DINOv3, EUPE") and the architecture's own name leaves out.
WEIGHT_FAMILIES = {"eupe": "EUPE"}
USAGE_WIDTH = 110
LISTED_ROWS = 3  # the rows of `timm-ls list` its page shows, before "..."


def variant_families(name: str, tags: Sequence[str]) -> list[str]:
    """The families of a variant's weights, in tag order (the architecture's family where it has no tags), by
    the family its config records."""
    title = family_record(VARIANTS[name].config.family).title
    own = ", ".join(t for t in title.split(", ") if t not in WEIGHT_FAMILIES.values()) or title
    found = [next((f for p, f in WEIGHT_FAMILIES.items() if tag.startswith(p)), own) for tag in tags]
    return list(dict.fromkeys(found or [own]))


def _layer_scale(attn: float | None, mlp: float | None) -> str:
    branches = [name for name, value in (("attention", attn), ("MLP", mlp)) if value is not None]
    return " and ".join(branches) or "off"


def variants_table(found: Sequence[Mapping[str, Any]]) -> str:
    """The shipped variants, one row each, with what `timm-ls list` prints of them and their shapes."""
    lines = [
        "| variant | family | width | depth | heads | params | LayerScale | tags | licence |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for record in found:
        if not record["shipped"]:
            continue
        config = VARIANTS[record["name"]].config
        heads = f"{config.num_heads}" + (" (grouped k/v)" if config.grouped_attention else "")
        tags = ", ".join(f"`{tag}`" for tag in record["tags"]) or "none (architecture only)"
        cells = [
            f"`{record['name']}`",
            ", ".join(variant_families(record["name"], list(record["tags"]))),
            str(config.embed_dim),
            str(config.depth),
            heads,
            f"{record['params'] / 1e6:,.1f}M",
            _layer_scale(*config.layer_init_values[0]),
            tags,
            licence_text(record["licenses"]) if record["tags"] else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def formats_list() -> str:
    """Every `--to` name with what it is, in the order the command lists them."""
    return "".join(f"- `{spec.name}`: {spec.description}\n" for spec in FORMATS)


def _top_level_words(text: str) -> list[str]:
    """`a [b [c ...]] {d,e}` -> ["a", "[b [c ...]]", "{d,e}"]: words split at spaces outside brackets."""
    words, depth, word = [], 0, ""
    for char in text:
        depth += (char in "[{(") - (char in "]})")
        if char == " " and depth == 0:
            words.append(word)
            word = ""
        else:
            word += char
    return [w for w in [*words, word] if w]


def _command_parser(command: str) -> argparse.ArgumentParser:
    (subparsers,) = (a for a in make_parser("")._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def command_usage(command: str) -> str:
    """A command's usage as its parser gives it, positionals first, wrapped under the command's name (the
    default command's name in brackets: `timm-ls [demo]`)."""
    parser = _command_parser(command)
    optionals = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    formatter = argparse.HelpFormatter(parser.prog, width=10**6)
    formatter.add_usage(parser.usage, optionals, parser._mutually_exclusive_groups, prefix="")
    words = _top_level_words(formatter.format_help().strip())[len(parser.prog.split()) :]
    positionals = [formatter._format_args(a, a.dest) for a in parser._actions if not a.option_strings]
    prog = f"timm-ls [{command}]" if command == DEFAULT_COMMAND else parser.prog
    lines, line = [], prog
    for word in [*positionals, *words]:
        if len(line) + 1 + len(word) > USAGE_WIDTH:
            lines.append(line)
            line = " " * len(prog) + " " + word
        else:
            line += " " + word
    return "```text\n" + "\n".join([*lines, line]) + "\n```\n"


def list_output(found: Sequence[Mapping[str, Any]]) -> str:
    """The first rows `timm-ls list` prints, as it prints them, and its last line."""
    lines = listing(list(found)).splitlines()
    return "```text\n" + "\n".join([*lines[: 1 + LISTED_ROWS], "...", lines[-1]]) + "\n```\n"


def generated_sections() -> dict[str, Callable[[], str]]:
    """Each marked section's name -> what renders it now."""
    found: list[dict] = []

    def variants() -> list[dict]:  # counted once for both sections that show them; what a fresh process lists
        found[:] = found or [record for record in registered_variants() if record["shipped"]]
        return found

    usages = {f"{command}-usage": (lambda command=command: command_usage(command)) for command in COMMANDS}
    return {
        "variants": lambda: variants_table(variants()),
        "list-output": lambda: list_output(variants()),
        "formats": formats_list,
        **usages,
    }


def render(text: str, sections: Mapping[str, str], page: str = "page") -> str:
    """`text` with each marked section's body replaced by `sections[name]`; an unknown or unclosed marker is
    an error naming the page."""
    closed = {m.group("name") for m in MARKED.finditer(text)}
    for name in OPENING.findall(text):
        if name not in sections:
            raise ValueError(f"{page}: no generated section is named {name!r}; known: {sorted(sections)}")
        if name not in closed:
            raise ValueError(f"{page}: the section {name!r} has no `<!-- end generated -->` after it")
    return MARKED.sub(lambda m: m.group(1) + sections[m.group("name")] + m.group(4), text)


def rendered_sections() -> dict[str, str]:
    """Every generated section's text as the registry and the parsers give it now."""
    return {name: make() for name, make in generated_sections().items()}


def stale_pages(root: Path, pages: Sequence[str] = PAGES, sections: Mapping[str, str] | None = None) -> dict[str, str]:
    """The pages under `root` whose generated sections differ from the registry's (or from `sections`, as
    `rendered_sections()` gave them), with their text as it should be."""
    sections = rendered_sections() if sections is None else sections
    stale = {}
    for page in pages:
        text = (root / page).read_text()
        rendered = render(text, sections, page)
        if rendered != text:
            stale[page] = rendered
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m timm_layerscale.docs_tables", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the pages whose generated sections differ")
    parser.add_argument("--root", type=Path, default=paths.package_dir().parent, help="the source checkout")
    args = parser.parse_args(argv)
    missing = [page for page in PAGES if not (args.root / page).is_file()]
    if missing:
        print(f"docs_tables: error: {args.root} has no {', '.join(missing)}; pass --root CHECKOUT", file=sys.stderr)
        return 2
    try:
        stale = stale_pages(args.root)
    except ValueError as error:  # a marker without its section or its end: the page's own line
        print(f"docs_tables: error: {error}", file=sys.stderr)
        return 2
    for page, text in stale.items():
        if args.write:
            (args.root / page).write_text(text)
        print(f"{'rewrote' if args.write else 'differs from the registry:'} {page}")
    if stale and not args.write:
        print(f"regenerate with: {REGENERATE}", file=sys.stderr)
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
