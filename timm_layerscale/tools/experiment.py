"""Experiment files: which variant to shrink, how, on what data, for how long, with which init values and seeds.

The shipped ones live in `configs/experiments/` (`demo.yaml` for the main job, `ablate.yaml` for
`timm-ls ablate`); every key is checked here, so a typo is one error line naming the allowed keys.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timm_ls import paths
from timm_ls.plain_yaml import load_file

from ..config import parse_scalar
from .shapes import ShapesSpec
from .trainer import TrainConfig

TOP_LEVEL_KEYS = ("description", "variant", "model", "init_values", "seeds", "data", "train")


def experiments_dir() -> Path:
    return paths.experiments_dir()


@dataclass(frozen=True)
class Experiment:
    variant: str
    model: dict[str, Any] = field(default_factory=dict)  # VitLsConfig fields over the variant's
    init_values: tuple[Any, ...] = ()  # empty: the variant's own
    seeds: tuple[int, ...] = (0,)
    data: ShapesSpec = field(default_factory=ShapesSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    source: str = ""

    def replace(self, **changes: Any) -> Experiment:
        return dataclasses.replace(self, **changes)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v: Any, low: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low


# (section, fields, check, what is allowed)
_RULES = (
    ("data", ("image_size", "train_size", "test_size"), _positive_int, "a positive integer"),
    ("data", ("seed",), lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    ("data", ("noise",), lambda v: _number(v, 0), "a number >= 0"),
    ("data", ("min_radius", "max_radius"), lambda v: _number(v, 0) and 0 < v <= 0.5, "a number in (0, 0.5]"),
    ("train", ("steps", "batch_size", "eval_every"), _positive_int, "a positive integer"),
    ("train", ("warmup",), lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
    ("train", ("lr",), lambda v: _number(v, 0) and v > 0, "a positive number"),
    ("train", ("weight_decay",), lambda v: _number(v, 0), "a number >= 0"),
)


def _section(cls: type, values: Any, name: str, where: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(
            f"{where}: {name}: got {values!r}; allowed: a mapping of {[f.name for f in dataclasses.fields(cls)]}"
        )
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: {name}: unknown key(s) {unknown}; allowed: {allowed}")
    values = {k: parse_scalar(v) for k, v in values.items()}
    for section, names, ok, what in _RULES:
        for key in names:
            if section == name and key in values and not ok(values[key]):
                raise ValueError(f"{where}: {name}.{key}: got {values[key]!r}; allowed: {what}")
    return cls(**values)


def check(experiment: Experiment, where: str = "experiment") -> Experiment:
    """Re-checks an experiment after flags changed it; returns it unchanged when valid."""
    data = _section(ShapesSpec, dataclasses.asdict(experiment.data), "data", where)
    _section(TrainConfig, dataclasses.asdict(experiment.train), "train", where)
    if data.min_radius > data.max_radius:
        raise ValueError(f"{where}: data.min_radius {data.min_radius} is above data.max_radius {data.max_radius}")
    if not experiment.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in experiment.seeds):
        raise ValueError(f"{where}: seeds: got {list(experiment.seeds)!r}; allowed: a list of integers")
    return experiment


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"experiment file {path} does not exist; pass a YAML file like {experiments_dir() / 'ablate.yaml'}"
        )
    raw = load_file(path) or {}
    where = str(path)
    if not isinstance(raw, dict) or "variant" not in raw:
        raise ValueError(
            f"{where}: an experiment is a mapping with at least `variant:`; allowed keys: {list(TOP_LEVEL_KEYS)}"
        )
    unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(TOP_LEVEL_KEYS)}")
    init_values = raw.get("init_values") or ()
    if not isinstance(init_values, list | tuple):
        init_values = (init_values,)
    seeds = raw.get("seeds", [0])
    experiment = Experiment(
        variant=str(raw["variant"]),
        model=dict(raw.get("model") or {}),
        init_values=tuple(init_values),
        seeds=tuple(seeds) if isinstance(seeds, list | tuple) else (seeds,),
        data=_section(ShapesSpec, raw.get("data") or {}, "data", where),
        train=_section(TrainConfig, raw.get("train") or {}, "train", where),
        source=where,
    )
    return check(experiment, where)
