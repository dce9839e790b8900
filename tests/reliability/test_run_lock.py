"""One run per folder: a training run holds an OS lock on its experiment folder; a second run is refused in one
line naming the holder, before anything in the folder changes (``--overwrite`` included); the lock dies with its
process (``kill -9`` leaves none), so ``--resume auto`` after a restart goes on at once."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asrprec.errors import AsrprecError
from asrprec.experiment import LOCK_NAME, ExperimentLockedError, lock_experiment, prepare_experiment
from asrprec.precision import get_policy
from asrprec.training import train

from .test_bad_args import recipe
from .tiny import Tok, batches, config, make_model

ROOT = Path(__file__).resolve().parents[2]


class Holder:
    """Another process holding ``exp_dir`` as a training run does (``prepare_experiment`` on rank 0)."""

    def __init__(self, exp_dir, **cfg):
        code = textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(ROOT)!r})
            from asrprec.experiment import prepare_experiment
            from tests.reliability.tiny import config
            prepare_experiment(config({str(exp_dir)!r}, **{cfg!r}))
            print("held", flush=True)
            time.sleep(300)
        """)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self.proc.stdout.readline().strip() == "held"

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.kill9()


def run(exp, epochs=1, **kw):
    return train(model=make_model(), policy=get_policy("fp32", "cpu"), tokenizer=Tok(), train_dl=batches(2),
                 valid_dl=batches(1, 1), cfg=config(exp, num_epochs=epochs, **kw))


def listing(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_second_run_before_the_first_checkpoint_is_refused_naming_the_holder(tmp_path):
    exp = tmp_path / "exp"
    with Holder(exp) as a:
        before = listing(exp)
        with pytest.raises(ExperimentLockedError) as e:
            run(exp)
        msg = str(e.value)
        assert isinstance(e.value, AsrprecError) and "\n" not in msg
        assert f"{exp} is in use by another training run (PID {a.proc.pid} on " in msg and ", started 20" in msg
        assert "Fix: wait for that run to end (or stop it), or train in another --exp-dir" in msg
        assert listing(exp) == before  # nothing written: no checkpoint, config.json or history of the second run
        assert json.loads((exp / LOCK_NAME).read_text())["pid"] == a.proc.pid


def test_a_resume_and_overwrite_are_refused_while_held_and_kill_9_leaves_no_stale_lock(tmp_path):
    exp = tmp_path / "exp"
    run(exp)  # epoch-1.pt, then the lock is released when the run returns
    with Holder(exp, resume="auto", num_epochs=2) as a:
        before = listing(exp)
        for kw in (dict(resume="auto"), dict(overwrite=True)):
            with pytest.raises(ExperimentLockedError, match=f"PID {a.proc.pid} "):
                run(exp, epochs=2, **kw)
            assert listing(exp) == before  # --overwrite deleted none of the running job's files
        a.kill9()
    state = run(exp, epochs=2, resume="auto")  # the restart takes it over at once
    assert state.epoch == 2 and (exp / "epoch-2.pt").is_file()
    history = [e["event"] for e in json.loads((exp / "history.json").read_text())]
    assert history == ["start", "epoch", "resume", "epoch"]  # one run's epochs, each once


def test_the_lock_is_held_for_the_run_and_released_after(tmp_path):
    exp = tmp_path / "exp"
    prepare_experiment(config(exp))
    assert json.loads((exp / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert lock_experiment(exp) == exp / LOCK_NAME  # this process holds it already: taken again as a no-op
    run(exp)  # the run this process prepared
    with Holder(exp, resume="auto", num_epochs=2) as a:  # released when the run returned
        assert json.loads((exp / LOCK_NAME).read_text())["pid"] == a.proc.pid


def test_train_py_refuses_in_one_line_and_writes_nothing_into_the_folder(data_root, tmp_path):
    exp = tmp_path / "exp"
    with Holder(exp) as a:
        (exp / "train.log").write_text("the running job's log\n")
        before = listing(exp)
        out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 1)
        assert out.code == 2 and "\n" not in out.error
        assert f"is in use by another training run (PID {a.proc.pid} on " in out.error and ", started 20" in out.error
        out = recipe("train.py", "--data-dir", data_root, "--exp-dir", exp, "--num-epochs", 1, "--overwrite")
        assert out.code == 2 and f"PID {a.proc.pid}" in out.error
        # the lock is taken before the log is opened: the refusals went to stderr, not into the running job's log
        assert listing(exp) == before
        assert sorted(p.name for p in exp.iterdir()) == [LOCK_NAME, "train.log"]
        assert json.loads((exp / LOCK_NAME).read_text())["pid"] == a.proc.pid
