#!/usr/bin/env python3
"""The embedded espeak corpus through recipes/custom in each format, against recipes/espeak: the same audio and
transcripts written as a Kaldi data dir per split (wav.scp, text, segments, utt2spk), a NeMo manifest per split and
a lhotse CutSet per split; each prepared by recipes/custom/prepare.py, trained by recipes/custom/train.py with
recipes/espeak/train.py's model and schedule, decoded (greedy, test split), and printed as a WER table beside
recipes/espeak's own runs.

    python benchmarks/custom_formats.py --epochs 3 --seeds 42 43 --threads 1 --out-dir recipes/custom/exp/custom_formats

What differs between the recipes besides the format is their data handling, which is recipes/custom's on purpose:
its training manifest is shuffled and read lazily, and its SpecAugment is icefall's (10 frame masks; time warping
off here, as recipes/espeak has it). So a custom run is compared with the spread of recipes/espeak over seeds, not
expected to equal one espeak run. Trainings run one after another; a finished step (a prepared folder, a trained
epoch, a decoded split) is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ESPEAK, CUSTOM = ROOT / "recipes" / "espeak", ROOT / "recipes" / "custom"
FORMATS = ("kaldi", "nemo", "lhotse")
SPLITS = ("train", "dev", "test")
# recipes/espeak/train.py's values of the config fields whose recipes/custom default differs (checked against it)
ESPEAK_TRAINING = {"model.size": "tiny", "data.max_duration": 30.0, "model.loss_warmup_batches": 4000,
                   "train.lr_batches": 500.0, "train.lr_epochs": 4.0, "train.warmup_batches": 100,
                   "train.log_interval": 20, "train.encoder_schedule_scale": 30.0, "train.average_period": 10,
                   "train.ref_duration": 0.0, "train.valid_interval": 0, "train.save_every_n": 0,
                   "train.keep_last_k": 5, "data.num_buckets": 10, "data.num_workers": 0}


def run(*args: object, log: Path) -> float:
    """Run a script with ``args`` (one torch thread), its output into ``log``; return the wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    with open(log, "a") as f:
        p = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"{args[0]} failed (exit {p.returncode}); see {log}")
    return time.perf_counter() - start


def check_espeak_defaults() -> None:
    """ESPEAK_TRAINING must be what recipes/espeak/train.py would use."""
    cfg = runpy.run_path(str(ESPEAK / "train.py"), run_name="espeak_train")["command_line"]().build()
    defaults = {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in ESPEAK_TRAINING}
    wrong = {k: (v, defaults[k]) for k, v in ESPEAK_TRAINING.items() if defaults[k] != v}
    if wrong:
        raise SystemExit(f"ESPEAK_TRAINING differs from recipes/espeak/train.py: {wrong}")


def flags(d: dict) -> list[str]:
    return [x for k, v in d.items() for x in (f"--{k}", str(v))]  # --section.field VALUE


def write_formats(espeak_data: Path, out: Path) -> dict[str, dict[str, Path]]:
    """The espeak splits in each format: ``{format: {split: source}}``."""
    from lhotse import load_manifest_lazy

    from asrprec.atomic import atomic_write_text
    from asrprec.data import write_cuts

    sources: dict[str, dict[str, Path]] = {f: {} for f in FORMATS}
    for split in SPLITS:
        cuts = list(load_manifest_lazy(espeak_data / f"espeak_cuts_{split}_fbank.jsonl.gz"))
        kaldi = out / "kaldi" / split
        rows = {"wav.scp": [], "text": [], "segments": [], "utt2spk": []}
        nemo = []
        for c in cuts:
            s, audio = c.supervisions[0], c.recording.sources[0].source
            rows["wav.scp"].append(f"{c.recording.id} {Path(audio).resolve()}")
            rows["text"].append(f"{c.id} {s.text}")
            rows["segments"].append(f"{c.id} {c.recording.id} {c.start:.4f} {c.start + c.duration:.4f}")
            rows["utt2spk"].append(f"{c.id} {s.speaker or c.id}")
            nemo.append(json.dumps({"audio_filepath": str(Path(audio).resolve()), "duration": c.duration,
                                    "offset": c.start, "text": s.text}))
        for name, lines in rows.items():
            atomic_write_text(kaldi / name, "".join(f"{x}\n" for x in dict.fromkeys(lines)))
        atomic_write_text(out / "nemo" / f"{split}.jsonl", "".join(f"{x}\n" for x in nemo))
        write_cuts((c.drop_features() for c in cuts), out / "lhotse" / f"{split}_cuts.jsonl.gz")
        sources["kaldi"][split] = kaldi
        sources["nemo"][split] = out / "nemo" / f"{split}.jsonl"
        sources["lhotse"][split] = out / "lhotse" / f"{split}_cuts.jsonl.gz"
    return sources


def test_wer(exp: Path, epoch: int, avg: int) -> float:
    return json.loads((exp / f"wer-summary-greedy_search-epoch-{epoch}-avg-{avg}-fp32.json").read_text())["test"]["wer"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--espeak-data-dir", type=Path, default=ESPEAK / "data", help="recipes/espeak/prepare.py's output")
    p.add_argument("--out-dir", type=Path, default=CUSTOM / "exp" / "custom_formats")
    p.add_argument("--epochs", type=int, default=10, help="recipes/espeak's 10; fewer for a shorter comparison")
    p.add_argument("--avg", type=int, default=1, help="decode the average of the last this many epochs")
    p.add_argument("--seeds", type=int, nargs="+", default=[42], help="recipes/espeak is trained with each")
    p.add_argument("--custom-seed", type=int, default=None, help="seed of the recipes/custom runs (the first --seeds)")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=128,
                   help="recipes/espeak/prepare.py's --vocab-size (a bpe model, its Tokenizer.train default)")
    p.add_argument("--prepare-espeak", action=argparse.BooleanOptionalAction, default=True,
                   help="run recipes/espeak/prepare.py on --espeak-data-dir first (a no-op when it is prepared)")
    args = p.parse_args()
    check_espeak_defaults()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    log = out / "run.log"
    if args.prepare_espeak:
        run(ESPEAK / "prepare.py", "--data-dir", args.espeak_data_dir, "--num-workers", 1, log=log)
    sources = write_formats(args.espeak_data_dir, out / "sources")
    common = ("--num-epochs", args.epochs, "--threads", args.threads, "--train.progress_bar", "false")
    decode = ("--epoch", args.epochs, "--avg", args.avg, "--device", "cpu")
    rows = []

    def espeak(seed: int) -> None:
        exp = out / f"espeak-s{seed}"
        secs = 0.0 if (exp / f"epoch-{args.epochs}.pt").is_file() else run(
            ESPEAK / "train.py", "--data-dir", args.espeak_data_dir, "--exp-dir", exp, "--seed", seed, *common, log=log)
        run(ESPEAK / "decode.py", "--data-dir", args.espeak_data_dir, "--exp-dir", exp, "--splits", "test", *decode,
            log=log)
        rows.append(("recipes/espeak", "(its own)", seed, test_wer(exp, args.epochs, args.avg), secs))
        print(rows[-1], flush=True)

    espeak(args.seeds[0])
    seed = args.custom_seed if args.custom_seed is not None else args.seeds[0]
    for fmt in args.formats:
        data, exp = out / fmt / "data", out / fmt / f"exp-s{seed}"
        src = sources[fmt]
        run(CUSTOM / "prepare.py", "--train", src["train"], "--dev", src["dev"], "--test", f"test={src['test']}",
            "--data-dir", data, "--vocab-size", args.vocab_size, "--bpe-model-type", "bpe", "--speed-factors", "--num-jobs", 1,
            log=log)
        secs = 0.0 if (exp / f"epoch-{args.epochs}.pt").is_file() else run(
            CUSTOM / "train.py", "--data-dir", data, "--vocab-size", args.vocab_size, "--exp-dir", exp, "--seed", seed,
            *flags(ESPEAK_TRAINING), "--data.spec_augment_config.time_warp_factor", 0, *common, log=log)
        run(CUSTOM / "decode.py", "--data-dir", data, "--vocab-size", args.vocab_size, "--exp-dir", exp, *decode, log=log)
        rows.append(("recipes/custom", fmt, seed, test_wer(exp, args.epochs, args.avg), secs))
        print(rows[-1], flush=True)
    for s in args.seeds[1:]:  # the spread of recipes/espeak, after the formats
        espeak(s)
    print(f"greedy_search test WER after {args.epochs} epochs (average of the last {args.avg}), --threads "
          f"{args.threads}\n")
    print("| recipe | source format | seed | test WER % | training wall s |\n|---|---|---|---|---|")
    for recipe, fmt, s, wer, secs in rows:
        print(f"| {recipe} | {fmt} | {s} | {wer:.2f} | {secs:.0f} |" if secs else
              f"| {recipe} | {fmt} | {s} | {wer:.2f} | (earlier run) |")


if __name__ == "__main__":
    main()
