"""Rebuild a trained transducer from an experiment folder (``model.json`` + ``epoch-N.pt`` checkpoints), in fp32 and
eval mode, with the weights a decode script's ``--epoch E --avg A [--use-averaged-model]`` name."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn


def load_experiment_model(exp_dir: str | os.PathLike, epoch: int, avg: int = 1,
                          use_averaged_model: bool = False) -> tuple[nn.Module, dict, str]:
    """Returns ``(model, model_config, description of the weights)``.

    ``model_config`` is the recipe's ``model.json`` (the ``build_transducer`` arguments, the encoder's resolved
    overrides included). Raises FileNotFoundError naming the missing file and the fix (no folder, no
    ``model.json``, missing epochs; :func:`asrprec.checkpoint.load_decoding_weights`)."""
    from asrprec.checkpoint import load_decoding_weights
    from asrprec.models import build_transducer

    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise FileNotFoundError(f"experiment folder {exp_dir} does not exist; pass the --exp-dir the model was "
                                "trained in")
    config_path = exp_dir / "model.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: the folder holds no model description (train.py writes "
                                "it when training starts); pass the --exp-dir of a training run")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON ({e})") from None
    model = build_transducer(**config)
    source = load_decoding_weights(model, exp_dir, epoch, avg, use_averaged_model)
    return model.float().eval(), config, source
