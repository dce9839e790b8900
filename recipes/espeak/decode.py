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

import argparse
from pathlib import Path

import torch

from asrprec.data import load_fbank_cuts
from asrprec.decoding.experiment import add_decoding_args, decode_from_args
from asrprec.cli import add_precision_args, run_main

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--exp-dir", type=Path, default=HERE / "exp" / "default")
    p.add_argument("--max-duration", type=float, default=300.0)
    p.add_argument("--splits", nargs="+", default=["test", "dev"])
    add_decoding_args(p)
    add_precision_args(p)
    return p


def main() -> None:
    args = get_parser().parse_args()
    decode_from_args(args, tokenizer_path=args.data_dir / "bpe.model", max_duration=args.max_duration,
                     load_splits=lambda: load_fbank_cuts(args.data_dir, splits=tuple(args.splits)))


if __name__ == "__main__":
    with torch.inference_mode():
        run_main(main, "decode.py")
