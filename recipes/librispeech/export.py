#!/usr/bin/env python3
"""Export a trained LibriSpeech model to the ONNX files sherpa-onnx runs: encoder.onnx, decoder.onnx, joiner.onnx,
tokens.txt.

    python recipes/librispeech/export.py --exp-dir recipes/librispeech/exp/amp-bf16 --epoch 30 --avg 9 \
        --use-averaged-model --int8

A causal Zipformer (trained with --causal) exports as a streaming model at one trained chunk size and left context
(icefall's chunk 32 = 640 ms, left 256):

    python recipes/librispeech/export.py --exp-dir recipes/librispeech/exp/causal --epoch 30 --avg 8 \
        --use-averaged-model --streaming --chunk-size 32 --left-context-frames 256

The files land in --out-dir (default: a folder in --exp-dir named after the weights); --int8 and --fp16 add those
variants of each file. sherpa-onnx runs them directly.

CTC-only and hybrid models (--use-ctc) export as in recipes/espeak/export.py: model.onnx for sherpa-onnx's zipformer
CTC recognisers (--ctc adds a hybrid's CTC head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asrprec.cli import run_main, setup_logging
from asrprec.config import option
from asrprec.data.corpora import PreparedData
from asrprec.export.cli import ExportingConfig, export_experiment, exporting_command_line
from asrprec.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


@dataclass
class Tokens:
    """Where the tokenizer is."""

    data_dir: str = option(str(HERE / "data"), help="prepare.py's folder")
    vocab_size: int = option(500, help="the tokenizer <data-dir>/lang_bpe_<N>/bpe.model")
    bpe_model: str | None = option(None, help="another tokenizer file (instead of --vocab-size)")


@dataclass
class Config(ExportingConfig):
    recipe: Tokens = field(default_factory=Tokens)


def command_line():
    return exporting_command_line(Config, description=__doc__,
                                  defaults={"export": {"exp_dir": str(HERE / "exp" / "default")}},
                                  extra_flags=("recipe.data_dir", "recipe.vocab_size", "recipe.bpe_model"))


def main() -> None:
    cfg = command_line().parse()
    setup_logging()
    r = cfg.recipe
    data = PreparedData(Path(r.data_dir))
    export_experiment(cfg.export, lambda: Tokenizer(r.bpe_model or data.tokenizer_model(r.vocab_size)))


if __name__ == "__main__":
    run_main(main, "export.py", also=(ValueError, ImportError))  # ImportError: names the pip extra to install
