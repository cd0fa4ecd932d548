"""`timm-ls list`: the registered variants with their size, pretrained tags and YAML file."""

from __future__ import annotations

import argparse

import timm

from ..variants import VARIANTS
from .common import table


def add_parser(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("list", help="list the registered variants").set_defaults(func=list_variants)


def list_variants(args: argparse.Namespace) -> int:
    rows = []
    for name, variant in sorted(VARIANTS.items()):
        params = sum(p.numel() for p in timm.create_model(name, device="meta").parameters())
        tags = ", ".join(f"{tag} ({cfg.get('hf_hub_id', 'no hub id')})" for tag, cfg in variant.tags.items())
        rows.append([name, f"{params / 1e6:,.1f}M", variant.source, tags or "-"])
    print(table(["variant", "params", "config", "pretrained tags"], rows))
    return 0
