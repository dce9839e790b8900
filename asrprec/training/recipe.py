"""A recipe's ``train.py`` as one call: :func:`train_experiment` does every step between the parsed config and the
end of training; the recipe passes only its dataset's decisions (where the tokenizer and the cuts come from, the
data module settings that follow from its own options, what the checkpoint records about the data)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

from asrprec.experiment import adopt_tokenizer, claim_experiment, prepare_experiment
from asrprec.models.icefall import icefall_training_model, parse_icefall_source

from asrprec.cli import setup_logging
from asrprec.devices import get_rank, is_main_process, resolve_device

from .batch_plan import batches_for_run
from .config import TrainingConfig, training_command_line
from .loop import train

__all__ = ["CONFIG_FILE", "begin_training", "save_config", "train_experiment"]

#: the effective config of a run, in its folder: ``train.py --config EXP/config.yaml`` runs it again
CONFIG_FILE = "config.yaml"
#: train fields that say how one invocation starts; the saved config holds their defaults, so that it starts a run
_INVOCATION = ("resume", "start_epoch", "start_batch", "overwrite")


def begin_training(cfg: TrainingConfig) -> None:
    """The first steps of a run: join torchrun's process group (nothing under a plain ``python``), the experiment
    folder and its lock, then its log (rank 0), ``train.threads``, and the seed (before the model is built, so that
    ``train.seed`` fixes its initialisation too)."""
    import torch

    from asrprec.rng import seed_everything

    from .distributed import setup_distributed

    setup_distributed(cfg.precision.device)
    # the lock before the log: a run refused because another holds the folder writes nothing into it
    claim_experiment(cfg.train.exp_dir, rank=get_rank())
    setup_logging(str(Path(cfg.train.exp_dir) / "train.log"), rank=get_rank())
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)


def save_config(cfg: TrainingConfig, *, resuming: bool) -> Path | None:
    """Write ``config.yaml`` into the run's folder (rank 0; atomically): for a new run, or a resumed run whose folder
    has none. The invocation fields (resume, start_epoch, start_batch, overwrite) are saved at their defaults."""
    from asrprec.atomic import atomic_write_text

    path = Path(cfg.train.exp_dir) / CONFIG_FILE
    if get_rank() != 0 or (resuming and path.is_file()):
        return None
    fresh = dataclasses.replace(cfg.train, **{k: getattr(type(cfg.train)(exp_dir="x"), k) for k in _INVOCATION})
    text = training_command_line(type(cfg)).to_yaml(dataclasses.replace(cfg, train=fresh),
                                                   header=f"{CONFIG_FILE}: train.py --config {path} runs it again")
    return atomic_write_text(path, text)


def train_experiment(cfg: TrainingConfig, *, tokenizer_path: str | Path | Callable[[], str | Path],
                     load_splits: Callable[[], dict[str, Any]], data_decisions: Mapping[str, Any] | None = None,
                     data_record: Mapping[str, Any] | None = None, **model_kwargs: Any) -> None:
    """Train the model ``cfg`` describes.

    The steps: torchrun's process group, log, threads and seed (:func:`begin_training`); the tokenizer; the model;
    the experiment folder, refusing another run's folder or a resume with another model before any data is read,
    and its ``config.yaml``; the splits, checked (``checks``: bad cuts counted, named and dropped); the data module
    (SpecAugment off under CR-CTC, whose model masks its two views itself); the precision policy; the loop.

    Args:
        cfg: the run's config (a recipe's subclass adds its own section, saved with the rest).
        tokenizer_path: the sentencepiece model, or a callable giving it (called after the log is set up, so that
            a missing file is reported there).
        load_splits: returns ``{"train": cuts, "dev": cuts}`` (lazy cuts are fine: the checks stream through them).
        data_decisions: :class:`asrprec.data.DataConfig` fields that follow from the recipe's own options (e.g. the
            MUSAN cuts of its data folder), over ``cfg.data``.
        data_record: what the checkpoint records about the data (with each split's check report added).
        model_kwargs: to :func:`asrprec.models.build_transducer` (e.g. ``model_warmup_batches``).
    """
    from asrprec.data import AsrDataModule, check_feature_bins, check_splits
    from asrprec.models import build_model, count_parameters
    from asrprec.tokenizer import Tokenizer

    begin_training(cfg)
    tcfg = cfg.train
    # CR-CTC masks its views itself (the data module's SpecAugment is then off): it takes these two settings
    time_warp = cfg.data.spec_augment_config.time_warp_factor
    mask_size = cfg.data.spec_augment_config.features_mask_size
    tokenizer = Tokenizer(tokenizer_path() if callable(tokenizer_path) else tokenizer_path)
    icefall = parse_icefall_source(tcfg.init_from)
    if icefall is not None:  # icefall's architecture, this run's objective; the loop loads the weights
        model, model_config = icefall_training_model(icefall, tcfg.icefall_args or None, cfg.model,
                                                     tokenizer.vocab_size, time_warp_factor=time_warp,
                                                     features_mask_size=mask_size, **model_kwargs)
    else:
        model, model_config = build_model(cfg.model, tokenizer.vocab_size, tokenizer.blank_id,
                                          time_warp_factor=time_warp, features_mask_size=mask_size,
                                          num_features=cfg.data.num_mel_bins,
                                          **model_kwargs)
    resume_from = prepare_experiment(tcfg, rank=get_rank(), model_config=model_config)
    save_config(cfg, resuming=resume_from is not None)
    model_config = adopt_tokenizer(tcfg.exp_dir, tokenizer.model_path, model_config, resuming=resume_from is not None,
                                   rank=get_rank())  # the folder keeps a copy; a resume must use the same one
    cuts, checks = check_splits(load_splits(), cfg.checks, tokenizer, model.min_input_frames)
    check_feature_bins(cuts, cfg.data.num_mel_bins, on_the_fly_feats=cfg.data.on_the_fly_feats)
    decisions = dict(data_decisions or {})
    spec_augment = cfg.model.data_spec_augment(decisions.pop("spec_augment", cfg.data.spec_augment))
    data = AsrDataModule(dataclasses.replace(cfg.data, spec_augment=spec_augment, **decisions))
    policy = cfg.precision.policy(resolve_device(cfg.precision.device))
    plan = batches_for_run(model, model_options=cfg.model, policy=policy, train_cfg=tcfg,
                           data_cfg=data.config, cuts=cuts["train"], tokenizer=tokenizer,
                           resuming=resume_from is not None)  # None without --max-memory
    if data.config.plan_only:
        return
    if is_main_process():
        print(f"model: {cfg.model.encoder}/{cfg.model.size}, {count_parameters(model):,} parameters; "
              f"precision: {policy.describe()}")
    record = {**(data_record or {}), "spec_augment": spec_augment, "checks": checks}
    cfg = tcfg
    train(model=model, policy=policy, tokenizer=tokenizer,
          train_dl=data.train_dataloader(cuts["train"], batch_plan=plan, count_tokens=tokenizer.count_tokens),
          valid_dl=data.valid_dataloader(cuts["dev"]), cfg=cfg, model_config=model_config,
          config_for_checkpoint={"data": record})
