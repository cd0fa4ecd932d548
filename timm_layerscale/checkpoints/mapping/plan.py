"""A plan: the tensors a conversion produces, known by name, shape and dtype before any tensor is read.

A plan is a list of steps over a source (a lazy checkpoint, a state dict or another plan). Each step
turns a few source tensors into a few output tensors: a rename, q/k/v split or fused, a gamma folded into
a projection, a cast. Shapes come from running the same step on meta tensors, so planning reads nothing;
reading an output runs its step on real tensors. Plans chain (file keys -> native keys -> target
keys), and iterating one yields `(key, tensor)` pairs while holding only the current step's tensors.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import CheckpointError


@dataclass(frozen=True)
class TensorInfo:
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


Tensor = torch.Tensor
PERIODS = "rope_embed.periods"  # RoPE's periods buffer: kept in its dtype by casts, never a fill's dtype
# A step's function: its input tensors (None for an absent optional input) -> one tensor or None per output.
StepFn = Callable[..., Sequence[Tensor | None]]


def same(*tensors: Tensor | None, **_: object) -> tuple[Tensor | None, ...]:
    return tensors


@dataclass(frozen=True)
class Step:
    outputs: tuple[str, ...]
    inputs: tuple[str | None, ...] = ()
    fn: StepFn = same


def info_of(source: Mapping[str, Tensor], key: str) -> TensorInfo:
    """Shape and dtype of `source[key]`, without reading it where the source can tell."""
    info = getattr(source, "info", None)
    if info is not None:
        return info(key)
    tensor = source[key]
    return TensorInfo(tensor.shape, tensor.dtype)


class LazyTensors(Mapping[str, Tensor]):
    """Tensors known by name, shape and dtype before any is read: `info(key)`, `infos`, `nbytes`, `in`, `len`
    and iterating answer from the infos; `self[key]` reads that one tensor (`_read`). The base of a plan and of
    a lazy checkpoint."""

    _infos: dict[str, TensorInfo]

    @abstractmethod
    def _read(self, key: str) -> Tensor:
        """The tensor of `key`, a key the infos hold."""

    def info(self, key: str) -> TensorInfo:
        return self._infos[key]

    @property
    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self._infos.values())

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._infos:
            raise KeyError(key)
        return self._read(key)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)


class Plan(LazyTensors):
    """Output tensors in step order. `plan[key]` runs the step that makes `key` (once for all its outputs
    read in a row); `info(key)` answers from the plan alone."""

    def __init__(self, source: Mapping[str, Tensor], steps: Iterable[Step]) -> None:
        self.source = source
        self._infos = {}
        self._step_of: dict[str, Step] = {}
        self._last: tuple[Step | None, dict[str, Tensor]] = (None, {})
        for step in steps:
            probes = [None if k is None else _meta(info_of(source, k)) for k in step.inputs]
            for key, out in zip(step.outputs, _planned(step, probes), strict=True):
                if out is not None:
                    self._infos[key] = TensorInfo(out.shape, out.dtype)
                    self._step_of[key] = step

    def step(self, key: str) -> Step:
        return self._step_of[key]

    def _read(self, key: str) -> Tensor:
        step = self._step_of[key]
        if self._last[0] is not step:
            self._last = (None, {})  # let the previous step's tensors go before reading the next ones
            made = step.fn(*(None if k is None else self.source[k] for k in step.inputs))
            self._last = (step, {k: t for k, t in zip(step.outputs, made, strict=True) if k in self._infos})
        return self._last[1][key]

    def release(self) -> None:
        """Drops the tensors of the last step run (down the chain too)."""
        self._last = (None, {})
        if isinstance(self.source, Plan):
            self.source.release()


def _planned(step: Step, probes: list[Tensor | None]) -> Sequence[Tensor | None]:
    """The step's outputs on meta tensors, or one line naming inputs whose shapes cannot make them (a crafted
    or broken file: a 1-D q projection beside 2-D k and v, say)."""
    try:
        return step.fn(*probes)
    except (RuntimeError, ValueError, IndexError) as error:
        shapes = ", ".join(f"{k} {list(p.shape)}" for k, p in zip(step.inputs, probes, strict=True) if p is not None)
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(
            f"{shapes} cannot make {', '.join(step.outputs)} ({reason}): the checkpoint's tensors do not fit "
            f"together; convert an unbroken copy"
        ) from None


def _meta(info: TensorInfo) -> Tensor:
    return torch.empty(info.shape, dtype=info.dtype, device="meta")


def passthrough(keys: Iterable[str]) -> list[Step]:
    return [Step((key,), (key,)) for key in keys]


def cast_plan(plan: Plan, dtype: torch.dtype | None, keep: Iterable[str] = ()) -> Plan:
    """Floating tensors cast to `dtype` as they are read, except the keys in `keep` (e.g. RoPE periods)."""
    if dtype is None:
        return plan
    keep = set(keep)

    def cast(tensor: Tensor) -> tuple[Tensor]:
        return (tensor.to(dtype) if tensor.is_floating_point() else tensor,)

    return Plan(plan, [Step((k,), (k,)) if k in keep else Step((k,), (k,), cast) for k in plan])


def dominant_dtype(tensors: Mapping[str, Tensor]) -> torch.dtype:
    """The floating dtype holding most of the bytes (RoPE periods aside): fills are made in it."""
    totals: dict[torch.dtype, int] = {}
    for key in tensors:
        info = info_of(tensors, key)
        if info.dtype.is_floating_point and key != PERIODS:
            totals[info.dtype] = totals.get(info.dtype, 0) + info.nbytes
    return max(totals, key=totals.get) if totals else torch.float32
