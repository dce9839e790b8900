#!/usr/bin/env python3
"""Export a model trained by train.py to the ONNX files sherpa-onnx runs: encoder.onnx, decoder.onnx, joiner.onnx,
tokens.txt (CTC models: model.onnx), as recipes/librispeech/export.py.

    python recipes/custom/export.py --data-dir exp_data --exp-dir exp/amp-bf16 --epoch 30 --avg 9 \
        --use-averaged-model --int8
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
    data = PreparedData(Path(r.data_dir), prefix="custom")
    export_experiment(cfg.export, lambda: Tokenizer(r.bpe_model or data.tokenizer_model(r.vocab_size)))


if __name__ == "__main__":
    run_main(main, "export.py", also=(ValueError, ImportError))  # ImportError: names the pip extra to install
