#!/usr/bin/env python3
"""Build n-gram LMs on the LibriSpeech training transcripts, in the tokenizer's BPE pieces (after prepare.py stage 5):

    python recipes/librispeech/prepare_lm.py --subset 960h [--vocab-size 500] [--order 3] [--lodr-order 2]

writes ``<data-dir>/lang_bpe_<vocab-size>/lm_<order>gram.arpa`` (for ``decode.py --lm``) and ``lm_<lodr-order>gram.arpa``
(for ``--lodr``, icefall's LODR uses a 2-gram) with asrprec's Kneser-Ney estimator (pure Python: the 960 h
transcripts take minutes and some GB of memory for a 3-gram; nothing is downloaded). Then, e.g.:

    python recipes/librispeech/decode.py --exp-dir EXP --epoch 30 --avg 9 --decoding-method modified_beam_search \\
        --lm recipes/librispeech/data/lang_bpe_500/lm_3gram.arpa --lm-scale 0.3 \\
        --lodr recipes/librispeech/data/lang_bpe_500/lm_2gram.arpa --lodr-scale 0.16
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asrprec.data.corpora import LIBRISPEECH_TRAIN_PARTS, PreparedData, librispeech_transcripts
from asrprec.lm import build_token_lm
from asrprec.tokenizer import Tokenizer
from asrprec.cli import run_main, setup_logging

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subset", choices=tuple(LIBRISPEECH_TRAIN_PARTS), default="960h")
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--vocab-size", type=int, default=500, help="the tokenizer prepare.py made (lang_bpe_<N>)")
    p.add_argument("--order", type=int, default=3, help="the LM for shallow fusion (--lm)")
    p.add_argument("--lodr-order", type=int, default=2, help="the low-order LM for LODR (--lodr); 0: none")
    return p


def main() -> None:
    args = get_parser().parse_args()
    setup_logging()
    data = PreparedData(args.data_dir)
    texts = librispeech_transcripts(data.manifest_dir, LIBRISPEECH_TRAIN_PARTS[args.subset])
    tokenizer = Tokenizer(data.bpe_model(args.vocab_size))
    for order in dict.fromkeys(o for o in (args.order, args.lodr_order) if o > 0):
        build_token_lm(texts, tokenizer, data.bpe_model(args.vocab_size).parent / f"lm_{order}gram.arpa", order)


if __name__ == "__main__":
    run_main(main, "prepare_lm.py")
