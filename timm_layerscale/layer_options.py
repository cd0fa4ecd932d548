"""The layer options a config names (its norm, its FFN, its attention's switches), each declared once beside its
layer: the class the model builds for it, the native keys that show it is present, and the formats that hold it.

A layer module registers its options (`register_option`); the config checks a field's value against the options
registered for it, the model builds the option's class, identity reads an option from a checkpoint's native keys by
its signature, and the family records and formats refuse an option that does not name them. Adding a norm (or an
FFN) is its module and one `register_option` call.

This module knows no other of the package: the config and the family records ask it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerOption:
    """One value of a config field and what it is in a model and a checkpoint.

    `layer`: what the model builds for it (a class, or a function taking the field's companion args; None for a
    switch the layer reads). `signature`: the native keys present exactly when a checkpoint has it (the option
    whose signature is present and longest wins, so a DyT's `norm.alpha` beside LayerNorm's weight and bias is
    read as DyT). `shows`: the other args its keys decide, each with the key whose presence makes it true (an
    MLP's bias). `formats`: the formats that can hold it by name, or None for every format (a family's record
    may still fix the field for one of its formats)."""

    field: str
    value: Any
    layer: Callable[..., Any] | None = None
    signature: tuple[str, ...] = ()
    shows: Mapping[str, str] = field(default_factory=dict)
    formats: Collection[str] | None = None

    def __post_init__(self) -> None:
        if self.formats is not None:
            object.__setattr__(self, "formats", frozenset(self.formats))

    def present(self, keys: Collection[str]) -> bool:
        return all(key in keys for key in self.signature)

    def held_by(self, format_name: str) -> bool:
        return self.formats is None or format_name in self.formats


OPTIONS: dict[str, dict[Any, LayerOption]] = {}  # field -> value -> its option, in registration order


def register_option(option: LayerOption) -> LayerOption:
    """Adds a value of a config field: configs may name it, the model builds its layer, identity reads it."""
    if not isinstance(option, LayerOption):
        raise TypeError(f"register_option takes a LayerOption, got {type(option).__name__}")
    OPTIONS.setdefault(option.field, {})[option.value] = option
    return option


def option_values(field_name: str) -> tuple[Any, ...]:
    """The values registered for a config field, in registration order."""
    return tuple(OPTIONS.get(field_name, {}))


def layer_option(field_name: str, value: Any) -> LayerOption:
    """The option a config's value names (its rule has checked it is registered)."""
    found = OPTIONS.get(field_name, {}).get(value)
    if found is None:
        allowed = ", ".join(map(repr, option_values(field_name))) or "none registered"
        raise ValueError(f"{field_name}: got {value!r}; allowed: {allowed} (or one added by register_option)")
    return found


def options_in_keys(keys: Collection[str]) -> dict[str, Any]:
    """Each field's value that native keys show, by the options' signatures: per field, the option with the
    longest signature wholly present (ties: the one registered last; an empty signature is always present, the
    value where no other shows); a field none shows is left out."""
    found: dict[str, Any] = {}
    for field_name, options in OPTIONS.items():
        present = [o for o in reversed(list(options.values())) if o.present(keys)]
        if present:
            found[field_name] = max(present, key=lambda o: len(o.signature)).value
    return found


def shown_args(keys: Collection[str]) -> dict[str, bool]:
    """The args the options' keys decide (an FFN's bias): true where any option shows it by its key."""
    shown: dict[str, bool] = {}
    for options in OPTIONS.values():
        for option in options.values():
            for arg, key in option.shows.items():
                shown[arg] = shown.get(arg, False) or key in keys
    return shown


def unheld_option(config: Any, format_name: str) -> LayerOption | None:
    """The first option of `config` that the format does not hold, or None."""
    for field_name, options in OPTIONS.items():
        option = options.get(getattr(config, field_name, None))
        if option is not None and not option.held_by(format_name):
            return option
    return None
