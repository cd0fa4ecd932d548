"""`timm-ls list`: the registered variants with their size, pretrained tags and their licences; `--json` adds Hub
repos and files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import timm

from ..variants import VARIANTS, config_dir
from .common import table

JSON_HINT = "Hub repos and YAML files: timm-ls list --json"


def _shipped(source: str) -> bool:
    return Path(source).resolve().parent == config_dir().resolve()


def licence_text(licenses: dict[str, str | None]) -> str:
    """The first tag's licence, then each tag with another: `dinov3-license; eupe_lvd1689m: fair-...`."""
    named = {tag: license or "unknown" for tag, license in licenses.items()}
    if not named:
        return "-"
    first = next(iter(named.values()))
    return "; ".join([first, *(f"{tag}: {license}" for tag, license in named.items() if license != first)])


def registered_variants() -> list[dict]:
    """Each registered variant, by name: its parameter count (on the meta device), tags with their Hub repos,
    licences, YAML file and whether it is shipped. What `timm-ls list` prints and the README's table shows."""
    found = []
    for name, variant in sorted(VARIANTS.items()):
        params = sum(p.numel() for p in timm.create_model(name, device="meta").parameters())
        tags = {tag: cfg.get("hf_hub_id") for tag, cfg in variant.tags.items()}
        licenses = {tag: timm.models.get_pretrained_cfg(f"{name}.{tag}").license for tag in tags}
        found.append(
            dict(
                name=name,
                params=params,
                tags=tags,
                licenses=licenses,
                config=variant.source,
                shipped=_shipped(variant.source),
            )
        )
    return found


def listing(found: list[dict]) -> str:
    """What `timm-ls list` prints of `found` (`registered_variants()`): a table, then where the rest is."""
    header = ["variant", "params", "pretrained tags", "licence"]
    rows = [
        [v["name"], f"{v['params'] / 1e6:,.1f}M", ", ".join(v["tags"]) or "-", licence_text(v["licenses"])]
        for v in found
    ]
    if not all(v["shipped"] for v in found):  # a variant registered from the user's own YAML says which file
        header.append("config")
        rows = [[*row, "" if v["shipped"] else v["config"]] for row, v in zip(rows, found)]
    return table(header, rows) + "\n" + JSON_HINT


def execute(args: argparse.Namespace) -> int:
    found = registered_variants()
    print(json.dumps(found, indent=1) if args.json else listing(found))
    return 0
