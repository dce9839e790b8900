"""Two optimizer steps of a TDT transducer under ``torchrun --nproc_per_node 2`` (gloo, CPU), for
tests/training/test_tdt_training.py; the batches, shards and helpers are those of ``_ddp_worker.py``.

    python -m torch.distributed.run --standalone --nproc_per_node 2 _tdt_ddp_worker.py OUT_DIR
"""

from __future__ import annotations

import importlib.util
import sys
from datetime import timedelta
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("asrprec_tests_ddp_worker", Path(__file__).with_name("_ddp_worker.py"))
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def make_tdt_model():
    from asrprec.models import Decoder, Joiner, LossConfig, Transducer

    torch.manual_seed(0)
    durations = (0, 1, 2)
    return Transducer(W.LinearEncoder(), Decoder(6, 16), Joiner(16, 16, 16, 6, durations=durations),
                      loss=LossConfig(loss="tdt", tdt_durations=durations, loss_warmup_batches=4))


def main() -> None:
    from asrprec.precision import get_policy
    from asrprec.training import get_rank, setup_distributed, train

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    setup_distributed("cpu", timeout=timedelta(seconds=90))
    rank = get_rank()
    model = make_tdt_model()
    train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(),
          train_dl=W.Loader(W.shard(W.make_batches(4), rank), 1.0), valid_dl=W.shard(W.make_batches(2, 1), rank),
          cfg=W.train_cfg(out / "run", num_epochs=1, ref_duration=1.0))
    torch.save(W.params(model), out / f"tdt-rank{rank}.pt")


if __name__ == "__main__":
    main()
