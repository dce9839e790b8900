#!/usr/bin/env python3
"""Decode the espeak test (and dev) speakers with the transducer or CTC searches; write recogs, errs, WER.

    python recipes/espeak/decode.py --exp-dir recipes/espeak/exp/default --epoch 8 --avg 3 \
        --decoding-method modified_beam_search --beam-size 4 --precision bf16

A model trained with --use-ctc decodes its CTC head with --decoding-method ctc_greedy_search or
ctc_prefix_beam_search (--beam-size); a hybrid (transducer + CTC) takes every method, a CTC-only model
(--use-transducer false) only these two, streaming (--streaming) included.

A TDT model (trained with --loss tdt) decodes with the same method names: greedy_search (label looping by default,
--greedy-method frame_looping for the batched TDT greedy search) and modified_beam_search jump over frames by the
predicted durations (asrprec.decoding.tdt).

A causal Zipformer (trained with --causal) needs --chunk-size and --left-context-frames (simulated streaming);
add --streaming to decode chunk by chunk with the encoder's caches, as a live stream:

    python recipes/espeak/decode.py --exp-dir recipes/espeak/exp/causal --epoch 10 --avg 3 \
        --chunk-size 32 --left-context-frames 128 --streaming
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from asrprec.cli import run_main
from asrprec.config import option
from asrprec.data import load_fbank_cuts
from asrprec.decoding.experiment import DecodingConfig, decode_experiment, decoding_command_line

HERE = Path(__file__).resolve().parent


@dataclass
class Espeak:
    """What to decode."""

    data_dir: str = option(str(HERE / "data"), help="prepare.py's folder")
    exp_dir: str = option(str(HERE / "exp" / "default"), help="the experiment folder")
    max_duration: float = option(300.0, help="seconds of audio per batch")
    splits: tuple[str, ...] = option(("test", "dev"), metavar="SPLIT", help="the splits to decode")


@dataclass
class Config(DecodingConfig):
    recipe: Espeak = field(default_factory=Espeak)


def command_line():
    return decoding_command_line(Config, description=__doc__, extra_flags=(
        "recipe.data_dir", "recipe.exp_dir", "recipe.max_duration", "recipe.splits"))


def main() -> None:
    cfg = command_line().parse()
    r = cfg.recipe
    decode_experiment(cfg.decode, cfg.precision, exp_dir=Path(r.exp_dir), tokenizer_path=Path(r.data_dir) / "bpe.model",
                      max_duration=r.max_duration,
                      load_splits=lambda: load_fbank_cuts(Path(r.data_dir), splits=tuple(r.splits)))


if __name__ == "__main__":
    with torch.inference_mode():
        run_main(main, "decode.py")
