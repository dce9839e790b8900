"""A recipe's ``train.py`` as one call: :func:`train_from_args` does every step between the parsed flags and the
end of training; the recipe passes only its dataset's decisions (where the tokenizer and the cuts come from, the
data module settings that are no flag, what the checkpoint records about the data)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Mapping

from asrprec.config import dataclass_from_args
from asrprec.experiment import adopt_tokenizer, prepare_experiment
from asrprec.models.icefall import icefall_training_model, parse_icefall_source

from asrprec.cli import policy_from_args
from asrprec.devices import get_rank

from .batch_plan import batches_for_run
from .cli import announce, begin_training, build_model_from_args, data_config_from_args, model_options_from_args
from .loop import train

__all__ = ["train_from_args"]


def train_from_args(args: argparse.Namespace, *, tokenizer_path: str | Path | Callable[[], str | Path],
                    load_splits: Callable[[], dict[str, Any]], data_decisions: Mapping[str, Any] | None = None,
                    data_record: Mapping[str, Any] | None = None, **model_kwargs: Any) -> None:
    """Train the model the recipe's flags describe (``add_model_args``, ``add_training_args``, ``add_data_args``,
    ``add_data_check_args``, ``add_precision_args``).

    The steps: torchrun's process group, config, log, threads and seed (:func:`begin_training`); the tokenizer; the
    model; the experiment folder, refusing another run's folder or a resume with another model before any data is
    read; the splits, checked (``--validate-data``: bad cuts counted, named and dropped); the data module
    (SpecAugment off under CR-CTC, whose model masks its two views itself); the precision policy; the loop.

    Args:
        args: the parsed flags.
        tokenizer_path: the sentencepiece model, or a callable giving it (called after the log is set up, so that
            a missing file is reported there).
        load_splits: returns ``{"train": cuts, "dev": cuts}`` (lazy cuts are fine: the checks stream through them).
        data_decisions: :class:`asrprec.data.DataConfig` fields that are no flag (or override one), e.g. the
            duration limits, the SpecAugment config, MUSAN mixing.
        data_record: what the checkpoint records about the data (with each split's check report added).
        model_kwargs: to :func:`asrprec.models.build_transducer` (e.g. ``model_warmup_batches``).
    """
    from asrprec.data import AsrDataModule, CheckOptions, check_splits
    from asrprec.tokenizer import Tokenizer

    cfg = begin_training(args)
    tokenizer = Tokenizer(tokenizer_path() if callable(tokenizer_path) else tokenizer_path)
    icefall = parse_icefall_source(cfg.init_from)
    if icefall is not None:  # icefall's architecture, this run's objective; the loop loads the weights
        model, model_config = icefall_training_model(
            icefall, cfg.icefall_args or None, model_options_from_args(args), tokenizer.vocab_size,
            time_warp_factor=getattr(args, "spec_aug_time_warp_factor", None), **model_kwargs)
    else:
        model, model_config = build_model_from_args(args, tokenizer, **model_kwargs)
    resume_from = prepare_experiment(cfg, rank=get_rank(), model_config=model_config)
    model_config = adopt_tokenizer(cfg.exp_dir, tokenizer.model_path, model_config, resuming=resume_from is not None,
                                   rank=get_rank())  # the folder keeps a copy; a resume must use the same one
    cuts, checks = check_splits(load_splits(), dataclass_from_args(CheckOptions, args), tokenizer,
                                model.min_input_frames)
    decisions = dict(data_decisions or {})
    spec_augment = model_options_from_args(args).data_spec_augment(decisions.pop("spec_augment", args.spec_augment))
    data = AsrDataModule(data_config_from_args(args, spec_augment=spec_augment, **decisions))
    policy = policy_from_args(args)
    plan = batches_for_run(model, model_options=model_options_from_args(args), policy=policy, train_cfg=cfg,
                           data_cfg=data.config, cuts=cuts["train"], tokenizer=tokenizer,
                           resuming=resume_from is not None)  # None without --max-memory
    if data.config.plan_only:
        return
    announce(args, model, policy)
    record = {**(data_record or {}), "spec_augment": spec_augment, "checks": checks}
    train(model=model, policy=policy, tokenizer=tokenizer,
          train_dl=data.train_dataloader(cuts["train"], batch_plan=plan),
          valid_dl=data.valid_dataloader(cuts["dev"]), cfg=cfg, model_config=model_config,
          config_for_checkpoint={"data": record})
