"""Typed configs: a config of sections is built strictly from layers (defaults, YAML, dotted overrides, flags), each
value read as its field's type; a flag is a field; the shared groups (compile options, weights selection) are
declared once."""

from __future__ import annotations

import dataclasses

import pytest

from asrprec.cli import ConfigCommandLine, add_dataclass_args, dataclass_from_args, parse_flat
from asrprec.config import (
    ConfigError, build_config, config_defaults, config_to_dict, config_to_yaml, merge_layer, option, parse_text,
    read_yaml,
)
from asrprec.data import DataConfig
from asrprec.training import TrainConfig, TrainingConfig


@dataclasses.dataclass
class _Inner:
    rate: float = option(0.5, help="a rate")
    sizes: tuple[int, ...] = option((1, 2), help="comma-separated")
    name: str | None = option(None, help="optional")


@dataclasses.dataclass
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    steps: int = option(3, help="steps")
    fast: bool = option(False, help="go fast")
    table: dict = dataclasses.field(default_factory=dict)


def test_layers_merge_key_by_key_and_values_take_their_field_types():
    d = config_defaults(_Outer)
    assert d == {"inner": {"rate": 0.5, "sizes": [1, 2], "name": None}, "steps": 3, "fast": False, "table": {}}
    d = merge_layer(_Outer, d, {"inner": {"rate": 2}, "table": {"k": [1]}})
    d = merge_layer(_Outer, d, parse_text(_Outer, "inner.sizes", "4,5,6"))
    d = merge_layer(_Outer, d, parse_text(_Outer, "fast", "yes"))
    d = merge_layer(_Outer, d, parse_text(_Outer, "inner.name", "none"))
    cfg = build_config(_Outer, d)
    assert cfg == _Outer(inner=_Inner(rate=2.0, sizes=(4, 5, 6), name=None), steps=3, fast=True, table={"k": [1]})
    assert isinstance(cfg.inner.rate, float)
    assert config_to_dict(cfg) == {"inner": {"rate": 2.0, "sizes": [4, 5, 6], "name": None}, "steps": 3,
                                   "fast": True, "table": {"k": [1]}}


@pytest.mark.parametrize("layer, message", [
    ({"inner": {"rat": 1.0}}, "unknown config key 'inner.rat'; did you mean 'inner.rate'"),
    ({"stepz": 1}, "'stepz'; did you mean 'steps'"),
    ({"inner": 3}, None),
])
def test_unknown_keys_name_the_closest(layer, message):
    if message is None:  # a section given as a scalar fails when built, naming the section
        with pytest.raises(ConfigError, match="inner"):
            build_config(_Outer, merge_layer(_Outer, config_defaults(_Outer), layer))
        return
    with pytest.raises(ConfigError, match=message):
        merge_layer(_Outer, config_defaults(_Outer), layer, source="x.yaml")


@pytest.mark.parametrize("key, text, message", [
    ("steps", "3.5", "expected an integer"), ("fast", "maybe", "expected true or false"),
    ("inner.sizes", "1,x", "comma-separated int"), ("inner", "1", "inner is a section"),
])
def test_text_that_is_not_the_fields_type_is_named(key, text, message):
    with pytest.raises(ConfigError, match=message):
        build_config(_Outer, merge_layer(_Outer, config_defaults(_Outer), parse_text(_Outer, key, text)))


def test_yaml_values_are_type_checked(tmp_path):
    for text, message in (("steps: 2.5\n", "steps: expected int, got float"),
                          ("fast: 1\n", "fast: expected bool, got int"),
                          ("inner:\n  name: 3\n", "inner.name: expected str, got int 3 \\(quote it\\)"),
                          ("- a\n", "a mapping of sections")):
        f = tmp_path / "c.yaml"
        f.write_text(text)
        with pytest.raises(ConfigError, match=message):
            build_config(_Outer, merge_layer(_Outer, config_defaults(_Outer), read_yaml(f)))


def test_yaml_round_trip_of_the_training_config(tmp_path):
    cl = ConfigCommandLine(TrainingConfig, ())
    cfg = cl.build(dotted=[("model.encoder_overrides", '{"dropout": 0.1}'), ("train.preempt_signals", ""),
                           ("model.chunk_size", "16,-1"), ("train.exp_dir", "runs/a")])
    assert cfg.train.preempt_signals == () and cfg.model.chunk_size == (16, -1)
    f = tmp_path / "c.yaml"
    f.write_text(config_to_yaml(cfg, header="a header"))
    assert f.read_text().startswith("# a header\nmodel:\n")
    assert cl.build([f]) == cfg


def test_the_dataclasses_own_checks_name_the_section():
    cl = ConfigCommandLine(TrainingConfig, ())
    with pytest.raises(ConfigError, match=r"^data: max_duration must be > 0"):
        cl.build(dotted=[("data.max_duration", "0")])
    with pytest.raises(ConfigError, match=r"^train: compile_mode must be one of"):
        cl.build(dotted=[("train.compile_mode", "fastest")])


def test_compile_options_and_weights_are_declared_once():
    from asrprec.decoding.experiment import DecodeConfig
    from asrprec.export.cli import ExportConfig
    from asrprec.models.weights import WeightsOptions
    from asrprec.models.compile import CompileOptions

    def owner(cls, name):
        return next(c for c in reversed(cls.__mro__) if name in getattr(c, "__annotations__", {}))

    for name in ("compile", "compile_dynamic", "compile_mode", "compile_regions"):
        assert owner(TrainConfig, name) is owner(DecodeConfig, name) is CompileOptions
    for name in ("epoch", "avg", "use_averaged_model", "init_from", "icefall_args", "allow_nonfinite"):
        assert owner(DecodeConfig, name) is owner(ExportConfig, name) is WeightsOptions
    cfg = TrainConfig(exp_dir="e", compile_mode="max-autotune")  # the loop reads the fields as before
    assert (cfg.compile, cfg.compile_mode, cfg.compile_dynamic) == (False, "max-autotune", "true")
    # runs made when --compile-dynamic was a switch stored true/false in config.json
    assert TrainConfig(exp_dir="e", compile_dynamic=True).compile_dynamic == "true"
    assert TrainConfig(exp_dir="e", compile_dynamic=False).compile_dynamic == "auto"
    with pytest.raises(ValueError, match="compile_dynamic must be one of"):
        TrainConfig(exp_dir="e", compile_dynamic="always")
    assert ExportConfig(exp_dir="e", epoch=3, use_averaged_model=True).tag() == "epoch-3-avg-1-use-averaged-model"
    with pytest.raises(ValueError, match="takes an icefall checkpoint as icefall:FILE"):
        ExportConfig(exp_dir="e", init_from="exp/epoch-1.pt")
    with pytest.raises(ValueError, match="--epoch is required: the epoch-N.pt to export"):
        ExportConfig(exp_dir="e").require_weights("export")


def test_data_seed_follows_the_train_seed():
    cfg = ConfigCommandLine(TrainingConfig, ["train.seed"]).parse(["--seed", "7"])
    assert cfg.data.seed == cfg.train.seed == 7 and cfg.data == DataConfig(seed=7)


@dataclasses.dataclass
class _Toy:
    name: str = option(help="required: it has no default")
    sizes: tuple[int, ...] = option((1, 2), help="comma-separated")
    limit: float | None = option(None, help="optional")
    fast: bool = option(False, help="go fast")
    slow: bool = option(True, help="go slow")
    use_x: bool = option(False, takes_value=True, help="x")
    table: dict = dataclasses.field(default_factory=dict)


def test_flat_generator_handles_required_optional_tuple_and_value_bools():
    import argparse

    p = argparse.ArgumentParser(exit_on_error=False)
    assert add_dataclass_args(p, _Toy, exclude=("table",)) == ["name", "sizes", "limit", "fast", "slow", "use_x"]
    with pytest.raises(SystemExit):  # argparse: "the following arguments are required: --name"
        p.parse_args([])
    toy = dataclass_from_args(_Toy, p.parse_args(["--name", "a", "--sizes", "3,4,5", "--limit", "2.5", "--fast",
                                                  "--no-slow", "--use-x", "true"]), table={"k": 1})
    assert toy == _Toy(name="a", sizes=(3, 4, 5), limit=2.5, fast=True, slow=False, use_x=True, table={"k": 1})
    assert dataclass_from_args(_Toy, p.parse_args(["--name", "a", "--sizes", "", "--use-x"])).sizes == ()
    with pytest.raises(ValueError, match="unknown _Toy keys"):
        dataclass_from_args(_Toy, p.parse_args(["--name", "a"]), tabel={})
    with pytest.raises(ValueError, match="did you mean 'fast'"):
        add_dataclass_args(argparse.ArgumentParser(), _Toy, defaults={"fats": True})
    assert parse_flat(_Toy, ["--name", "b", "--limit", "none"], defaults={"fast": True}) == \
        _Toy(name="b", fast=True)


def test_a_plain_flag_reaches_its_field_and_only_what_was_given_changes():
    from asrprec.training.config import TRAIN_FLAGS, training_command_line

    cl = training_command_line(defaults={"train": {"exp_dir": "e"}})
    base = cl.parse([])
    assert base == TrainingConfig(train=TrainConfig(exp_dir="e"))
    for path in TRAIN_FLAGS:
        section, name = path.split(".")
        f = next(f for f in dataclasses.fields(getattr(base, section)) if f.name == name)
        assert f.metadata["help"] and len(f.metadata["help"]) <= 100, path
        assert "\n" not in f.metadata["help"]
