"""Run by test_restart.py under ``torchrun --standalone --nproc_per_node 2`` (gloo, CPU)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 1 _restart_worker.py OUT_DIR kill
    python -m torch.distributed.run --standalone --nproc_per_node 2 _restart_worker.py OUT_DIR preempt

``kill``: attempt 0 trains an uninterrupted reference run, then the same run with ``resume="auto"`` in another
folder, in which rank 1 kills itself with SIGKILL during its 5th training step (mid epoch 2; the newest checkpoint
is ``checkpoint-4.pt``). torchrun ends rank 0 and starts both workers again: attempt 1 runs the same command
(``resume="auto"``) to the end.

``preempt`` (a first launch, then the same command again): the reference run if it is not there, then the run with
``resume="auto"`` and no periodic checkpoints, in which rank 0 announces its 5th training step
(``OUT_DIR/step5``) and waits there until the test has sent SIGTERM to torchrun (``OUT_DIR/signalled``).

Each run leaves its weights and a record in OUT_DIR.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("asrprec_tests_ddp_worker", HERE.parent / "training" / "_ddp_worker.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

KILL_AT_STEP = 5


class KilledEncoder(W.DropoutEncoder):
    """Draws dropout masks each step (the random states must be restored too); in training forward pass
    ``kill_at`` it sends SIGKILL to its own process, in ``wait_at`` it announces the step and waits for the test's
    signal."""

    def __init__(self, kill_at: int | None = None, wait_at: int | None = None, out: Path | None = None):
        super().__init__()
        self.kill_at, self.wait_at, self.out = kill_at, wait_at, out

    def forward(self, x, lens):
        if self.training and self.kill_at is not None and self.calls + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.training and self.wait_at is not None and self.calls + 1 == self.wait_at:
            (self.out / f"step{self.wait_at}").write_text("")
            deadline = time.time() + 60
            while not (self.out / "signalled").exists() and time.time() < deadline:
                time.sleep(0.05)
        return super().forward(x, lens)


def run(exp: Path, rank: int, encoder: dict | None = None, **cfg) -> tuple[torch.nn.Module, object]:
    """Train in ``exp`` with a :class:`KilledEncoder` of arguments ``encoder``."""
    from asrprec.precision import get_policy
    from asrprec.training import train

    torch.manual_seed(0)  # the encoder is built before make_model seeds the rest
    model = W.make_model(KilledEncoder(**(encoder or {})))
    state = train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(),
                  train_dl=W.shard(W.make_batches(6), rank), valid_dl=W.shard(W.make_batches(2, 1), rank),
                  cfg=W.train_cfg(exp, num_epochs=3, keep_last_k=10, seed=5, resume="auto",
                                  **{"save_every_n": 2, **cfg}))
    return model, state


def preempt(out: Path, rank: int) -> None:
    """The ``preempt`` mode; a preempted run raises out of here (run_main turns it into exit code 75)."""
    from asrprec.cli import run_main

    if not (out / f"reference-rank{rank}.pt").exists():
        reference, _ = run(out / "reference", rank, save_every_n=0)
        torch.save(W.params(reference), out / f"reference-rank{rank}.pt")
    launch = len(list(out.glob(f"preempt-launch*-rank{rank}.started")))
    (out / f"preempt-launch{launch}-rank{rank}.started").write_text("")
    encoder = {"wait_at": 5 if launch == 0 and rank == 0 else None, "out": out}

    def main() -> None:
        model, state = run(out / "preempted", rank, encoder, save_every_n=0)
        torch.save(W.params(model), out / f"preempted-rank{rank}.pt")
        (out / f"preempt-launch{launch}-rank{rank}.json").write_text(json.dumps(
            {"batch_idx_train": state.batch_idx_train, "steps_here": model.encoder.calls}))

    try:
        run_main(main, "_restart_worker.py")
    except SystemExit as e:  # the exit status torchrun sees; recorded, since torchrun does not print it here
        (out / f"preempt-launch{launch}-rank{rank}.exit").write_text(str(e.code))
        raise


def main() -> None:
    from asrprec.training import setup_distributed

    out, mode = Path(sys.argv[1]), sys.argv[2]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.time()
    env = setup_distributed("cpu", timeout=timedelta(seconds=60))
    rank = env.rank
    if mode == "preempt":
        preempt(out, rank)
        return
    (out / f"attempt{attempt}-rank{rank}.started").write_text(json.dumps({"before": t0, "joined": time.time()}))
    if attempt == 0:
        reference, _ = run(out / "reference", rank)
        torch.save(W.params(reference), out / f"reference-rank{rank}.pt")
    model, state = run(out / "restarted", rank, {"kill_at": KILL_AT_STEP if attempt == 0 and rank == 1 else None})
    torch.save(W.params(model), out / f"restarted-rank{rank}.pt")
    (out / f"attempt{attempt}-rank{rank}.json").write_text(json.dumps(
        {"batch_idx_train": state.batch_idx_train, "steps_here": model.encoder.calls}))


if __name__ == "__main__":
    main()
