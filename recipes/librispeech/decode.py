#!/usr/bin/env python3
"""Decode LibriSpeech test-clean and test-other with the transducer or CTC searches; write recogs, errs, WER.

    python recipes/librispeech/decode.py --exp-dir recipes/librispeech/exp/amp-bf16 --epoch 30 --avg 9 \
        --use-averaged-model --decoding-method modified_beam_search --beam-size 4 --precision bf16

A model trained with --use-ctc decodes its CTC head with --decoding-method ctc_greedy_search or
ctc_prefix_beam_search (--beam-size); a hybrid (transducer + CTC) takes every method, a CTC-only model
(--use-transducer false) only these two, streaming (--streaming) included.

A causal Zipformer (trained with --causal) needs --chunk-size and --left-context-frames (simulated streaming);
add --streaming to decode chunk by chunk with the encoder's caches (icefall's chunk 32 = 640 ms, left 256):

    python recipes/librispeech/decode.py --exp-dir recipes/librispeech/exp/causal --epoch 30 --avg 8 \
        --use-averaged-model --chunk-size 32 --left-context-frames 256 --streaming
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from asrprec.cli import run_main
from asrprec.config import option
from asrprec.data import load_cuts
from asrprec.data.corpora import LIBRISPEECH_TEST_PARTS, PreparedData
from asrprec.decoding.experiment import DecodingConfig, decode_experiment, decoding_command_line

HERE = Path(__file__).resolve().parent


@dataclass
class Librispeech:
    """What to decode."""

    data_dir: str = option(str(HERE / "data"), help="prepare.py's folder")
    exp_dir: str = option(str(HERE / "exp" / "default"), help="the experiment folder")
    vocab_size: int = option(500, help="the tokenizer <data-dir>/lang_bpe_<N>/bpe.model")
    bpe_model: str | None = option(None, help="another tokenizer file (instead of --vocab-size)")
    max_duration: float = option(600.0, help="seconds of audio per batch")
    splits: tuple[str, ...] = option(tuple(LIBRISPEECH_TEST_PARTS), metavar="SPLIT",
                                     help="test-clean, test-other, dev-clean, dev-other")
    on_the_fly_feats: bool = option(False, help="compute fbank from the audio")


@dataclass
class Config(DecodingConfig):
    recipe: Librispeech = field(default_factory=Librispeech)


def command_line():
    return decoding_command_line(Config, description=__doc__, extra_flags=tuple(f"recipe.{name}" for name in (
        "data_dir", "exp_dir", "vocab_size", "bpe_model", "max_duration", "splits", "on_the_fly_feats")))


def main() -> None:
    cfg = command_line().parse()
    r = cfg.recipe
    data = PreparedData(Path(r.data_dir))
    decode_experiment(
        cfg.decode, cfg.precision, exp_dir=Path(r.exp_dir),
        tokenizer_path=lambda: r.bpe_model or data.tokenizer_model(r.vocab_size),
        load_splits=lambda: {split: load_cuts(data.cuts(split, features=not r.on_the_fly_feats), lazy=False,
                                              hint="run python recipes/librispeech/prepare.py") for split in r.splits},
        max_duration=r.max_duration, on_the_fly_feats=r.on_the_fly_feats)


if __name__ == "__main__":
    with torch.inference_mode():
        run_main(main, "decode.py")
