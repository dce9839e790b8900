#!/usr/bin/env python3
"""Export a trained model to the ONNX files sherpa-onnx runs: encoder.onnx, decoder.onnx, joiner.onnx, tokens.txt.
sherpa-onnx runs RNN-T models (configs/rnnt.yaml); the default TDT model's files run in onnxruntime (onnx_decode.py).

    python recipes/espeak/export.py --exp-dir recipes/espeak/exp/fp32 --epoch 10 --avg 3 --use-averaged-model --int8

A causal RNN-T Zipformer (trained with --config configs/causal.yaml; a TDT model exports offline only) exports as
a streaming model at one trained chunk size and left context:

    python recipes/espeak/export.py --exp-dir recipes/espeak/exp/causal --epoch 10 --avg 3 --use-averaged-model \
        --streaming --chunk-size 32 --left-context-frames 128 --int8

The files land in --out-dir (default: a folder in --exp-dir named after the weights). --int8 adds encoder.int8.onnx
... (onnxruntime dynamic quantisation), --fp16 adds encoder.fp16.onnx ...; tokens.txt serves every variant. Decode
them with recipes/espeak/onnx_decode.py (onnxruntime or sherpa-onnx), or with sherpa-onnx directly.

A model trained with --use-ctc: a CTC-only model (--use-transducer false) writes model.onnx and tokens.txt for
sherpa-onnx's zipformer CTC recognisers (OfflineRecognizer.from_zipformer_ctc, or with --streaming
OnlineRecognizer.from_zipformer2_ctc); a hybrid writes its transducer as above and, with --ctc, also its CTC head as
model.onnx in the same folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asrprec.cli import run_main, setup_logging
from asrprec.config import option
from asrprec.export.cli import ExportingConfig, export_experiment, exporting_command_line
from asrprec.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


@dataclass
class Tokens:
    """Where the tokenizer is."""

    data_dir: str = option(str(HERE / "data"), help="holds bpe.model (tokens.txt comes from it)")


@dataclass
class Config(ExportingConfig):
    recipe: Tokens = field(default_factory=Tokens)


def command_line():
    return exporting_command_line(Config, description=__doc__,
                                  defaults={"export": {"exp_dir": str(HERE / "exp" / "default")}},
                                  extra_flags=("recipe.data_dir",))


def main() -> None:
    cfg = command_line().parse()
    setup_logging()
    export_experiment(cfg.export, lambda: Tokenizer(Path(cfg.recipe.data_dir) / "bpe.model"))


if __name__ == "__main__":
    run_main(main, "export.py", also=(ValueError, ImportError))  # ImportError: names the pip extra to install
