"""Faults of a torchrun job (2 CPU ranks, gloo, fp32; ``_restart_worker.py``), each run ending with the weights of
an uninterrupted run, bitwise:

* a rank killed with SIGKILL mid-epoch under ``torchrun --max-restarts 1``: torchrun restarts the workers and the
  same command (``resume="auto"``) continues from the newest checkpoint;
* SIGTERM to torchrun mid-epoch: torchrun passes it on, both ranks stop after the same step, rank 0 saves that
  batch, the workers exit with 75; the same command launched again continues.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _torchrun(out: Path, mode: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *extra,
            "--monitor-interval", "0.1", str(HERE / "_restart_worker.py"), str(out), mode]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(v, None)
    return env


def _assert_same_weights(out: Path, name: str) -> None:
    for r in (0, 1):
        ref = torch.load(out / f"reference-rank{r}.pt", weights_only=True)
        got = torch.load(out / f"{name}-rank{r}.pt", weights_only=True)
        assert ref.keys() == got.keys()
        for k in ref:
            assert torch.equal(ref[k], got[k]), (r, k)


# two torchrun attempts of 2 workers, each importing torch (tens of seconds on 2 cores)
def test_rank_killed_mid_epoch_restarts_and_resume_auto_matches_an_uninterrupted_run(tmp_path):
    p = subprocess.run(_torchrun(tmp_path, "kill", "--max-restarts", "1"), cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=300)
    tail = f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    assert p.returncode == 0, tail
    # attempt 0 lost rank 1 before its end; attempt 1 finished on both ranks
    started = sorted(f.name for f in tmp_path.glob("attempt*.started"))
    assert started == [f"attempt{a}-rank{r}.started" for a in (0, 1) for r in (0, 1)], (started, tail)
    assert not (tmp_path / "attempt0-rank1.json").exists()
    done = [json.loads((tmp_path / f"attempt1-rank{r}.json").read_text()) for r in (0, 1)]
    # 3 epochs of 3 steps; attempt 1 resumed from checkpoint-4.pt and took steps 5 to 9
    assert [d["batch_idx_train"] for d in done] == [9, 9] and [d["steps_here"] for d in done] == [5, 5], done
    events = json.loads((tmp_path / "restarted" / "history.json").read_text())
    resumes = [e for e in events if e["event"] == "resume"]
    assert [e["event"] for e in events if e["event"] in ("start", "resume")] == ["start", "resume"], events
    assert Path(resumes[0]["from"]).name == "checkpoint-4.pt", resumes
    _assert_same_weights(tmp_path, "restarted")


@pytest.mark.slow  # ~80 s on 2 CPU cores: two torchrun launches of 2 workers
def test_sigterm_to_torchrun_stops_every_rank_at_one_step_and_the_same_command_continues(tmp_path):
    from asrprec.training.preemption import PREEMPTED_EXIT_CODE

    p = subprocess.Popen(_torchrun(tmp_path, "preempt"), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not (tmp_path / "step5").exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "step5").exists(), p.communicate(timeout=60)[0][-6000:]
    p.send_signal(signal.SIGTERM)  # to torchrun, which passes it on to both workers
    (tmp_path / "signalled").write_text("")
    log = p.communicate(timeout=120)[0]
    assert p.returncode != 0, log[-6000:]
    # both workers stopped with the preemption exit code after the step agreed on (step 6, in epoch 2)
    codes = [(tmp_path / f"preempt-launch0-rank{r}.exit").read_text() for r in (0, 1)]
    assert codes == [str(PREEMPTED_EXIT_CODE)] * 2, log[-6000:]
    exp = tmp_path / "preempted"
    events = json.loads((exp / "history.json").read_text())
    (stop,) = [e for e in events if e["event"] == "preempted"]
    assert stop["ranks"] == [0, 1] and stop["checkpoint"] == "checkpoint-6.pt", stop
    assert sorted(q.name for q in exp.glob("*.pt")) == ["checkpoint-6.pt", "epoch-1.pt"]
    again = subprocess.run(_torchrun(tmp_path, "preempt"), cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, f"{again.stdout[-3000:]}\n{again.stderr[-6000:]}"
    done = [json.loads((tmp_path / f"preempt-launch1-rank{r}.json").read_text()) for r in (0, 1)]
    assert [d["batch_idx_train"] for d in done] == [9, 9] and [d["steps_here"] for d in done] == [3, 3], done
    _assert_same_weights(tmp_path, "preempted")
