#!/usr/bin/env python3
"""Train a transducer on LibriSpeech (run prepare.py first) with icefall's recipe defaults: Zipformer medium,
pruned RNN-T, ScaledAdam + Eden at base-lr 0.045, 30 epochs, max-duration 1000, 30 buckets, SpecAugment with
time warping, MUSAN mixed into half the cuts at 10-20 dB (k2-fsa/icefall egs/librispeech/ASR/zipformer/train.py
and asr_datamodule.py).

    python recipes/librispeech/train.py --subset 960h --precision amp-bf16 --exp-dir recipes/librispeech/exp/amp-bf16
    torchrun --nproc_per_node=8 recipes/librispeech/train.py --precision amp-bf16 ...      (README.md: 2 nodes)

The training manifest is read lazily (960 h x 3 speeds never sits in memory); every precision policy, encoder,
loss and joint mode is a flag; the loop lives in asrprec.training.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asrprec.cli import add_precision_args, run_main
from asrprec.data import NoiseMixConfig, SpecAugmentConfig, load_cuts
from asrprec.data.corpora import LIBRISPEECH_TRAIN_PARTS, PreparedData
from asrprec.training import train_from_args
from asrprec.training.cli import add_data_args, add_data_check_args, add_model_args, add_training_args

HERE = Path(__file__).resolve().parent
PREPARE_HINT = "run python recipes/librispeech/prepare.py with the same --subset and --data-dir"
# Every schedule counts audio, not steps (asrprec.training.schedules.schedule_batches_per_step). icefall's LibriSpeech
# runs (4 GPUs x max-duration 1000, ref-duration 600) move the count by 6.67 per step; icefall applies it to the
# encoder's schedules and counts raw steps for Eden (lr-batches 7500, warm-up 500) and the loss warm-up (2000).
# The defaults below are those step counts x 6.67, so on 4 GPUs every schedule matches icefall's, and on 1 or 8
# GPUs each keeps the same pace per hour of audio.
ICEFALL_STEP = 4 * 1000.0 / 600.0


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--subset", choices=tuple(LIBRISPEECH_TRAIN_PARTS), default="960h")
    p.add_argument("--vocab-size", type=int, default=500,
                   help="the tokenizer prepare.py made with this --vocab-size: <data-dir>/lang_bpe_<N>/bpe.model")
    p.add_argument("--bpe-model", type=Path, default=None, help="another tokenizer file (instead of --vocab-size)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    # icefall's LibriSpeech training commands pass --max-duration 1000 per GPU (RESULTS.md, zipformer medium);
    # --on-the-fly-feats makes stage 3 of prepare.py unnecessary
    add_data_args(p, max_duration=1000.0, num_buckets=30, num_workers=2)
    p.add_argument("--spec-aug-time-warp-factor", type=int, default=80, help="0 = no time warping")
    p.add_argument("--no-musan", dest="musan", action="store_false", help="no MUSAN noise mixing")
    add_precision_args(p)
    add_model_args(p, encoder="zipformer", size="medium")
    p.set_defaults(loss="pruned", loss_warmup_batches=round(2000 * ICEFALL_STEP))  # icefall: warm_step 2000
    add_training_args(p, exp_dir=str(HERE / "exp" / "default"), num_epochs=30, optimizer="scaled_adam",
                      base_lr=0.045, lr_batches=round(7500 * ICEFALL_STEP), lr_epochs=3.5,
                      warmup_batches=round(500 * ICEFALL_STEP), ref_duration=600.0, encoder_schedule_scale=1.0,
                      log_interval=50, valid_interval=3000, save_every_n=4000, keep_last_k=30, average_period=200)
    add_data_check_args(p)
    return p


def data_decisions(args: argparse.Namespace, data: PreparedData) -> dict:
    """icefall's asr_datamodule.py settings: SpecAugment with 10 frame masks of <= 100 frames and 2 feature masks of
    <= 27 bins; CutMix(MUSAN, p=0.5, 10-20 dB); buckets estimated over num_buckets x 2000 cuts and shuffled
    over num_buckets x 5000; cuts of 1-20 s (train.py's remove_short_and_long_utt)."""
    return dict(
        drop_last=True, min_cut_s=1.0, max_cut_s=20.0,
        spec_augment_config=SpecAugmentConfig(time_warp_factor=args.spec_aug_time_warp_factor or None,
                                              num_frame_masks=10, frames_mask_size=100, num_feature_masks=2,
                                              features_mask_size=27),
        noise_mix=NoiseMixConfig(str(data.musan_cuts), p=0.5, snr_db=(10.0, 20.0)) if args.musan else None,
        bucketing_buffer_size=args.num_buckets * 2000, shuffle_buffer_size=args.num_buckets * 5000,
    )


def load_part(args: argparse.Namespace, data: PreparedData, part: str, *, lazy: bool):
    """A prepared part's cuts: with features, or with audio only under --on-the-fly-feats."""
    return load_cuts(data.cuts(part, features=not args.on_the_fly_feats), lazy=lazy, hint=PREPARE_HINT)


def main() -> None:
    args = get_parser().parse_args()
    data = PreparedData(args.data_dir)
    train_from_args(
        args, tokenizer_path=lambda: args.bpe_model or data.tokenizer_model(args.vocab_size),
        # the training manifest stays lazy: the checks stream through it and keep only the ids of bad cuts
        load_splits=lambda: {
            "train": load_part(args, data, data.train_part(args.subset), lazy=True),
            "dev": (load_part(args, data, "dev-clean", lazy=False) + load_part(args, data, "dev-other", lazy=False))
            .to_eager()},
        data_decisions=data_decisions(args, data),
        data_record={"data_dir": str(args.data_dir), "subset": args.subset, "max_duration": args.max_duration,
                     "musan": args.musan, "on_the_fly_feats": args.on_the_fly_feats})


if __name__ == "__main__":
    run_main(main, "train.py")
