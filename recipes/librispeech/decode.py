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

import argparse
from pathlib import Path

import torch

from asrprec.data import load_cuts
from asrprec.data.corpora import LIBRISPEECH_DEV_PARTS, LIBRISPEECH_TEST_PARTS, PreparedData
from asrprec.decoding.experiment import add_decoding_args, decode_from_args
from asrprec.cli import add_precision_args, run_main

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--exp-dir", type=Path, default=HERE / "exp" / "default")
    p.add_argument("--vocab-size", type=int, default=500,
                   help="the tokenizer prepare.py made with this --vocab-size: <data-dir>/lang_bpe_<N>/bpe.model")
    p.add_argument("--bpe-model", type=Path, default=None, help="another tokenizer file (instead of --vocab-size)")
    p.add_argument("--max-duration", type=float, default=600.0)
    p.add_argument("--splits", nargs="+", choices=LIBRISPEECH_TEST_PARTS + LIBRISPEECH_DEV_PARTS,
                   default=list(LIBRISPEECH_TEST_PARTS))
    p.add_argument("--on-the-fly-feats", action="store_true", help="compute fbank from the audio")
    add_decoding_args(p)
    add_precision_args(p)
    return p


def main() -> None:
    args = get_parser().parse_args()
    data = PreparedData(args.data_dir)
    decode_from_args(
        args, tokenizer_path=lambda: args.bpe_model or data.tokenizer_model(args.vocab_size),
        load_splits=lambda: {split: load_cuts(data.cuts(split, features=not args.on_the_fly_feats), lazy=False,
                                              hint="run python recipes/librispeech/prepare.py") for split in args.splits},
        max_duration=args.max_duration, on_the_fly_feats=args.on_the_fly_feats)


if __name__ == "__main__":
    with torch.inference_mode():
        run_main(main, "decode.py")
