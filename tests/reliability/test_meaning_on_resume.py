"""Settings that change what a checkpoint means are refused on resume, as architecture changes are; settings that
only change how the run trains (the loss, its scales) are not."""

from __future__ import annotations

import copy

import pytest

from asrprec.experiment import ModelMismatchError, check_model_config, record_model_config
from asrprec.models import ModelOptions, build_model


def _config(**options):
    _, config = build_model(ModelOptions(encoder="conformer", size="tiny", **options), 32, 0)
    return config


@pytest.fixture
def tdt_folder(tmp_path):
    config = _config(loss="tdt", tdt_durations=(0, 1, 2, 3, 4))
    record_model_config(tmp_path, config)
    return tmp_path, config


def test_other_tdt_durations_are_refused_naming_them(tdt_folder):
    folder, _ = tdt_folder
    other = _config(loss="tdt", tdt_durations=(0, 1, 2, 4, 8))
    with pytest.raises(ModelMismatchError, match=r"tdt_durations: \[0, 1, 2, 3, 4\] -> \[0, 1, 2, 4, 8\]"):
        check_model_config(folder, other)
    import json

    assert json.loads((folder / "model.json").read_text())["loss"]["tdt_durations"] == [0, 1, 2, 3, 4]


def test_leaving_tdt_is_refused(tdt_folder):
    folder, _ = tdt_folder
    with pytest.raises(ModelMismatchError, match="tdt: True -> False"):
        check_model_config(folder, _config(loss="pruned"))


@pytest.mark.parametrize("key, value", [("vocab_size", 64), ("blank_id", 1), ("context_size", 3)])
def test_vocabulary_blank_and_context_are_refused(tdt_folder, key, value):
    folder, config = tdt_folder
    changed = copy.deepcopy(config)
    changed[key] = value
    with pytest.raises(ModelMismatchError, match=key):
        check_model_config(folder, changed)


def test_subsampling_is_refused(tmp_path):
    _, config = build_model(ModelOptions(encoder="zipformer", size="tiny"), 32, 0)
    record_model_config(tmp_path, config)
    changed = copy.deepcopy(config)
    changed["encoder_overrides"]["output_downsampling_factor"] = 4  # 80 ms frames instead of 40
    with pytest.raises(ModelMismatchError, match="output_downsampling_factor: 2 -> 4"):
        check_model_config(tmp_path, changed)


def test_the_loss_that_trains_may_change(tmp_path):
    record_model_config(tmp_path, _config(loss="pruned"))
    check_model_config(tmp_path, _config(loss="full"))  # the same joiner: no error
    tdt = tmp_path / "tdt"
    record_model_config(tdt, _config(loss="tdt", tdt_sigma=0.05))
    check_model_config(tdt, _config(loss="tdt", tdt_sigma=0.02))  # TDT's sigma shapes training only


def test_a_truncated_config_json_is_rewritten_on_resume_with_a_warning(tmp_path, caplog):
    import json
    import logging

    from asrprec.experiment import record_run_start

    config = {"train": {"base_lr": 0.045, "num_epochs": 10}, "model": {"encoder": "zipformer"}}
    record_run_start(tmp_path, model_config=None, config=config, precision={"name": "fp32"}, resume=None)
    text = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(text[: len(text) // 2])  # cut short
    with caplog.at_level(logging.WARNING):
        record_run_start(tmp_path, model_config=None, config=config, precision={"name": "fp32"},
                         resume={"checkpoint": str(tmp_path / "epoch-1.pt"), "config": config})
    assert json.loads((tmp_path / "config.json").read_text()) == config
    assert "config.json was unreadable (JSONDecodeError" in caplog.text and "rewritten" in caplog.text
