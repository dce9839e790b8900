#!/usr/bin/env python3
"""Prepare the embedded espeak-ng corpus: synthesise speech, compute fbank, train the BPE tokenizer.

    python recipes/espeak/prepare.py [--data-dir recipes/espeak/data]

Idempotent: each step reuses its outputs when they match the requested settings. Writes
``<data-dir>/espeak_cuts_<split>_fbank.jsonl.gz`` and ``<data-dir>/bpe.model`` for train.py / decode.py.
Needs the optional espeak-ng wheel: ``pip install 'asrprec[synth]'``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from asrprec.data import compute_corpus_fbank, generate_corpus, validate_cuts
from asrprec.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    # Sizes chosen so that prep + training + decoding fit in ~10 min on 2 CPU cores (~1.3 h of audio).
    p.add_argument("--num-train", type=int, default=2500)
    p.add_argument("--num-dev", type=int, default=200)
    p.add_argument("--num-test", type=int, default=400)
    p.add_argument("--num-test-fast", type=int, default=200, help="utterances spoken faster than any other split's")
    p.add_argument("--num-test-names", type=int, default=200, help="test sentences, half of them with names never trained on")
    p.add_argument("--train-name-count", type=int, default=0,
                   help="training sentences that begin with each of the test-names split's names (0: never heard)")
    p.add_argument("--train-speakers-per-voice", type=int, default=1,
                   help="training speakers drawn per training voice (held-out splits keep one per voice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=2, help="synthesis and feature-extraction processes")
    # Noise and reverberation keep the task from being trivial: a tiny CTC BiGRU on one thread reached 1.1 % dev
    # WER in 4 min on clean audio but 12.5 % with these defaults (held-out voices). --clean turns both off.
    p.add_argument("--snr-db", type=float, nargs=2, default=(0.0, 20.0), metavar=("LOW", "HIGH"), help="noise SNR range")
    p.add_argument("--reverb-prob", type=float, default=0.5, help="share of utterances given synthetic reverberation")
    p.add_argument("--clean", action="store_true", help="no noise and no reverberation")
    # ~7.5 BPE pieces per utterance (mostly whole words of the 48-word vocabulary); 128 beat 64 (1.1 vs 3.6 % WER
    # in the same CTC check).
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--force", action="store_true", help="regenerate the corpus even if it is up to date")
    return p


def main() -> None:
    args = get_parser().parse_args()
    from asrprec.cli import setup_logging  # here: the corpus generator's spawn workers skip torch

    setup_logging()
    start = time.perf_counter()
    cuts = generate_corpus(
        args.data_dir, num_train=args.num_train, num_dev=args.num_dev, num_test=args.num_test,
        num_test_fast=args.num_test_fast, num_test_names=args.num_test_names, seed=args.seed,
        train_name_count=args.train_name_count, train_speakers_per_voice=args.train_speakers_per_voice,
        num_workers=args.num_workers, snr_db=None if args.clean else args.snr_db,
        reverb_prob=0.0 if args.clean else args.reverb_prob, force=args.force,
    )
    cuts = {split: split_cuts for split, split_cuts in cuts.items() if len(split_cuts)}  # --num-test-fast 0: none
    for split_cuts in cuts.values():
        validate_cuts(split_cuts, check_audio=False)  # transcripts and durations; audio is checked by fbank
    compute_corpus_fbank(cuts, args.data_dir, num_jobs=args.num_workers)
    tokenizer = Tokenizer.train([c.supervisions[0].text for c in cuts["train"]], args.data_dir / "bpe", args.vocab_size)
    logging.info("prepared %s in %.1f s; tokenizer %s", args.data_dir, time.perf_counter() - start, tokenizer)


if __name__ == "__main__":
    from asrprec.cli import run_main  # here, not at the top: the synthesis workers import this module without torch

    run_main(main, "prepare.py", also=(ValueError,))
