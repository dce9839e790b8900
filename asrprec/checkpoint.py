"""Checkpoints: atomic save, load / resume across precision policies, rotation, averaging.

What a checkpoint holds (one ``torch.save`` dict; every entry loads with ``torch.load(weights_only=True)``)::

    format_version   int
    model            state_dict of the unwrapped model (DDP ``.module`` / ``torch.compile`` ``_orig_mod`` removed)
    model_avg        optional running average of the weights (icefall's ``model_avg``): :class:`RunningAverage`'s
                     {"weights": float64 state_dict, "count": snapshots, "period": batches between them}
    optimizer        optimizer.state_dict()           optimizer_kind  "master" (bf16 fp32-master wrapper) | "plain"
    scheduler        scheduler.state_dict()           scaler          scaler.state_dict()
    sampler          optional sampler.state_dict()    config          dict (the run's configuration)
    policy           policy.describe() (policy name + effective dtypes)
    rng              python / numpy / torch CPU / torch CUDA generator states (:mod:`asrprec.rng`)
    runtime_state    optional state modules keep outside their state_dict (:func:`module_runtime_state`)
    extra            dict of counters (epoch, batch_idx_train, best losses...); the training loop adds
                     ``progress`` (the position within the epoch, :class:`asrprec.training.resume.EpochProgress`)
                     and ``history`` (the epochs' records)

Writing is atomic: a temporary file in the destination directory, flushed and fsync-ed, then ``os.replace``
onto the destination; a failure at any point leaves the previous checkpoint untouched and no temporary file
behind. Only rank 0 writes (``rank`` argument), so DDP training can call these functions on every rank.

Loading across precision policies (rule):

* **model weights** always load: each tensor is copied into the current model's parameter, i.e. cast to the
  current model's dtype (fp32 checkpoint → bf16-cast model rounds to bf16; bf16 → fp32 widens exactly);
  a warning says the policy changed.
* **optimizer state** of the ``bf16`` policy's fp32-master-weights wrapper and of a plain optimizer are
  different structures; loading one into the other raises :class:`CheckpointMismatchError` whose message
  gives the fix (resume under the saved policy, or pass ``optimizer=None`` to load weights only and restart
  the optimizer).
* **scaler state** loads into whatever scaler the current policy made (a no-op scaler ignores a GradScaler's
  scale; a GradScaler that finds no saved scale keeps its initial one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from asrprec.models.builders import unwrap_model
from asrprec.rng import get_rng_state, set_rng_state

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and the fix."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's contents do not fit the objects it is being loaded into."""


class CheckpointReadError(CheckpointError):
    """A checkpoint file exists but cannot be read (empty, truncated, corrupt, or not a checkpoint)."""


class CheckpointPolicyWarning(UserWarning):
    """The checkpoint was saved under a different precision policy than the one loading it."""


# -- internals -------------------------------------------------------------------------------------


def _optimizer_kind(optimizer: Any) -> str:
    from asrprec.precision import MasterWeightOptimizer

    return "master" if isinstance(optimizer, MasterWeightOptimizer) else "plain"


def _saved_optimizer_kind(state: dict) -> str:
    return "master" if isinstance(state, dict) and "masters" in state and "inner" in state else "plain"


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform/filesystem (best effort).
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: str | os.PathLike, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; checkpoints are ordinary readable files
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` that either fully replaces ``path`` or leaves it as it was."""
    return _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` so that ``path`` holds either the old or the whole new text."""
    return _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def module_runtime_state(model: nn.Module) -> dict[str, dict]:
    """State that modules keep outside their ``state_dict`` but that later steps depend on (e.g. the Zipformer's
    ``Whiten`` probability, which its backward updates): ``{module name: module.runtime_state_dict()}`` for every
    submodule defining ``runtime_state_dict``. Kept apart from the weights, so that weight files, averaging and
    older checkpoints are unaffected."""
    return {name: m.runtime_state_dict() for name, m in unwrap_model(model).named_modules()
            if callable(getattr(m, "runtime_state_dict", None))}


def load_module_runtime_state(model: nn.Module, state: dict[str, dict]) -> None:
    """Restore :func:`module_runtime_state` (modules missing on either side are skipped)."""
    modules = dict(unwrap_model(model).named_modules())
    for name, s in state.items():
        m = modules.get(name)
        if m is not None and callable(getattr(m, "load_runtime_state_dict", None)):
            m.load_runtime_state_dict(s)


# -- save / load -----------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    policy: Any = None,
    config: dict | None = None,
    extra: dict | None = None,
    model_avg: Any = None,
    rank: int = 0,
) -> Path | None:
    """Write a training checkpoint atomically (rank 0 only; other ranks return None without writing).

    Args:
        path: destination file (parent directories are created).
        model: the model, possibly DDP- or compile-wrapped (the bare model's state is saved).
        optimizer / scheduler / scaler / sampler: anything with ``state_dict()``; None to skip.
        policy: the :class:`~asrprec.precision.PrecisionPolicy` in use (its ``describe()`` is stored).
        config: the run's configuration as a plain dict. extra: counters (epoch, batch_idx_train...).
        model_avg: an optional :class:`RunningAverage` (or any object with ``state_dict()``, e.g. a model).
    Returns:
        the written path on rank 0, else None.
    """
    if rank != 0:
        return None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"config must be a plain dict (e.g. dataclasses.asdict(cfg)), got {type(config).__name__}")
    ckpt: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "model": unwrap_model(model).state_dict(),
        "policy": policy.describe() if policy is not None else None,
        "config": config or {},
        "extra": dict(extra or {}),
        "rng": get_rng_state(),
    }
    runtime = module_runtime_state(model)
    if runtime:
        ckpt["runtime_state"] = runtime
    if model_avg is not None:
        ckpt["model_avg"] = unwrap_model(model_avg).state_dict()
    if optimizer is not None:
        ckpt["optimizer"] = optimizer.state_dict()
        ckpt["optimizer_kind"] = _optimizer_kind(optimizer)
    for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("sampler", sampler)):
        if obj is not None:
            ckpt[name] = obj.state_dict()
    return atomic_torch_save(ckpt, path)


def _present_checkpoints(directory: Path) -> str:
    names = [p.name for p in list_checkpoints(directory, EPOCH_PATTERN)[::-1]]
    names += [p.name for p in list_checkpoints(directory, BATCH_PATTERN)[::-1]]
    return ", ".join(names) or "none"


def read_checkpoint(
    path: str | os.PathLike, *, map_location: Any = "cpu", weights_only: bool = True, mmap: bool = False
) -> dict:
    """``torch.load`` a checkpoint; every failure names the file and the fix.

    Raises:
        FileNotFoundError: no such file (the message lists the checkpoints present in its folder).
        CheckpointReadError: an empty, truncated or corrupt file, one that is not an asrprec checkpoint, or (with
            ``weights_only``) one holding objects that safe loading refuses.
    """
    path = Path(path)
    if not path.is_file():
        where = path.parent
        present = _present_checkpoints(where) if where.is_dir() else f"the folder {where} does not exist"
        raise FileNotFoundError(
            f"checkpoint {path} does not exist (checkpoints in {where}: {present}). Fix: pick one of those (or "
            f"--resume latest for the newest complete one), or check --exp-dir"
        )
    size = path.stat().st_size
    if size == 0:
        raise CheckpointReadError(
            f"checkpoint {path} is empty (0 bytes): its writing was cut off before any data reached the disk, or "
            f"the disk was full. Fix: delete it and resume from another checkpoint (--resume latest picks the newest "
            f"complete one; present: {_present_checkpoints(path.parent)})"
        )
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except Exception as e:  # pickle / zip errors come in many types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if weights_only and "Weights only load failed" in str(e):
            raise CheckpointReadError(
                f"checkpoint {path} holds Python objects that safe loading (weights_only=True) refuses ({first}). "
                "asrprec's own checkpoints never do. Fix: if the file comes from a source you trust, load it with "
                "weights_only=False; otherwise do not load it"
            ) from e
        raise CheckpointReadError(
            f"checkpoint {path} ({size:,} bytes) cannot be read: it is truncated or corrupt ({type(e).__name__}: "
            f"{first}). Fix: delete it and resume from another checkpoint (--resume latest picks the newest "
            f"complete one; present: {_present_checkpoints(path.parent)})"
        ) from e
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointReadError(
            f"{path} is not an asrprec checkpoint (no 'model' entry). Fix: pass a file written by asrprec's "
            "training (epoch-N.pt or checkpoint-N.pt)"
        )
    return ckpt


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    policy: Any = None,
    model_avg: Any = None,
    strict: bool = True,
    restore_rng: bool = True,
    map_location: Any = "cpu",
    weights_only: bool = True,
    checkpoint: dict | None = None,
) -> dict:
    """Load a checkpoint into the given objects (those left None are not touched).

    Args:
        path: the checkpoint file.
        model: receives the weights, cast to its own parameter dtypes (see the module docstring's rule).
        optimizer / scheduler / scaler / sampler / model_avg: receive their saved states; asking for a state
            the checkpoint lacks raises :class:`CheckpointMismatchError`.
        policy: the current precision policy; a different saved policy gives :class:`CheckpointPolicyWarning`.
        strict: passed to ``model.load_state_dict``.
        restore_rng: restore python / numpy / torch (CPU, CUDA) generator states, for an exact resume.
        map_location: where tensors are loaded (``"cpu"`` then copied into the objects' own devices).
        checkpoint: the contents of ``path`` if already read with :func:`read_checkpoint` (not read again).
    Returns:
        ``{"extra": dict, "config": dict, "policy": dict | None, "format_version": int}``.
    """
    ckpt = checkpoint if checkpoint is not None else read_checkpoint(path, map_location=map_location,
                                                                     weights_only=weights_only)
    saved_policy = ckpt.get("policy")
    if policy is not None and saved_policy is not None and saved_policy.get("policy") != policy.name:
        warnings.warn(
            f"checkpoint {path} was saved under precision policy {saved_policy.get('policy')!r} "
            f"(params {saved_policy.get('param_dtype')}), loading under {policy.name!r}: model weights are cast "
            "to the current model's dtypes; the grad-scaler state applies only if both policies use one.",
            CheckpointPolicyWarning,
            stacklevel=2,
        )

    def need(key: str) -> Any:
        if key not in ckpt:
            raise CheckpointMismatchError(
                f"checkpoint {path} has no {key!r} state (it holds: {', '.join(sorted(ckpt))}); pass {key}=None "
                "to skip it"
            )
        return ckpt[key]

    if optimizer is not None:
        state = need("optimizer")
        saved_kind = ckpt.get("optimizer_kind", _saved_optimizer_kind(state))
        kind = _optimizer_kind(optimizer)
        if saved_kind != kind:
            describe = {"master": "the bf16 policy's fp32-master-weights optimizer", "plain": "a plain optimizer"}
            saved_name = (saved_policy or {}).get("policy", "unknown")
            raise CheckpointMismatchError(
                f"checkpoint {path} holds the state of {describe[saved_kind]} (saved under policy {saved_name!r}) "
                f"but the optimizer given is {describe[kind]}. Fix: resume under the saved policy "
                f"(--precision {saved_name}), or pass optimizer=None (and scheduler=None) to load only the "
                "weights and start the optimizer afresh."
            )

    if model is not None:
        if strict:
            load_model_weights(model, ckpt["model"], source=f"checkpoint {path}", fix=(
                "resume with the model settings of the run that wrote it (its folder's model.json / config.json), "
                "or start the new model in another --exp-dir"))
        else:
            unwrap_model(model).load_state_dict(ckpt["model"], strict=False)
        load_module_runtime_state(model, ckpt.get("runtime_state", {}))
    if model_avg is not None:
        unwrap_model(model_avg).load_state_dict(need("model_avg"), strict=strict)
    # After the model: the master-weights optimizer copies its fp32 masters into the model's bf16 params.
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(need("scheduler"))
    if scaler is not None:
        scaler.load_state_dict(need("scaler"))
    if sampler is not None:
        sampler.load_state_dict(need("sampler"))
    if restore_rng and "rng" in ckpt:
        set_rng_state(ckpt["rng"])
    return {
        "extra": ckpt.get("extra", {}),
        "config": ckpt.get("config", {}),
        "policy": saved_policy,
        "format_version": ckpt.get("format_version", 0),
    }


# -- file names, rotation --------------------------------------------------------------------------


def load_model_weights(model: nn.Module, state: dict[str, torch.Tensor], *, source: str = "checkpoint",
                       fix: str | None = None) -> None:
    """``model.load_state_dict(state)`` (strict), with an error that says which tensors disagree and what to do.

    ``source`` names where ``state`` came from in the message; ``fix`` replaces the default advice (which is
    written for decoding with a recipe's ``model.json``).

    Raises:
        CheckpointMismatchError: missing or unexpected tensor names, or shapes that differ, e.g. when a recipe's
            ``model.json`` describes another architecture than the one the checkpoint was trained with.
    """
    target = unwrap_model(model).state_dict()
    missing = sorted(set(target) - set(state))
    unexpected = sorted(set(state) - set(target))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(target[k].shape)}"
              for k in target if k in state and tuple(state[k].shape) != tuple(target[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append(f"{len(shapes)} shape(s) differ, e.g. {'; '.join(shapes[:3])}")
        if missing:
            parts.append(f"{len(missing)} tensor(s) missing from the {source}, e.g. {missing[:3]}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")
        if fix is not None:
            raise CheckpointMismatchError(
                f"the {source} does not fit this model ({'; '.join(parts)}): it was trained with another "
                f"architecture. Fix: {fix}.")
        raise CheckpointMismatchError(
            f"the {source} does not fit this model ({'; '.join(parts)}). The model was built with a different "
            "architecture from the one the checkpoint was trained with. Fix: build the model with the training "
            "run's settings (a recipe's model.json stores the encoder's full config in 'encoder_overrides'; for an "
            "experiment whose model.json lacks a field, add the field the run was trained with, e.g. "
            "--encoder-overrides '{\"frontend_channels\": [8, 32, 128]}' for a Conformer 'tiny' with icefall's "
            "front-end widths)."
        )
    unwrap_model(model).load_state_dict(state)


#: end-of-epoch checkpoints (icefall's names), periodic mid-epoch checkpoints, and the file saved on a failure
EPOCH_PATTERN = "epoch-*.pt"
BATCH_PATTERN = "checkpoint-*.pt"
BAD_MODEL_NAME = "bad-model.pt"
# the temporary files of atomic_torch_save / atomic_write_text: ".<name>.<random>.tmp" beside the destination
_TEMPORARY_PATTERNS = (".*.pt.*.tmp", ".*.json.*.tmp")


def epoch_checkpoint_path(exp_dir: str | os.PathLike, epoch: int) -> Path:
    """``exp_dir/epoch-{epoch}.pt`` (icefall's name for end-of-epoch checkpoints)."""
    return Path(exp_dir) / f"epoch-{epoch}.pt"


def batch_checkpoint_path(exp_dir: str | os.PathLike, batch_idx_train: int) -> Path:
    """``exp_dir/checkpoint-{batch_idx_train}.pt`` (icefall's name for periodic checkpoints)."""
    return Path(exp_dir) / f"checkpoint-{batch_idx_train}.pt"


def bad_model_path(exp_dir: str | os.PathLike) -> Path:
    """``exp_dir/bad-model.pt``: the state saved when training stops on an error, for inspection."""
    return Path(exp_dir) / BAD_MODEL_NAME


def oom_batch_path(exp_dir: str | os.PathLike, batch_idx_train: int, rank: int | None = None) -> Path:
    """``exp_dir/oom-batch-{batch_idx_train}[-rank{rank}].pt``: a batch that ran out of memory, for reproduction."""
    return Path(exp_dir) / f"oom-batch-{batch_idx_train}{'' if rank is None else f'-rank{rank}'}.pt"


def _number(p: Path) -> int | None:
    nums = re.findall(r"\d+", p.stem)
    return int(nums[-1]) if nums else None


def list_checkpoints(exp_dir: str | os.PathLike, pattern: str = BATCH_PATTERN) -> list[Path]:
    """Files matching ``pattern`` that carry a number, newest (largest number) first."""
    files = [(n, p) for p in Path(exp_dir).glob(pattern) if (n := _number(p)) is not None]
    return [p for _, p in sorted(files, key=lambda x: x[0], reverse=True)]


def training_checkpoints(exp_dir: str | os.PathLike) -> list[Path]:
    """Every ``epoch-N.pt`` and ``checkpoint-N.pt`` in ``exp_dir`` (a run's resumable files), sorted by name."""
    return sorted(list_checkpoints(exp_dir, EPOCH_PATTERN) + list_checkpoints(exp_dir, BATCH_PATTERN))


def remove_stale_temporaries(exp_dir: str | os.PathLike, *, rank: int = 0) -> list[Path]:
    """Delete the temporary files that writes killed mid-way left in ``exp_dir`` (``.<name>.<random>.tmp``).

    Call it when a run starts, before anything writes into the folder: a temporary file is never a checkpoint
    (only a completed write is renamed onto a checkpoint name). Only rank 0 deletes. Returns the deleted paths.
    """
    if rank != 0 or not Path(exp_dir).is_dir():
        return []
    stale = sorted(p for pattern in _TEMPORARY_PATTERNS for p in Path(exp_dir).glob(pattern))
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    if stale:
        log.info("removed %d unfinished checkpoint write(s) from %s: %s", len(stale), exp_dir,
                 ", ".join(p.name for p in stale))
    return stale


def checkpoint_position(path: str | os.PathLike) -> tuple[int, int, bool]:
    """Where in training ``path`` was written: ``(batch_idx_train, epoch, end_of_epoch)``, read without loading
    its tensors (memory-mapped). Raises what :func:`read_checkpoint` raises."""
    ckpt = read_checkpoint(path, mmap=True)
    extra = ckpt.get("extra", {})
    if "batch_idx_train" not in extra:
        raise CheckpointReadError(f"{path} records no training position (extra['batch_idx_train']); it cannot be "
                                  "resumed from. Fix: resume from a checkpoint written by asrprec's training loop")
    progress = extra.get("progress") or {}
    end = bool(progress.get("epoch_done", Path(path).name.startswith("epoch-")))
    return int(extra["batch_idx_train"]), int(extra.get("epoch", 0)), end


def _first_readable(paths: list[Path], unreadable: list[str]) -> tuple[Path, tuple[int, int, bool]] | None:
    """The first of ``paths`` (newest first) whose position can be read; the others are noted and skipped."""
    for path in paths:
        try:
            return path, checkpoint_position(path)
        except (CheckpointError, OSError) as e:
            unreadable.append(path.name)
            log.warning("--resume latest: skipping %s: %s", path, e)
    return None


def find_latest_checkpoint(exp_dir: str | os.PathLike) -> Path:
    """The newest complete checkpoint in ``exp_dir`` (``--resume latest``): the one furthest into training among
    ``epoch-N.pt`` and ``checkpoint-N.pt``; at the same batch the end-of-epoch one (it is written later).

    Only the newest readable file of each kind is opened (names order each kind: epochs, batches); files that
    cannot be read (empty, truncated, not a checkpoint) are skipped with a warning naming them.

    Raises:
        FileNotFoundError: the folder holds no readable checkpoint (the message says what it found).
    """
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise FileNotFoundError(f"--resume latest: the experiment folder {exp_dir} does not exist. Fix: check "
                                "--exp-dir, or start a new run without --resume")
    unreadable: list[str] = []
    found = [f for f in (_first_readable(list_checkpoints(exp_dir, EPOCH_PATTERN), unreadable),
                         _first_readable(list_checkpoints(exp_dir, BATCH_PATTERN), unreadable)) if f is not None]
    if not found:
        what = f" (unreadable: {', '.join(unreadable)})" if unreadable else ""
        raise FileNotFoundError(f"--resume latest: no complete checkpoint in {exp_dir}{what}. Fix: start a new run "
                                "without --resume (add --overwrite if the folder holds another run's files)")
    return max(found, key=lambda f: (f[1][0], f[1][2]))[0]


def newer_checkpoints(exp_dir: str | os.PathLike, position: tuple[int, int, bool]) -> list[Path]:
    """The checkpoints of ``exp_dir`` written after the training ``position`` ``(batch_idx_train, epoch,
    end_of_epoch)``, told by their names: ``checkpoint-B.pt`` with B beyond the batch, ``epoch-N.pt`` with N beyond
    the epoch (or equal, when the position is within epoch N)."""
    batch, epoch, end = position
    newer = [p for p in list_checkpoints(exp_dir, BATCH_PATTERN) if _number(p) > batch]
    newer += [p for p in list_checkpoints(exp_dir, EPOCH_PATTERN)
              if _number(p) > epoch or (_number(p) == epoch and not end)]
    return sorted(newer)


def keep_last_k(
    exp_dir: str | os.PathLike, pattern: str = BATCH_PATTERN, k: int = 30, *, rank: int = 0
) -> list[Path]:
    """Delete all but the ``k`` newest checkpoints matching ``pattern`` (ordered by the number in the name).

    ``k <= 0`` keeps everything (icefall's ``--keep-last-k 0``). Only rank 0 deletes. Returns the deleted paths.
    """
    if rank != 0 or k <= 0:
        return []
    doomed = list_checkpoints(exp_dir, pattern)[k:]
    for p in doomed:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return doomed


# -- averaging -------------------------------------------------------------------------------------


def find_epoch_checkpoints(exp_dir: str | os.PathLike, epoch: int, avg: int) -> list[Path]:
    """``epoch-(epoch-avg+1).pt … epoch-{epoch}.pt`` in ``exp_dir`` (icefall's ``--epoch E --avg A``)."""
    if avg < 1:
        raise ValueError(f"avg must be >= 1, got {avg}")
    if epoch - avg + 1 < 1:
        raise ValueError(f"cannot average {avg} epochs ending at epoch {epoch} (epochs start at 1); use avg <= {epoch}")
    paths = [epoch_checkpoint_path(exp_dir, e) for e in range(epoch - avg + 1, epoch + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        have = [p.name for p in sorted(list_checkpoints(exp_dir, EPOCH_PATTERN), key=_number)]
        raise FileNotFoundError(
            f"cannot average epochs {epoch - avg + 1}..{epoch}: missing {', '.join(missing)} in {exp_dir} "
            f"(present: {', '.join(have) or 'none'}). Fix: choose --epoch/--avg within the present epochs."
        )
    return paths


def average_checkpoints(
    paths: Iterable[str | os.PathLike], *, key: str = "model", map_location: Any = "cpu", weights_only: bool = True
) -> dict[str, torch.Tensor]:
    """The element-wise mean of the ``key`` state_dicts of ``paths``.

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
        ckpt = read_checkpoint(p, map_location=map_location, weights_only=weights_only)
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
                    map_location: Any = "cpu") -> dict[str, torch.Tensor]:
    """The mean of the weight snapshots a :class:`RunningAverage` took after checkpoint ``start`` and up to
    checkpoint ``end`` (``start=None``: since the beginning of training):
    ``(mean_end * count_end - mean_start * count_start) / (count_end - count_start)``.

    Returns a state dict for the model of ``end``, each floating tensor cast to its dtype there.
    Raises:
        CheckpointMismatchError: a checkpoint without a running average (trained before it existed, or with
            averaging off), or no snapshot between the two (``start`` is not earlier, or the period is longer
            than the span: lower ``--average-period`` or widen ``--avg``).
    """
    def averaged(path):
        ckpt = read_checkpoint(path, map_location=map_location)
        avg = ckpt.get("model_avg")
        if not isinstance(avg, dict) or "count" not in avg:
            raise CheckpointMismatchError(
                f"checkpoint {path} holds no running average of the weights (trained with --average-period 0 or "
                "before asrprec kept one); decode without --use-averaged-model (plain --avg averages epoch files)")
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
    return out


def load_decoding_weights(model: nn.Module, exp_dir: str | os.PathLike, epoch: int, avg: int,
                          use_averaged_model: bool = False) -> str:
    """Load the weights a decode script's ``--epoch E --avg A [--use-averaged-model]`` name into ``model``.

    Without ``use_averaged_model``: the mean of ``epoch-(E-A+1).pt`` ... ``epoch-E.pt``. With it: the mean of the
    running-average snapshots after ``epoch-(E-A).pt`` up to ``epoch-E.pt`` (since the start when E == A), as
    icefall's ``--use-averaged-model``. Returns a description of what was loaded, for the log."""
    if not use_averaged_model:
        paths = find_epoch_checkpoints(exp_dir, epoch, avg)
        source = f"average of {', '.join(p.name for p in paths)}"
        load_model_weights(model, average_checkpoints(paths), source=source)
        return source
    if not 1 <= avg <= epoch:
        raise ValueError(f"--use-averaged-model averages the epochs after epoch {epoch}-{avg}: need 1 <= avg <= epoch")
    end = find_epoch_checkpoints(exp_dir, epoch, 1)[0]
    start = None if epoch - avg == 0 else find_epoch_checkpoints(exp_dir, epoch - avg, 1)[0]
    source = f"running average from {start.name if start else 'the start'} to {end.name}"
    load_model_weights(model, average_between(start, end), source=source)
    return source
