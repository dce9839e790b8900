"""The Run object and the Experiment folder: checkpoints and records checked on disk (file names written out by
hand, history.json read as plain JSON, weights compared with the model's own tensors)."""

import json

import pytest
import torch

from asrprec import checkpoint as ckpt
from asrprec.experiment import Experiment, prepare_experiment
from asrprec.experiment import contents as experiment_contents
from asrprec.precision import get_policy
from asrprec.training import train
from asrprec.training.run import Run

from ..reliability.tiny import Tok, batches, config, make_model


def _run(exp, **kw):
    return Run.build(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(4),
                     valid_dl=batches(2, 1), cfg=config(exp, num_epochs=2, **kw), model_config={"size": "tiny"})


def _events(exp):
    return json.loads((exp / "history.json").read_text())


def test_experiment_names_its_files(tmp_path):
    e = Experiment(tmp_path / "exp")
    assert e.log_path == tmp_path / "exp" / "train.log" and e.model_path == tmp_path / "exp" / "model.json"
    assert e.config_path.name == "config.json" and e.history_path.name == "history.json"
    assert e.tokenizer_path.name == "bpe.model" and e.lock_path.name == "run.lock"
    assert e.epoch_checkpoint(3).name == "epoch-3.pt" and e.batch_checkpoint(120).name == "checkpoint-120.pt"
    assert e.bad_model_path.name == "bad-model.pt" and e.oom_batch_path(7, 1).name == "oom-batch-7-rank1.pt"
    assert e == Experiment(tmp_path / "exp") and e != Experiment(tmp_path / "other")


def test_keep_last_deletes_all_but_the_newest_batch_checkpoints(tmp_path):
    for name in ("checkpoint-5.pt", "checkpoint-40.pt", "checkpoint-7.pt", "checkpoint-100.pt", "epoch-1.pt"):
        (tmp_path / name).write_bytes(b"x")
    deleted = Experiment(tmp_path).keep_last(2)
    assert sorted(p.name for p in deleted) == ["checkpoint-5.pt", "checkpoint-7.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-100.pt", "checkpoint-40.pt", "epoch-1.pt"]
    assert Experiment(tmp_path).keep_last(0) == []  # 0 keeps everything


def test_record_appends_to_the_history(tmp_path):
    e = Experiment(tmp_path)
    e.record({"event": "a", "n": 1})
    e.record({"event": "b"})
    events = json.loads((tmp_path / "history.json").read_text())
    assert [(ev["event"], ev.get("n")) for ev in events] == [("a", 1), ("b", None)] and "time" in events[0]
    assert e.history() == events


def test_build_records_the_start_and_save_writes_the_runs_weights(tmp_path):
    exp = tmp_path / "exp"
    run = _run(exp)
    try:
        assert [ev["event"] for ev in _events(exp)] == ["start"]
        assert json.loads((exp / "model.json").read_text()) == {"size": "tiny"}
        assert json.loads((exp / "config.json").read_text())["train"]["num_epochs"] == 2
        assert run.hooks == []  # no compile: no compile report
        run.state.batch_idx_train = 3
        path = run.save("batch")
        assert path == exp / "checkpoint-3.pt"
        saved = torch.load(path, weights_only=True)
        assert saved["extra"]["batch_idx_train"] == 3 and saved["config"]["model"] == {"size": "tiny"}
        assert saved["model"].keys() == run.bare.state_dict().keys()
        assert all(torch.equal(saved["model"][k], v) for k, v in run.bare.state_dict().items())
        with pytest.raises(ValueError, match="no checkpoint kind 'best'"):
            run.save("best")
    finally:
        run.experiment.unlock()


def test_stop_saves_records_and_raises(tmp_path):
    exp = tmp_path / "exp"
    run = _run(exp)
    try:
        run.state.batch_idx_train, run.state.epoch = 2, 1
        with pytest.raises(RuntimeError, match="stopped here"):
            run.stop(lambda: RuntimeError("stopped here"), event=lambda: {"event": "stopped", "reason": "test"})
        assert ckpt.checkpoint_position(exp / "checkpoint-2.pt")[:2] == (2, 1)
        last = _events(exp)[-1]
        assert (last["event"], last["reason"], last["checkpoint"]) == ("stopped", "test", "checkpoint-2.pt")
        assert last["save_seconds"] >= 0
        # a checkpoint written already is named, not written again
        (exp / "epoch-1.pt").write_bytes(b"written before")
        with pytest.raises(KeyError):
            run.stop(lambda: KeyError("k"), event=lambda: {"event": "preempted"}, checkpoint=exp / "epoch-1.pt")
        assert (exp / "epoch-1.pt").read_bytes() == b"written before"
        assert _events(exp)[-1]["checkpoint"] == "epoch-1.pt"
    finally:
        run.experiment.unlock()


def test_a_recipes_early_prepare_is_the_runs_prepare(tmp_path, monkeypatch):
    calls = []
    real = experiment_contents._prepare
    monkeypatch.setattr(experiment_contents, "_prepare", lambda *a: calls.append(a) or real(*a))
    exp = tmp_path / "exp"
    cfg = config(exp, num_epochs=1)
    assert prepare_experiment(cfg, model_config={"size": "tiny"}) is None
    train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(2),
          valid_dl=batches(1, 1), cfg=cfg, model_config={"size": "tiny", "tokenizer": {"sha256": "added"}})
    assert len(calls) == 1 and (exp / "epoch-1.pt").is_file()
    # once the folder changed (the run wrote its checkpoint and released the lock), a new call prepares again
    cfg2 = config(exp, num_epochs=2, resume="latest")
    assert Experiment(exp).resume_checkpoint(cfg2) == exp / "epoch-1.pt"
    assert prepare_experiment(cfg2) == exp / "epoch-1.pt" and len(calls) == 2
    Experiment(exp).unlock()
