"""The held-out part of a train set, stratified and seeded, as Meta's `split_train_val_datasets`."""

from __future__ import annotations

import random


def stratified_split(labels: list[int], fraction: float, seed: int) -> list[bool]:
    """Which items are held out: per class, shuffled by `seed`, max(1, int(fraction * n)) of them, none of a
    class with one item (Meta's rule: a lone item stays in train)."""
    if not 0 < fraction < 1:
        raise ValueError(f"held-out fraction: got {fraction}; pass a number between 0 and 1")
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        by_class.setdefault(int(label), []).append(i)
    held = [False] * len(labels)
    rng = random.Random(seed)
    for label in sorted(by_class):
        members = by_class[label][:]
        rng.shuffle(members)
        n = max(1, int(fraction * len(members))) if len(members) > 1 else 0
        for i in members[:n]:
            held[i] = True
    return held
