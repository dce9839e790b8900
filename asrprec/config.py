"""Typed configs: dataclasses whose fields carry their help (:func:`option`), checked strictly when built from
plain dicts (YAML files, ``config.json``, ``model.json``) or from dotted ``section.field`` overrides.

A key a dataclass does not have is an error that names it, suggests the field it was probably meant to be, and
lists the valid keys (a typo must never be silently ignored). Renamed fields keep loading under their old
names with a DeprecationWarning. After openai/whisper ``whisper/decoding.py`` (``DecodingOptions``: a dataclass
is the config).

A program's config is a dataclass of sections (``model``, ``precision``, ``data``, ``train``, ``checks``; each a
dataclass). It is built from layers, each a nested dict checked against the classes: the program's defaults, the
YAML files of ``--config``, and the command line (:mod:`asrprec.cli` turns flags and ``--section.field VALUE``
overrides into such layers). Values read as text (an override) take the field's type (:func:`parse_text`).

The parsing is written here rather than taken from a config library (OmegaConf and the like): the configs are
dataclasses of scalars two or three levels deep, the checks (closest key, type per field, the dataclasses' own
``__post_init__``) take a page, and PyYAML is already installed with lhotse; a dependency for that is not worth it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, TypeVar

from asrprec.errors import AsrprecError

__all__ = ["ConfigError", "build_config", "check_config_keys", "config_defaults", "config_to_dict", "config_to_yaml",
           "merge_layer", "option", "parse_bool", "parse_text", "read_yaml", "section_fields", "strict_from_dict"]

T = TypeVar("T")


class ConfigError(AsrprecError, ValueError):
    """A config file, key or value that is wrong; the message names the key and the fix."""


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


def option(default: Any = dataclasses.MISSING, *, help: str, choices: Iterable[Any] | None = None,  # noqa: A002
           metavar: str | None = None, default_factory: Any = dataclasses.MISSING,
           parse: Any = None, takes_value: bool = False, kw_only: bool = False) -> Any:
    """A dataclass field with its one-line ``help`` (and ``choices``, ``metavar``), read by the flag generator
    (:mod:`asrprec.cli`) and the docs.

    ``parse``: how text becomes the value when the field's type alone does not say (a JSON object, a checked list);
    it raises ValueError naming the problem. ``takes_value``: a ``bool`` flag written with a value, ``--use-ctc
    true|false`` (icefall's style; a bare ``--use-ctc`` means true). ``kw_only``: a field without a default after
    fields with one (a subclass of a config with defaults).
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "metavar": metavar,
                "parse": parse, "takes_value": takes_value}
    kw = {"kw_only": True} if kw_only else {}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata, **kw)
    return dataclasses.field(default=default, metadata=metadata, **kw)


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) as a bool; anything else is a ValueError."""
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false (or 1/0), got {text!r}")


# -- the shape of a config: sections and fields -----------------------------------------------------


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """``(hint without None, whether None is allowed)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        return (args[0] if len(args) == 1 else hint), optional
    return hint, False


def section_fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """``{name: (field, type hint)}`` of the init fields of the dataclass ``cls``."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError:  # a class of a script run without a module (runpy): a section's type is its default_factory
        hints = {}
        for base in reversed(cls.__mro__):
            if dataclasses.is_dataclass(base) and base is not cls:
                hints.update({name: hint for name, (_, hint) in section_fields(base).items()})
        for f in dataclasses.fields(cls):
            if f.name not in hints or f.name in cls.__dict__.get("__annotations__", {}):
                factory = f.default_factory
                hints[f.name] = factory if isinstance(factory, type) else type(f.default)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def _dataclass_of(hint: Any) -> type | None:
    inner, _ = _unwrap_optional(hint)
    return inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def config_defaults(cls: type) -> dict[str, Any]:
    """The defaults of ``cls`` as a nested dict (a section field is its class's defaults; a field without a default
    is left out)."""
    out: dict[str, Any] = {}
    for name, (f, hint) in section_fields(cls).items():
        sub = _dataclass_of(hint)
        value = _default(f)
        if sub is not None and (value is dataclasses.MISSING or dataclasses.is_dataclass(value)):
            out[name] = config_to_dict(value) if dataclasses.is_dataclass(value) else config_defaults(sub)
        elif value is not dataclasses.MISSING:
            out[name] = copy.deepcopy(value)
    return out


def _where(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _unknown(cls: type, path: str, key: str) -> ConfigError:
    names = sorted(section_fields(cls))
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {_where(path, close[0])!r}?" if close else ""
    return ConfigError(f"unknown config key {_where(path, key)!r}{hint} (valid keys{' of ' + path if path else ''}: "
                       f"{', '.join(names)})")


def merge_layer(cls: type, base: dict[str, Any], layer: Mapping[str, Any], *, path: str = "",
                source: str = "") -> dict[str, Any]:
    """``base`` (a nested dict of ``cls``) updated by ``layer``, each key checked against ``cls``; a section given
    as a dict updates the section key by key. Raises :class:`ConfigError` naming an unknown key (with the closest
    valid one) and ``source``."""
    if not isinstance(layer, Mapping):
        raise ConfigError(f"{source or 'config'}: {path or 'the config'} must be a mapping of keys, got "
                          f"{type(layer).__name__}")
    fields = section_fields(cls)
    out = dict(base)
    for key, value in layer.items():
        if key not in fields:
            e = _unknown(cls, path, str(key))
            raise ConfigError(f"{source}: {e}" if source else str(e))
        sub = _dataclass_of(fields[key][1])
        if sub is not None and isinstance(value, Mapping):
            below = out.get(key)
            below = config_to_dict(below) if dataclasses.is_dataclass(below) else dict(below or {})
            out[key] = merge_layer(sub, below, value, path=_where(path, key), source=source)
        else:
            out[key] = value
    return out


def parse_text(cls: type, dotted: str, text: str) -> dict[str, Any]:
    """A one-key nested layer setting ``dotted`` (``train.base_lr``) to ``text`` read as the field's type: int,
    float, ``true``/``false``, comma-separated lists, JSON/YAML for dicts, ``none`` for an optional field."""
    parts = dotted.split(".")
    owner, path = cls, ""
    for i, key in enumerate(parts):
        fields = section_fields(owner)
        if key not in fields:
            raise _unknown(owner, path, key)
        f, hint = fields[key]
        sub = _dataclass_of(hint)
        if i < len(parts) - 1:
            if sub is None:
                raise ConfigError(f"{_where(path, key)!r} is a value, not a section: write {_where(path, key)}=VALUE")
            owner, path = sub, _where(path, key)
            continue
        try:
            value = text_to_value(f, hint, text)
        except ValueError as e:
            raise ConfigError(f"{dotted}: {e}") from None
    layer: Any = value
    for key in reversed(parts):
        layer = {key: layer}
    return layer


def text_to_value(f: dataclasses.Field, hint: Any, text: str) -> Any:
    """The value of field ``f`` (type ``hint``) written as ``text`` on a command line."""
    inner, optional = _unwrap_optional(hint)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    parse = f.metadata.get("parse")
    if parse is not None:
        return parse(text)
    if inner is bool:
        return parse_bool(text)
    if inner in (int, float):
        try:
            return inner(text)
        except ValueError:
            raise ValueError(f"expected {'an integer' if inner is int else 'a number'}, got {text!r}") from None
    if inner is str:
        return text
    if typing.get_origin(inner) is tuple:
        item = typing.get_args(inner)[0]
        try:
            return tuple(item(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"expected comma-separated {item.__name__} values, got {text!r}") from None
    import yaml

    try:  # dicts, lists, sections: YAML's flow style (JSON is YAML)
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML/JSON ({str(e).splitlines()[0]})") from None


def _typed(name: str, f: dataclasses.Field, hint: Any, value: Any) -> Any:
    """``value`` from a YAML file or a dict checked against the field's type (an int for a float is widened, a
    list for a tuple converted; text for a field with a ``parse`` is parsed)."""
    inner, optional = _unwrap_optional(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name}: null is not allowed (expected {getattr(inner, '__name__', inner)})")
    if isinstance(value, str) and f.metadata.get("parse") is not None:
        try:
            return f.metadata["parse"](value)
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from None
    expect = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(inner)
    if expect is not None:
        if not isinstance(value, expect) or (inner is not bool and isinstance(value, bool)):
            raise ConfigError(f"{name}: expected {inner.__name__}, got {type(value).__name__} {value!r}"
                              + (" (quote it)" if inner is str else ""))
        return float(value) if inner is float else value
    if typing.get_origin(inner) is tuple:
        if isinstance(value, str):
            return text_to_value(f, hint, value)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(value)
    return value


def build_config(cls: type[T], d: Mapping[str, Any], *, path: str = "") -> T:
    """``cls`` from the nested dict ``d`` (sections built recursively, every value checked against its field's
    type); a missing field takes its default. The dataclasses' own checks raise as :class:`ConfigError` naming the
    section."""
    fields = section_fields(cls)
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in fields:
            raise _unknown(cls, path, key)
        f, hint = fields[key]
        sub = _dataclass_of(hint)
        if sub is not None and isinstance(value, Mapping):
            kwargs[key] = build_config(sub, value, path=_where(path, key))
        elif sub is not None and (value is None and _unwrap_optional(hint)[1] or isinstance(value, sub)):
            kwargs[key] = value
        elif sub is not None:
            raise ConfigError(f"{_where(path, key)} is a section: give its fields as a mapping, got {value!r}")
        else:
            kwargs[key] = _typed(_where(path, key), f, hint, value)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_to_dict(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as a nested dict of plain values (tuples as lists), field order kept."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}


def config_to_yaml(cfg: Any, header: str = "") -> str:
    """The YAML text of a config (``header``: comment lines put first)."""
    import yaml

    class Dumper(yaml.SafeDumper):  # sections as blocks, lists on one line
        pass

    Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    body = yaml.dump(config_to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg, Dumper=Dumper, sort_keys=False,
                     default_flow_style=False, width=120)
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping (an empty file is ``{}``). Raises FileNotFoundError / ConfigError."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file is a mapping of sections, got {type(data).__name__}")
    return data


def json_dict(text: str) -> dict:
    """A JSON (or YAML flow) object written on a command line, e.g. ``'{"dropout": 0.0}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e}); write e.g. '{{\"dropout\": 0.0}}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object of preset fields, got {type(value).__name__}")
    return value
