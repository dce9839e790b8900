"""Typed configs from plain dicts (YAML, JSON, ``model.json``): the one strict check of their keys.

A key a dataclass does not have is an error that names it, suggests the field it was probably meant to be, and
lists the valid keys (a typo must never be silently ignored). Renamed fields keep loading under their old
names with a DeprecationWarning. After openai/whisper ``whisper/decoding.py`` (``DecodingOptions``: a dataclass
is the config).
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any, Iterable, Mapping, TypeVar

__all__ = ["check_config_keys", "strict_from_dict"]

T = TypeVar("T")


def check_config_keys(cls: type, d: Mapping[str, Any], *, renamed: Mapping[str, str] | None = None,
                      exclude: Iterable[str] = ()) -> dict[str, Any]:
    """``d`` as a dict of ``cls``'s field names, old names in ``renamed`` (old -> new) replaced.

    Args:
        cls: a dataclass. d: the keys and values to check.
        renamed: fields that were renamed; an old name gives a DeprecationWarning and is mapped to the new one.
        exclude: fields the caller sets itself (not accepted in ``d``, not listed as valid).
    Raises:
        ValueError: a key that is no field of ``cls`` (naming the closest field and the valid keys), or a field
            given under both its old and its new name.
    """
    renamed = dict(renamed or {})
    names = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    out: dict[str, Any] = {}
    unknown = []
    for key, value in d.items():
        if key in renamed and key not in names:
            new = renamed[key]
            if new in d:
                raise ValueError(f"{cls.__name__}: both {key!r} and its new name {new!r} are given; keep only {new!r}")
            warnings.warn(f"{cls.__name__} field {key!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=3)
            key = new
        if key not in names:
            unknown.append(key)
        out[key] = value
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            if close:
                hints.append(f"{close[0]!r} for {key!r}")
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise ValueError(f"unknown {cls.__name__} keys {sorted(unknown)}{hint}; valid keys: {sorted(names)}")
    return out


def strict_from_dict(cls: type[T], d: Mapping[str, Any], *, renamed: Mapping[str, str] | None = None) -> T:
    """``cls(**d)`` after :func:`check_config_keys` (unknown keys raise ValueError naming them)."""
    if not isinstance(d, Mapping):
        raise TypeError(f"{cls.__name__} needs a dict of its fields, got {type(d).__name__}")
    return cls(**check_config_keys(cls, d, renamed=renamed))
