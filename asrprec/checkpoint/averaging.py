"""Averaged weights for decoding: the mean of epoch checkpoints (``--avg``), and the running average of the
weights a checkpoint carries (:class:`RunningAverage`, ``--use-averaged-model``)."""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch
from torch import nn

from asrprec.models.unwrap import unwrap_model

from .files import check_epoch_selection, find_epoch_checkpoints
from .io import CheckpointMismatchError, load_model_weights, read_checkpoint, verify_weights


def average_checkpoints(
    paths: Iterable[str | os.PathLike], *, key: str = "model", map_location: Any = "cpu", weights_only: bool = True,
    allow_nonfinite: bool = False,
) -> dict[str, torch.Tensor]:
    """The element-wise mean of the ``key`` state_dicts of ``paths``, each verified as it is read
    (:func:`~.io.verify_weights`: its digest, finite unless ``allow_nonfinite``).

    Floating tensors are summed in float64 and the mean is cast back to the dtype they have in the *last*
    checkpoint; integer / bool buffers (counters such as BatchNorm's ``num_batches_tracked``) are taken from the
    last checkpoint, since a mean of counters means nothing.
    """
    paths = list(paths)
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint path")
    acc: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    for i, p in enumerate(paths):
        ckpt = read_checkpoint(p, map_location=map_location, weights_only=weights_only,
                               allow_nonfinite=allow_nonfinite)
        if key not in ckpt:
            raise CheckpointMismatchError(f"checkpoint {p} has no {key!r} entry")
        state = ckpt[key]
        if i == 0:
            acc = {k: v.double().clone() for k, v in state.items() if v.is_floating_point()}
            names = set(state)
        else:
            if set(state) != names:
                diff = sorted(set(state) ^ names)
                raise CheckpointMismatchError(
                    f"checkpoint {p} has different tensors from {paths[0]} (e.g. {diff[:5]}); "
                    "only checkpoints of the same model can be averaged"
                )
            for k, a in acc.items():
                if state[k].shape != a.shape:
                    raise CheckpointMismatchError(
                        f"{k} has shape {tuple(state[k].shape)} in {p} but {tuple(a.shape)} in {paths[0]}"
                    )
                a += state[k].double()
        last = state
    n = len(paths)
    return {k: (acc[k] / n).to(v.dtype) if k in acc else v.clone() for k, v in last.items()}


class RunningAverage:
    """The mean of the model's weights sampled every ``period`` batches since training began, in float64 on the
    CPU: icefall's ``model_avg`` (k2-fsa/icefall egs/librispeech/ASR/zipformer/train.py ``update_averaged_model``:
    weight ``period / batch_idx_train`` on the current model, i.e. a running mean of the snapshots).

    A checkpoint stores it (``model_avg`` entry); :func:`average_between` turns the averages in two checkpoints
    into the mean of the snapshots taken between them, which is what icefall decodes with
    ``--use-averaged-model`` (icefall/checkpoint.py ``average_checkpoints_with_averaged_model``): an average of
    every ``period``-th model over the last epochs, not only of their end points as ``--avg`` without it.
    Integer / bool buffers are taken from the latest snapshot.
    """

    def __init__(self, model: nn.Module, period: int = 200):
        if period < 1:
            raise ValueError(f"the averaging period must be >= 1 batch, got {period}")
        self.period = int(period)
        self.count = 0
        self.weights = {k: v.detach().to("cpu", torch.float64 if v.is_floating_point() else v.dtype, copy=True)
                        for k, v in unwrap_model(model).state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Add a snapshot of ``model``: mean <- mean + (current - mean) / count."""
        self.count += 1
        for k, v in unwrap_model(model).state_dict().items():
            a = self.weights[k]
            if a.is_floating_point():
                a.add_(v.detach().to("cpu", torch.float64) - a, alpha=1.0 / self.count)
            else:
                a.copy_(v)

    def maybe_update(self, model: nn.Module, batch_idx_train: int) -> bool:
        """:meth:`update` on every ``period``-th batch (``batch_idx_train`` counts from 1); True if it did."""
        if batch_idx_train > 0 and batch_idx_train % self.period == 0:
            self.update(model)
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "count": self.count, "period": self.period}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        if not isinstance(state, dict) or not {"weights", "count", "period"} <= set(state):
            raise CheckpointMismatchError("the checkpoint's model_avg is not a RunningAverage state "
                                          "({'weights', 'count', 'period'})")
        if strict and set(state["weights"]) != set(self.weights):
            diff = sorted(set(state["weights"]) ^ set(self.weights))
            raise CheckpointMismatchError(f"the checkpoint's model_avg holds other tensors than this model (e.g. "
                                          f"{diff[:3]})")
        self.weights = {k: v.to("cpu", torch.float64 if v.is_floating_point() else v.dtype)
                        for k, v in state["weights"].items()}
        self.count, self.period = int(state["count"]), int(state["period"])


def average_between(start: str | os.PathLike | None, end: str | os.PathLike, *,
                    map_location: Any = "cpu", allow_nonfinite: bool = False) -> dict[str, torch.Tensor]:
    """The mean of the weight snapshots a :class:`RunningAverage` took after checkpoint ``start`` and up to
    checkpoint ``end`` (``start=None``: since the beginning of training):
    ``(mean_end * count_end - mean_start * count_start) / (count_end - count_start)``.

    Returns a state dict for the model of ``end``, each floating tensor cast to its dtype there. Both checkpoints
    are verified as :func:`average_checkpoints` verifies its own, and so is the mean.
    Raises:
        CheckpointMismatchError: a checkpoint without a running average (trained before it existed, or with
            averaging off), or no snapshot between the two (``start`` is not earlier, or the period is longer
            than the span: lower ``--average-period`` or widen ``--avg``).
    """
    def averaged(path):
        ckpt = read_checkpoint(path, map_location=map_location, allow_nonfinite=allow_nonfinite)
        avg = ckpt.get("model_avg")
        if not isinstance(avg, dict) or "count" not in avg:
            raise CheckpointMismatchError(
                f"checkpoint {path} holds no running average of the weights (trained with --average-period 0, "
                "or written without one); decode without --use-averaged-model (plain --avg averages epoch files)")
        return ckpt, avg

    end_ckpt, end_avg = averaged(end)
    if start is None:
        start_count, start_weights = 0, {}
    else:
        _, start_avg = averaged(start)
        start_count, start_weights = int(start_avg["count"]), start_avg["weights"]
    n = int(end_avg["count"]) - start_count
    if n <= 0:
        raise CheckpointMismatchError(
            f"no averaged snapshot between {start} ({start_count} snapshots) and {end} ({end_avg['count']}): "
            "choose a larger --avg, or train with a smaller --average-period")
    out = {}
    for k, ref in end_ckpt["model"].items():
        w = end_avg["weights"][k]
        if w.is_floating_point():
            total = w.double() * int(end_avg["count"])
            if start_count:
                total = total - start_weights[k].double() * start_count
            out[k] = (total / n).to(ref.dtype)
        else:
            out[k] = ref.clone()
    # the running average is no part of the digest: a NaN there is caught here, named as in the checkpoint
    verify_weights({"model": out}, f"{end} (its running average)", allow_nonfinite=allow_nonfinite)
    return out


def load_decoding_weights(model: nn.Module, exp_dir: str | os.PathLike, epoch: int, avg: int,
                          use_averaged_model: bool = False, *, allow_nonfinite: bool = False) -> str:
    """Load the weights a decode script's ``--epoch E --avg A [--use-averaged-model]`` name into ``model``.

    Without ``use_averaged_model``: the mean of ``epoch-(E-A+1).pt`` ... ``epoch-E.pt``. With it: the mean of the
    running-average snapshots after ``epoch-(E-A).pt`` up to ``epoch-E.pt`` (since the start when E == A), as
    icefall's ``--use-averaged-model``. Every checkpoint read is verified (:func:`~.io.verify_weights`; NaN / Inf
    weights load only with ``allow_nonfinite``). Returns a description of what was loaded, for the log."""
    if not use_averaged_model:
        paths = find_epoch_checkpoints(exp_dir, epoch, avg)
        source = f"average of {', '.join(p.name for p in paths)}"
        load_model_weights(model, average_checkpoints(paths, allow_nonfinite=allow_nonfinite), source=source)
        return source
    check_epoch_selection(exp_dir, epoch, avg)  # the snapshots after epoch E-A, since the start when A == E
    end = find_epoch_checkpoints(exp_dir, epoch, 1)[0]
    start = None if epoch - avg == 0 else find_epoch_checkpoints(exp_dir, epoch - avg, 1)[0]
    source = f"running average from {start.name if start else 'the start'} to {end.name}"
    load_model_weights(model, average_between(start, end, allow_nonfinite=allow_nonfinite), source=source)
    return source
