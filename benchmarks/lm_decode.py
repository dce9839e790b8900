"""Language models in decoding: WER and RTFx of greedy search, modified beam search and malsd_batch, each without an
LM, with shallow fusion (--lm) and with shallow fusion + LODR (--lodr), on one model and one test set, in one run.

Every configuration decodes the same batches of ``--batch-size`` utterances (features loaded before timing), all
configurations interleaved pass by pass (``benchmarks/decode.py``'s ``run_all``: medians of ``--runs`` passes after a
warm-up). RTFx = audio seconds / (encoder + search) seconds of this process's CPU time; the last column is each
configuration's RTFx over plain greedy search's (label looping) in the same run. Pick the scales on the dev split
(``--split dev``), then report the test split with them.

    python benchmarks/lm_decode.py --exp-dir recipes/espeak/exp/fp32 --epoch 10 --avg 3 \\
        --data-dir recipes/espeak/data --lm recipes/espeak/data/lm_4gram.arpa --lodr recipes/espeak/data/lm_2gram.arpa \\
        --lm-scale 0.3 --lodr-scale 0.1 --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as bench  # noqa: E402  (benchmarks/decode.py: loading and interleaved timing)

from asrprec.data.frames import FRAME_SHIFT_S  # noqa: E402
from asrprec.decoding import (  # noqa: E402
    DecodingOptions, LabelLoopingGreedy, Searcher, ctc_prefix_beam_search, modified_beam_search,
)
from asrprec.decoding.batched_beam import MalsdBeamSearch  # noqa: E402
from asrprec.decoding.fusion import Fusion  # noqa: E402
from asrprec.metrics import compute_wer  # noqa: E402

METHODS = ("greedy_search", "modified_beam_search", "malsd_batch", "ctc_prefix_beam_search")


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp-dir", type=Path, required=True)
    p.add_argument("--epoch", type=int, default=10)
    p.add_argument("--avg", type=int, default=3)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--max-utts", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="utterances per decoded batch")
    p.add_argument("--methods", default="greedy_search,modified_beam_search,malsd_batch")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lm", type=Path, required=True)
    p.add_argument("--lodr", type=Path, default=None)
    p.add_argument("--lm-scale", type=float, nargs="+", default=[0.3])
    p.add_argument("--lodr-scale", type=float, nargs="+", default=[0.1])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, help="append the table (markdown) to this file")
    return p


def search_for(model, method: str, beam: int, fusion):
    if getattr(model, "durations", None) and method in ("greedy_search", "modified_beam_search"):
        # a TDT model: the library's table picks its TDT searches (label looping greedy, TDT beam search)
        searcher = Searcher(model, DecodingOptions(method=method, beam=beam, greedy_method="label_looping"))
        return lambda enc, lens: searcher(enc, lens, fusion)
    if method == "greedy_search":
        looping = LabelLoopingGreedy(model, 1)
        return lambda enc, lens: looping(enc, lens, fusion=fusion)
    if method == "modified_beam_search":
        return lambda enc, lens: modified_beam_search(model, enc, lens, beam=beam, fusion=fusion)
    if method == "malsd_batch":  # one search for the run: its decoder outputs by context are kept between batches
        search = MalsdBeamSearch(model, beam, 1)
        return lambda enc, lens: search(enc, lens, fusion=fusion)
    return lambda enc, lens: ctc_prefix_beam_search(model.ctc_log_probs(enc), lens, beam, blank_id=model.blank_id,
                                                    fusion=fusion)


def main(argv=None) -> str:
    args = get_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = bench._csv(args.methods, METHODS, "methods")
    load_args = argparse.Namespace(exp_dir=args.exp_dir, data_dir=args.data_dir, epoch=args.epoch, avg=args.avg,
                                   split=args.split, max_utts=args.max_utts, max_duration=300.0)
    model, batches, tokenizer = bench.load_trained(load_args)
    model, autocast = bench.variant(model, "fp32", "cpu")
    batches = bench.rebatch(batches, args.batch_size)
    configs = [("none", 0.0, 0.0)]
    configs += [("LM", lam, 0.0) for lam in args.lm_scale]
    if args.lodr:
        configs += [("LM + LODR", lam, mu) for lam in args.lm_scale for mu in args.lodr_scale]
    plain = Fusion.from_files(tokenizer, lm=args.lm, lodr=args.lodr)
    setups = {}
    for method in methods:
        for name, lam, mu in configs:
            if name == "none":
                fusion = None
            else:
                fusion = Fusion(vocab_size=tokenizer.vocab_size, lm=plain.lm, lm_scale=lam,
                                lodr=plain.lodr if mu else None, lodr_scale=mu).for_batch([])
            setups[method, name, lam, mu] = (model, autocast, search_for(model, method, args.beam, fusion))
    results = bench.run_all(setups, batches, "cpu", args.runs)
    audio = sum(float(b["feature_lens"].sum()) for b in batches) * FRAME_SHIFT_S
    refs = [t.split() for b in batches for t in b["texts"]]
    base = None
    lines = ["| method | LM | λ | μ (LODR) | WER % | RTFx (CPU) | vs plain greedy |", "|---|---|---|---|---|---|---|"]
    for (method, name, lam, mu), (hyps, te, ts, ce, cs) in results.items():
        rtfx = audio / (ce + cs)
        base = base or rtfx  # the first setup is plain greedy search
        wer = compute_wer(refs, [tokenizer.decode(h).split() for h in hyps]).wer_percent
        lines.append(f"| {method} | {name} | {lam:g} | {mu:g} | {wer:.2f} | {rtfx:.1f} | {rtfx / base:.2f} |")
        print(lines[-1], flush=True)
    header = (f"\n{args.exp_dir} epoch {args.epoch} avg {args.avg}, {args.split}: {len(refs)} utterances, "
              f"{audio:.0f} s; batch {args.batch_size}, beam {args.beam}; {torch.get_num_threads()} threads; "
              f"median of {args.runs} runs after a warm-up; LM {args.lm.name}, LODR "
              f"{args.lodr.name if args.lodr else '-'}\n")
    table = header + "\n" + "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(table)
    return table


if __name__ == "__main__":
    print(main())
