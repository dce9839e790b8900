#!/usr/bin/env python3
"""Prepare a corpus of one's own for train.py / decode.py, in stages as recipes/librispeech/prepare.py:

    0  import every source (a Kaldi data dir, a NeMo manifest or a lhotse manifest) as 16 kHz mono cuts
    1  speed perturbation of the training cuts (0.9, 1.1); cuts with audio for on-the-fly features
    2  80-dim fbank of every split (skipped with --on-the-fly-feats)
    3  MUSAN noise cuts and their fbank (with --musan-dir)
    4  the tokenizer (sentencepiece, --vocab-size pieces) on the training transcripts

    python recipes/custom/prepare.py --train data/train --dev data/dev --test data/test --data-dir exp_data \
        --vocab-size 500
    python recipes/custom/prepare.py --train train.jsonl --dev dev.jsonl --test clean=test_clean.jsonl \
        --test noisy=test_noisy.jsonl --data-dir exp_data --vocab-size 500 --text-norm upper

Each test source is a split of its own, named after its folder or file or given as NAME=SRC; decode.py reports
each. What a source may be, and how bad lines and audio are left out, is asrprec.data.sources. A stage skips the
outputs whose record (<output>.done.json) says they were made from the same inputs and flags; otherwise it makes
them again. Outputs go to --data-dir (manifests/, fbank/, audio/ for mixed-down multi-channel recordings,
lang_bpe_<vocab-size>/, splits.json).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from asrprec.cli import add_dataclass_args, dataclass_from_args, run_main, setup_logging
from asrprec.data import compute_fbank, load_cuts
from asrprec.data.corpora import PreparedData, musan_noise_cuts, prepare_musan_manifests
from asrprec.data.preparation import (
    input_digests, make_audio_cuts, make_fbank, make_shuffled_cuts, run_stages, train_tokenizer,
)
from asrprec.data.sources import (
    ImportOptions, detect_format, import_split, source_files, source_path, test_split_names, write_splits,
)
from asrprec.data.stages import make_unless_done

HERE = Path(__file__).resolve().parent
TRAIN = "train-all-shuf"


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", nargs="+", required=True, metavar="SRC", help="training sources")
    p.add_argument("--dev", nargs="+", required=True, metavar="SRC", help="validation sources")
    p.add_argument("--test", action="append", required=True, metavar="[NAME=]SRC",
                   help="a test source (repeat for several); each is a split of its own")
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--stop-stage", type=int, default=4)
    add_dataclass_args(p, ImportOptions)
    p.add_argument("--on-the-fly-feats", action="store_true",
                   help="no fbank stage: train.py and decode.py compute fbank from the audio")
    p.add_argument("--speed-factors", type=float, nargs="*", default=[0.9, 1.1],
                   help="speed perturbation of the training cuts (none: no perturbation)")
    p.add_argument("--musan-dir", type=Path, default=None,
                   help="MUSAN on disk (music/, speech/, noise/) for train.py's noise mixing (none: train.py "
                        "--no-musan)")
    p.add_argument("--vocab-size", type=int, default=500)
    p.add_argument("--bpe-model-type", choices=("unigram", "bpe"), default="unigram")
    p.add_argument("--num-jobs", type=int, default=min(15, os.cpu_count() or 1),
                   help="processes for feature extraction")
    p.add_argument("--chunk-size", type=int, default=20000, help="cuts per feature-extraction chunk")
    p.add_argument("--seed", type=int, default=0, help="order of the shuffled training manifest")
    return p


def splits(args) -> dict[str, list[str]]:
    return {"train": args.train, "dev": args.dev, **{n: [t] for n, t in zip(test_split_names(args.test), args.test)}}


def imported(data: PreparedData, split: str) -> Path:
    return data.manifest_dir / f"{data.prefix}_imported_{split}.jsonl.gz"


def stage_import(args, data: PreparedData) -> None:
    options = dataclass_from_args(ImportOptions, args)
    for split, srcs in splits(args).items():
        kinds = [detect_format(s) if options.format == "auto" else options.format for s in srcs]
        made_from = {"sources": {source_path(s): input_digests(source_files(s, k), "check the path")
                                 for s, k in zip(srcs, kinds)}, "formats": kinds, "text_norm": options.text_norm}
        make_unless_done([imported(data, split)], made_from, lambda srcs=srcs, split=split: import_split(
            srcs, options, imported(data, split), data.root / "audio"))
    write_splits(data.root, splits(args))


def stage_speed_perturb(args, data: PreparedData) -> None:
    for split in splits(args):
        make_audio_cuts(data.cuts(split, features=False), [imported(data, split)],
                        lambda split=split: load_cuts(imported(data, split)),
                        args.speed_factors if split == "train" else [], "run stage 0 first")
    make_shuffled_cuts([data.cuts("train", features=False)], data.cuts(TRAIN, features=False), seed=args.seed,
                       hint="run stage 1 first")


def stage_fbank(args, data: PreparedData) -> None:
    if args.on_the_fly_feats:
        logging.info("--on-the-fly-feats: no fbank stage")
        return
    for split in splits(args):
        make_fbank(data.cuts(split, features=False), data.feature_storage(split), data.cuts(split),
                   chunk_size=args.chunk_size, num_jobs=args.num_jobs, max_bad_audio=args.max_bad_audio,
                   hint="run stage 1 first")
    make_shuffled_cuts([data.cuts("train")], data.cuts(TRAIN), seed=args.seed, hint="run stage 2 first")


def stage_musan(args, data: PreparedData) -> None:
    if args.musan_dir:
        prepare_musan_manifests(args.musan_dir, data.manifest_dir)
        compute_fbank(musan_noise_cuts(data.manifest_dir), data.fbank_dir / "musan_feats", data.musan_cuts,
                      num_jobs=args.num_jobs, max_unreadable=args.max_bad_audio)


def stage_tokenizer(args, data: PreparedData) -> None:
    texts = [c.supervisions[0].text for c in load_cuts(imported(data, "train"), hint="run stage 0 first")]
    train_tokenizer(texts, data.bpe_model(args.vocab_size), args.vocab_size, model_type=args.bpe_model_type,
                    stage="stage 4")


STAGES = (stage_import, stage_speed_perturb, stage_fbank, stage_musan, stage_tokenizer)


def main() -> None:
    args = get_parser().parse_args()
    setup_logging()
    run_stages(STAGES, args, PreparedData(args.data_dir, prefix="custom"), args.stage, args.stop_stage)


if __name__ == "__main__":
    run_main(main, "prepare.py")
