#!/usr/bin/env python3
"""Decode every test split prepare.py made (or --splits) with the transducer or CTC searches; write recogs, errs,
WER per split.

    python recipes/custom/decode.py --data-dir exp_data --exp-dir exp/amp-bf16 --epoch 30 --avg 9 \
        --use-averaged-model --decoding-method modified_beam_search --beam-size 4

Methods, CTC heads, streaming (--causal models: --chunk-size, --left-context-frames, --streaming) are as in
recipes/librispeech/decode.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from asrprec.cli import run_main
from asrprec.config import option
from asrprec.data import load_cuts
from asrprec.data.corpora import PreparedData
from asrprec.data.sources import prepared_splits
from asrprec.decoding.experiment import DecodingConfig, decode_experiment, decoding_command_line

HERE = Path(__file__).resolve().parent


@dataclass
class Custom:
    """What to decode."""

    data_dir: str = option(str(HERE / "data"), help="prepare.py's folder")
    exp_dir: str = option(str(HERE / "exp" / "default"), help="the experiment folder")
    vocab_size: int = option(500, help="the tokenizer <data-dir>/lang_bpe_<N>/bpe.model")
    bpe_model: str | None = option(None, help="another tokenizer file (instead of --vocab-size)")
    max_duration: float = option(600.0, help="seconds of audio per batch")
    splits: tuple[str, ...] = option((), metavar="SPLIT", help="splits to decode (default: every test split)")
    on_the_fly_feats: bool = option(False, help="compute fbank from the audio")


@dataclass
class Config(DecodingConfig):
    recipe: Custom = field(default_factory=Custom)


def command_line():
    return decoding_command_line(Config, description=__doc__, extra_flags=tuple(f"recipe.{name}" for name in (
        "data_dir", "exp_dir", "vocab_size", "bpe_model", "max_duration", "splits", "on_the_fly_feats")))


def main() -> None:
    cfg = command_line().parse()
    r = cfg.recipe
    data = PreparedData(Path(r.data_dir), prefix="custom")
    splits = list(r.splits) or [s for s in prepared_splits(Path(r.data_dir)) if s not in ("train", "dev")]
    decode_experiment(
        cfg.decode, cfg.precision, exp_dir=Path(r.exp_dir),
        tokenizer_path=lambda: r.bpe_model or data.tokenizer_model(r.vocab_size),
        load_splits=lambda: {s: load_cuts(data.cuts(s, features=not r.on_the_fly_feats), lazy=False,
                                          hint="run python recipes/custom/prepare.py") for s in splits},
        max_duration=r.max_duration, on_the_fly_feats=r.on_the_fly_feats)


if __name__ == "__main__":
    with torch.inference_mode():
        run_main(main, "decode.py")
