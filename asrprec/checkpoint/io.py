"""Checkpoint I/O: save, read, load (across precision policies, the rule in :mod:`asrprec.checkpoint`), the
training position of a file, and the newest readable checkpoint of a folder.

Every checkpoint records the sha256 of its weights (:func:`~.integrity.weights_digest`, entry ``model_sha256``);
reading one for its weights verifies that digest (older checkpoints without it are read as before) and refuses
non-finite weights, naming the tensor, unless ``allow_nonfinite`` (for debugging a run that diverged)."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asrprec.atomic import atomic_write
from asrprec.devices import get_rank
from asrprec.errors import AsrprecError
from asrprec.models.unwrap import unwrap_model
from asrprec.rng import get_rng_state, set_rng_state

from .integrity import DIGEST_KEY, nonfinite_tensors, weights_digest
from .files import BATCH_PATTERN, EPOCH_PATTERN, list_checkpoints, present_checkpoints

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class CheckpointError(AsrprecError, ValueError):
    """A checkpoint cannot be used; the message names the file and the fix."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's contents do not fit the objects it is being loaded into."""


class CheckpointReadError(CheckpointError):
    """A checkpoint file exists but cannot be read (empty, truncated, corrupt, or not a checkpoint)."""


class CheckpointIntegrityError(CheckpointReadError):
    """A checkpoint's weights differ from the digest recorded when it was saved (changed or damaged since)."""


class NonFiniteWeightsError(CheckpointError):
    """A checkpoint's weights hold NaN or Inf."""


class CheckpointPolicyWarning(UserWarning):
    """The checkpoint was saved under a different precision policy than the one loading it."""


def _optimizer_kind(optimizer: Any) -> str:
    from asrprec.precision import MasterWeightOptimizer

    return "master" if isinstance(optimizer, MasterWeightOptimizer) else "plain"


def _saved_optimizer_kind(state: dict) -> str:
    return "master" if isinstance(state, dict) and "masters" in state and "inner" in state else "plain"


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` that either fully replaces ``path`` or leaves it as it was (:mod:`asrprec.atomic`)."""
    return atomic_write(path, lambda f: torch.save(obj, f))


_COMPILED = "_orig_mod."  # the submodule name torch.compile's OptimizedModule wrapper adds to every key


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict()`` without ``torch.compile`` wrappers' ``_orig_mod.`` in the names (a submodule replaced by
    ``torch.compile(submodule)``): a checkpoint names tensors as the uncompiled model does."""
    return {k.replace(_COMPILED, ""): v for k, v in unwrap_model(model).state_dict().items()}


def load_plain_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """``load_state_dict`` of names without ``_orig_mod.`` into a model that may hold compiled submodules."""
    bare = unwrap_model(model)
    names = [k for k in bare.state_dict() if _COMPILED in k]
    if names:
        state = dict(state)
        for k in names:
            plain = k.replace(_COMPILED, "")
            if plain in state:
                state[k] = state.pop(plain)
    return bare.load_state_dict(state, strict=strict)


def module_runtime_state(model: nn.Module) -> dict[str, dict]:
    """State that modules keep outside their ``state_dict`` but that later steps depend on (e.g. the Zipformer's
    ``Whiten`` probability, which its backward updates): ``{module name: module.runtime_state_dict()}`` for every
    submodule defining ``runtime_state_dict``. Kept apart from the weights, so that weight files and averaging see
    weights only, and a checkpoint without it still loads."""
    return {name.replace(_COMPILED, ""): m.runtime_state_dict() for name, m in unwrap_model(model).named_modules()
            if callable(getattr(m, "runtime_state_dict", None))}


def load_module_runtime_state(model: nn.Module, state: dict[str, dict]) -> None:
    """Restore :func:`module_runtime_state` (modules missing on either side are skipped)."""
    modules = {name.replace(_COMPILED, ""): m for name, m in unwrap_model(model).named_modules()}
    for name, s in state.items():
        m = modules.get(name)
        if m is not None and callable(getattr(m, "load_runtime_state_dict", None)):
            m.load_runtime_state_dict(s)


@dataclass
class TrainingObjects:
    """The objects a checkpoint holds the state of (None: not saved, or not loaded). ``model`` may be DDP- or
    compile-wrapped (the bare model's state is saved); ``model_avg`` is a :class:`RunningAverage` (or any object
    with ``state_dict()``, e.g. a model); the others are anything with ``state_dict()``."""

    model: nn.Module | None = None
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    sampler: Any = None
    model_avg: Any = None


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`load_checkpoint` reads and loads a file.

    strict: passed to ``model.load_state_dict``. restore_rng: restore python / numpy / torch (CPU, CUDA) generator
    states, for an exact resume. map_location: where tensors are loaded (``"cpu"``, then copied into the objects'
    own devices). allow_nonfinite: load NaN / Inf weights with a warning instead of
    :class:`NonFiniteWeightsError`."""

    strict: bool = True
    restore_rng: bool = True
    map_location: Any = "cpu"
    weights_only: bool = True
    allow_nonfinite: bool = False


def save_checkpoint(path: str | os.PathLike, objects: TrainingObjects, *, policy: Any = None,
                    config: dict | None = None, extra: dict | None = None) -> Path | None:
    """Write a training checkpoint of ``objects`` atomically (on rank 0 only: other ranks return None without
    writing).

    Args:
        path: destination file (parent directories are created).
        objects: what to save (``objects.model`` is required).
        policy: the :class:`~asrprec.precision.PrecisionPolicy` in use (its ``describe()`` is stored).
        config: the run's configuration as a plain dict. extra: counters (epoch, batch_idx_train...).
    Returns:
        the written path on rank 0, else None.
    """
    if get_rank() != 0:
        return None
    model, model_avg, optimizer = objects.model, objects.model_avg, objects.optimizer
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"config must be a plain dict (e.g. dataclasses.asdict(cfg)), got {type(config).__name__}")
    ckpt: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "model": plain_state_dict(model),
        "policy": policy.describe() if policy is not None else None,
        "config": config or {},
        "extra": dict(extra or {}),
        "rng": get_rng_state(),
    }
    ckpt[DIGEST_KEY] = weights_digest(ckpt["model"])
    runtime = module_runtime_state(model)
    if runtime:
        ckpt["runtime_state"] = runtime
    if model_avg is not None:
        ckpt["model_avg"] = plain_state_dict(model_avg)
    if optimizer is not None:
        ckpt["optimizer"] = optimizer.state_dict()
        ckpt["optimizer_kind"] = _optimizer_kind(optimizer)
    for name, obj in (("scheduler", objects.scheduler), ("scaler", objects.scaler), ("sampler", objects.sampler)):
        if obj is not None:
            ckpt[name] = obj.state_dict()
    return atomic_torch_save(ckpt, path)


def read_checkpoint(
    path: str | os.PathLike, *, map_location: Any = "cpu", weights_only: bool = True, mmap: bool = False,
    verify: bool = True, allow_nonfinite: bool = False
) -> dict:
    """``torch.load`` a checkpoint; every failure names the file and the fix. ``verify``: check its weights
    (:func:`verify_weights`; off only for reading its counters); ``allow_nonfinite``: NaN / Inf weights load with a
    warning.

    Raises:
        FileNotFoundError: no such file (the message lists the checkpoints present in its folder).
        CheckpointReadError: an empty, truncated or corrupt file, one that is not an asrprec checkpoint, or (with
            ``weights_only``) one holding objects that safe loading refuses.
    """
    path = Path(path)
    if not path.is_file():
        where = path.parent
        present = present_checkpoints(where) if where.is_dir() else f"the folder {where} does not exist"
        raise FileNotFoundError(
            f"checkpoint {path} does not exist (checkpoints in {where}: {present}). Fix: pick one of those (or "
            f"--resume latest for the newest complete one), or check --exp-dir"
        )
    size = path.stat().st_size
    if size == 0:
        raise CheckpointReadError(
            f"checkpoint {path} is empty (0 bytes): its writing was cut off before any data reached the disk, or "
            f"the disk was full. Fix: delete it and resume from another checkpoint (--resume latest picks the newest "
            f"complete one; present: {present_checkpoints(path.parent)})"
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
            f"complete one; present: {present_checkpoints(path.parent)})"
        ) from e
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointReadError(
            f"{path} is not an asrprec checkpoint (no 'model' entry). Fix: pass a file written by asrprec's "
            "training (epoch-N.pt or checkpoint-N.pt)"
        )
    if verify:
        verify_weights(ckpt, path, allow_nonfinite=allow_nonfinite)
    return ckpt


def verify_weights(ckpt: dict, path: str | os.PathLike, *, allow_nonfinite: bool = False) -> None:
    """Check the ``model`` weights of a read checkpoint: the digest it recorded when saved (if any), then that every
    value is finite (with ``allow_nonfinite``: a warning instead).

    Raises:
        CheckpointIntegrityError: the weights differ from the recorded digest.
        NonFiniteWeightsError: a weight is NaN or Inf (the message names the first tensor and how many hold them).
    """
    state = ckpt["model"]
    recorded = ckpt.get(DIGEST_KEY)
    if recorded is not None:
        actual = weights_digest(state)
        if actual != recorded:
            raise CheckpointIntegrityError(
                f"checkpoint {path} fails its integrity check: its weights hash to sha256 {actual[:16]}... but "
                f"{recorded[:16]}... was recorded when it was saved, so it was changed or damaged since. Fix: delete "
                f"it and use another checkpoint (present: {present_checkpoints(Path(path).parent)})")
    bad = nonfinite_tensors(state)
    if not bad:
        return
    name, count, total = bad[0]
    what = (f"checkpoint {path} holds non-finite weights: {name} has {count:,} NaN/Inf of {total:,} values"
            f"{f' (and {len(bad) - 1} more tensor(s), e.g. {bad[1][0]})' if len(bad) > 1 else ''}")
    if allow_nonfinite:
        log.warning("%s; loading it anyway (allow_nonfinite)", what)
        return
    raise NonFiniteWeightsError(
        f"{what}: a model with them gives NaN outputs. Fix: use an earlier checkpoint (present: "
        f"{present_checkpoints(Path(path).parent)}); to load it anyway for debugging, pass --allow-nonfinite")


def load_checkpoint(path: str | os.PathLike, objects: TrainingObjects, *, policy: Any = None,
                    options: LoadOptions = LoadOptions(), checkpoint: dict | None = None) -> dict:
    """Load a checkpoint into ``objects`` (those left None are not touched).

    Args:
        path: the checkpoint file.
        objects: ``model`` receives the weights, cast to its own parameter dtypes (the rule of
            :mod:`asrprec.checkpoint`); the others receive their saved states, and asking for a state the
            checkpoint lacks raises :class:`CheckpointMismatchError`.
        policy: the current precision policy; a different saved policy gives :class:`CheckpointPolicyWarning`.
        options: :class:`LoadOptions`.
        checkpoint: the contents of ``path`` if already read with :func:`read_checkpoint` (not read again).
    Returns:
        ``{"extra": dict, "config": dict, "policy": dict | None, "format_version": int}``.
    """
    model, optimizer, strict = objects.model, objects.optimizer, options.strict
    ckpt = checkpoint if checkpoint is not None else read_checkpoint(
        path, map_location=options.map_location, weights_only=options.weights_only,
        allow_nonfinite=options.allow_nonfinite)
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
            load_plain_state_dict(model, ckpt["model"], strict=False)
        load_module_runtime_state(model, ckpt.get("runtime_state", {}))
    if objects.model_avg is not None:
        unwrap_model(objects.model_avg).load_state_dict(need("model_avg"), strict=strict)
    # After the model: the master-weights optimizer copies its fp32 masters into the model's bf16 params.
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    for name in ("scheduler", "scaler", "sampler"):
        if getattr(objects, name) is not None:
            getattr(objects, name).load_state_dict(need(name))
    if options.restore_rng and "rng" in ckpt:
        set_rng_state(ckpt["rng"])
    return {
        "extra": ckpt.get("extra", {}),
        "config": ckpt.get("config", {}),
        "policy": saved_policy,
        "format_version": ckpt.get("format_version", 0),
    }


def load_model_weights(model: nn.Module, state: dict[str, torch.Tensor], *, source: str = "checkpoint",
                       fix: str | None = None) -> None:
    """``model.load_state_dict(state)`` (strict), with an error that says which tensors disagree and what to do.

    ``source`` names where ``state`` came from in the message; ``fix`` replaces the default advice (which is
    written for decoding with a recipe's ``model.json``).

    Raises:
        CheckpointMismatchError: missing or unexpected tensor names, or shapes that differ, e.g. when a recipe's
            ``model.json`` describes another architecture than the one the checkpoint was trained with.
    """
    target = plain_state_dict(model)
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
    load_plain_state_dict(model, state)


def checkpoint_position(path: str | os.PathLike) -> tuple[int, int, bool]:
    """Where in training ``path`` was written: ``(batch_idx_train, epoch, end_of_epoch)``, read without loading
    its tensors (memory-mapped). Raises what :func:`read_checkpoint` raises."""
    ckpt = read_checkpoint(path, mmap=True, verify=False)
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
