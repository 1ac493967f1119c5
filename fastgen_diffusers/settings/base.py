"""What every settings value shares: a frozen dataclass whose fields carry their help text, JSON with a version, and
field-by-field merging (a call's values over stored ones), plus the small value checks the values are built from.

Imports nothing heavy (no torch): the CLI checks a directory's stored settings and renders ``--help`` from these values
before any model module loads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field, fields, replace
from typing import Any, ClassVar, TypeVar

SETTINGS_VERSION = 1

Value = TypeVar("Value", bound="SettingsValue")


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. Also a ``ValueError``, so that code catching ``ValueError`` for bad input (as
    diffusers' ``check_inputs`` raises it) catches this too."""


def setting(default: Any = None, help: str = "", *, stored: bool = True) -> Any:  # noqa: A002 - argparse's word
    """A settings field: its default and its help text (the CLI's ``--help`` renders it). ``stored=False``: a
    per-call value that a pipeline config never holds (a call's value stands even when it is ``None``)."""
    return field(default=default, metadata={"help": help, "stored": stored})


def type_name(value: Any) -> str:
    return type(value).__name__


def check_bool(name: str, value: Any) -> None:
    """``True`` or ``False``, nothing else (``"yes"`` and ``1`` are refused)."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"`{name}` must be True or False, got {value!r} ({type_name(value)}).")


def check_int(name: str, value: Any, minimum: int | None = None) -> None:
    """A Python (or NumPy) integer, not a bool and not a float, at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"`{name}` must be an int, got {value!r} ({type_name(value)}).")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be at least {minimum}, got {value}.")


def check_real(name: str, value: Any, minimum: float | None = None) -> None:
    """A finite real number (int or float, not a bool or a string), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"`{name}` must be a number, got {value!r} ({type_name(value)}).")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be at least {minimum}, got {value}.")


def as_floats(name: str, values: Any) -> tuple[float, ...] | None:
    """A flat sequence of finite numbers as a tuple of floats (``None`` stays ``None``)."""
    if values is None:
        return None
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a 1-D array or tensor
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ArgumentTypeError(f"`{name}` must be a list of numbers, got {type_name(values)}.")
    values = [v.item() if hasattr(v, "item") and not isinstance(v, numbers.Real) else v for v in values]
    for value in values:
        check_real(name, value)
    return tuple(float(value) for value in values)


def merge_values(cls: type, stored: Mapping[str, Any], call: Mapping[str, Any]) -> dict[str, Any]:
    """``call`` over ``stored``, field by field (fields of the dataclass ``cls``): a call's ``None`` keeps the stored
    value, except for per-call fields (``stored=False``), whose call value always stands."""
    values = dict(stored)
    for f in fields(cls):
        if f.name in call and (call[f.name] is not None or not f.metadata.get("stored", True)):
            values[f.name] = call[f.name]
    return values


class SettingsValue:
    """Mixin of the frozen settings dataclasses (see the module docstring)."""

    # ``(stored, call) -> values``: how [`merge`] lays a call's values over the stored ones; a class with a rule of its
    # own (a schedule, the sink) sets its merge function here, so that ``merge`` and ``RolloutSettings`` agree
    merge_rule: ClassVar[Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]] = classmethod(merge_values)

    # ------------------------------------------------------------------ fields and help
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def help(cls, name: str) -> str:
        """The help text of field ``name`` (what ``--help`` shows for its flag)."""
        for f in fields(cls):
            if f.name == name:
                return f.metadata.get("help", "")
        raise ValueError(f"{cls.__name__} has no setting {name!r}; accepted: {cls.field_names()}.")

    # ------------------------------------------------------------------ copies
    def replace(self: Value, **changes: Any) -> Value:
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    def merge(self: Value, other: Value | None = None, **overrides: Any) -> Value:
        """This value (the stored one) with ``other``'s fields (a call's), then ``overrides``, over it field by
        field: a ``None`` keeps the stored value, except for per-call fields (``stored=False``)."""
        call = {} if other is None else {name: getattr(other, name) for name in self.field_names()}
        unknown = sorted(set(overrides) - set(self.field_names()))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no setting {unknown}; accepted: {self.field_names()}.")
        values = self.merge_rule({name: getattr(self, name) for name in self.field_names()}, call)
        return type(self)(**self.merge_rule(values, overrides))

    # ------------------------------------------------------------------ JSON
    def values(self) -> dict[str, Any]:
        """The fields as JSON-ready values (tuples as lists), without a version."""
        return {f.name: _json(getattr(self, f.name)) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with ``"version"`` (see [`from_dict`])."""
        return {"version": SETTINGS_VERSION, **self.values()}

    @classmethod
    def from_dict(cls: type[Value], data: Mapping[str, Any]) -> Value:
        """The value that [`to_dict`] wrote; ``ValueError`` for another version or an unknown key."""
        return cls(**{name: _unjson(value) for name, value in cls._checked_dict(data).items()})

    @classmethod
    def _checked_dict(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """``data`` without its ``"version"``; ``ValueError`` for another version or a key that is no field."""
        data = dict(data)
        version = data.pop("version", SETTINGS_VERSION)
        if version != SETTINGS_VERSION:
            raise ValueError(f"`version` must be {SETTINGS_VERSION} (this package's settings), got {version!r}.")
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{cls.__name__} has no setting {unknown}; accepted: {cls.field_names()}.")
        return data


def _json(value: Any) -> Any:
    if isinstance(value, SettingsValue):
        return value.values()
    if isinstance(value, tuple):
        return [_json(entry) for entry in value]
    return value


def _unjson(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
