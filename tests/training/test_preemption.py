"""Preemption signals and ``--resume auto`` in-process (the subprocess tests with real process deaths are
tests/reliability/test_preemption.py and test_restart.py)."""

import os
import signal

import pytest
import torch

from asrprec.checkpoint import checkpoint_position
from asrprec.precision import get_policy
from asrprec.training import ExperimentError, TrainConfig, train
from asrprec.experiment import prepare_experiment, read_history, resolve_resume
from asrprec.training.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch, TrainingPreempted, parse_signals

from ..reliability.tiny import Tok, batches, config, make_model


def test_signal_names_are_parsed_and_bad_ones_refused():
    assert parse_signals(["SIGTERM", "usr1", " ", "TERM"]) == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("") == ()
    with pytest.raises(ValueError, match="'SIGFOO' is not a signal on this system. Fix: name signals such as"):
        parse_signals(["SIGFOO"])
    with pytest.raises(ValueError, match="'KILL' cannot be caught by a process"):
        parse_signals(["KILL"])
    with pytest.raises(ValueError, match="'TREM' is not a signal"):
        TrainConfig(exp_dir="x", preempt_signals=("TREM",))


def test_watch_records_the_first_signal_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionWatch(("SIGUSR1", "SIGUSR2")) as watch:
        assert not watch.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.received == signal.SIGUSR2 and watch.later == [signal.SIGUSR1]
        assert watch.describe() == "SIGUSR2 (then SIGUSR1, ignored while stopping)"
    assert signal.getsignal(signal.SIGUSR1) is before


class SignalAt(list):
    """Batches; fetching batch ``at`` (1-based) of the first epoch sends ``sig`` to this process."""

    def __init__(self, data, at, sig):
        super().__init__(data)
        self.at, self.sig, self.fired = at, sig, False

    def __iter__(self):
        for i, b in enumerate(super().__iter__(), 1):
            if i == self.at and not self.fired:
                self.fired = True
                os.kill(os.getpid(), self.sig)
            yield b


def _params(path):
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_stops_after_the_agreed_step_and_resume_auto_continues_exactly(tmp_path, sig):
    policy = get_policy("fp32", "cpu")
    ref = tmp_path / "ref"
    train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=batches(4), valid_dl=batches(2, 1),
          cfg=config(ref, num_epochs=2))
    exp = tmp_path / "exp"
    before = signal.getsignal(sig)
    with pytest.raises(TrainingPreempted, match=rf"rank 0: {sig.name}\); stopped at epoch 1, 2 batches into it") as e:
        train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=SignalAt(batches(4), 2, sig),
              valid_dl=batches(2, 1), cfg=config(exp, num_epochs=2, resume="auto"))
    assert signal.getsignal(sig) is before
    assert e.value.exit_code == PREEMPTED_EXIT_CODE == 75 and e.value.checkpoint == exp / "checkpoint-2.pt"
    assert checkpoint_position(exp / "checkpoint-2.pt") == (2, 1, False)
    assert [ev["event"] for ev in read_history(exp)] == ["start", "preempted"]
    train(model=make_model(), policy=policy, tokenizer=Tok(), train_dl=batches(4), valid_dl=batches(2, 1),
          cfg=config(exp, num_epochs=2, resume="auto"))
    a, b = _params(ref / "epoch-2.pt"), _params(exp / "epoch-2.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_signal_during_the_epoch_end_stops_with_the_epoch_checkpoint(tmp_path):
    exp = tmp_path / "exp"
    # sent during epoch 1's validation, after epoch-1.pt was written
    with pytest.raises(TrainingPreempted, match="stopped at epoch 1, 4 batches into it") as e:
        train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(4),
              valid_dl=SignalAt(batches(2, 1), 1, signal.SIGTERM), cfg=config(exp, num_epochs=3))
    assert e.value.checkpoint == exp / "epoch-1.pt" and sorted(p.name for p in exp.glob("*.pt")) == ["epoch-1.pt"]
    assert [ev["event"] for ev in read_history(exp)] == ["start", "epoch", "preempted"]


class HandlerSeen(list):
    """Batches; records the SIGTERM handler in force while the loop iterates them."""

    def __iter__(self):
        self.handler = signal.getsignal(signal.SIGTERM)
        yield from super().__iter__()


@pytest.mark.parametrize("names, watched", [((), False), (("SIGTERM",), True)])
def test_signals_are_watched_only_when_listed(tmp_path, names, watched):
    data = HandlerSeen(batches(2))
    train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=data,
          valid_dl=batches(2, 1), cfg=config(tmp_path, num_epochs=1, preempt_signals=names))
    assert (data.handler is not signal.getsignal(signal.SIGTERM)) is watched


def test_resume_auto_starts_a_new_run_or_takes_the_newest_checkpoint(tmp_path):
    exp = tmp_path / "exp"
    cfg = config(exp, num_epochs=2, resume="auto", save_every_n=3)
    assert resolve_resume(cfg) is None and prepare_experiment(cfg) is None  # no folder yet, then an empty one
    train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(4),
          valid_dl=batches(2, 1), cfg=config(exp, num_epochs=1, save_every_n=3))
    assert resolve_resume(cfg) == exp / "epoch-1.pt"
    with pytest.raises(ExperimentError, match="--overwrite with --resume auto"):
        prepare_experiment(config(exp, num_epochs=2, resume="auto", overwrite=True))
    for p in exp.glob("*.pt"):
        p.write_bytes(b"")  # every checkpoint unreadable: starting afresh over them is refused
    with pytest.raises(ExperimentError, match="--resume auto does not start afresh over checkpoints it cannot read"):
        resolve_resume(cfg)
