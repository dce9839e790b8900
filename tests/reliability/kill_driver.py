"""Kill training with SIGKILL while it writes checkpoints, at several points of a write, then resume with
``--resume latest`` until the run completes; compare with an uninterrupted run.

Run as ``python kill_driver.py DATA_ROOT WORK_DIR``; prints one JSON object. Python starts once: each training
run is a forked child (a real process, really killed with SIGKILL), so the torch/lhotse imports are paid once.
In a child, ``torch.save`` inside checkpoint writes is slowed to chunked writes that stop at each chunk (and at the
rename) until the parent says go on, so the parent kills at an exact point of a write.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

torch.set_num_threads(1)

import harness  # noqa: E402

import asrprec.checkpoint as ckpt  # noqa: E402
from asrprec.atomic import TEMPORARY_GLOB  # noqa: E402

CHUNKS = 6
# (checkpoint kind, which of that kind in the child's own writes, where in the write)
KILLS = [
    ("checkpoint", 1, "chunk-0"),  # the run's very first write: no complete checkpoint exists yet
    ("checkpoint", 3, "chunk-3"),  # the middle of a mid-epoch checkpoint
    ("epoch", 1, "written"),  # all bytes of epoch-1.pt written and flushed, not yet renamed
    ("checkpoint", 2, "renamed"),  # renamed onto its name, the directory not yet synced
]


def _instrument(events_w: int, acks_r: int) -> None:
    """Chunked checkpoint writes that report each step on ``events_w`` and wait for a byte on ``acks_r``."""
    real_save, real_replace = torch.save, os.replace
    counts: dict[str, int] = {}

    def step(what: str) -> None:
        os.write(events_w, (what + "\n").encode())
        os.read(acks_r, 1)

    def save(obj, f, *a, **kw):
        progress = obj.get("extra", {}).get("progress") if isinstance(obj, dict) else None
        if not progress:
            return real_save(obj, f, *a, **kw)
        kind = "epoch" if progress["epoch_done"] else "checkpoint"
        counts[kind] = counts.get(kind, 0) + 1
        buf = io.BytesIO()
        real_save(obj, buf, *a, **kw)
        data = buf.getvalue()
        size = -(-len(data) // CHUNKS)
        for i in range(CHUNKS):
            step(f"{kind} {counts[kind]} chunk-{i}")
            f.write(data[i * size:(i + 1) * size])
            f.flush()
        os.fsync(f.fileno())
        step(f"{kind} {counts[kind]} written")
        save.last = (kind, counts[kind])

    def replace(src, dst):
        real_replace(src, dst)
        last = getattr(save, "last", None)
        if last is not None and Path(dst).name.endswith(".pt"):
            step(f"{last[0]} {last[1]} renamed")

    torch.save = save
    os.replace = replace


def _child(data: Path, exp: Path, kw: dict, events_w: int | None = None, acks_r: int | None = None) -> None:
    code = 0
    try:
        if events_w is not None:
            _instrument(events_w, acks_r)
        harness.run(data, exp, **kw)
    except BaseException as e:  # report to the parent through the exit code
        print(f"child failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        os._exit(code)


def _run_to_end(data: Path, exp: Path, kw: dict) -> int:
    pid = os.fork()
    if pid == 0:
        _child(data, exp, kw)
    return os.waitpid(pid, 0)[1]


def _run_and_kill(data: Path, exp: Path, kw: dict, target: str) -> bool:
    events_r, events_w = os.pipe()
    acks_r, acks_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(events_r)
        os.close(acks_w)
        _child(data, exp, kw, events_w, acks_r)
    os.close(events_w)
    os.close(acks_r)
    killed = False
    with os.fdopen(events_r) as events:
        for line in events:
            if line.strip() == target:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
            os.write(acks_w, b"k")
    os.close(acks_w)
    os.waitpid(pid, 0)
    return killed


def _state_of(exp: Path) -> dict:
    """Every checkpoint file must load completely; temporary files are counted."""
    bad = []
    for p in ckpt.training_checkpoints(exp):
        try:
            ckpt.read_checkpoint(p)
        except Exception as e:  # any failure is a finding
            bad.append(f"{p.name}: {e}")
    return {"checkpoints": [p.name for p in ckpt.training_checkpoints(exp)], "unloadable": bad,
            "temporaries": sorted(p.name for p in exp.glob(TEMPORARY_GLOB))}


def _warm_up(data: Path) -> None:
    """Import in the parent what every child needs (building an optimizer imports torch._dynamo, seconds)."""
    from asrprec.data import AsrDataModule, DataConfig  # noqa: F401
    from asrprec.tokenizer import Tokenizer
    from asrprec.training import optimizer_from_config  # noqa: F401

    harness.build_model(Tokenizer(data / "bpe.model"))
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def main() -> None:
    data, work = Path(sys.argv[1]), Path(sys.argv[2])
    _warm_up(data)
    # natural epoch ends (no cap) of about three batches
    base = dict(num_epochs=2, keep_last_k=3, save_every_n=1, max_duration=6.0)
    ref, exp = work / "reference", work / "killed"
    out = {"reference_status": _run_to_end(data, ref, base), "kills": []}
    for kind, n, where in KILLS:
        resume = "latest" if ckpt.training_checkpoints(exp) else ""
        before = _state_of(exp) if exp.is_dir() else None
        killed = _run_and_kill(data, exp, {**base, "resume": resume}, f"{kind} {n} {where}")
        out["kills"].append({"target": f"{kind} {n} {where}", "resume": resume, "killed": killed,
                             "temporaries_before": before["temporaries"] if before else [],
                             "after": _state_of(exp)})
    out["final_status"] = _run_to_end(data, exp, {**base, "resume": "latest"})
    out["final"] = _state_of(exp)
    try:
        harness.assert_same(harness.weights(ref / "epoch-2.pt"), harness.weights(exp / "epoch-2.pt"))
        out["same_as_uninterrupted"] = True
    except AssertionError as e:
        out["same_as_uninterrupted"] = f"differs: {e}"
    events = json.loads((exp / "history.json").read_text())
    out["events"] = [e["event"] for e in events]
    out["epochs_recorded"] = [e["epoch"] for e in events if e["event"] == "epoch"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
