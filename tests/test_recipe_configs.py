"""A recipe is a config file: every shipped ``recipes/*/configs/*.yaml`` loads through the strict loader, each
recipe's ``default.yaml`` is its ``train.py``'s defaults (read over the library's defaults alone, so the two cannot
drift), and the command lines stay short."""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from asrprec.cli import ConfigCommandLine
from asrprec.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("espeak", "librispeech", "custom")


def _load(recipe: str, script: str = "train"):
    name = f"_recipe_{recipe}_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / recipe / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their annotations through it
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("recipe", RECIPES)
def test_default_yaml_is_the_parsers_defaults(recipe):
    m = _load(recipe)
    parser_default = m.command_line().build()
    # the file over the library's defaults, with only the two folders (left out of the file) from the recipe
    bare = ConfigCommandLine(m.Config, (), {"train": {"exp_dir": parser_default.train.exp_dir},
                                            "recipe": {"data_dir": parser_default.recipe.data_dir}})
    from_file = bare.build([ROOT / "recipes" / recipe / "configs" / "default.yaml"])
    assert from_file == parser_default
    assert from_file.model != type(from_file.model)() or recipe == "espeak"  # the file does say something


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*/configs/*.yaml")),
                         ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_shipped_config_loads_strictly_and_changes_what_it_says(path):
    import yaml

    m = _load(path.parent.parent.name)
    cl = m.command_line()
    cfg = cl.build([path])
    written = yaml.safe_load(path.read_text())
    for section, fields in written.items():
        for key, value in fields.items():
            got = getattr(getattr(cfg, section), key)
            got = list(got) if isinstance(got, tuple) else got
            assert got == value or isinstance(value, dict), (path.name, section, key)


def test_a_typo_in_a_config_file_is_named_with_the_closest_key(tmp_path):
    m = _load("espeak")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  base_lrr: 0.01\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.base_lrr'; did you mean 'train.base_lr'"):
        m.command_line().build([bad])
    bad.write_text("trian:\n  base_lr: 0.01\n")
    with pytest.raises(ConfigError, match=r"'trian'; did you mean 'train'"):
        m.command_line().build([bad])
    bad.write_text("train:\n  num_epochs: ten\n")
    with pytest.raises(ConfigError, match=r"train.num_epochs: expected int, got str 'ten'"):
        m.command_line().build([bad])
    bad.write_text("data:\n  seed: 3\n")
    with pytest.raises(ConfigError, match="data.seed follows train.seed"):
        m.command_line().build([bad])


def test_layers_apply_in_order_defaults_file_dotted_flags(tmp_path):
    m = _load("espeak")
    f = tmp_path / "a.yaml"
    f.write_text("train:\n  base_lr: 0.01\n  num_epochs: 3\nmodel:\n  loss: tdt\n")
    cfg = m.command_line().parse(["--config", str(f), "--train.base_lr", "0.02", "--train.compile_mode=max-autotune",
                                  "--num-epochs", "4", "--data.spec_augment_config.num_frame_masks", "5",
                                  "--train.preempt_signals", "SIGINT", "--model.chunk_size", "16,-1"])
    assert (cfg.train.base_lr, cfg.train.num_epochs, cfg.train.compile_mode) == (0.02, 4, "max-autotune")
    assert cfg.model.loss == "tdt" and cfg.data.spec_augment_config.num_frame_masks == 5
    assert cfg.train.preempt_signals == ("SIGINT",) and cfg.model.chunk_size == (16, -1)
    assert cfg.data.seed == cfg.train.seed == 42
    assert cfg.train.lr_batches == 500.0  # the recipe's default, untouched


def test_a_bad_override_exits_like_a_bad_flag(capsys):
    m = _load("espeak")
    for argv, message in ((["--train.base_lrr", "1"], "did you mean 'train.base_lr'"),
                          (["--train.num_epochs", "x"], "train.num_epochs: expected an integer"),
                          (["--train.compile_mode", "fast"], "compile_mode must be one of"),
                          (["--train.start_epoch", "5", "--num-epochs", "2"], "start_epoch 5 > num_epochs 2")):
        with pytest.raises(SystemExit) as e:
            m.command_line().parse(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_print_config_is_a_config_that_gives_the_same_run(tmp_path, capsys):
    m = _load("librispeech")
    argv = ["--precision", "amp-bf16", "--no-musan", "--model.encoder_overrides", '{"dropout": 0.05}',
            "--use-ctc", "--train.lr_epochs", "6"]
    with pytest.raises(SystemExit) as e:
        m.command_line().parse([*argv, "--print-config"])
    assert e.value.code == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert m.command_line().parse(["--config", str(printed)]) == m.command_line().parse(argv)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("script", ["train", "decode", "export"])
def test_help_is_at_most_35_flags_of_one_short_line(recipe, script):
    help_text = _load(recipe, script).command_line().parser().format_help()
    options = help_text.split("options:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    flags = [line for line in options if line.startswith("  -")]
    assert len(flags) <= 35, (recipe, script, len(flags))
    assert len(options) <= 2 * len(flags)
    for i, line in enumerate(options):  # a long flag puts its help on the next line; the help is that one line
        if not line.startswith("  -"):
            assert i and options[i - 1].startswith("  -") and "  " not in options[i - 1].strip(), line
    assert all(len(line) <= 120 for line in options)


def test_the_old_flags_still_read_as_their_fields():
    m = _load("espeak")
    cfg = m.command_line().parse(["--train.progress_bar", "false", "--use-ctc", "--use-transducer", "false",
                                  "--precision", "bf16",
                                  "--bf16-update", "kahan", "--exp-dir", "e", "--threads", "1", "--resume", "auto"])
    assert (cfg.train.progress_bar, cfg.model.use_ctc, cfg.model.use_transducer) == (False, True, False)
    assert (cfg.precision.precision, cfg.precision.bf16_update, cfg.train.threads) == ("bf16", "kahan", 1)
    d = _load("espeak", "decode").command_line().parse(["--epoch", "3", "--splits", "test", "dev", "--avg", "2"])
    assert (d.decode.epoch, d.decode.avg, d.recipe.splits) == (3, 2, ("test", "dev"))
    assert d.decode.compile_dynamic == "auto" and dataclasses.fields(d.decode)  # decoding's default


def test_train_py_print_config_runs_as_a_program():
    out = subprocess.run([sys.executable, str(ROOT / "recipes" / "espeak" / "train.py"), "--print-config",
                          "--train.base_lr", "0.03"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "  base_lr: 0.03\n" in out.stdout and "  seed: 42\n" in out.stdout


SHELL = {"PRECISION": "fp32", "EPOCHS": "10", "AVG": "3"}


def _commands():
    """Every ``recipes/<recipe>/<script>.py ...`` command line of the READMEs and docs/ (continuations joined)."""
    import re
    import shlex

    pages = [ROOT / "README.md", *sorted((ROOT / "recipes").glob("*/README.md")), *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "recipes").glob("*/run.sh"))]
    for page in pages:
        text = page.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            m = re.search(r"recipes/(espeak|librispeech|custom)/(train|decode|export)\.py((?:\s+[^#|`>]*)?)", line)
            if m is None or "--help" in line or "`" in line.split("recipes/")[0]:
                continue
            args = re.sub(r"\[(--[^\]]*)\]", r"\1", m.group(3)).replace("...", "").replace('"$@"', "")
            args = re.sub(r"\$\{?(\w+)\}?", lambda v: SHELL.get(v.group(1), "/x"), args)  # run.sh's variables
            yield f"{page.name}: {m.group(0).strip()}", m.group(1), m.group(2), shlex.split(args)


@pytest.mark.parametrize("where, recipe, script, argv", list(_commands()), ids=lambda v: v if isinstance(v, str) and
                         ":" in v else None)
def test_every_documented_command_line_parses(where, recipe, script, argv, capsys):
    if "--print-config" not in argv:
        _load(recipe, script).command_line().parse(argv)
        return
    with pytest.raises(SystemExit) as e:
        _load(recipe, script).command_line().parse(argv)
    assert e.value.code == 0 and capsys.readouterr().out.startswith("model:")


def test_the_saved_config_starts_the_same_run_again(tmp_path):
    from asrprec.training.recipe import save_config

    m = _load("espeak")
    argv = ["--exp-dir", str(tmp_path / "a"), "--resume", "auto", "--overwrite", "--use-ctc", "--train.lr_epochs", "6",
            "--precision", "bf16", "--data.spec_augment_config.p", "0.5"]
    cfg = m.command_line().parse(argv)
    (tmp_path / "a").mkdir()
    path = save_config(cfg, resuming=False)
    assert path == tmp_path / "a" / "config.yaml" and path.read_text().startswith("# config.yaml: train.py --config")
    again = m.command_line().parse(["--config", str(path)])
    want = m.command_line().parse(argv[5:] + ["--exp-dir", str(tmp_path / "a")])  # without resume and overwrite
    assert again == want and (again.train.resume, again.train.overwrite) == ("", False)
    path.write_text("# an older run's\n")
    assert save_config(cfg, resuming=True) is None and path.read_text() == "# an older run's\n"  # kept on resume


@pytest.mark.parametrize("script, argv", [
    ("decode", ["--epoch", "3", "--decoding-method", "modified_beam_search", "--splits", "test", "--decode.beam_size",
                "8", "--decode.greedy_method", "frame_looping"]),
    ("export", ["--epoch", "3", "--int8", "--export.out_dir", "onnx"]),
])
def test_decode_and_export_configs_print_and_read_back(script, argv, tmp_path, capsys):
    cl = _load("librispeech", script).command_line
    with pytest.raises(SystemExit) as e:
        cl().parse([*argv, "--print-config"])
    assert e.value.code == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert cl().parse(["--config", str(printed)]) == cl().parse(argv)


def test_espeak_run_sh_trains_and_decodes_the_default_epochs():
    import re

    import yaml

    script = (ROOT / "recipes" / "espeak" / "run.sh").read_text()
    epochs = int(re.search(r"^EPOCHS=\$\{EPOCHS:-(\d+)\}", script, re.M).group(1))
    default = yaml.safe_load((ROOT / "recipes" / "espeak" / "configs" / "default.yaml").read_text())
    assert epochs == default["train"]["num_epochs"]  # decode.py --epoch "$EPOCHS" is the last epoch trained
