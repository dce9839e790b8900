"""Typed configs: the one strict check of plain dicts (YAML, JSON, ``model.json``) and the one way a config
dataclass becomes command-line flags.

A key a dataclass does not have is an error that names it, suggests the field it was probably meant to be, and
lists the valid keys (a typo must never be silently ignored). Renamed fields keep loading under their old
names with a DeprecationWarning. After openai/whisper ``whisper/decoding.py`` (``DecodingOptions``: a dataclass
is the config).

A flag is a field: :func:`option` declares a field with its help text, :func:`add_dataclass_args` turns the
fields into argparse flags (``--field-name``, the type, choices and help from the field; a ``bool`` field that
defaults to False is ``--name``, one that defaults to True is ``--no-name``, its help read after "do not"), and
:func:`dataclass_from_args` builds the dataclass back from the parsed flags. Recipes change defaults with ``parser.set_defaults`` (or the
``defaults`` argument), never by declaring a flag again. The generator is the standard library's argparse rather
than jsonargparse or tyro: the configs are flat dataclasses of scalars, the recipes and their tests already
speak argparse (``set_defaults``, ``SystemExit`` on a bad flag), and a core dependency for forty lines is not
worth it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
import warnings
from typing import Any, Iterable, Mapping, TypeVar

__all__ = ["add_dataclass_args", "check_config_keys", "dataclass_from_args", "option", "parse_bool", "strict_from_dict"]

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


# -- dataclass -> argparse -------------------------------------------------------------------------


def option(default: Any = dataclasses.MISSING, *, help: str, choices: Iterable[Any] | None = None,  # noqa: A002
           metavar: str | None = None, default_factory: Any = dataclasses.MISSING,
           parse: Any = None, takes_value: bool = False) -> Any:
    """A dataclass field that is also a command-line flag: ``help`` (and ``choices``, ``metavar``) go to
    :func:`add_dataclass_args`.

    ``parse``: the flag's argparse ``type`` when the field's type alone does not say how to read it (a JSON
    object, a checked list); it raises ``argparse.ArgumentTypeError`` naming the problem. ``takes_value``: a
    ``bool`` flag written with a value, ``--use-ctc true|false`` (icefall's style; a bare ``--use-ctc`` means true).
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "metavar": metavar,
                "parse": parse, "takes_value": takes_value}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) as a bool; anything else is an ArgumentTypeError."""
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (or 1/0), got {text!r}")


def _flag_type(name: str, hint: Any) -> tuple[Any, bool]:
    """The argparse ``type`` of a field's type hint and whether the field may be None."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else hint
    if hint in (int, float, str, bool):
        return hint, optional
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (Ellipsis,):
        item = typing.get_args(hint)[0]

        def parse(text: str) -> tuple:
            try:
                return tuple(item(v) for v in text.split(",") if v.strip())
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected comma-separated {item.__name__} values, got {text!r}") \
                    from None

        parse.__name__ = f"comma-separated {item.__name__}s"
        return parse, optional
    raise TypeError(f"field {name!r} has type {hint!r}, which has no flag; leave it out (exclude=...) or give it a "
                    "scalar type")


def add_dataclass_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                       only: Iterable[str] | None = None, exclude: Iterable[str] = (),
                       defaults: Mapping[str, Any] | None = None) -> list[str]:
    """Declare one flag per field of the dataclass ``cls`` (those in ``only``, less ``exclude``); return the
    field names declared.

    ``defaults`` replaces field defaults (an unknown name is an error naming it); a field without a default, and
    none in ``defaults``, is a required flag. Help comes from the field's :func:`option` metadata.

    Raises:
        ValueError: an unknown name in ``only``, ``exclude`` or ``defaults``.
        TypeError: a selected field whose type has no flag (a nested dataclass, a dict).
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for names in (only or (), exclude, defaults or {}):
        check_config_keys(cls, dict.fromkeys(names))
    selected = [n for n in (only if only is not None else fields) if n not in set(exclude)]
    hints = typing.get_type_hints(cls)
    defaults = dict(defaults or {})
    for name in selected:
        f = fields[name]
        meta = f.metadata
        flag = "--" + name.replace("_", "-")
        if name in defaults:
            default = defaults[name]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        kind = meta.get("parse") or _flag_type(name, hints[name])[0]
        kwargs: dict[str, Any] = {"dest": name, "help": meta.get("help")}
        if kind is bool and meta.get("takes_value"):
            parser.add_argument(flag, type=parse_bool, nargs="?", const=True, default=bool(default),
                                metavar="true|false", **kwargs)
            continue
        if kind is bool:
            if default is True:
                kwargs["help"] = f"do not {kwargs['help']}" if kwargs["help"] else None
                parser.add_argument("--no-" + name.replace("_", "-"), action="store_false", **kwargs)
            else:
                parser.add_argument(flag, action="store_true", **kwargs)
            parser.set_defaults(**{name: bool(default)})
            continue
        kwargs["type"] = kind
        if meta.get("choices") is not None:
            kwargs["choices"] = meta["choices"]
        if meta.get("metavar") is not None:
            kwargs["metavar"] = meta["metavar"]
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        parser.add_argument(flag, **kwargs)
    return selected


def dataclass_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """``cls`` from the parsed flags of its fields (those ``args`` has) and ``overrides``; the dataclass's own
    checks raise as usual (ValueError)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: getattr(args, k) for k in names if hasattr(args, k)}
    return cls(**{**values, **check_config_keys(cls, overrides)})
