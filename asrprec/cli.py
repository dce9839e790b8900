"""Every entry point's scaffolding: :func:`run_main`, :func:`setup_logging`, and the command line of a config
(:func:`parse_config`): the one place the library speaks argparse.

A program's command line, over a config dataclass of sections (:mod:`asrprec.config`), in the order applied:

* the program's defaults (a nested dict of the fields it changes);
* ``--config FILE.yaml`` (repeatable; later files win): any part of the config, unknown keys refused;
* ``--section.field VALUE`` or ``--section.field=VALUE``: any field of the config (``--train.base_lr 0.03``,
  ``--train.compile_mode max-autotune``, ``--data.spec_augment_config.num_frame_masks 5``);
* the program's plain flags (``--precision``, ``--exp-dir``, ...), each a field named once in the program.

``--print-config`` prints the effective config as YAML and exits; the file it prints is a valid ``--config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from typing import Any, Callable, Mapping, Sequence, TypeVar

from asrprec.config import (
    ConfigError, build_config, check_config_keys, config_defaults, config_to_dict, config_to_yaml, merge_layer,
    parse_bool, parse_text, read_yaml, section_fields, text_to_value,
)
from asrprec.devices import get_rank, get_world_size
from asrprec.errors import AsrprecError, ResumableStop

__all__ = ["ConfigCommandLine", "add_dataclass_args", "dataclass_from_args", "parse_config", "parse_flat", "run_main",
           "setup_logging"]

T = TypeVar("T")


def run_main(main: Callable[[], Any], prog: str, also: tuple[type[BaseException], ...] = ()) -> None:
    """Run a program's ``main``; an error a user can fix (:class:`~asrprec.errors.AsrprecError`, a missing file,
    and the exception types in ``also``) ends the program with ``prog: error: <message>`` on stderr (and in the log)
    and exit code 2 instead of a traceback. A run stopped where it can continue
    (:class:`~asrprec.errors.ResumableStop`, e.g. a preempted training run) exits with its ``exit_code``."""
    log = logging.getLogger("asrprec")
    try:
        main()
    except ResumableStop as e:
        log.warning("%s", e)
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except (AsrprecError, FileNotFoundError, *also) as e:
        log.error("%s", e)
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(getattr(e, "exit_code", AsrprecError.exit_code)) from None


def setup_logging(log_file: str | None = None, rank: int | None = None) -> None:
    """Rank 0 (default: this process's rank) logs to stderr and ``log_file``; other ranks log warnings to
    stderr only, tagged with their rank (only rank 0 writes files)."""
    import os

    if rank is None:  # torchrun's RANK also before the process group exists
        rank = get_rank() if get_world_size() > 1 else int(os.environ.get("RANK", "0"))
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file and rank == 0:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s [%(name)s] " + (f"[rank {rank}] " if rank else "") + "%(message)s",
        handlers=handlers,
        force=True,
    )


# -- one flat dataclass as flags (small programs: prepare.py, the sherpa-onnx child) ----------------------


def _without_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and len(typing.get_args(hint)) == 2 else hint


def _arg_type(f: dataclasses.Field, hint: Any) -> Callable[[str], Any]:
    """argparse's ``type`` for a field: :func:`asrprec.config.text_to_value`, its ValueError as argparse's error."""
    def parse(text: str) -> Any:
        try:
            return text_to_value(f, hint, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = getattr(hint, "__name__", "value")
    return parse


def _add_field_flag(parser: Any, flag: str, dest: str, f: dataclasses.Field, hint: Any, default: Any) -> None:
    """One flag for one field; ``default`` may be ``argparse.SUPPRESS`` (the flag only says what was given) or
    ``dataclasses.MISSING`` (a required flag)."""
    meta = f.metadata
    kwargs: dict[str, Any] = {"dest": dest, "help": meta.get("help")}
    if default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
    full, hint = hint, _without_none(hint)
    inner = hint if hint in (bool,) else None
    if inner is bool and meta.get("takes_value"):
        parser.add_argument(flag, type=parse_bool, nargs="?", const=True, metavar="true|false", **kwargs)
        return
    if inner is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        return
    if typing.get_origin(hint) is tuple and meta.get("parse") is None:  # --splits test dev, or test,dev
        parse = _arg_type(f, full)

        class Join(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None):
                setattr(namespace, self.dest, parse(",".join(values)))

        kwargs.update(nargs="+", action=Join)
    else:
        kwargs["type"] = _arg_type(f, full)
    if meta.get("choices") is not None:
        kwargs["choices"] = meta["choices"]
    kwargs["metavar"] = meta.get("metavar") or (None if meta.get("choices") else flag.lstrip("-").replace("-", "_")
                                                .upper())
    parser.add_argument(flag, **kwargs)


def add_dataclass_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                       only: Sequence[str] | None = None, exclude: Sequence[str] = (),
                       defaults: Mapping[str, Any] | None = None) -> list[str]:
    """One flag per field of the flat dataclass ``cls`` (``--field-name``; a ``bool`` is ``--name`` /
    ``--no-name``); ``defaults`` replace field defaults (an unknown name is an error naming it); a field without
    a default is a required flag. Returns the field names declared."""
    fields = section_fields(cls)
    for names in (only or (), exclude, defaults or {}):
        check_config_keys(cls, dict.fromkeys(names))
    defaults = dict(defaults or {})
    selected = [n for n in (only if only is not None else fields) if n not in set(exclude)]
    for name in selected:
        f, hint = fields[name]
        value = defaults[name] if name in defaults else (
            f.default if f.default is not dataclasses.MISSING else
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        _add_field_flag(parser, "--" + name.replace("_", "-"), name, f, hint, value)
    return selected


def parse_flat(cls: type[T], argv: Sequence[str] | None = None, *, description: str | None = None,
               defaults: Mapping[str, Any] | None = None) -> T:
    """``cls`` (a flat dataclass) from a command line of its flags (:func:`add_dataclass_args`); a bad value exits
    like argparse (code 2)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, cls, defaults=defaults)
    args = p.parse_args(argv)
    try:
        return dataclass_from_args(cls, args)
    except ValueError as e:
        p.error(str(e))


def dataclass_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """``cls`` from the parsed flags of its fields (those ``args`` has) and ``overrides``; the dataclass's own
    checks raise as usual (ValueError)."""
    names = set(section_fields(cls))
    values = {k: getattr(args, k) for k in names if hasattr(args, k)}
    return cls(**{**values, **check_config_keys(cls, overrides)})


# -- a config of sections: defaults, --config files, dotted overrides, plain flags -------------------------


def _field_at(cls: type, dotted: str) -> tuple[dataclasses.Field, Any]:
    owner = cls
    parts = dotted.split(".")
    for key in parts[:-1]:
        owner = section_fields(owner)[key][1]
        owner = next((a for a in getattr(owner, "__args__", (owner,)) if a is not type(None)), owner)
    return section_fields(owner)[parts[-1]]


def _split_dotted(argv: Sequence[str], sections: set[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """``argv`` without its ``--section.field VALUE`` / ``--section.field=VALUE`` overrides, and those."""
    rest: list[str] = []
    dotted: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token[2:].split("=", 1)[0] if token.startswith("--") else ""
        if "." in name and name.split(".", 1)[0] in sections:
            if "=" in token:
                dotted.append((name, token.split("=", 1)[1]))
            elif i + 1 < len(argv):
                dotted.append((name, argv[i + 1]))
                i += 1
            else:
                raise ConfigError(f"--{name} needs a value: --{name} VALUE")
            i += 1
            continue
        rest.append(token)
        i += 1
    return rest, dotted


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=46, width=120)


@dataclasses.dataclass
class ConfigCommandLine:
    """The command line of the config dataclass ``cls``.

    ``flags``: the plain flags, each a dotted field path (``"train.exp_dir"`` is ``--exp-dir``; the flag is the
    field's name) or ``(flag, path)`` for another name. ``defaults``: the program's nested dict of defaults over
    ``cls``'s. ``derived``: dotted keys set by the program from others (refused in files and overrides, left out of
    the printed config), mapped to what to set instead.
    """

    cls: type
    flags: Sequence[str | tuple[str, str]]
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    description: str | None = None
    derived: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def _flags(self) -> list[tuple[str, str]]:
        out = []
        for item in self.flags:
            flag, path = item if isinstance(item, tuple) else ("--" + item.rsplit(".", 1)[-1].replace("_", "-"), item)
            out.append((flag, path))
        return out

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=self.description, formatter_class=_Formatter,
                                    epilog="Any other config field: --SECTION.FIELD VALUE; --print-config shows them "
                                           "all (docs/configuration.md).")
        p.add_argument("--config", action="append", default=[], metavar="FILE.yaml",
                       help="config file(s) over the defaults; flags and --SECTION.FIELD win")
        p.add_argument("--print-config", action="store_true", help="print the effective config as YAML and exit")
        for flag, path in self._flags():
            f, hint = _field_at(self.cls, path)
            _add_field_flag(p, flag, "flag:" + path, f, hint, argparse.SUPPRESS)
        return p

    def defaults_dict(self) -> dict[str, Any]:
        return merge_layer(self.cls, config_defaults(self.cls), self.defaults, source="the program's defaults")

    def parse(self, argv: Sequence[str] | None = None) -> Any:
        """The config the command line names (exits like argparse, code 2, on a bad flag, key or value;
        ``--print-config`` prints it and exits 0)."""
        p = self.parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        try:
            argv, dotted = _split_dotted(argv, set(section_fields(self.cls)))
        except ConfigError as e:
            p.error(str(e))
        args = p.parse_args(argv)
        try:
            cfg = self.build(args.config, dotted, {k[5:]: v for k, v in vars(args).items() if k.startswith("flag:")})
        except ConfigError as e:
            p.error(str(e))
        except FileNotFoundError as e:
            p.error(f"--config: {e}")
        if args.print_config:
            sys.stdout.write(self.to_yaml(cfg))
            raise SystemExit(0)
        return cfg

    def build(self, files: Sequence[str] = (), dotted: Sequence[tuple[str, str]] = (),
              flags: Mapping[str, Any] | None = None) -> Any:
        """The config of the defaults, then ``files``, then ``dotted`` overrides (text), then ``flags``
        (``{dotted path: value}``). Raises :class:`ConfigError`."""
        d = self.defaults_dict()
        for path in files:
            layer = read_yaml(path)
            self._refuse_derived(layer, str(path))
            d = merge_layer(self.cls, d, layer, source=str(path))
        for key, text in dotted:
            layer = parse_text(self.cls, key, text)
            self._refuse_derived(layer, f"--{key}")
            d = merge_layer(self.cls, d, layer, source=f"--{key}")
        for key, value in (flags or {}).items():
            layer: Any = value
            for part in reversed(key.split(".")):
                layer = {part: layer}
            d = merge_layer(self.cls, d, layer)
        return build_config(self.cls, d)

    def _refuse_derived(self, layer: Mapping[str, Any], source: str) -> None:
        for key, instead in self.derived.items():
            node: Any = layer
            for part in key.split("."):
                node = node.get(part, dataclasses.MISSING) if isinstance(node, Mapping) else dataclasses.MISSING
            if node is not dataclasses.MISSING:
                raise ConfigError(f"{source}: {key} follows {instead}; set {instead} instead")

    def to_dict(self, cfg: Any) -> dict[str, Any]:
        """``cfg`` as a nested dict without the derived keys."""
        d = config_to_dict(cfg)
        for key in self.derived:
            *parents, last = key.split(".")
            node = d
            for part in parents:
                node = node.get(part) or {}
            if isinstance(node, dict):
                node.pop(last, None)
        return d

    def to_yaml(self, cfg: Any, header: str = "") -> str:
        return config_to_yaml(self.to_dict(cfg), header)


def parse_config(cls: type[T], flags: Sequence[str | tuple[str, str]], *, defaults: Mapping[str, Any] | None = None,
                 description: str | None = None, argv: Sequence[str] | None = None) -> T:
    """:meth:`ConfigCommandLine.parse` in one call."""
    return ConfigCommandLine(cls, flags, defaults or {}, description).parse(argv)
