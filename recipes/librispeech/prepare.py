#!/usr/bin/env python3
"""Prepare LibriSpeech (100 h or 960 h) and MUSAN for train.py / decode.py, in stages as icefall's prepare.sh:

    0  download LibriSpeech and MUSAN from OpenSLR (parts already in --corpus-dir are not downloaded); a download
       resumes where an earlier one stopped, and an archive is unpacked only once its size and MD5 are verified
    1  manifests (lhotse's prepare_librispeech and prepare_musan)
    2  3x speed perturbation (0.9, 1.1) of the training parts; cuts with audio for on-the-fly features
    3  80-dim fbank of every part (lhotse Fbank, LilcomChunkyWriter), computed in chunks from lazy manifests
    4  MUSAN noise cuts (10 s windows) and their fbank
    5  the tokenizer (sentencepiece, --vocab-size pieces, 500 by default) on the training transcripts

    python recipes/librispeech/prepare.py --subset 960h --corpus-dir /data/corpora
    python recipes/librispeech/prepare.py --subset 100h --stage 1 --stop-stage 5 --num-jobs 16

A stage skips the outputs it finds only when they were made from the same inputs and flags and are complete (the
record <output>.done.json that stages 1-3 write last says so; MUSAN's manifests are compared with its audio, the
tokenizer with its transcripts); otherwise it makes them again, so a rerun continues after an interruption and
follows a changed corpus. With --on-the-fly-feats in train.py, stages 3 and 4's LibriSpeech fbank are not needed
(stage 4 still makes the MUSAN cuts). Outputs go to --data-dir (manifests/, fbank/, lang_bpe_<vocab-size>/); the
layout is asrprec.data.corpora.PreparedData. Errors a user can fix (a corpus that is missing or cannot be
downloaded, a damaged download, a malformed transcript line, MUSAN recordings too short for the noise windows, a
vocabulary too large) end the program with one line naming the fix.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from asrprec.data import compute_fbank
from asrprec.data.corpora import (
    LIBRISPEECH_TRAIN_PARTS, PreparedData, download_librispeech, download_musan, librispeech_cuts,
    librispeech_manifest_paths, librispeech_parts, librispeech_transcripts, musan_noise_cuts,
    prepare_librispeech_manifests, prepare_musan_manifests,
)
from asrprec.data.download import OPENSLR_URL
from asrprec.data.preparation import make_audio_cuts, make_fbank, make_shuffled_cuts, run_stages, train_tokenizer
from asrprec.cli import run_main, setup_logging

HERE = Path(__file__).resolve().parent
NUM_STAGES = 6


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subset", choices=tuple(LIBRISPEECH_TRAIN_PARTS), default="960h",
                   help="training data: train-clean-100, or all three training parts (icefall's --full-libri)")
    p.add_argument("--corpus-dir", type=Path, default=HERE / "download",
                   help="holds LibriSpeech/ and musan/ (downloaded here when missing)")
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--openslr-url", default=OPENSLR_URL,
                   help="stage 0: OpenSLR's resources, or a mirror of them (e.g. https://openslr.elda.org/resources, "
                        "https://us.openslr.org/resources); LibriSpeech is <url>/12/<part>.tar.gz, MUSAN "
                        "<url>/17/musan.tar.gz")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--stop-stage", type=int, default=NUM_STAGES - 1)
    # icefall uses min(15, cpu_count) processes for fbank (egs/librispeech/ASR/local/compute_fbank_librispeech.py)
    p.add_argument("--num-jobs", type=int, default=min(15, os.cpu_count() or 1),
                   help="processes for manifests and feature extraction")
    p.add_argument("--chunk-size", type=int, default=20000,
                   help="cuts per feature-extraction chunk (memory bound; an interrupted stage 3 resumes by chunk)")
    p.add_argument("--speed-factors", type=float, nargs="*", default=[0.9, 1.1],
                   help="speed perturbation of the training parts (none: no perturbation)")
    # icefall's vocabulary (data/lang_bpe_500) and model type (local/train_bpe_model.py: unigram)
    p.add_argument("--vocab-size", type=int, default=500)
    p.add_argument("--bpe-model-type", choices=("unigram", "bpe"), default="unigram")
    p.add_argument("--no-musan", dest="musan", action="store_false", help="skip MUSAN (train.py then needs --no-musan)")
    # icefall's noise cuts (local/compute_fbank_musan.py): 10 s windows, those of 5 s or less dropped
    p.add_argument("--musan-window-s", type=float, default=10.0, help="MUSAN recordings are cut into windows this long")
    p.add_argument("--musan-min-s", type=float, default=5.0,
                   help="MUSAN windows of this length or less (and recordings as short) are not used")
    p.add_argument("--seed", type=int, default=0, help="order of the shuffled training manifest")
    p.add_argument("--max-bad-lines", type=int, default=100,
                   help="stage 1: transcript lines that are not '<utterance-id> <text>' are named and their "
                        "utterances left out, up to this many in all; more stop the stage")
    p.add_argument("--max-bad-audio", type=int, default=100,
                   help="stages 1, 3 and 4: audio files that cannot be read are named and their cuts left out, up to "
                        "this many per part; more stop the stage")
    return p


def stage_download(args, data: PreparedData) -> None:
    download_librispeech(args.corpus_dir, librispeech_parts(args.subset), base_url=args.openslr_url)
    if args.musan:
        download_musan(args.corpus_dir, base_url=args.openslr_url)


def stage_manifests(args, data: PreparedData) -> None:
    prepare_librispeech_manifests(args.corpus_dir, librispeech_parts(args.subset), data.manifest_dir,
                                  num_jobs=args.num_jobs, max_bad_lines=args.max_bad_lines,
                                  max_bad_audio=args.max_bad_audio)
    if args.musan:
        prepare_musan_manifests(args.corpus_dir, data.manifest_dir)


def stage_speed_perturb(args, data: PreparedData) -> None:
    train_parts = LIBRISPEECH_TRAIN_PARTS[args.subset]
    for part in librispeech_parts(args.subset):
        make_audio_cuts(data.cuts(part, features=False), list(librispeech_manifest_paths(data.manifest_dir,
                                                                                         part).values()),
                        lambda part=part: librispeech_cuts(data.manifest_dir, part),
                        args.speed_factors if part in train_parts else [], "run stage 1 first")
    _shuffled_train_cuts(args, data, features=False)


def _shuffled_train_cuts(args, data: PreparedData, *, features: bool) -> None:
    parts = [data.cuts(p, features=features) for p in LIBRISPEECH_TRAIN_PARTS[args.subset]]
    make_shuffled_cuts(parts, data.cuts(data.train_part(args.subset), features=features), seed=args.seed,
                       hint=f"run stage {3 if features else 2} first")


def stage_fbank(args, data: PreparedData) -> None:
    for part in librispeech_parts(args.subset):
        make_fbank(data.cuts(part, features=False), data.feature_storage(part), data.cuts(part),
                   chunk_size=args.chunk_size, num_jobs=args.num_jobs, max_bad_audio=args.max_bad_audio,
                   hint="run stage 2 first")
    _shuffled_train_cuts(args, data, features=True)


def stage_musan(args, data: PreparedData) -> None:
    if args.musan:
        compute_fbank(musan_noise_cuts(data.manifest_dir, window_s=args.musan_window_s, min_s=args.musan_min_s),
                      data.fbank_dir / "musan_feats", data.musan_cuts, num_jobs=args.num_jobs,
                      max_unreadable=args.max_bad_audio)


def stage_tokenizer(args, data: PreparedData) -> None:
    texts = librispeech_transcripts(data.manifest_dir, LIBRISPEECH_TRAIN_PARTS[args.subset])
    train_tokenizer(texts, data.bpe_model(args.vocab_size), args.vocab_size, model_type=args.bpe_model_type,
                    stage="stage 5")


STAGES = (stage_download, stage_manifests, stage_speed_perturb, stage_fbank, stage_musan, stage_tokenizer)


def main() -> None:
    args = get_parser().parse_args()
    setup_logging()
    run_stages(STAGES, args, PreparedData(args.data_dir), args.stage, args.stop_stage)


if __name__ == "__main__":
    run_main(main, "prepare.py")
