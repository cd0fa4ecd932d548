"""Block indices a dense head reads, by Meta's names or ours (`feature_layers`)."""

from __future__ import annotations

from typing import Any

# Meta's names for the blocks a dense head reads (dinov3/eval/segmentation/models/__init__.py,
# BackboneLayersSet): LAST for the linear and depth heads, FOUR_LAST, and FOUR_EVEN_INTERVALS for Mask2Former.
FEATURE_LAYER_NAMES = {
    "last": "last",
    "last_four": "last_four",
    "four_last": "last_four",
    "four_even": "four_even",
    "four_even_intervals": "four_even",
}
PAPER_FOUR_EVEN = {24: [4, 11, 17, 23]}  # Meta keeps the paper's ViT-L blocks for 24, not 5, 11, 17, 23


def feature_layers(indices: Any, depth: int) -> Any:
    """Block indices for a name (Meta's spelling or ours, any case), anything else as it is.

    `last`: the last block. `last_four` (`four_last`): the last four, in order. `four_even`
    (`four_even_intervals`): Meta's `i * (depth // 4) - 1` for i = 1..4 (2, 5, 8, 11 of 12 blocks; 9, 19, 29,
    39 of 40), except 24 blocks, which get the paper's 4, 11, 17, 23. Under 4 blocks both four-block names
    give every block, in order (Meta's formula would name block -1 four times).
    """
    if not isinstance(indices, str):
        return indices
    name = FEATURE_LAYER_NAMES.get(indices.strip().lower())
    if name is None:
        raise ValueError(
            f"feature blocks: got {indices!r}; allowed: block indices or one of {', '.join(FEATURE_LAYER_NAMES)}"
        )
    if name == "last":
        return [depth - 1]
    if depth < 4:
        return list(range(depth))
    if name == "last_four":
        return list(range(depth - 4, depth))
    return PAPER_FOUR_EVEN.get(depth, [i * (depth // 4) - 1 for i in range(1, 5)])
