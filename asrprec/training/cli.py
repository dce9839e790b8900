"""Training's command-line flags (model, data, data checks, :class:`TrainConfig`), so a recipe's ``train.py`` stays
a page long (no copied argparse); the flags and scaffolding every program shares are in :mod:`asrprec.cli`.

Recipes add their dataset flags and defaults; these functions add the rest and turn the parsed
namespace into typed configs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from asrprec.cli import (  # noqa: F401  (re-exported: every program's scaffolding, at home in asrprec.cli)
    add_precision_args, policy_from_args, precision_options_from_args, run_main, setup_logging,
)
from asrprec.config import add_dataclass_args, dataclass_from_args
from asrprec.devices import get_rank, is_main_process, resolve_device  # noqa: F401  (resolve_device re-exported)

from .config import TrainConfig

#: the DataConfig fields that are flags (the other fields are a recipe's decisions)
DATA_FLAGS = ("max_duration", "num_buckets", "num_workers", "on_the_fly_feats", "spec_augment", "max_memory",
              "plan_only", "memory_safety")


def add_model_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One flag per :class:`asrprec.models.ModelOptions` field; ``defaults`` are the recipe's (e.g.
    ``encoder="zipformer", size="medium"``)."""
    from asrprec.models import ModelOptions

    add_dataclass_args(p, ModelOptions, defaults=defaults)


def model_options_from_args(args: argparse.Namespace):
    """The :class:`asrprec.models.ModelOptions` of the :func:`add_model_args` flags."""
    from asrprec.models import ModelOptions

    return dataclass_from_args(ModelOptions, args)


def ctc_config_from_args(args: argparse.Namespace) -> Any:
    """The CTC head the flags describe (:meth:`asrprec.models.ModelOptions.ctc_config`, with a recipe's
    ``--spec-aug-time-warp-factor`` for CR-CTC), or None without ``--use-ctc``."""
    return model_options_from_args(args).ctc_config(getattr(args, "spec_aug_time_warp_factor", None))


def data_spec_augment(args: argparse.Namespace, requested: bool) -> bool:
    """:meth:`asrprec.models.ModelOptions.data_spec_augment` of the flags."""
    return model_options_from_args(args).data_spec_augment(requested)


def encoder_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """:meth:`asrprec.models.ModelOptions.all_encoder_overrides` of the flags."""
    return model_options_from_args(args).all_encoder_overrides()


def build_model_from_args(args: argparse.Namespace, tokenizer, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """:func:`asrprec.models.build_model` of the :func:`add_model_args` flags for ``tokenizer``'s vocabulary
    (``kwargs`` go to ``build_transducer``, e.g. ``model_warmup_batches``)."""
    from asrprec.models import build_model

    return build_model(model_options_from_args(args), tokenizer.vocab_size, tokenizer.blank_id,
                       time_warp_factor=getattr(args, "spec_aug_time_warp_factor", None), **kwargs)


def add_training_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """One flag per :class:`TrainConfig` field (:func:`asrprec.config.add_dataclass_args`); ``defaults`` are the
    recipe's (checked by building a TrainConfig from them)."""
    TrainConfig(**{"exp_dir": "exp", **defaults})
    add_dataclass_args(p, TrainConfig, defaults={"exp_dir": "exp", **defaults})


def add_data_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """The :class:`asrprec.data.DataConfig` fields a run chooses on the command line (:data:`DATA_FLAGS`), with the
    recipe's ``defaults``; :func:`data_config_from_args` reads them back."""
    from asrprec.data import DataConfig

    add_dataclass_args(p, DataConfig, only=DATA_FLAGS, defaults=defaults)


def data_config_from_args(args: argparse.Namespace, **decisions: Any):
    """The :class:`asrprec.data.DataConfig` of the :func:`add_data_args` flags, ``--seed``, and the recipe's
    ``decisions`` (fields that are no flag, or flags it overrides); an invalid value exits like an argparse
    error."""
    from asrprec.data import DataConfig

    try:
        return dataclass_from_args(DataConfig, argparse.Namespace(**{k: getattr(args, k) for k in (*DATA_FLAGS, "seed")
                                                                     if hasattr(args, k)}), **decisions)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def add_data_check_args(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`asrprec.data.CheckOptions` field (``--validate-data``, ``--max-oov-fraction``)."""
    from asrprec.data import CheckOptions

    add_dataclass_args(p, CheckOptions)


def begin_training(args: argparse.Namespace) -> TrainConfig:
    """The first steps of a recipe's ``train.py``: join torchrun's process group (nothing under a plain ``python``),
    the typed config, the experiment folder and its log (rank 0), ``--threads``, and the seed (before the model is
    built, so that ``--seed`` fixes its initialisation too)."""
    import torch

    from asrprec.rng import seed_everything

    from .distributed import setup_distributed

    setup_distributed(args.device)
    cfg = train_config_from_args(args)
    Path(args.exp_dir).mkdir(parents=True, exist_ok=True)
    setup_logging(str(Path(args.exp_dir) / "train.log"), rank=get_rank())
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    return cfg


def announce(args: argparse.Namespace, model, policy) -> None:
    """Print the model and the precision (rank 0)."""
    from asrprec.models import count_parameters

    if is_main_process():
        print(f"model: {args.encoder}/{args.size}, {count_parameters(model):,} parameters; "
              f"precision: {policy.describe()}")


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed flags; an invalid combination exits like an argparse error."""
    try:
        return dataclass_from_args(TrainConfig, args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
