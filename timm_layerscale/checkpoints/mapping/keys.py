"""Two-way key tables: one table per format maps every key of the native layout (Meta's DINOv3 keys, which are
this package's) to that format's keys and back.

A table row pairs native key patterns with format key patterns (`{i}` a block index, `{p}` `weight` or `bias`,
a trailing `?` an optional key) and, where the tensors differ, one function per direction. Most rows rename;
a few fuse or split (q/k/v, eva's q/v biases, transformers' 3-d mask token). Reading a file runs the rows from
the format to native, writing one runs them back, both as plans over shapes alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ...config import MAX_DEPTH, shown
from ..errors import CheckpointError
from .plan import Plan, Step, StepFn, passthrough, same

Tensor = torch.Tensor
StateDict = dict[str, Tensor]

_PLACEHOLDERS = {"i": r"\d+", "p": r"weight|bias"}


class KeyPattern:
    def __init__(self, template: str) -> None:
        self.optional = template.endswith("?")
        self.template = template.rstrip("?")
        parts = re.split(r"\{(\w+)\}", self.template)
        regex = "".join(
            re.escape(part) if n % 2 == 0 else f"(?P<{part}>{_PLACEHOLDERS[part]})" for n, part in enumerate(parts)
        )
        self.regex = re.compile(f"^{regex}$")

    def match(self, key: str) -> dict[str, str] | None:
        found = self.regex.match(key)
        return None if found is None else found.groupdict()

    def fill(self, groups: Mapping[str, str]) -> str:
        return self.template.format(**groups)


def block_index(key: str, prefix: str = "blocks.") -> int | None:
    """The block index N of a `{prefix}N.*` key (None for a key outside the blocks), parsed with a bound: an
    index that is not an integer, or at or beyond the deepest model a config may have, is one line naming the
    key, before any per-block structure is made from it."""
    if not key.startswith(prefix):
        return None
    text = key[len(prefix) :].partition(".")[0]
    if not (text.isascii() and text.isdigit()):
        raise CheckpointError(
            f"key {shown(key)}: block index {shown(text)} is not an integer; the file's keys are damaged or "
            f"not a ViT's: save or download it again"
        )
    if len(text) > len(str(MAX_DEPTH)) or int(text) >= MAX_DEPTH:
        raise CheckpointError(
            f"key {shown(key)}: block index {shown(text)} is beyond the deepest model a config may have "
            f"({MAX_DEPTH} blocks); the file's keys are damaged: save or download it again"
        )
    return int(text)


def block_count(keys: Iterable[str], prefix: str = "blocks.") -> int:
    """1 + the largest block index among `keys` (0 without blocks), each index parsed by `block_index`."""
    return 1 + max((i for key in keys if (i := block_index(key, prefix)) is not None), default=-1)


@dataclass(frozen=True)
class KeyRow:
    """One row of a key table: native keys <-> format keys; the functions map the tensors (in pattern order) each
    way. (A config field's check is `config.Rule`.)"""

    native: tuple[KeyPattern, ...]
    format_keys: tuple[KeyPattern, ...]
    to_native: StepFn = same
    to_format: StepFn = same


def row(native: str | tuple[str, ...], format_keys: str | tuple[str, ...], to_native=same, to_format=same) -> KeyRow:
    def patterns(keys):
        return tuple(KeyPattern(k) for k in ((keys,) if isinstance(keys, str) else keys))

    return KeyRow(patterns(native), patterns(format_keys), to_native, to_format)


def _match(keys: list[str], rows: Iterable[KeyRow], from_native: bool, options: Mapping[str, Any]):
    """Steps mapping `keys` across the rows, and the keys no row covers.

    A row applies to a group of keys when all its required keys are there; the first that applies wins,
    so the gated-MLP rows (which need a gate key) come before the plain ones that share a key name.
    """
    present, placed, steps = set(keys), set(), []
    for key in keys:
        if key in placed:
            continue
        for key_row in rows:
            src, dst = (key_row.native, key_row.format_keys) if from_native else (key_row.format_keys, key_row.native)
            groups = next((g for p in src if (g := p.match(key)) is not None), None)
            if groups is None:
                continue
            inputs = [p.fill(groups) for p in src]
            if any(k not in present and not p.optional for k, p in zip(inputs, src)):
                continue
            fn = key_row.to_format if from_native else key_row.to_native
            outputs = tuple(p.fill(groups) for p in dst)
            steps.append(Step(outputs, tuple(k if k in present else None for k in inputs), partial(fn, **options)))
            placed.update(k for k in inputs if k in present)
            break
    return steps, [k for k in keys if k not in placed]


@dataclass(frozen=True)
class KeyTable:
    rows: tuple[KeyRow, ...]
    # Spellings of the same keys that reading accepts (source prefix -> table prefix).
    aliases: tuple[tuple[str, str], ...] = field(default=())

    def to_native(self, source: Mapping[str, Tensor]) -> Plan:
        """Native keys from this table's; keys the table does not know pass through (for the checks to name)."""
        spelled = {self._unalias(k): k for k in source}
        steps, unknown = _match(list(spelled), self.rows, from_native=False, options={})
        steps = [Step(s.outputs, tuple(spelled.get(k) if k else None for k in s.inputs), s.fn) for s in steps]
        return Plan(source, [*steps, *passthrough(spelled[k] for k in unknown)])

    def from_native(self, native: Mapping[str, Tensor], **options: Any) -> tuple[Plan, list[str]]:
        """This table's keys from native ones, and the native keys it has no place for."""
        steps, unheld = _match(list(native), self.rows, from_native=True, options=options)
        return Plan(native, steps), unheld

    def _unalias(self, key: str) -> str:
        for alias, canonical in self.aliases:
            if key.startswith(alias):
                return canonical + key[len(alias) :]
        return key
