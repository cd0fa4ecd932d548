"""ATen ops counted by name in a forward, at the level of the kernels that run.

A `TorchDispatchMode` sees composite ops (`linear`, `to`, `contiguous`, `layer_norm`) first under
`torch.inference_mode()`; `OpCounter` runs their decompositions inside itself, so it counts what they become
(`addmm`, `_to_copy`, `clone`, `native_layer_norm`) and a `to` or `contiguous` that returns its input counts
as nothing. Data moves without arithmetic are `copy_`, `clone` and `_to_copy`; an op whose floating inputs
or output differ in dtype (bf16 times an fp32 table) converts an operand inside the kernel, so `OpCounter`
counts those as `mixed_dtype` too. With `where=`, it keeps the Python frames of each such op.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

COPIES = ("copy_", "clone", "_to_copy")
MIXED_DTYPE = "mixed_dtype"
MOVES = (*COPIES, MIXED_DTYPE)
# frames kept for a traced op: the model code, not torch's or pytest's
CODE_PATHS = ("timm_layerscale", "timm/", "transformers/")


def _float_dtypes(values: Iterable[object]) -> set[torch.dtype]:
    return {v.dtype for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _mixed(args, kwargs, out) -> str:
    """The floating dtypes of an op's inputs and first output where they differ (the first output only: a
    kernel's side outputs, such as flash attention's fp32 log-sum-exp, are no conversion), else ''."""
    inputs = _float_dtypes(tree_flatten((args, kwargs))[0])
    first = tree_flatten(out)[0][:1]
    dtypes = inputs | _float_dtypes(first) if inputs else set()
    return " ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) if len(dtypes) > 1 else ""


class OpCounter(TorchDispatchMode):
    """`counts[name]` per kernel-level ATen op, `in_blocks[name]` those run while `inside` is set (the
    hooks of `count_ops` set it around each block); `sources[name]` the model frames of each traced op."""

    def __init__(self, where: Iterable[str] = ()) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.in_blocks: collections.Counter[str] = collections.Counter()
        self.inside = False
        self.where = set(where)
        self.sources: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self:
            decomposed = func.decompose(*args, **kwargs)
        if decomposed is not NotImplemented:
            return decomposed
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self._count(name)
        if name not in COPIES and (dtypes := _mixed(args, kwargs, out)):
            self._count(MIXED_DTYPE, f"{name} {dtypes}")
        return out

    def _count(self, name: str, detail: str = "") -> None:
        self.counts[name] += 1
        self.in_blocks[name] += self.inside
        if name in self.where:
            frames = [f for f in traceback.extract_stack() if any(p in f.filename for p in CODE_PATHS)]
            site = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.line}" for f in reversed(frames[-3:]))
            site = site or "(outside the model code)"
            self.sources[name][f"{detail} @ {site}" if detail else site] += 1

    def moves(self, in_blocks: bool = False) -> dict[str, int]:
        """The copies and dtype conversions by name (zeros included): of the whole forward, or of its blocks."""
        counts = self.in_blocks if in_blocks else self.counts
        return {name: counts[name] for name in MOVES}


def count_ops(model: torch.nn.Module, x: torch.Tensor, where: Iterable[str] = ()) -> OpCounter:
    """The ops of one inference forward of `model` on `x`, those of its `blocks` (timm's name) apart."""
    counter = OpCounter(where)

    def enter(*_) -> None:
        counter.inside = True

    def leave(*_) -> None:
        counter.inside = False

    blocks = getattr(model, "blocks", [])
    hooks = [
        h for block in blocks for h in (block.register_forward_pre_hook(enter), block.register_forward_hook(leave))
    ]
    try:
        with torch.inference_mode(), counter:
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return counter
