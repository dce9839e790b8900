"""kill -9 during checkpoint writes: every checkpoint stays loadable, the interrupted writes' temporary files are
removed at the next start, and ``--resume latest`` after each kill ends in exactly the uninterrupted run's model.

The kills are real SIGKILLs of training processes (``kill_driver.py``: forked children, killed by their parent at
an exact point of a write: the first chunk of the run's first checkpoint, the middle of a mid-epoch checkpoint, an
end-of-epoch checkpoint written but not renamed, a checkpoint renamed but its folder not yet synced).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_kill_during_checkpoint_writes_then_resume_latest_is_exact(data_root, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(HERE / "kill_driver.py"), str(data_root), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["reference_status"] == 0 and out["final_status"] == 0, p.stderr[-4000:]
    kills = out["kills"]
    assert all(k["killed"] for k in kills), kills
    for k in kills:
        assert k["after"]["unloadable"] == [], k  # every checkpoint on disk loads completely
    # a kill inside a write leaves its temporary file; the next start removes it
    for k, nxt in zip(kills, kills[1:]):
        if k["target"].split()[-1] != "renamed":
            assert k["after"]["temporaries"], k
            assert set(k["after"]["temporaries"]).isdisjoint(nxt["after"]["temporaries"]), (k, nxt)
    assert out["final"]["temporaries"] == [] and out["final"]["unloadable"] == []
    # the first kill hit the run's first write: nothing to resume, the next run starts afresh; later ones resume
    assert kills[0]["after"]["checkpoints"] == [] and [k["resume"] for k in kills[2:]] == ["latest", "latest"]
    assert out["same_as_uninterrupted"] is True, out["same_as_uninterrupted"]
    # the folder's history records every start and resume, and each epoch once
    assert out["events"].count("resume") == 3 and out["epochs_recorded"] == [1, 2], out["events"]
