"""Long-form decoding: WER, peak memory and RTFx of recordings of 1, 5 and 30 minutes against decoding each
utterance alone.

A recording of L minutes is the test split's utterances one after another (cycled when the split is shorter),
``--pause`` seconds of faint white noise between them, written as one 16 kHz WAV. Each recording is decoded in a fresh
process by :func:`asrprec.decoding.longform.decode_long` (audio read and turned into fbank chunk by chunk), which
reports its RSS once the model is loaded and warmed up, the peak RSS while decoding (VmHWM, reset first), and the
wall and CPU time of the decode.
``--one-pass-minutes`` also decodes the recordings up to that length in one encoder pass (the whole recording's
features at once), to show the memory that chunking saves. WER: the long-form hypothesis against the recording's
whole reference; "per utterance": the same utterances decoded one by one (one batch pass, features on the fly).
"in utt": the share of correctly recognised words whose centre lies inside their own utterance's span.
A model trained only on single short utterances (the embedded recipe's: 0.6-3.5 s) may fail on any input holding
several of them, chunked or not: the one-pass rows show what the model does without chunking.

    python benchmarks/longform.py --exp-dir recipes/espeak/exp/fp32 --epoch 10 --avg 3 \\
        --data-dir recipes/espeak/data --work-dir /tmp/longform --minutes 1 5 30 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 16000


OPTION_FIELDS = ("chunk_seconds", "overlap_seconds", "chunks_per_batch", "pause_seconds", "pause_db")


def get_parser() -> argparse.ArgumentParser:
    from asrprec.decoding.longform import LongFormOptions

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp-dir", type=Path, required=True)
    p.add_argument("--epoch", type=int, default=10)
    p.add_argument("--avg", type=int, default=3)
    p.add_argument("--data-dir", type=Path, required=True, help="the recipe's data folder (cuts, bpe.model)")
    p.add_argument("--work-dir", type=Path, required=True, help="where the long recordings are written")
    p.add_argument("--split", default="test")
    p.add_argument("--minutes", type=float, nargs="+", default=[1.0, 5.0, 30.0])
    p.add_argument("--pause", type=float, default=0.5, help="seconds of silence between utterances")
    p.add_argument("--pause-noise-db", type=float, default=-60.0,
                   help="RMS of the white noise filling the pauses, dBFS (the utterances' own noise floor is "
                        "higher; digital silence gives fbank values training never shows)")
    p.add_argument("--method", default="greedy_search")
    p.add_argument("--one-pass-minutes", type=float, default=5.0,
                   help="also decode recordings up to this long in one encoder pass (0: never)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the table's numbers here")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)  # decode this WAV, print JSON
    p.add_argument("--one-pass", action="store_true", help=argparse.SUPPRESS)
    for name in OPTION_FIELDS:  # LongFormOptions' fields and defaults
        default = getattr(LongFormOptions, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    return p


def load_model(args):
    from asrprec.checkpoint import load_decoding_weights
    from asrprec.experiment import build_experiment_model
    from asrprec.tokenizer import Tokenizer

    model = build_experiment_model(args.exp_dir)  # model.json, as decode.py reads it
    load_decoding_weights(model, args.exp_dir, args.epoch, args.avg)
    return model.eval(), Tokenizer(args.data_dir / "bpe.model")


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (VmHWM) from the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@torch.no_grad()
def child(args) -> None:
    """Decode one WAV in this fresh process; print words and memory / time as JSON."""
    from lhotse import Recording

    from asrprec.decoding.api import DecodingOptions
    from asrprec.decoding.longform import LongFormOptions, decode_long

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args)
    rec = Recording.from_file(args.child)
    options = LongFormOptions(**{name: getattr(args, name) for name in OPTION_FIELDS})
    if args.one_pass:  # the whole recording as one chunk
        options = LongFormOptions(chunk_seconds=rec.duration + 1.0, overlap_seconds=0.0, chunks_per_batch=1)
    decode_long(model, Recording.from_file(args.child).to_cut().truncate(duration=2.0), tokenizer, options,
                DecodingOptions(method=args.method))  # warm-up on 2 s
    base = _status_mb("VmRSS")
    if not _reset_peak_rss():  # the peak then includes loading the model
        print("note: cannot reset the peak RSS count; the peak includes loading the model", file=sys.stderr)
    wall, cpu = time.perf_counter(), time.process_time()
    words = decode_long(model, rec, tokenizer, options, DecodingOptions(method=args.method))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _status_mb("VmHWM")
    print(json.dumps({"words": [(w.word, w.start, w.end) for w in words], "wall_s": wall, "cpu_s": cpu,
                      "rss_base_mb": base, "rss_peak_mb": peak, "duration_s": rec.duration}))


def make_recording(cuts: list, minutes: float, pause: float, noise_db: float,
                   path: Path) -> list[tuple[str, float, float, list]]:
    """Write the recording; returns its utterances ``(id, begin s, end s, words)`` in order."""
    import soundfile as sf

    from asrprec.atomic import atomic_path

    rng = np.random.default_rng(0)
    gap = (10 ** (noise_db / 20) * rng.standard_normal(int(pause * SAMPLE_RATE))).astype(np.float32)
    parts, utts, t, i = [], [], 0.0, 0
    while t < minutes * 60:
        cut = cuts[i % len(cuts)]
        audio = cut.load_audio()[0].astype(np.float32)
        utts.append((cut.id, t, t + len(audio) / SAMPLE_RATE, cut.supervisions[0].text.split()))
        parts += [audio, gap]
        t += (len(audio) + len(gap)) / SAMPLE_RATE
        i += 1
    with atomic_path(path) as tmp:
        sf.write(str(tmp), np.concatenate(parts), SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return utts


@torch.no_grad()
def per_utterance(args, cuts: list) -> dict[str, list[str]]:
    """Each cut decoded alone: ``{id: hypothesis words}``."""
    from asrprec.data.features import OnTheFlyFbank
    from asrprec.decoding.api import DecodingOptions, Searcher

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args)
    searcher, fbank, out = Searcher(model, DecodingOptions(method=args.method)), OnTheFlyFbank(), {}
    for i in range(0, len(cuts), 32):
        batch = cuts[i: i + 32]
        feats, lens = fbank(batch)
        enc, enc_lens = model.encode(feats, lens)
        for cut, tokens in zip(batch, searcher(enc, enc_lens)):
            out[cut.id] = tokenizer.decode(tokens).split()
    return out


def run_child(args, wav: Path, one_pass: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(wav), "--exp-dir", str(args.exp_dir), "--epoch", str(args.epoch),
           "--avg", str(args.avg), "--data-dir", str(args.data_dir), "--work-dir", str(args.work_dir),
           "--method", args.method, "--threads", str(args.threads)]
    cmd += [a for name in OPTION_FIELDS for a in ("--" + name.replace("_", "-"), str(getattr(args, name)))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd + (["--one-pass"] if one_pass else []), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def score(utts, words, per_utt) -> dict:
    from asrprec.metrics import align_words, compute_wer

    refs = [w for _, _, _, ws in utts for w in ws]
    owner = [k for k, (_, _, _, ws) in enumerate(utts) for _ in ws]
    pairs, counts = align_words(refs, [w[0] for w in words])
    inside = matched = i = j = 0
    for r, h in pairs:
        if r is not None and h is not None and r == h:
            _, begin, end, _ = utts[owner[i]]
            matched += 1
            inside += begin <= (words[j][1] + words[j][2]) / 2 <= end
        i += r is not None
        j += h is not None
    alone = compute_wer([ws for _, _, _, ws in utts], [per_utt[u] for u, _, _, _ in utts])
    return {"wer": counts.wer_percent, "wer_per_utt": alone.wer_percent, "ref_words": len(refs),
            "in_utt": inside / max(matched, 1)}


def main() -> None:
    args = get_parser().parse_args()
    if args.child:
        return child(args)
    from lhotse import CutSet

    cuts = list(CutSet.from_file(args.data_dir / f"espeak_cuts_{args.split}.jsonl.gz"))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    per_utt = per_utterance(args, cuts)
    rows = []
    for minutes in args.minutes:
        wav = args.work_dir / f"long-{minutes:g}min.wav"
        utts = make_recording(cuts, minutes, args.pause, args.pause_noise_db, wav)
        for one_pass in ([False, True] if minutes <= args.one_pass_minutes else [False]):
            res = run_child(args, wav, one_pass)
            row = {"minutes": minutes, "utts": len(utts), "mode": "one pass" if one_pass else "chunked", **res}
            if "error" not in res:
                row.update(score(utts, res.pop("words"), per_utt))
                row.pop("words", None)
            rows.append(row)
            print(row if "error" in row else {k: v for k, v in row.items() if k != "words"}, flush=True)
    print(f"\nlong-form decoding, {args.method}, {args.exp_dir} epoch {args.epoch} avg {args.avg}; chunks "
          f"{args.chunk_seconds:g} s, overlap {args.overlap_seconds:g} s, {args.chunks_per_batch} per batch, cut at "
          f"pauses of {args.pause_seconds:g} s ({args.pause_db:g} dB down; 0: never); "
          f"{args.threads} thread(s)")
    head = ("minutes", "mode", "utts", "words", "WER per utt %", "WER long-form %", "in utt %", "RSS peak MB",
            "RSS growth MB", "RTFx wall", "RTFx CPU")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        if "error" in r:
            print(f"| {r['minutes']:g} | {r['mode']} | {r['utts']} | failed: {r['error']} |")
            continue
        print(f"| {r['minutes']:g} | {r['mode']} | {r['utts']} | {r['ref_words']} | {r['wer_per_utt']:.2f} | "
              f"{r['wer']:.2f} | {100 * r['in_utt']:.1f} | {r['rss_peak_mb']:.0f} | "
              f"{r['rss_peak_mb'] - r['rss_base_mb']:.0f} | {r['duration_s'] / r['wall_s']:.1f} | "
              f"{r['duration_s'] / r['cpu_s']:.1f} |")
    if args.json:
        from asrprec.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
