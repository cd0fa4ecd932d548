"""LayerScale's key spellings, in one table that every format, timm family and report reads them from.

A spelling names a block's LayerScale vector after its `<stack>.<block>.` prefix, with N the branch:
1 scales the attention, 2 the MLP (`BRANCHES[N - 1]`). The spellings of timm's and the original code's families
are written here; each format declares its own (`Format.gamma_spelling`) and registering it adds the spelling
(`register_spelling`), so a report reads a new format's gammas without a line here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# spelling -> where it is written
GAMMA_SPELLINGS = {
    "lsN.gamma": "Meta's DINOv2 and DINOv3, this package, timm's vision_transformer (DeiT-III)",
    "gamma_N": "timm's eva (its DINOv3) and cait, the original DeiT-III and CaiT code",
    "layer_scaleN.lambda1": "transformers' DINOv2 and DINOv3",
}
NATIVE_SPELLING = "lsN.gamma"


def gamma_name(spelling: str, branch: int | str) -> str:
    """The key suffix of branch 1 or 2 in a spelling: `gamma_name("gamma_N", 2) == "gamma_2"`."""
    return spelling.replace("N", str(branch))


def _branch_pattern(spelling: str) -> str:
    return re.escape(spelling).replace("N", "([12])")


# A spelling's pattern matches a key's rest after `<stack>.<block>.`; its one group is the branch (unset: 1).
SPELLING_PATTERNS = {spelling: re.compile(_branch_pattern(spelling)) for spelling in GAMMA_SPELLINGS}


def register_spelling(spelling: str, pattern: str = "") -> None:
    """Adds a format's spelling (N the branch) to what reports read; `pattern` where it is not one word with N in it
    (its one group the branch, unset: 1). Read only: `rename_layer_scale` writes the spellings of the table above."""
    if not pattern and "N" not in spelling:
        raise ValueError(f"gamma spelling {spelling!r}: N marks the branch (lsN.gamma); or give its pattern")
    SPELLING_PATTERNS.setdefault(spelling, re.compile(pattern or _branch_pattern(spelling)))


# Any spelling at the end of a key (one group per spelling, in table order, holds the branch).
ANY_GAMMA_KEY = re.compile(r"(^|\.)(?:" + "|".join(map(_branch_pattern, GAMMA_SPELLINGS)) + r")$")
# A native gamma key: groups (block, branch).
NATIVE_GAMMA_KEY = re.compile(r"^blocks\.(\d+)\." + _branch_pattern(NATIVE_SPELLING) + "$")


def native_gamma_key(block: int, branch: int | str) -> str:
    return f"blocks.{block}.{gamma_name(NATIVE_SPELLING, branch)}"


def rename_layer_scale(state_dict: Mapping[str, Any], to: str) -> dict[str, Any]:
    """Renames LayerScale keys of any ViT-like state dict to one spelling, keeping order and values.

    `to` is "lsN.gamma" (Meta, timm ViT), "gamma_N" (timm eva, CaiT, DeiT-III) or "layer_scaleN.lambda1"
    (transformers). Other keys are left as they are.
    """
    if to not in GAMMA_SPELLINGS:
        raise ValueError(f"to: got {to!r}; allowed: {', '.join(GAMMA_SPELLINGS)}")

    def rename(key: str) -> str:
        found = ANY_GAMMA_KEY.search(key)
        if found is None:
            return key
        branch = next(b for b in found.groups()[1:] if b)
        return key[: found.end(1)] + gamma_name(to, branch)

    renamed = {rename(k): v for k, v in state_dict.items()}
    if len(renamed) != len(state_dict):
        raise ValueError(
            f"the state dict holds the same LayerScale under two spellings; keep one before renaming to {to}"
        )
    return renamed
