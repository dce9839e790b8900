"""TDT against RNN-T decoding on one test set: WER, RTFx and frames per joiner step of greedy search (frame looping),
label looping and modified beam search, both models timed in the same run, pass by pass interleaved.

The TDT paper (Xu et al., ICML 2023, arXiv 2304.06795) reports its speed-up from skipping frames: a TDT search
evaluates the joiner only on the frames its predicted durations land on. The last column counts that: encoder frames
divided by joiner evaluations of the TDT greedy search (:meth:`asrprec.decoding.TdtLabelLoopingGreedy.frame_stats`);
the RNN-T greedy search with one symbol per frame evaluates the joiner once on every frame (1.00 by construction).
RTFx = audio seconds / (encoder + search) seconds, and audio seconds / search seconds alone, by this process's CPU
time (medians of ``--runs`` passes after one warm-up; see ``benchmarks/decode.py``).

    python benchmarks/tdt_decode.py --tdt-exp-dir recipes/espeak/exp/tdt --rnnt-exp-dir recipes/espeak/exp/fp32 \\
        --epoch 10 --avg 3 --data-dir recipes/espeak/data --split test --threads 1
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as bench  # noqa: E402  (benchmarks/decode.py: loading, timing, the searches by name)

from asrprec.data.frames import FRAME_SHIFT_S  # noqa: E402
from asrprec.decoding import TdtLabelLoopingGreedy, is_tdt  # noqa: E402
from asrprec.metrics import compute_wer  # noqa: E402

METHODS = ("greedy_search", "label_looping", "modified_beam_search")


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tdt-exp-dir", type=Path, required=True, help="a model trained with --loss tdt")
    p.add_argument("--rnnt-exp-dir", type=Path, required=True, help="an RNN-T model of the same size")
    p.add_argument("--epoch", type=int, default=10)
    p.add_argument("--avg", type=int, default=3)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--max-duration", type=float, default=300.0)
    p.add_argument("--max-utts", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--max-sym-per-frame", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, help="append the table (markdown) to this file")
    return p


@torch.inference_mode()
def frames_per_step(model, batches, max_sym: int) -> tuple[int, int]:
    """(encoder frames, joiner evaluations) of the TDT greedy search over ``batches``."""
    search = TdtLabelLoopingGreedy(model, max_sym)
    frames = steps = 0
    for b in batches:
        search(*model.encode(b["features"], b["feature_lens"]))
        stats = search.frame_stats()
        frames, steps = frames + stats["frames"], steps + stats["joiner_steps"]
    return frames, steps


def main(argv=None) -> str:
    args = get_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = bench._csv(args.methods, METHODS, "methods")
    setups, stats, tokenizer, batches = {}, {}, None, None
    for name, exp_dir in (("TDT", args.tdt_exp_dir), ("RNN-T", args.rnnt_exp_dir)):
        load_args = argparse.Namespace(exp_dir=exp_dir, data_dir=args.data_dir, epoch=args.epoch, avg=args.avg,
                                       split=args.split, max_utts=args.max_utts, max_duration=args.max_duration)
        model, batches, tokenizer = bench.load_trained(load_args)
        if is_tdt(model) != (name == "TDT"):
            raise SystemExit(f"{exp_dir} does not hold {'a' if name == 'TDT' else 'an'} {name} model")
        model, autocast = bench.variant(model, "fp32", "cpu")
        for method in methods:
            setups[name, method] = (model, autocast, bench.searcher(model, method, args))
        if name == "TDT":
            stats[name] = frames_per_step(model, batches, args.max_sym_per_frame)
    audio = sum(float(b["feature_lens"].sum()) for b in batches) * FRAME_SHIFT_S
    refs = [t.split() for b in batches for t in b["texts"]]
    results = bench.run_all(setups, batches, "cpu", args.runs)
    lines = ["| model | method | WER % | RTFx (CPU) | search-only RTFx (CPU) | encoder CPU s | search CPU s | tokens "
             "| frames per joiner step |", "|---|---|---|---|---|---|---|---|---|"]
    for (name, method), (hyps, _te, _ts, ce, cs) in results.items():
        wer = compute_wer(refs, [tokenizer.decode(h).split() for h in hyps]).wer_percent
        fps = "-"
        if method == "greedy_search":
            fps = f"{stats[name][0] / stats[name][1]:.2f}" if name in stats else "1.00"
        lines.append(f"| {name} | {method} | {wer:.2f} | {audio / (ce + cs):.1f} | {audio / cs:.1f} | {ce:.2f} | "
                     f"{cs:.2f} | {sum(map(len, hyps))} | {fps} |")
    header = (f"\n### TDT against RNN-T decoding ({bench._cpu_name()}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, {datetime.date.today()})\n\nTDT {args.tdt_exp_dir}, RNN-T {args.rnnt_exp_dir}, "
              f"epoch {args.epoch} avg {args.avg}, {args.split}: {len(refs)} utterances, {audio:.0f} s of audio; "
              f"beam {args.beam}, max_sym_per_frame {args.max_sym_per_frame}; median of {args.runs} runs after a "
              f"warm-up.\n")
    table = header + "\n" + "\n".join(lines) + "\n"
    print(table, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table)
    return table


if __name__ == "__main__":
    main()
