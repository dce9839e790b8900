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

import argparse
from pathlib import Path

from asrprec.config import add_dataclass_args, dataclass_from_args
from asrprec.data.corpora import PreparedData
from asrprec.export.cli import ExportConfig, export_experiment
from asrprec.tokenizer import Tokenizer
from asrprec.cli import run_main, setup_logging

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--vocab-size", type=int, default=500,
                   help="the tokenizer prepare.py made with this --vocab-size: <data-dir>/lang_bpe_<N>/bpe.model")
    p.add_argument("--bpe-model", type=Path, default=None, help="another tokenizer file (instead of --vocab-size)")
    add_dataclass_args(p, ExportConfig, defaults={"exp_dir": str(HERE / "exp" / "default")})
    return p


def main() -> None:
    args = get_parser().parse_args()
    setup_logging()
    export_experiment(dataclass_from_args(ExportConfig, args),
                      lambda: Tokenizer(args.bpe_model or PreparedData(args.data_dir).tokenizer_model(args.vocab_size)))


if __name__ == "__main__":
    run_main(main, "export.py", also=(ValueError, ImportError))  # ImportError: names the pip extra to install
