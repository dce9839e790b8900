#!/usr/bin/env python3
"""Build the n-gram LMs of the embedded recipe on its training transcripts, in the tokenizer's BPE pieces:

    python recipes/espeak/prepare_lm.py [--data-dir recipes/espeak/data] [--order 4] [--lodr-order 2]

writes ``<data-dir>/lm_<order>gram.arpa`` (for ``decode.py --lm``) and ``<data-dir>/lm_<lodr-order>gram.arpa`` (for
``--lodr``) with asrprec's Kneser-Ney estimator (nothing to install or download). Run after prepare.py:

    python recipes/espeak/decode.py --exp-dir recipes/espeak/exp/fp32 --epoch 10 --avg 3 \\
        --decoding-method modified_beam_search --lm recipes/espeak/data/lm_4gram.arpa --lm-scale 0.3 \\
        --lodr recipes/espeak/data/lm_2gram.arpa --lodr-scale 0.1
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asrprec.data import load_fbank_cuts
from asrprec.lm import build_token_lm
from asrprec.tokenizer import Tokenizer
from asrprec.cli import run_main, setup_logging

HERE = Path(__file__).resolve().parent


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--order", type=int, default=4, help="the LM for shallow fusion (--lm)")
    p.add_argument("--lodr-order", type=int, default=2, help="the low-order LM for LODR (--lodr); 0: none")
    return p


def main() -> None:
    args = get_parser().parse_args()
    setup_logging()
    texts = [s.text for c in load_fbank_cuts(args.data_dir, splits=("train",))["train"] for s in c.supervisions]
    tokenizer = Tokenizer(args.data_dir / "bpe.model")
    for order in dict.fromkeys(o for o in (args.order, args.lodr_order) if o > 0):
        build_token_lm(texts, tokenizer, args.data_dir / f"lm_{order}gram.arpa", order)


if __name__ == "__main__":
    run_main(main, "prepare_lm.py")
