#!/usr/bin/env python3
"""Train a transducer on a corpus prepared by prepare.py, with icefall's LibriSpeech defaults (Zipformer medium,
pruned RNN-T, ScaledAdam + Eden at base-lr 0.045, max-duration 1000, SpecAugment with time warping; schedules
counted in audio as recipes/librispeech/train.py explains).

    python recipes/custom/train.py --data-dir exp_data --vocab-size 500 --precision amp-bf16 --exp-dir exp/amp-bf16
    python recipes/custom/train.py --data-dir exp_data --vocab-size 500 --init-from other_exp/epoch-30.pt ...

--init-from starts from another model's weights (fine-tuning); --musan mixes the noise of prepare.py --musan-dir
into half the cuts. The defaults are configs/default.yaml; any field is --section.field VALUE
(docs/configuration.md); the loop lives in asrprec.training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asrprec.cli import run_main
from asrprec.config import option
from asrprec.data import NoiseMixConfig, load_cuts
from asrprec.data.corpora import PreparedData
from asrprec.training import TrainingConfig, train_experiment
from asrprec.training.config import training_command_line

HERE = Path(__file__).resolve().parent
PREPARE_HINT = "run python recipes/custom/prepare.py with the same --data-dir"
ICEFALL_STEP = 4 * 1000.0 / 600.0  # icefall's step counts at 4 GPUs x max-duration 1000 (recipes/librispeech)


@dataclass
class Custom:
    """This corpus's choices."""

    data_dir: str = option(str(HERE / "data"), help="prepare.py's folder")
    vocab_size: int = option(500, help="the tokenizer <data-dir>/lang_bpe_<N>/bpe.model")
    bpe_model: str | None = option(None, help="another tokenizer file (instead of --vocab-size)")
    musan: bool = option(False, help="mix MUSAN noise (prepare.py --musan-dir) into half the cuts at 10-20 dB")


@dataclass
class Config(TrainingConfig):
    recipe: Custom = field(default_factory=Custom)


#: icefall's asr_datamodule.py settings, as recipes/librispeech/train.py, but for the cut lengths: those of
#: asrprec.data.DataConfig (0.5-20 s), since a corpus of one's own may hold short commands
DEFAULTS = {
    "data": {"max_duration": 1000.0, "num_buckets": 30, "num_workers": 2, "drop_last": True,
             "spec_augment_config": {"time_warp_factor": 80, "num_frame_masks": 10, "frames_mask_size": 100,
                                     "num_feature_masks": 2, "features_mask_size": 27}},
    "model": {"encoder": "zipformer", "size": "medium", "loss": "pruned",
              "loss_warmup_batches": round(2000 * ICEFALL_STEP)},
    "train": {"exp_dir": str(HERE / "exp" / "default"), "num_epochs": 30, "optimizer": "scaled_adam", "base_lr": 0.045,
              "lr_batches": float(round(7500 * ICEFALL_STEP)), "lr_epochs": 3.5,
              "warmup_batches": round(500 * ICEFALL_STEP), "ref_duration": 600.0, "encoder_schedule_scale": 1.0,
              "log_interval": 50, "valid_interval": 3000, "save_every_n": 4000, "keep_last_k": 30,
              "average_period": 200},
}


def command_line():
    return training_command_line(Config, defaults=DEFAULTS, description=__doc__, extra_flags=(
        "recipe.data_dir", "recipe.vocab_size", "recipe.bpe_model", "recipe.musan"))


def data_decisions(cfg: Config, data: PreparedData) -> dict:
    """MUSAN from --musan and the data folder; the sampler's buffers (num_buckets x 2000 / x 5000) unless set."""
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
    data = PreparedData(Path(r.data_dir), prefix="custom")
    features = not cfg.data.on_the_fly_feats
    train_experiment(
        cfg, tokenizer_path=lambda: r.bpe_model or data.tokenizer_model(r.vocab_size),
        load_splits=lambda: {"train": load_cuts(data.cuts("train-all-shuf", features=features), hint=PREPARE_HINT),
                             "dev": load_cuts(data.cuts("dev", features=features), lazy=False, hint=PREPARE_HINT)},
        data_decisions=data_decisions(cfg, data),
        data_record={"data_dir": str(Path(r.data_dir)), "max_duration": cfg.data.max_duration, "musan": r.musan,
                     "on_the_fly_feats": cfg.data.on_the_fly_feats})


if __name__ == "__main__":
    run_main(main, "train.py")
