"""Configs as the one source of the command-line flags: every field reaches the CLI with its default, type and
help, and the parsed flags build the same dataclass back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from asrprec.config import add_dataclass_args, dataclass_from_args, option
from asrprec.data import DataConfig
from asrprec.training import TrainConfig
from asrprec.training.cli import DATA_FLAGS, add_data_args, add_training_args, data_config_from_args


def _parser(**defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_training_args(p, **defaults)
    return p


def _other_value(f: dataclasses.Field):
    """A valid non-default command-line value for a TrainConfig field, and the value it should parse to."""
    special = {"exp_dir": ("runs/x", "runs/x"), "resume": ("latest", "latest"), "optimizer": ("adamw", "adamw"),
               "init_from": ("a/epoch-3.pt", "a/epoch-3.pt"), "icefall_args": ("args.json", "args.json"),
               "scan_oom": ("off", "off"),
               "compile_dynamic": ("auto", "auto"), "compile_regions": ("layers", "layers"),
               "compile_schedules": ("tensor", "tensor"),
               "compile_backend": ("aot_eager", "aot_eager"), "compile_mode": ("max-autotune", "max-autotune"),
               "num_epochs": ("12", 12), "start_epoch": ("2", 2),
               "max_skipped_fraction": ("0.25", 0.25), "preempt_signals": ("SIGINT", ("SIGINT",))}
    if f.name in special:
        return special[f.name]
    if isinstance(f.default, bool):
        return None, not f.default
    if isinstance(f.default, int):
        return str(f.default + 3), f.default + 3
    if isinstance(f.default, float):
        return str(f.default + 0.5), f.default + 0.5
    raise AssertionError(f"no test value for {f.name}")


def test_every_train_config_field_is_a_flag_with_the_dataclass_default():
    args = _parser().parse_args([])
    got = dataclass_from_args(TrainConfig, args)
    want = TrainConfig(exp_dir="exp")
    assert got == want
    help_text = _parser().format_help()
    for f in dataclasses.fields(TrainConfig):
        flag = f"--no-{f.name}" if f.default is True else f"--{f.name}"
        assert flag.replace("_", "-") in help_text, f.name
        assert f.metadata.get("help"), f"{f.name} has no help text"
    assert "--weight-decay" in help_text


def test_each_train_flag_reaches_its_field():
    for f in dataclasses.fields(TrainConfig):
        text, value = _other_value(f)
        flag = (f"--no-{f.name}" if f.default is True else f"--{f.name}").replace("_", "-")
        argv = [flag] if text is None else [flag, text]
        cfg = dataclass_from_args(TrainConfig, _parser().parse_args(argv))
        assert getattr(cfg, f.name) == value, (f.name, argv)
        others = {g.name for g in dataclasses.fields(cfg) if getattr(cfg, g.name) != getattr(TrainConfig(exp_dir="exp"),
                                                                                               g.name)}
        assert others == {f.name}, (f.name, others)


def test_recipe_defaults_replace_field_defaults_and_unknown_ones_are_named():
    args = _parser(exp_dir="e", base_lr=0.01, tensorboard=False).parse_args([])
    assert (args.exp_dir, args.base_lr, args.tensorboard) == ("e", 0.01, False)
    with pytest.raises(TypeError):  # TrainConfig itself refuses the unknown name
        _parser(base_rl=0.01)
    p = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="did you mean 'base_lr'"):
        add_dataclass_args(p, TrainConfig, defaults={"base_rl": 0.01})


def test_choices_and_types_are_enforced():
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        _parser().parse_args(["--optimizer", "sgd"])
    with pytest.raises(argparse.ArgumentError, match="invalid int value"):
        _parser().parse_args(["--num-epochs", "ten"])


@dataclasses.dataclass
class _Toy:
    name: str = option(help="required: it has no default")
    sizes: tuple[int, ...] = option((1, 2), help="comma-separated")
    limit: float | None = option(None, help="optional")
    fast: bool = option(False, help="go fast")
    table: dict = dataclasses.field(default_factory=dict)


def test_generator_handles_required_optional_tuple_and_refuses_other_types():
    p = argparse.ArgumentParser(exit_on_error=False)
    assert add_dataclass_args(p, _Toy, exclude=("table",)) == ["name", "sizes", "limit", "fast"]
    with pytest.raises(SystemExit):  # argparse: "the following arguments are required: --name"
        p.parse_args([])
    toy = dataclass_from_args(_Toy, p.parse_args(["--name", "a", "--sizes", "3,4,5", "--limit", "2.5", "--fast"]),
                              table={"k": 1})
    assert toy == _Toy(name="a", sizes=(3, 4, 5), limit=2.5, fast=True, table={"k": 1})
    assert dataclass_from_args(_Toy, p.parse_args(["--name", "a", "--sizes", ""])).sizes == ()
    with pytest.raises(TypeError, match="'table'"):
        add_dataclass_args(argparse.ArgumentParser(), _Toy)
    with pytest.raises(ValueError, match="unknown _Toy keys"):
        dataclass_from_args(_Toy, p.parse_args(["--name", "a"]), tabel={})


def test_data_flags_come_from_data_config_with_recipe_defaults():
    p = argparse.ArgumentParser()
    add_training_args(p)
    add_data_args(p, max_duration=30.0, num_workers=2)
    cfg = data_config_from_args(p.parse_args([]), drop_last=True)
    want = DataConfig(max_duration=30.0, num_workers=2, seed=TrainConfig(exp_dir="e").seed, drop_last=True)
    assert cfg == want
    cfg = data_config_from_args(p.parse_args(["--no-spec-augment", "--on-the-fly-feats", "--num-buckets", "3"]))
    assert (cfg.spec_augment, cfg.on_the_fly_feats, cfg.num_buckets) == (False, True, 3)
    for name in DATA_FLAGS:
        assert dataclasses.fields(DataConfig)[[f.name for f in dataclasses.fields(DataConfig)].index(name)].metadata[
            "help"]
    with pytest.raises(SystemExit, match="max_duration must be > 0"):
        data_config_from_args(p.parse_args(["--max-duration", "0"]))


def test_value_bools_and_custom_parsers():
    @dataclasses.dataclass
    class Cfg:
        use_x: bool = option(True, takes_value=True, help="x")
        use_y: bool = option(False, takes_value=True, help="y")
        pair: tuple = option((1, 2), parse=lambda t: tuple(int(v) for v in t.split("/")), help="a/b")

    p = argparse.ArgumentParser()
    add_dataclass_args(p, Cfg)
    assert dataclass_from_args(Cfg, p.parse_args([])) == Cfg()
    got = dataclass_from_args(Cfg, p.parse_args(["--use-x", "false", "--use-y", "--pair", "3/4"]))
    assert (got.use_x, got.use_y, got.pair) == (False, True, (3, 4))
    assert p.parse_args(["--use-y", "0"]).use_y is False
    with pytest.raises(SystemExit):
        p.parse_args(["--use-x", "maybe"])


def test_every_model_option_is_a_flag_with_its_default_and_reaches_its_field():
    from asrprec.models import ModelOptions
    from asrprec.training.cli import add_model_args, model_options_from_args

    p = argparse.ArgumentParser()
    add_model_args(p, size="medium")
    assert model_options_from_args(p.parse_args([])) == ModelOptions(size="medium")
    flags = {a.dest: a.option_strings for a in p._actions}
    for f in dataclasses.fields(ModelOptions):
        assert "--" + f.name.replace("_", "-") in flags[f.name], f.name
    got = model_options_from_args(p.parse_args(
        ["--use-transducer", "false", "--use-ctc", "--use-cr-ctc", "true", "--tdt-durations", "0,1,3",
         "--encoder-overrides", '{"dropout": 0.05}', "--chunk-size", "16,-1", "--causal"]))
    assert (got.use_transducer, got.use_ctc, got.use_cr_ctc) == (False, True, True)
    assert got.tdt_durations == (0, 1, 3) and got.encoder_overrides == {"dropout": 0.05}
    assert got.all_encoder_overrides() == {"dropout": 0.05, "causal": True, "chunk_size": [16, -1]}
    for bad in (["--tdt-durations", "0,2"], ["--chunk-size", "0"], ["--encoder-overrides", "[1]"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_decode_and_precision_flags_come_from_their_dataclasses():
    from asrprec.precision import PrecisionOptions
    from asrprec.decoding.experiment import DecodeConfig, add_decoding_args, decode_config_from_args
    from asrprec.cli import add_precision_args, precision_options_from_args

    p = argparse.ArgumentParser()
    add_decoding_args(p, beam_size=8)
    add_precision_args(p, default="amp-bf16")
    args = p.parse_args(["--epoch", "3"])
    assert decode_config_from_args(args) == DecodeConfig(epoch=3, beam_size=8)
    assert precision_options_from_args(args) == PrecisionOptions(precision="amp-bf16")
    flags = {a.dest: a.option_strings for a in p._actions}
    for cls in (DecodeConfig, PrecisionOptions):
        for f in dataclasses.fields(cls):
            assert any(o.startswith("--") for o in flags[f.name]), f.name
    with pytest.raises(SystemExit, match="--epoch is required"):
        decode_config_from_args(p.parse_args([]))
    assert decode_config_from_args(p.parse_args(["--init-from", "icefall:x.pt"])).epoch is None
    with pytest.raises(SystemExit, match="takes an icefall checkpoint as icefall:FILE"):
        decode_config_from_args(p.parse_args(["--epoch", "1", "--init-from", "exp/epoch-1.pt"]))
    with pytest.raises(SystemExit, match="--tail-padding applies to --streaming"):
        decode_config_from_args(p.parse_args(["--epoch", "1", "--tail-padding", "0.66"]))
    cfg = decode_config_from_args(p.parse_args(["--epoch", "2", "--decoding-method", "ctc_prefix_beam_search"]))
    assert (cfg.search().method, cfg.search().beam) == ("ctc_prefix_beam_search", 8)


def test_compile_dynamic_of_an_older_config_json_reads_as_its_mode():
    # runs made when --compile-dynamic was a switch stored true/false in config.json
    assert TrainConfig(exp_dir="e", compile_dynamic=True).compile_dynamic == "true"
    assert TrainConfig(exp_dir="e", compile_dynamic=False).compile_dynamic == "auto"
    with pytest.raises(ValueError, match="compile_dynamic must be one of"):
        TrainConfig(exp_dir="e", compile_dynamic="always")
