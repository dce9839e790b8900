"""Hooks: what a run reports around its epochs besides the loop's own records. A hook is registered by the run's
builder (:meth:`asrprec.training.run.Run.build`) when its feature is on, so the loop never asks about it."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from asrprec.models.compile import compiled_graph_count, recompile_limit_hits

log = logging.getLogger(__name__)


class Hook(Protocol):
    """Called by the run at the start of each epoch, and at its end after validation (``stats``: the epoch's
    statistics, which the hook may add to; they go to ``history.json`` and the epoch's log line)."""

    def epoch_started(self, epoch: int) -> None: ...

    def epoch_ended(self, epoch: int, stats: dict[str, Any]) -> None: ...


class CompileReport:
    """torch.compile's graphs per epoch: logs the graphs compiled during each epoch (training and validation, first
    compiles and recompiles; ``stats["compiled_graphs"]``) and warns, naming them, about functions that reached
    dynamo's recompile limit: past it they run eager."""

    def __init__(self) -> None:
        self.graphs, self.limit_hits = 0, 0

    def epoch_started(self, epoch: int) -> None:
        self.graphs, self.limit_hits = compiled_graph_count(), len(recompile_limit_hits())

    def epoch_ended(self, epoch: int, stats: dict[str, Any]) -> None:
        new = compiled_graph_count() - self.graphs
        logging.info("torch.compile: %d graphs compiled during epoch %d (%d in all)", new, epoch, self.graphs + new)
        hits = list(dict.fromkeys(recompile_limit_hits()[self.limit_hits:]))
        if hits:
            log.warning("torch.compile: %s reached dynamo's recompile limit during epoch %d and run%s eager from "
                        "there on. TORCH_LOGS=recompiles names the guards that fail: if they are bounded (schedules "
                        "settling, train/eval, batch sizes of 1), raise --compile-recompile-limit; if they follow "
                        "every shape, --compile-dynamic true keeps every (B, T) in one graph (docs/compile.md).",
                        "; ".join(hits), epoch, "" if len(hits) > 1 else "s")
        stats["compiled_graphs"] = new
