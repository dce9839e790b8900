"""Hot phrases: recall of boosted words and the WER of the utterances without them, without and with boosting.

The words to boost are given (``--words``) or picked as the ``--pick`` words of lowest recall on another split
(``--pick-split``, decoded plainly first), so the test split never chooses them. Recall = matched occurrences /
reference occurrences, an occurrence matched when the hypothesis holds the word as many times (per utterance, up to
the reference's count). Every search runs without boosting and with each ``--score``, on the same batches.

    python benchmarks/hotword_recall.py --exp-dir recipes/espeak/exp/fp32 --epoch 10 --avg 3 \\
        --data-dir recipes/espeak/data --split test --pick-split dev --pick 3 --score 1 2 --threads 1
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as bench  # noqa: E402
import lm_decode  # noqa: E402

from asrprec.decoding.fusion import Fusion  # noqa: E402
from asrprec.metrics import compute_wer  # noqa: E402


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp-dir", type=Path, required=True)
    p.add_argument("--epoch", type=int, default=10)
    p.add_argument("--avg", type=int, default=3)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--words", nargs="*", default=[], help="the words to boost (else picked on --pick-split)")
    p.add_argument("--pick-split", default="dev")
    p.add_argument("--pick", type=int, default=3)
    p.add_argument("--score", type=float, nargs="+", default=[1.0, 2.0], help="--hotword-score values")
    p.add_argument("--methods", default="greedy_search,modified_beam_search")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=0)
    return p


def recall(refs: list[list[str]], hyps: list[list[str]], words: set[str]) -> tuple[int, int]:
    hit = total = 0
    for r, h in zip(refs, hyps):
        rc, hc = Counter(w for w in r if w in words), Counter(h)
        total += sum(rc.values())
        hit += sum(min(n, hc[w]) for w, n in rc.items())
    return hit, total


def load(args, split: str):
    ns = argparse.Namespace(exp_dir=args.exp_dir, data_dir=args.data_dir, epoch=args.epoch, avg=args.avg,
                            split=split, max_utts=0, max_duration=300.0)
    model, batches, tok = bench.load_trained(ns)
    model, autocast = bench.variant(model, "fp32", "cpu")
    return model, autocast, bench.rebatch(batches, args.batch_size), tok


def main(argv=None) -> str:
    args = get_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    words = [w.upper() for w in args.words]
    if not words:
        model, autocast, batches, tok = load(args, args.pick_split)
        search = lm_decode.search_for(model, "greedy_search", args.beam, None)
        hyps, *_ = bench.run_all({"plain": (model, autocast, search)}, batches, "cpu", 1)["plain"]
        refs = [t.split() for b in batches for t in b["texts"]]
        per_word = {w: recall(refs, [tok.decode(h).split() for h in hyps], {w}) for r in refs for w in r}
        words = sorted(per_word, key=lambda w: per_word[w][0] / per_word[w][1])[: args.pick]
        picked = ", ".join(f"{w} {per_word[w][0]}/{per_word[w][1]}" for w in words)
        print(f"picked on {args.pick_split} (greedy recall): {picked}", flush=True)
    model, autocast, batches, tok = load(args, args.split)
    phrases = tok.encode(words)
    setups = {}
    for method in methods:
        setups[method, 0.0] = (model, autocast, lm_decode.search_for(model, method, args.beam, None))
        for s in args.score:
            fusion = Fusion(vocab_size=tok.vocab_size, phrases=phrases, hotword_score=s).for_batch([])
            setups[method, s] = (model, autocast, lm_decode.search_for(model, method, args.beam, fusion))
    results = bench.run_all(setups, batches, "cpu", 1)
    refs = [t.split() for b in batches for t in b["texts"]]
    target = set(words)
    without = [i for i, r in enumerate(refs) if not target & set(r)]
    lines = [f"boosted: {' '.join(words)}; {args.split}: {len(refs)} utterances, {len(refs) - len(without)} with a "
             f"boosted word", "", "| method | hotword score | recall of boosted words | WER % (utterances without "
             "them) | WER % (all) |", "|---|---|---|---|---|"]
    for (method, s), (hyps, *_) in results.items():
        words_h = [tok.decode(h).split() for h in hyps]
        hit, total = recall(refs, words_h, target)
        wer_without = compute_wer([refs[i] for i in without], [words_h[i] for i in without]).wer_percent
        lines.append(f"| {method} | {s:g} | {hit}/{total} ({100 * hit / max(total, 1):.1f} %) | {wer_without:.2f} | "
                     f"{compute_wer(refs, words_h).wer_percent:.2f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
