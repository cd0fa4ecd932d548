"""LayerScale gammas per block and branch, from any state dict or lazily read checkpoint.

Only the gamma tensors are read: `tensors` may be a `LazyCheckpoint`, whose other tensors stay on disk.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from ..checkpoints.mapping.gamma_keys import SPELLING_PATTERNS
from ..checkpoints.mapping.keys import block_index
from ..config import BRANCHES

MUTED_BELOW = 1e-3
BLOCK_KEY = re.compile(r"^(?P<stack>(?:.+\.)?[A-Za-z_]\w*)\.(?P<index>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True)
class BranchStats:
    """|gamma| over the channels of one branch."""

    mean: float
    median: float
    min: float
    max: float
    muted: float  # share of channels with |gamma| < MUTED_BELOW
    channels: int

    @classmethod
    def of(cls, gamma: torch.Tensor) -> BranchStats:
        g = gamma.detach().double().abs().flatten()  # float64: a float32 mean of equal values can fall below them
        median = g.sort().values[(len(g) - 1) // 2 : len(g) // 2 + 1].mean()  # the middle one or two
        values = (g.mean(), median, g.min(), g.max(), (g < MUTED_BELOW).double().mean())
        mean, median, low, high, muted = (float(f"{v.item():.7g}") for v in values)  # float32's digits
        return cls(mean=mean, median=median, min=low, max=high, muted=muted, channels=len(g))


@dataclass(frozen=True)
class BlockGammas:
    label: str  # the block index, prefixed by its stack where a model has several (CaiT)
    key: str  # `<stack>.<index>` in the source
    attn: BranchStats | None  # None: this branch has no LayerScale
    mlp: BranchStats | None

    def branch(self, name: str) -> BranchStats | None:
        return getattr(self, name)

    def to_dict(self) -> dict:
        return {
            "block": self.label,
            **{b: None if s is None else asdict(s) for b, s in zip(BRANCHES, (self.attn, self.mlp))},
        }


def find_gamma_keys(keys: list[str]) -> tuple[dict[tuple[str, int], dict[str, str]], list[str]]:
    """{(stack, block): {branch: key}} for every block of a stack that has gammas, and the spellings seen.

    Blocks of those stacks without any gamma get an empty entry: their LayerScale is off.
    """
    found: dict[tuple[str, int], dict[str, str]] = {}
    spellings: list[str] = []
    blocks: dict[str, set[int]] = {}
    for key in keys:
        match = BLOCK_KEY.match(key)
        if match is None:
            continue
        stack = match["stack"]
        index = block_index(key, f"{stack}.")
        blocks.setdefault(stack, set()).add(index)
        for spelling, pattern in SPELLING_PATTERNS.items():
            if branch := pattern.fullmatch(match["rest"]):
                found.setdefault((stack, index), {})[BRANCHES[int(branch[1] or 1) - 1]] = key
                if spelling not in spellings:
                    spellings.append(spelling)
    stacks = list(dict.fromkeys(stack for stack, _ in found))
    ordered = {(s, i): found.get((s, i), {}) for s in stacks for i in sorted(blocks[s])}
    return ordered, spellings


def gamma_stats(tensors: Mapping[str, torch.Tensor]) -> list[BlockGammas]:
    """Per block and branch |gamma| statistics, in block order; empty when there is no LayerScale."""
    keys, _ = find_gamma_keys(list(tensors))
    several_stacks = len({stack for stack, _ in keys}) > 1
    result = []
    for (stack, index), branches in keys.items():
        stats = {b: BranchStats.of(tensors[k]) for b, k in branches.items()}
        label = f"{stack.rsplit('.', 1)[-1]}.{index}" if several_stacks else str(index)
        result.append(BlockGammas(label, f"{stack}.{index}", stats.get("attn"), stats.get("mlp")))
    return result


def block_name(label: str) -> str:
    """`block 3` for a plain index, the label alone where it names its stack (CaiT's `blocks_token_only.0`)."""
    return f"block {label}" if label.isdigit() else label


def short_number(value: float | None) -> str:
    return "off" if value is None else f"{value:.3g}"


def stats_rows(blocks: list[BlockGammas]) -> tuple[list[str], list[list[str]]]:
    header = ["block"]
    for branch in BRANCHES:
        header += [f"{branch} mean", "median", "max", "muted"]
    rows = []
    for block in blocks:
        row = [block.label]
        for branch in BRANCHES:
            s = block.branch(branch)
            row += (
                ["off", "", "", ""]
                if s is None
                else [short_number(s.mean), short_number(s.median), short_number(s.max), f"{s.muted:.0%}"]
            )
        rows.append(row)
    return header, rows
