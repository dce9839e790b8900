#!/usr/bin/env python3
"""Export a model trained by train.py to the ONNX files sherpa-onnx runs: encoder.onnx, decoder.onnx, joiner.onnx,
tokens.txt (CTC models: model.onnx), as recipes/librispeech/export.py.

    python recipes/custom/export.py --data-dir exp_data --exp-dir exp/amp-bf16 --epoch 30 --avg 9 \
        --use-averaged-model --int8
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asrprec.config import add_dataclass_args, dataclass_from_args
from asrprec.data.corpora import PreparedData
from asrprec.export.cli import ExportConfig, export_experiment
from asrprec.tokenizer import Tokenizer
from asrprec.training.cli import run_main, setup_logging

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
    data = PreparedData(args.data_dir, prefix="custom")
    export_experiment(dataclass_from_args(ExportConfig, args),
                      lambda: Tokenizer(args.bpe_model or data.tokenizer_model(args.vocab_size)))


if __name__ == "__main__":
    run_main(main, "export.py", also=(ValueError, ImportError))  # ImportError: names the pip extra to install
