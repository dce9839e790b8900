"""Preemption by a real signal, and ``resume="auto"`` after it and after a SIGKILL (``preempt_driver.py``: forked
training processes that train through ``run_main`` like a recipe's ``train.py``):

* SIGTERM during step 1: the run stops after step 2 (the next agreement), writes ``checkpoint-2.pt`` mid-epoch and
  exits with 75; a second SIGTERM in the middle of that write is ignored and the file is complete; the same command
  (``resume="auto"``) ends with exactly the uninterrupted run's model, optimizer, schedule and average;
* SIGKILL mid-epoch 2: the same command resumes from ``epoch-1.pt`` and ends exactly as the uninterrupted run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from asrprec.training.preemption import PREEMPTED_EXIT_CODE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_signal_stops_at_a_step_boundary_and_resume_auto_continues_exactly(data_root, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(HERE / "preempt_driver.py"), str(data_root), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["reference_status"] == 0, p.stderr[-4000:]

    pre = out["preempted"]
    assert pre["status"] == PREEMPTED_EXIT_CODE == 75, p.stderr[-4000:]
    # one more step after the signal, then the checkpoint of that batch; the second signal came mid-write
    assert pre["events"][:2] == ["step 1", "step 2"] and "step 3" not in pre["events"], pre["events"]
    assert "save checkpoint-2.pt chunk-3" in pre["events"], pre["events"]
    assert pre["after"] == {"checkpoints": {"checkpoint-2.pt": [2, 1, False]}, "unloadable": [], "temporaries": []}
    (event,) = pre["history"]
    assert event["signal"] == "SIGTERM (then SIGTERM, ignored while stopping)" and event["batch_idx_train"] == 2
    assert "preempted: rank(s) [0] received a stop signal" in p.stderr and "--resume auto" in p.stderr
    assert pre["resume_status"] == 0 and pre["resumed_from"] == ["checkpoint-2.pt"]
    assert pre["same_as_uninterrupted"] is True, pre["same_as_uninterrupted"]

    killed = out["killed"]
    assert killed["status"] == -9 and killed["events"][-1] == "step 5", killed
    assert list(killed["after"]["checkpoints"]) == ["epoch-1.pt"] and not killed["after"]["unloadable"]
    assert killed["resume_status"] == 0 and killed["resumed_from"] == ["epoch-1.pt"]
    assert killed["same_as_uninterrupted"] is True, killed["same_as_uninterrupted"]
