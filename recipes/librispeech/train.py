#!/usr/bin/env python3
"""Train a transducer on LibriSpeech (run prepare.py first) with icefall's recipe defaults: Zipformer medium,
pruned RNN-T, ScaledAdam + Eden at base-lr 0.045, 30 epochs, max-duration 1000, 30 buckets, SpecAugment with
time warping, MUSAN mixed into half the cuts at 10-20 dB (k2-fsa/icefall egs/librispeech/ASR/zipformer/train.py
and asr_datamodule.py).

    python recipes/librispeech/train.py --subset 960h --precision amp-bf16 --exp-dir recipes/librispeech/exp/amp-bf16
    torchrun --nproc_per_node=8 recipes/librispeech/train.py --precision amp-bf16 ...      (README.md: 2 nodes)

The training manifest is read lazily (960 h x 3 speeds never sits in memory). The defaults are configs/default.yaml;
any field is --section.field VALUE (docs/configuration.md); the loop lives in asrprec.training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asrprec.cli import run_main
from asrprec.config import option
from asrprec.data import NoiseMixConfig, load_cuts
from asrprec.data.corpora import LIBRISPEECH_TRAIN_PARTS, PreparedData
from asrprec.training import TrainingConfig, train_experiment
from asrprec.training.config import training_command_line

HERE = Path(__file__).resolve().parent
PREPARE_HINT = "run python recipes/librispeech/prepare.py with the same --subset and --data-dir"
# Every schedule counts audio, not steps (asrprec.training.schedules.schedule_batches_per_step). icefall's LibriSpeech
# runs (4 GPUs x max-duration 1000, ref-duration 600) move the count by 6.67 per step; icefall applies it to the
# encoder's schedules and counts raw steps for Eden (lr-batches 7500, warm-up 500) and the loss warm-up (2000).
# The defaults below are those step counts x 6.67, so on 4 GPUs every schedule matches icefall's, and on 1 or 8
# GPUs each keeps the same pace per hour of audio.
ICEFALL_STEP = 4 * 1000.0 / 600.0


@dataclass
class Librispeech:
    """This corpus's choices."""

    data_dir: str = option(str(HERE / "data"), help="prepare.py's folder")
    subset: str = option("960h", choices=tuple(LIBRISPEECH_TRAIN_PARTS), help="the training subset")
    vocab_size: int = option(500, help="the tokenizer <data-dir>/lang_bpe_<N>/bpe.model")
    bpe_model: str | None = option(None, help="another tokenizer file (instead of --vocab-size)")
    musan: bool = option(True, help="mix MUSAN noise into half the cuts at 10-20 dB")


@dataclass
class Config(TrainingConfig):
    recipe: Librispeech = field(default_factory=Librispeech)


#: icefall's settings (asr_datamodule.py, train.py): --max-duration 1000 per GPU, 30 buckets (their buffers:
#: data_decisions), cuts of 1-20 s (remove_short_and_long_utt), SpecAugment with time warping 80, 10 frame masks
#: of <= 100 frames and 2 feature masks of <= 27 bins
DEFAULTS = {
    "data": {"max_duration": 1000.0, "num_buckets": 30, "num_workers": 2, "drop_last": True, "min_cut_s": 1.0,
             "max_cut_s": 20.0,
             "spec_augment_config": {"time_warp_factor": 80, "num_frame_masks": 10, "frames_mask_size": 100,
                                     "num_feature_masks": 2, "features_mask_size": 27}},
    "model": {"encoder": "zipformer", "size": "medium", "loss": "pruned",
              "loss_warmup_batches": round(2000 * ICEFALL_STEP)},  # icefall: warm_step 2000
    "train": {"exp_dir": str(HERE / "exp" / "default"), "num_epochs": 30, "optimizer": "scaled_adam", "base_lr": 0.045,
              "lr_batches": float(round(7500 * ICEFALL_STEP)), "lr_epochs": 3.5,
              "warmup_batches": round(500 * ICEFALL_STEP), "ref_duration": 600.0, "encoder_schedule_scale": 1.0,
              "log_interval": 50, "valid_interval": 3000, "save_every_n": 4000, "keep_last_k": 30,
              "average_period": 200},
}


def command_line():
    return training_command_line(Config, defaults=DEFAULTS, description=__doc__, extra_flags=(
        "recipe.data_dir", "recipe.subset", "recipe.vocab_size", "recipe.bpe_model", "recipe.musan"))


def data_decisions(cfg: Config, data: PreparedData) -> dict:
    """What follows from other settings: MUSAN (CutMix, p=0.5, 10-20 dB) from --musan and the data folder; the
    sampler's buffers (num_buckets x 2000 cuts to estimate buckets, x 5000 to shuffle) unless set."""
    d = cfg.data
    out: dict = {}
    if cfg.recipe.musan and d.noise_mix is None:
        out["noise_mix"] = NoiseMixConfig(str(data.musan_cuts), p=0.5, snr_db=(10.0, 20.0))
    if d.bucketing_buffer_size is None:
        out["bucketing_buffer_size"] = d.num_buckets * 2000
    if d.shuffle_buffer_size is None:
        out["shuffle_buffer_size"] = d.num_buckets * 5000
    return out


def main() -> None:
    cfg = command_line().parse()
    r = cfg.recipe
    data = PreparedData(Path(r.data_dir))
    features = not cfg.data.on_the_fly_feats

    def part(name: str, lazy: bool):  # a prepared part's cuts: with features, or with audio only
        return load_cuts(data.cuts(name, features=features), lazy=lazy, hint=PREPARE_HINT)

    train_experiment(
        cfg, tokenizer_path=lambda: r.bpe_model or data.tokenizer_model(r.vocab_size),
        # the training manifest stays lazy: the checks stream through it and keep only the ids of bad cuts
        load_splits=lambda: {"train": part(data.train_part(r.subset), lazy=True),
                             "dev": (part("dev-clean", lazy=False) + part("dev-other", lazy=False)).to_eager()},
        data_decisions=data_decisions(cfg, data),
        data_record={"data_dir": str(Path(r.data_dir)), "subset": r.subset, "max_duration": cfg.data.max_duration,
                     "musan": r.musan, "on_the_fly_feats": cfg.data.on_the_fly_feats})


if __name__ == "__main__":
    run_main(main, "train.py")
