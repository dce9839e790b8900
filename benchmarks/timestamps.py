"""Word-boundary error of decoded word times against the synthetic corpus' true word times, per head and search.

The recipe's test split is synthesised again with word times (``generate_corpus`` of the same configuration, read
from ``<data-dir>/corpus.json``, with no train or dev utterances: each split's draws and shards are its own, so the
audio is the same, which the script checks on a few files). Each utterance is decoded (features on the fly),
its token frames become word spans (:func:`asrprec.timestamps.word_spans`), hypothesis and reference words
are aligned by minimum edit distance, and every correctly recognised word gives |start - true start| and
|end - true end|. Rows: mean, 90th percentile and mean signed error (bias; > 0 = late) in ms. Methods the model has
no head for, or that give no times yet, are skipped with the reason.

    python benchmarks/timestamps.py --exp-dir recipes/espeak/exp/fp32 --epoch 10 --avg 3 \\
        --data-dir recipes/espeak/data --work-dir /tmp/espeak_aligned --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

METHODS = ("greedy_search", "modified_beam_search", "malsd_batch", "ctc_greedy_search", "ctc_prefix_beam_search")


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp-dir", type=Path, required=True)
    p.add_argument("--epoch", type=int, default=10)
    p.add_argument("--avg", type=int, default=3)
    p.add_argument("--data-dir", type=Path, required=True, help="the recipe's data folder (corpus.json, bpe.model)")
    p.add_argument("--work-dir", type=Path, required=True, help="where the aligned test split is synthesised")
    p.add_argument("--split", default="test", choices=("dev", "test", "test-fast"))
    p.add_argument("--seed", type=int, default=None,
                   help="synthesise the split of another corpus seed (other texts and voices; default: the recipe's)")
    p.add_argument("--max-utts", type=int, default=0, help="decode only the first N utterances (0 = all)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the table's numbers here")
    return p


def aligned_split(data_dir: Path, work_dir: Path, split: str, seed: int | None = None):
    """The split's cuts, synthesised again with word alignments (same configuration, same audio; or ``seed``'s)."""
    from asrprec.data.synthetic import SPLITS, generate_corpus

    cfg = json.loads((data_dir / "corpus.json").read_text())
    if seed is not None:
        cfg["seed"] = seed
    counts = {f"num_{s.replace('-', '_')}": (cfg.get(f"num_{s.replace('-', '_')}", 0) if s == split else 0)
              for s in SPLITS}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()
               if k not in counts and k != "version"}
    before = sum(cfg.get(f"num_{s.replace('-', '_')}", 0) for s in SPLITS[: SPLITS.index(split)])
    if before % cfg["shard_size"]:  # espeak's output depends on what its process spoke before (shards)
        print("note: the split does not start on a shard boundary of the recipe's corpus; its audio may differ")
    cuts = generate_corpus(work_dir, num_workers=1, **counts, **options)[split]
    stored = [(data_dir / "audio" / split / f"{c.id}.flac", Path(c.recording.sources[0].source)) for c in list(cuts)[:5]]
    same = [a for a, b in stored if a.is_file() and a.read_bytes() == b.read_bytes()]
    print(f"audio identical to the recipe's {split} split: {len(same)} of the first 5 files")
    return cuts


def load_model(args):
    from asrprec.checkpoint import load_decoding_weights
    from asrprec.experiment import build_experiment_model
    from asrprec.tokenizer import Tokenizer

    model = build_experiment_model(args.exp_dir)  # model.json, as decode.py reads it
    print("weights:", load_decoding_weights(model, args.exp_dir, args.epoch, args.avg))
    return model.eval(), Tokenizer(args.data_dir / "bpe.model")


def boundary_errors(ref_items, hyp_words) -> list[tuple[float, float]]:
    """(start error, end error) in seconds, signed, of each hypothesis word aligned to an equal reference word."""
    from asrprec.metrics import align_words

    refs = [it.symbol for it in ref_items]
    pairs, _ = align_words(refs, [w.word for w in hyp_words])
    out, i, j = [], 0, 0
    for r, h in pairs:
        if r is not None and h is not None and r == h:
            out.append((hyp_words[j].start - ref_items[i].start, hyp_words[j].end - ref_items[i].end))
        i += r is not None
        j += h is not None
    return out


@torch.no_grad()
def measure(model, tokenizer, cuts, method: str, beam: int, batch_size: int) -> dict:
    from asrprec.data.features import OnTheFlyFbank
    from asrprec.decoding.api import DecodingOptions, Searcher
    from asrprec.timestamps import words_from_ids

    fbank = OnTheFlyFbank()
    searcher = Searcher(model, DecodingOptions(method=method, beam=beam))
    cuts = sorted(cuts, key=lambda c: c.duration, reverse=True)
    errors, hyp_words, ref_words, wall = [], 0, 0, 0.0
    for i in range(0, len(cuts), batch_size):
        batch = cuts[i: i + batch_size]
        feats, lens = fbank(batch)
        start = time.perf_counter()
        enc, enc_lens = model.encode(feats, lens)
        found = searcher(enc, enc_lens, return_timestamps=True)
        wall += time.perf_counter() - start
        for cut, r, n in zip(batch, found, enc_lens.tolist()):
            words = words_from_ids(tokenizer.id_to_piece, r.tokens, r.frames, r.durations, num_frames=n)
            items = cut.supervisions[0].alignment["word"]
            errors += boundary_errors(items, words)
            hyp_words += len(words)
            ref_words += len(items)
    signed = np.array(errors, dtype=np.float64).reshape(-1, 2) * 1000
    e = np.abs(signed)
    if not len(e):  # no word recognised: no boundary to measure
        e = signed = np.full((1, 2), np.nan)
    return {"method": method, "ref_words": ref_words, "matched": len(errors),
            "start_mean_ms": float(e[:, 0].mean()), "start_p90_ms": float(np.percentile(e[:, 0], 90)),
            "end_mean_ms": float(e[:, 1].mean()), "end_p90_ms": float(np.percentile(e[:, 1], 90)),
            "start_bias_ms": float(signed[:, 0].mean()), "end_bias_ms": float(signed[:, 1].mean()),
            "search_s": wall}


def main() -> None:
    args = get_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args)
    cuts = list(aligned_split(args.data_dir, args.work_dir, args.split, args.seed))
    if args.max_utts:
        cuts = cuts[: args.max_utts]
    rows = []
    for method in args.methods.split(","):
        try:
            rows.append(measure(model, tokenizer, cuts, method, args.beam, args.batch_size))
        except ValueError as e:
            print(f"{method}: skipped ({e})")
    seed = "the recipe's seed" if args.seed is None else f"corpus seed {args.seed}"
    print(f"\nword-boundary error, {len(cuts)} {args.split} utterances ({seed}), {args.exp_dir} epoch {args.epoch} "
          f"avg {args.avg}; 40 ms encoder frames; errors of correctly recognised words (ms)")
    head = ("method", "words", "matched", "|start| mean", "|start| p90", "|end| mean", "|end| p90", "start bias",
            "end bias")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['method']} | {r['ref_words']} | {r['matched']} | {r['start_mean_ms']:.0f} | "
              f"{r['start_p90_ms']:.0f} | {r['end_mean_ms']:.0f} | {r['end_p90_ms']:.0f} | "
              f"{r['start_bias_ms']:+.0f} | {r['end_bias_ms']:+.0f} |")
    if args.json:
        from asrprec.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
