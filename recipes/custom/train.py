#!/usr/bin/env python3
"""Train a transducer on a corpus prepared by prepare.py, with icefall's LibriSpeech defaults (Zipformer medium,
pruned RNN-T, ScaledAdam + Eden at base-lr 0.045, max-duration 1000, SpecAugment with time warping; schedules
counted in audio as recipes/librispeech/train.py explains).

    python recipes/custom/train.py --data-dir exp_data --vocab-size 500 --precision amp-bf16 --exp-dir exp/amp-bf16
    python recipes/custom/train.py --data-dir exp_data --vocab-size 500 --init-from other_exp/epoch-30.pt ...

--init-from starts from another model's weights (fine-tuning); --musan mixes the noise of prepare.py --musan-dir
into half the cuts. Every precision policy, encoder, loss and joint mode is a flag; the loop lives in
asrprec.training.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asrprec.data import NoiseMixConfig, SpecAugmentConfig, load_cuts
from asrprec.data.corpora import PreparedData
from asrprec.training import train_from_args
from asrprec.training.cli import (
    add_data_args, add_data_check_args, add_model_args, add_precision_args, add_training_args, run_main,
)

HERE = Path(__file__).resolve().parent
PREPARE_HINT = "run python recipes/custom/prepare.py with the same --data-dir"
ICEFALL_STEP = 4 * 1000.0 / 600.0  # icefall's step counts at 4 GPUs x max-duration 1000 (recipes/librispeech)


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--vocab-size", type=int, default=500,
                   help="the tokenizer prepare.py made with this --vocab-size: <data-dir>/lang_bpe_<N>/bpe.model")
    p.add_argument("--bpe-model", type=Path, default=None, help="another tokenizer file (instead of --vocab-size)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    add_data_args(p, max_duration=1000.0, num_buckets=30, num_workers=2)
    p.add_argument("--spec-aug-time-warp-factor", type=int, default=80, help="0 = no time warping")
    p.add_argument("--musan", action=argparse.BooleanOptionalAction, default=False,
                   help="mix MUSAN noise (prepare.py --musan-dir) into half the cuts at 10-20 dB")
    add_precision_args(p)
    add_model_args(p, encoder="zipformer", size="medium")
    p.set_defaults(loss="pruned", loss_warmup_batches=round(2000 * ICEFALL_STEP))
    add_training_args(p, exp_dir=str(HERE / "exp" / "default"), num_epochs=30, optimizer="scaled_adam",
                      base_lr=0.045, lr_batches=round(7500 * ICEFALL_STEP), lr_epochs=3.5,
                      warmup_batches=round(500 * ICEFALL_STEP), ref_duration=600.0, encoder_schedule_scale=1.0,
                      log_interval=50, valid_interval=3000, save_every_n=4000, keep_last_k=30, average_period=200)
    add_data_check_args(p)
    return p


def data_decisions(args: argparse.Namespace, data: PreparedData) -> dict:
    """icefall's asr_datamodule.py settings, as recipes/librispeech/train.py, but for the cut lengths: those of
    asrprec.data.DataConfig (0.5-20 s), since a corpus of one's own may hold short commands."""
    return dict(
        drop_last=True,
        spec_augment_config=SpecAugmentConfig(time_warp_factor=args.spec_aug_time_warp_factor or None,
                                              num_frame_masks=10, frames_mask_size=100, num_feature_masks=2,
                                              features_mask_size=27),
        noise_mix=NoiseMixConfig(str(data.musan_cuts), p=0.5, snr_db=(10.0, 20.0)) if args.musan else None,
        bucketing_buffer_size=args.num_buckets * 2000, shuffle_buffer_size=args.num_buckets * 5000,
    )


def main() -> None:
    args = get_parser().parse_args()
    data = PreparedData(args.data_dir, prefix="custom")
    features = not args.on_the_fly_feats
    train_from_args(
        args, tokenizer_path=lambda: args.bpe_model or data.tokenizer_model(args.vocab_size),
        load_splits=lambda: {"train": load_cuts(data.cuts("train-all-shuf", features=features), hint=PREPARE_HINT),
                             "dev": load_cuts(data.cuts("dev", features=features), lazy=False, hint=PREPARE_HINT)},
        data_decisions=data_decisions(args, data),
        data_record={"data_dir": str(args.data_dir), "max_duration": args.max_duration, "musan": args.musan,
                     "on_the_fly_feats": args.on_the_fly_feats})


if __name__ == "__main__":
    run_main(main, "train.py")
