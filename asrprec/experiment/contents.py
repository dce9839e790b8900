"""What an experiment folder holds (:mod:`asrprec.experiment`): reading and writing its records, the rules for
starting or resuming a run in it, its tokenizer copy and its model."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Protocol

from asrprec import checkpoint as ckpt
from asrprec.atomic import atomic_write, atomic_write_text

from .errors import ExperimentError, ModelMismatchError, TokenizerMismatchError, require_folder
from .lock import claim_experiment, holds_lock, now

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
MODEL_NAME = "model.json"
HISTORY_NAME = "history.json"
TOKENIZER_NAME = "bpe.model"
# the model.json entry recording the tokenizer copy ({"file": "bpe.model", "sha256": ...}); no builder argument
TOKENIZER_KEY = "tokenizer"
# model.json entries a resume may change: how the loss is computed is a training choice, not the architecture
MUTABLE_MODEL_KEYS = ("loss",)
# what a decode script writes beside the checkpoints (stale once the checkpoints are replaced)
_DECODE_OUTPUTS = ("recogs-*.txt", "errs-*.txt", "wer-summary-*.json")


class RunSpec(Protocol):
    """What the folder rules read of a run's config (:class:`asrprec.training.TrainConfig` has these fields)."""

    exp_dir: str
    resume: str
    start_epoch: int
    start_batch: int
    overwrite: bool
    num_epochs: int


# -- reading ---------------------------------------------------------------------------------------


def _read_json(path: Path, what: str, fix: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist ({what}). Fix: {fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ExperimentError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}; "
                              f"{len(text)} characters): it is truncated or was edited by hand. Fix: {fix}") from e


def read_model_config(exp_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``model.json`` of ``exp_dir``, for decoding; every failure names the file and the fix.

    Raises:
        FileNotFoundError: no such folder, or no ``model.json`` in it.
        ExperimentError: ``exp_dir`` is a file; ``model.json`` is not a JSON object (truncated or hand-edited).
    """
    exp_dir = require_folder(exp_dir, "--exp-dir", "pass the folder training wrote (model.json, epoch-N.pt)")
    if not exp_dir.is_dir():
        raise FileNotFoundError(f"the experiment folder {exp_dir} does not exist. Fix: pass the --exp-dir that "
                                "training wrote its checkpoints to")
    fix = ("restore it from the training command's model settings (train.py writes it when a run starts), or "
           "copy it from the run's config.json 'model' entry")
    path = exp_dir / MODEL_NAME
    if not path.is_file() and (exp_dir / CONFIG_NAME).is_file():
        config = _read_json(exp_dir / CONFIG_NAME, "the run's configuration", fix)
        if isinstance(config, dict) and isinstance(config.get("model"), dict):
            log.warning("%s is missing; using the 'model' entry of %s", path, exp_dir / CONFIG_NAME)
            return config["model"]
    value = _read_json(path, "the model's architecture, written by training", fix)
    if not isinstance(value, dict):
        raise ExperimentError(f"{path} holds a JSON {type(value).__name__}, not an object of model settings. "
                              f"Fix: {fix}")
    value.pop(TOKENIZER_KEY, None)  # the tokenizer record, not a builder argument
    return value


def read_history(exp_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of ``history.json`` (empty when there is none)."""
    path = Path(exp_dir) / HISTORY_NAME
    if not path.is_file():
        return []
    value = _read_json(path, "the run's history", f"move {path} aside; a new one is started")
    if not isinstance(value, list):
        raise ExperimentError(f"{path} is not a list of events. Fix: move it aside; a new one is started")
    return value


# -- writing ---------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def append_history(exp_dir: str | os.PathLike, event: dict[str, Any]) -> None:
    """Append ``event`` (with the time) to ``history.json``; the file is rewritten atomically with every older
    event kept."""
    events = read_history(exp_dir)
    events.append(_jsonable({"time": now(), **event}))
    atomic_write_text(Path(exp_dir) / HISTORY_NAME, json.dumps(events, indent=1))


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            if k not in old or k not in new:
                out.append(f"{prefix}{k}: {old.get(k, '(absent)')!r} -> {new.get(k, '(absent)')!r}")
            else:
                out += _differences(old[k], new[k], f"{prefix}{k}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def _loss_meaning(model_config: dict[str, Any]) -> dict[str, Any]:
    """The part of the (otherwise changeable) loss settings that decides what a checkpoint means: whether the
    joiner has TDT's duration head, and the frame advances its outputs stand for."""
    loss = model_config.get("loss") or {}
    if loss.get("loss") != "tdt":
        return {"tdt": False}
    return {"tdt": True, "tdt_durations": list(loss.get("tdt_durations") or ())}


def check_model_config(exp_dir: str | os.PathLike, model_config: dict[str, Any] | None) -> None:
    """Refuse a model whose architecture differs from the ``model.json`` the folder's run recorded.

    Raises:
        ModelMismatchError: naming each differing setting and the fix.
    """
    path = Path(exp_dir) / MODEL_NAME
    if model_config is None or not path.is_file():
        return
    stored = _read_json(path, "the run's model", "delete it if the checkpoints are the only record you trust")
    new = _jsonable(model_config)
    keep = set(MUTABLE_MODEL_KEYS) | {TOKENIZER_KEY}  # a tokenizer change has its own check (adopt_tokenizer)
    diff = _differences({**{k: v for k, v in stored.items() if k not in keep}, **_loss_meaning(stored)},
                        {**{k: v for k, v in new.items() if k not in keep}, **_loss_meaning(new)})
    if diff:
        raise ModelMismatchError(
            f"{path} records another model than the one this command builds ({'; '.join(diff[:6])}). Resuming would "
            f"load the run's checkpoints into the wrong architecture. Fix: resume with the run's model settings (as "
            f"in {path}), or train the new model in another --exp-dir")


def record_model_config(exp_dir: str | os.PathLike, model_config: dict[str, Any] | None) -> None:
    """Write ``model.json`` (after a successful start or resume). Its architecture never changes: a different one
    raises (:func:`check_model_config`); only :data:`MUTABLE_MODEL_KEYS` are updated."""
    if model_config is None:
        return
    check_model_config(exp_dir, model_config)
    path = Path(exp_dir) / MODEL_NAME
    new = _jsonable(model_config)
    if path.is_file() and _read_json(path, "the run's model", "") == new:
        return
    atomic_write_text(path, json.dumps(new, indent=1))


# -- starting a run --------------------------------------------------------------------------------


def _run_files(exp_dir: Path) -> list[Path]:
    files = ckpt.training_checkpoints(exp_dir) + [p for p in (ckpt.bad_model_path(exp_dir),) if p.is_file()]
    files += [exp_dir / n for n in (MODEL_NAME, CONFIG_NAME, TOKENIZER_NAME) if (exp_dir / n).is_file()]
    files += sorted(p for pattern in _DECODE_OUTPUTS for p in exp_dir.glob(pattern))
    if (exp_dir / "tensorboard").is_dir():
        files.append(exp_dir / "tensorboard")
    return files


def _delete(paths: list[Path], exp_dir: Path, why: str) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if paths:
        names = [p.name for p in paths]
        log.warning("--overwrite: deleted %d file(s) of %s from %s: %s", len(paths), why, exp_dir, ", ".join(names))
        append_history(exp_dir, {"event": "overwrite", "why": why, "deleted": names})


def resolve_resume(cfg: RunSpec) -> Path | None:
    """The checkpoint a run resumes from (None for a new run): ``--resume latest`` / ``--resume FILE``,
    ``--start-batch N`` (``checkpoint-N.pt``) or ``--start-epoch E`` (``epoch-(E-1).pt``); ``--resume auto`` is
    ``latest`` when the folder holds a complete checkpoint and a new run when it holds no checkpoint at all.

    Raises:
        FileNotFoundError: the named checkpoint is missing (the message lists those present).
        ExperimentError: ``--resume auto`` in a folder whose checkpoints are all unreadable (starting afresh would
            silently drop them).
    """
    exp_dir = Path(cfg.exp_dir)
    if cfg.resume == "auto":
        present = ckpt.training_checkpoints(exp_dir) if exp_dir.is_dir() else []
        if not present:
            log.info("--resume auto: no checkpoint in %s, starting a new run", exp_dir)
            return None
        try:
            path = ckpt.find_latest_checkpoint(exp_dir)
        except FileNotFoundError as e:
            raise ExperimentError(f"{e}. --resume auto does not start afresh over checkpoints it cannot read. Fix: "
                                  f"move them aside, or start a new run with --overwrite") from None
        log.info("--resume auto: resuming from %s", path)
        return path
    if cfg.resume == "latest":
        return ckpt.find_latest_checkpoint(exp_dir)
    if cfg.resume:
        path = Path(cfg.resume)
        path = path if path.is_absolute() or path.parent != Path(".") else exp_dir / path
    elif cfg.start_batch > 0:
        path = ckpt.batch_checkpoint_path(exp_dir, cfg.start_batch)
    elif cfg.start_epoch > 1:
        path = ckpt.epoch_checkpoint_path(exp_dir, cfg.start_epoch - 1)
    else:
        return None
    if not path.is_file():
        ckpt.read_checkpoint(path)  # raises, listing the checkpoints present
    return path


def _refuse_or_delete(found: list[Path], delete_here: bool, exp_dir: Path, what: str, files: list[Path],
                      refusal: str, overwrite: bool) -> None:
    """Files ``found`` in the way of a run: refused (``refusal``) without ``--overwrite``, else ``files`` deleted
    (by rank 0 only: ``delete_here``)."""
    if found and not overwrite:
        raise ExperimentError(refusal)
    if found and delete_here:
        _delete(files, exp_dir, what)


def _readable(path: Path) -> bool:
    try:
        ckpt.checkpoint_position(path)
    except (ckpt.CheckpointError, OSError):
        return False
    return True


def _names(paths: list[Path], most: int = 6) -> str:
    return ", ".join(p.name for p in paths[:most]) + (", ..." if len(paths) > most else "")


def prepare_experiment(cfg: RunSpec, *, rank: int = 0, model_config: dict[str, Any] | None = None) -> Path | None:
    """Make ``cfg.exp_dir`` ready for the run ``cfg`` describes; return the checkpoint to resume from (or None).

    Creates the folder, removes temporary files of interrupted writes, resolves the resume checkpoint, and
    enforces the folder rules of the module docstring. Done once per run: a recipe may call it early (to fail
    before loading data), and the run's own call (:class:`asrprec.training.run.Run`) then takes that result, as
    long as the call asks the same (config, rank, model), this process still holds the lock and the folder's
    records are as they were left.

    ``model_config``: the model about to be trained; a resume refuses one that differs from the run's
    ``model.json`` (:func:`check_model_config`).

    On rank 0 it first takes the folder's lock (:func:`lock_experiment`), held until
    :func:`unlock_experiment` or the process's end.

    Raises:
        ExperimentLockedError: another run holds the folder (checked before anything there changes).
        ExperimentError: a new run in a folder with another run's checkpoints, or a resume from a checkpoint that
            is not the newest, without ``overwrite``; ``overwrite`` with ``--resume latest`` or ``auto``; a resume with
            another model; a resume from the end of the last epoch asked for.
        FileNotFoundError / CheckpointReadError: the checkpoint to resume from is missing or unreadable.
    """
    exp_dir = Path(cfg.exp_dir)
    key = _preparation(cfg, rank, model_config)
    done = _PREPARED.get(exp_dir.resolve())
    if done is not None and done[0] == key and done[1] == _folder_snapshot(exp_dir):
        return done[2]
    resume_from = _prepare(cfg, rank, model_config)
    _PREPARED[exp_dir.resolve()] = (key, _folder_snapshot(exp_dir), resume_from)
    return resume_from


# folder (resolved) -> (what was asked, the folder's records then, the checkpoint to resume from), for this process
_PREPARED: dict[Path, tuple[Any, Any, Path | None]] = {}


def _preparation(cfg: RunSpec, rank: int, model_config: dict[str, Any] | None) -> Any:
    """What a call of :func:`prepare_experiment` asks (the tokenizer record added in between changes nothing)."""
    model = {k: v for k, v in _jsonable(model_config).items() if k != TOKENIZER_KEY} if model_config else None
    return (_jsonable({k: getattr(cfg, k, None) for k in _INVOCATION_KEYS}), rank, model)


def _folder_snapshot(exp_dir: Path) -> Any:
    """The folder's checkpoints and records (name, size, modification time) and whether this process holds its
    lock. The tokenizer copy is left out: :func:`adopt_tokenizer` writes it after the rules accepted the run."""
    files = ckpt.training_checkpoints(exp_dir) if exp_dir.is_dir() else []
    files += [exp_dir / n for n in (ckpt.BAD_MODEL_NAME, MODEL_NAME, CONFIG_NAME, HISTORY_NAME)]
    return holds_lock(exp_dir), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()]


def _prepare(cfg: RunSpec, rank: int, model_config: dict[str, Any] | None) -> Path | None:
    exp_dir = claim_experiment(cfg.exp_dir, rank=rank)
    ckpt.remove_stale_temporaries(exp_dir, rank=rank)
    resume_from = resolve_resume(cfg)
    if resume_from is None:
        existing = ckpt.training_checkpoints(exp_dir)
        _refuse_or_delete(
            existing, cfg.overwrite and rank == 0, exp_dir, "the earlier run", _run_files(exp_dir),
            f"{exp_dir} holds the checkpoints of an earlier run ({_names(existing)}); a new run there would mix the two "
            f"(e.g. decoding with --avg would average epochs of both). Fix: continue that run with --resume "
            f"latest, train in another --exp-dir, or add --overwrite to delete the earlier run's files", cfg.overwrite)
        return None
    if cfg.overwrite and cfg.resume in ("latest", "auto"):
        raise ExperimentError(f"--overwrite with --resume {cfg.resume}: there is nothing newer to overwrite. Fix: drop "
                              "--overwrite")
    check_model_config(exp_dir, model_config)
    position = ckpt.checkpoint_position(resume_from)
    _, epoch, end = position
    if end and epoch >= cfg.num_epochs:
        raise ExperimentError(f"{resume_from} ends epoch {epoch} and --num-epochs is {cfg.num_epochs}: nothing to "
                              "train. Fix: raise --num-epochs")
    # an unreadable file is no continuation (--resume latest passes over it; the resumed run rewrites it)
    newer = [p for p in ckpt.newer_checkpoints(exp_dir, position)
             if p.resolve() != resume_from.resolve() and _readable(p)]
    _refuse_or_delete(
        newer, cfg.overwrite and rank == 0, exp_dir, f"the continuation after {resume_from.name}", newer,
        f"{resume_from} is not the newest checkpoint in {exp_dir}: {_names(newer)} went further. Resuming from it would "
        f"leave those beside the new ones, and --avg or --resume latest would mix the two continuations. Fix: "
        f"--resume latest, or add --overwrite to delete the newer checkpoints", cfg.overwrite)
    return resume_from


# train config entries that only say how an invocation started or where it stops; a resume changing them is
# no change to the run
_INVOCATION_KEYS = ("resume", "start_epoch", "start_batch", "overwrite", "num_epochs", "preempt_signals")


def _without_invocation(config: dict[str, Any]) -> dict[str, Any]:
    config = _jsonable(config)
    if isinstance(config.get("train"), dict):
        config["train"] = {k: v for k, v in config["train"].items() if k not in _INVOCATION_KEYS}
    return config


def _repair_record(path: Path, config: dict[str, Any]) -> None:
    """Rewrite the run's ``config.json`` from ``config`` when it is missing or unreadable (cut short by a full disk or
    an editor), with a warning: a resume must not carry a corrupt record on."""
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return
    except FileNotFoundError:
        why = "missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = f"unreadable ({type(e).__name__}: {str(e)[:80]})"
    log.warning("%s was %s; rewritten from the resumed run's configuration", path, why)
    atomic_write_text(path, json.dumps(_jsonable(config), indent=1))


def record_run_start(exp_dir: str | os.PathLike, *, model_config: dict[str, Any] | None, config: dict[str, Any],
                     precision: dict[str, Any], resume: dict[str, Any] | None, rank: int = 0) -> None:
    """Record that a run started (``config.json``, ``model.json``, a ``start`` event) or resumed (``model.json``
    if the run had none, a ``resume`` event naming the checkpoint and the settings that changed)."""
    if rank != 0:
        return
    exp_dir = Path(exp_dir)
    event: dict[str, Any] = {"command": list(sys.argv), "precision": precision}
    if resume is None:  # a new run (prepare_experiment made sure no other run's checkpoints are here)
        if model_config is not None:
            atomic_write_text(exp_dir / MODEL_NAME, json.dumps(_jsonable(model_config), indent=1))
        atomic_write_text(exp_dir / CONFIG_NAME, json.dumps(_jsonable(config), indent=1))
        append_history(exp_dir, {"event": "start", **event})
        return
    record_model_config(exp_dir, model_config)
    _repair_record(exp_dir / CONFIG_NAME, config)
    changed = _differences(_without_invocation(resume.pop("config", {}) or {}), _without_invocation(config))
    append_history(exp_dir, {"event": "resume", **resume, **event, "changed": changed})
    if changed:
        log.info("resumed with changed settings: %s", "; ".join(changed))


# -- the tokenizer of an experiment ----------------------------------------------------------------


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _refuse_other_tokenizer(exp_dir: Path, given: Path, use: str, fix: str) -> None:
    """Raise :class:`TokenizerMismatchError` if ``given`` is not the same file as the folder's copy."""
    copy = exp_dir / TOKENIZER_NAME
    ours, theirs = file_sha256(copy), file_sha256(given)
    if ours != theirs:
        raise TokenizerMismatchError(
            f"the tokenizer {given} (sha256 {theirs[:16]}...) is not the one the model in {exp_dir} was trained "
            f"with ({copy}, sha256 {ours[:16]}...): its ids mean other pieces, and {use} with it gives garbage. "
            f"Fix: {fix}")


def adopt_tokenizer(exp_dir: str | os.PathLike, given: str | os.PathLike, model_config: dict[str, Any] | None, *,
                    resuming: bool, rank: int = 0) -> dict[str, Any] | None:
    """Seal the run's tokenizer into its folder (after :func:`prepare_experiment` accepted the run): a new run
    copies ``given`` to ``bpe.model`` (rank 0); a resume checks that ``given`` is the folder's copy. Returns
    ``model_config`` with the copy's record (``model.json``'s ``"tokenizer"`` entry) added.

    A folder from before runs kept a copy is resumed with ``given`` as it is (logged), and stays without one.

    Raises:
        TokenizerMismatchError: a resume with another tokenizer than the folder's copy (both digests named).
    """
    exp_dir, given = Path(exp_dir), Path(given)
    copy = exp_dir / TOKENIZER_NAME
    if resuming and not copy.is_file():
        log.info("%s holds no copy of its tokenizer (trained before runs kept one): resuming with %s", exp_dir, given)
        return model_config
    if resuming:
        _refuse_other_tokenizer(exp_dir, given, "training on", f"resume with the tokenizer the run was trained with "
                                f"(the data folder's was re-made: restore it from {copy}, and re-make the cuts' "
                                f"token counts if they came from the new one), or train on the new tokenizer in "
                                f"another --exp-dir")
    elif rank == 0:
        atomic_write(copy, lambda f: f.write(given.read_bytes()))
    if model_config is None:
        return None
    return {**model_config, TOKENIZER_KEY: {"file": TOKENIZER_NAME, "sha256": file_sha256(given)}}


def experiment_tokenizer(exp_dir: str | os.PathLike, given: Any) -> Path:
    """The tokenizer file to decode or export the model of ``exp_dir`` with: the folder's copy when it has one,
    else ``given`` (logged). ``given``: a path, an object with ``model_path`` (a
    :class:`~asrprec.tokenizer.Tokenizer`), or a function returning either (called here; a missing file is no
    error when the folder has its copy).

    Raises:
        TokenizerMismatchError: ``given`` exists and differs from the folder's copy (both digests named), or the
            copy differs from the digest ``model.json`` recorded.
    """
    exp_dir = Path(exp_dir)
    copy = exp_dir / TOKENIZER_NAME

    def resolve() -> Path:
        value = given() if callable(given) else given
        return Path(getattr(value, "model_path", value))

    if not copy.is_file():
        path = resolve()
        log.info("%s holds no copy of its tokenizer (trained before runs kept one): using %s", exp_dir, path)
        return path
    recorded = (_read_json(exp_dir / MODEL_NAME, "the model", "restore it from the run's config.json 'model' entry")
                if (exp_dir / MODEL_NAME).is_file() else {})
    want = (recorded.get(TOKENIZER_KEY) or {}).get("sha256") if isinstance(recorded, dict) else None
    if want is not None and file_sha256(copy) != want:
        raise TokenizerMismatchError(f"{copy} (sha256 {file_sha256(copy)[:16]}...) is not the tokenizer "
                                     f"{exp_dir / MODEL_NAME} records (sha256 {want[:16]}...): it was changed after "
                                     "training. Fix: restore it from the data folder the run was trained on")
    try:
        path = resolve()
    except FileNotFoundError:
        return copy
    if path.is_file() and path.resolve() != copy.resolve():
        _refuse_other_tokenizer(exp_dir, path, "decoding", f"restore {path} from the folder's copy ({copy}), or "
                                "pass the --data-dir the model was trained on")
    return copy


# -- the model of an experiment ----------------------------------------------------------------------


def build_experiment_model(exp_dir: str | os.PathLike) -> Any:
    """The transducer ``model.json`` of ``exp_dir`` describes (the ``build_transducer`` arguments, the encoder's
    resolved overrides included), with fresh weights. Raises as :func:`read_model_config`."""
    from asrprec.models import build_transducer

    return build_transducer(**read_model_config(exp_dir))


def load_experiment_model(exp_dir: str | os.PathLike, epoch: int, avg: int = 1, use_averaged_model: bool = False,
                          *, allow_nonfinite: bool = False) -> tuple[Any, dict, str]:
    """``(model, model_config, description of the weights)``: the model of ``exp_dir`` in fp32 and eval mode with
    the weights ``--epoch E --avg A [--use-averaged-model]`` name (:func:`asrprec.checkpoint.load_decoding_weights`:
    each checkpoint verified, NaN / Inf weights refused unless ``allow_nonfinite``).

    Raises FileNotFoundError naming the missing folder, ``model.json`` or epochs and the fix, and
    :class:`ExperimentError` for an unreadable ``model.json``."""
    from asrprec.models import build_transducer

    config = read_model_config(exp_dir)
    model = build_transducer(**config)
    source = ckpt.load_decoding_weights(model, Path(exp_dir), epoch, avg, use_averaged_model,
                                        allow_nonfinite=allow_nonfinite)
    return model.float().eval(), config, source
