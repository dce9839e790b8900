#!/usr/bin/env python3
"""Decode every test split prepare.py made (or --splits) with the transducer or CTC searches; write recogs, errs,
WER per split.

    python recipes/custom/decode.py --data-dir exp_data --exp-dir exp/amp-bf16 --epoch 30 --avg 9 \
        --use-averaged-model --decoding-method modified_beam_search --beam-size 4

Methods, CTC heads, streaming (--causal models: --chunk-size, --left-context-frames, --streaming) are as in
recipes/librispeech/decode.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from asrprec.data import load_cuts
from asrprec.data.corpora import PreparedData
from asrprec.data.sources import prepared_splits
from asrprec.decoding.experiment import add_decoding_args, decode_from_args
from asrprec.training.cli import add_precision_args, run_main

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--exp-dir", type=Path, default=HERE / "exp" / "default")
    p.add_argument("--vocab-size", type=int, default=500,
                   help="the tokenizer prepare.py made with this --vocab-size: <data-dir>/lang_bpe_<N>/bpe.model")
    p.add_argument("--bpe-model", type=Path, default=None, help="another tokenizer file (instead of --vocab-size)")
    p.add_argument("--max-duration", type=float, default=600.0)
    p.add_argument("--splits", nargs="+", default=None, help="splits to decode (default: every test split)")
    p.add_argument("--on-the-fly-feats", action="store_true", help="compute fbank from the audio")
    add_decoding_args(p)
    add_precision_args(p)
    return p


def main() -> None:
    args = get_parser().parse_args()
    data = PreparedData(args.data_dir, prefix="custom")
    splits = args.splits or [s for s in prepared_splits(args.data_dir) if s not in ("train", "dev")]
    decode_from_args(
        args, tokenizer_path=lambda: args.bpe_model or data.tokenizer_model(args.vocab_size),
        load_splits=lambda: {s: load_cuts(data.cuts(s, features=not args.on_the_fly_feats), lazy=False,
                                          hint="run python recipes/custom/prepare.py") for s in splits},
        max_duration=args.max_duration, on_the_fly_feats=args.on_the_fly_feats)


if __name__ == "__main__":
    with torch.inference_mode():
        run_main(main, "decode.py")
