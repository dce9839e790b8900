"""Stop training with real signals and with SIGKILL, then run the same command with ``resume="auto"`` until the run
completes; compare with an uninterrupted run.

Run as ``python preempt_driver.py DATA_ROOT WORK_DIR``; prints one JSON object. Python starts once: each training
run is a forked child (a real process, sent real signals) that trains through
:func:`asrprec.cli.run_main`, as a recipe's ``train.py`` does, so its exit status is the program's. In a
child, the training step and ``torch.save`` inside checkpoint writes report to the parent and wait for its go-ahead,
so the parent signals at an exact point: during a training step, or in the middle of a checkpoint write.
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

CHUNKS = 4


def _instrument(events_w: int, acks_r: int) -> None:
    """Report each training step and each chunk of a checkpoint write on ``events_w``; wait for a byte on
    ``acks_r`` after each."""
    from asrprec.training import loop

    real_step, real_save = loop.train_step, torch.save

    def report(what: str) -> None:
        os.write(events_w, (what + "\n").encode())
        os.read(acks_r, 1)  # a signal arriving here runs its handler, then the read goes on (PEP 475)

    def step(run, *a, **kw):
        report(f"step {run.state.batch_idx_train}")
        return real_step(run, *a, **kw)

    def save(obj, f, *a, **kw):
        if not (isinstance(obj, dict) and "extra" in obj and hasattr(f, "write")):
            return real_save(obj, f, *a, **kw)
        buf = io.BytesIO()
        real_save(obj, buf, *a, **kw)
        data = buf.getvalue()
        size = -(-len(data) // CHUNKS)
        for i in range(CHUNKS):
            report(f"save {Path(f.name).name.split('-', 2)[-1]} chunk-{i}")
            f.write(data[i * size:(i + 1) * size])
            f.flush()

    loop.train_step = step
    torch.save = save


def _child(data: Path, exp: Path, kw: dict, events_w: int | None = None, acks_r: int | None = None) -> None:
    code = 0
    try:
        from asrprec.cli import run_main

        if events_w is not None:
            _instrument(events_w, acks_r)
        run_main(lambda: harness.run(data, exp, **kw), "train.py")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # report to the parent through the exit code
        print(f"child failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        sys.stderr.flush()
        os._exit(code)


def _status(wait_status: int) -> int:
    """The exit code, or -signal for a process killed by a signal."""
    return os.waitstatus_to_exitcode(wait_status)


def _run_to_end(data: Path, exp: Path, kw: dict) -> int:
    pid = os.fork()
    if pid == 0:
        _child(data, exp, kw)
    return _status(os.waitpid(pid, 0)[1])


def _run_with(data: Path, exp: Path, kw: dict, actions: dict[str, list[int]]) -> tuple[int, list[str]]:
    """Run a child; when it reports an event named in ``actions``, send it those signals before letting it go on.
    Returns its exit status and the events it reported."""
    events_r, events_w = os.pipe()
    acks_r, acks_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(events_r)
        os.close(acks_w)
        _child(data, exp, kw, events_w, acks_r)
    os.close(events_w)
    os.close(acks_r)
    seen = []
    with os.fdopen(events_r) as events:
        for line in events:
            seen.append(line.strip())
            for sig in actions.get(seen[-1], []):
                os.kill(pid, sig)
            try:
                os.write(acks_w, b"k")
            except BrokenPipeError:  # the child was killed
                break
    os.close(acks_w)
    return _status(os.waitpid(pid, 0)[1]), seen


def _state_of(exp: Path) -> dict:
    bad, positions = [], {}
    for p in ckpt.training_checkpoints(exp):
        try:
            ckpt.read_checkpoint(p)
            positions[p.name] = list(ckpt.checkpoint_position(p))
        except Exception as e:  # any failure is a finding
            bad.append(f"{p.name}: {e}")
    return {"checkpoints": positions, "unloadable": bad, "temporaries": sorted(p.name for p in exp.glob(TEMPORARY_GLOB))}


def _same(ref: Path, exp: Path) -> bool | str:
    try:
        harness.assert_same(harness.weights(ref / "epoch-2.pt"), harness.weights(exp / "epoch-2.pt"))
        return True
    except AssertionError as e:
        return f"differs: {e}"


def _events(exp: Path) -> list[dict]:
    return json.loads((exp / "history.json").read_text())


def _warm_up(data: Path) -> None:
    """Import in the parent what every child needs (building an optimizer imports torch._dynamo, seconds)."""
    from asrprec.data import AsrDataModule, DataConfig  # noqa: F401
    from asrprec.tokenizer import Tokenizer
    from asrprec.training import optimizer_from_config  # noqa: F401
    from asrprec.cli import run_main  # noqa: F401

    harness.build_model(Tokenizer(data / "bpe.model"))
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def main() -> None:
    data, work = Path(sys.argv[1]), Path(sys.argv[2])
    _warm_up(data)
    # epochs of about three batches; no periodic mid-epoch checkpoints: a preempted run's is the only one
    base = dict(num_epochs=2, keep_last_k=3, save_every_n=0, max_duration=6.0, resume="auto")
    ref = work / "reference"
    out: dict = {"reference_status": _run_to_end(data, ref, base)}

    # SIGTERM during step 1: the next agreement (batch 2) stops the run after step 2; a second SIGTERM arrives in
    # the middle of writing checkpoint-2.pt
    exp = work / "preempted"
    status, seen = _run_with(data, exp, base, {"step 1": [signal.SIGTERM],
                                               "save checkpoint-2.pt chunk-1": [signal.SIGTERM]})
    out["preempted"] = {"status": status, "events": seen, "after": _state_of(exp),
                        "history": [e for e in _events(exp) if e["event"] == "preempted"]}
    out["preempted"]["resume_status"] = _run_to_end(data, exp, base)
    out["preempted"]["same_as_uninterrupted"] = _same(ref, exp)
    out["preempted"]["resumed_from"] = [Path(e["from"]).name for e in _events(exp) if e["event"] == "resume"]

    # SIGKILL during step 5 (epoch 2): the newest complete checkpoint is epoch-1.pt
    exp = work / "killed"
    status, seen = _run_with(data, exp, base, {"step 5": [signal.SIGKILL]})
    out["killed"] = {"status": status, "events": seen[-3:], "after": _state_of(exp)}
    out["killed"]["resume_status"] = _run_to_end(data, exp, base)
    out["killed"]["same_as_uninterrupted"] = _same(ref, exp)
    out["killed"]["resumed_from"] = [Path(e["from"]).name for e in _events(exp) if e["event"] == "resume"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
