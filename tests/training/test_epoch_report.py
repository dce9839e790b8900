"""What the training log says about the data: the augmentation in use at the start, and per epoch the cuts left out
of training, per reason (counted here from the cuts themselves)."""

import importlib.util
import logging
from pathlib import Path

from lhotse.utils import fastcopy

from asrprec.data.datamodule import (
    AsrDataModule,
    DataConfig,
    NoiseMixConfig,
    SpecAugmentConfig,
    describe_augmentation,
)
from asrprec.data.durations import _DurationFilter
from asrprec.precision import get_policy
from asrprec.training import train
from asrprec.experiment import read_history

_spec = importlib.util.spec_from_file_location("asrprec_tests_ddp_worker",
                                               Path(__file__).resolve().parent / "_ddp_worker.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def test_augmentation_line_names_noise_mixing_spec_augment_and_speed_perturbation():
    cuts = W.memory_cuts(4)
    config = DataConfig(noise_mix=NoiseMixConfig("musan_cuts.jsonl.gz", p=0.5, snr_db=(10.0, 20.0)),
                        spec_augment_config=SpecAugmentConfig(time_warp_factor=80, num_frame_masks=10))
    perturbed = [fastcopy(c, id=f"{c.id}_sp{f}") for c in cuts for f in ("0.9", "1.1")]
    line = describe_augmentation(config, list(cuts) + perturbed)
    assert line == ("noise mixing p=0.5 at 10-20 dB SNR (musan_cuts.jsonl.gz); SpecAugment p=0.9: 10 frame masks of "
                    "<= 100 frames (<= 0.15 of the frames), 2 feature masks of <= 27 bins, time warp 80; speed "
                    "perturbation present (factors 0.9, 1.1 in the first cut ids)")
    assert describe_augmentation(DataConfig(spec_augment=False), cuts) == (
        "noise mixing off; SpecAugment off; speed perturbation absent (no _sp<factor> cut ids among the first 1000)")


def test_the_training_loader_logs_its_augmentation(caplog):
    with caplog.at_level(logging.INFO, logger="asrprec.data"):
        AsrDataModule(DataConfig(max_duration=4.0, spec_augment=False)).train_dataloader(W.memory_cuts(4))
    assert "training augmentation: noise mixing off; SpecAugment off; speed perturbation absent" in caplog.text


def test_a_lazy_duration_filter_counts_each_pass():
    cuts = list(W.memory_cuts(12))
    f = _DurationFilter(1.0, 20.0)
    short = sum(c.duration < 1.0 for c in cuts)
    assert 0 < short < len(cuts)
    for _ in range(2):  # two epochs
        f.start_pass()
        kept = [c for c in cuts if f(c)]
        assert len(kept) == len(cuts) - short and f.dropped_in_pass() == {"outside 1.00-20.00 s": short}


def test_each_epoch_gives_its_totals_of_cuts_left_out_per_reason(tmp_path, caplog):
    cuts = W.memory_cuts(22)
    # one unreadable cut (its stored bytes are cut short), and a minimum duration that drops the shortest cuts
    bad = next(c for c in cuts if c.duration >= 1.0)
    broken = fastcopy(bad, features=fastcopy(bad.features, storage_key=bad.features.storage_key[:100]))
    cuts = type(cuts).from_cuts([broken if c.id == bad.id else c for c in cuts])
    short = sum(c.duration < 1.0 for c in cuts)
    dm = AsrDataModule(DataConfig(max_duration=4.0, num_buckets=1, spec_augment=False, min_cut_s=1.0))
    with caplog.at_level(logging.INFO, logger="asrprec.training"):
        train(model=W.make_model(), policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(),
              train_dl=dm.train_dataloader(cuts), valid_dl=dm.valid_dataloader(cuts.subset(first=2)),
              cfg=W.train_cfg(tmp_path, num_epochs=2, max_skipped_fraction=0.5))  # a batch of the bad cut alone
    expected = {"outside 1.00-20.00 s": short, "unreadable features": 1}
    assert [e["dropped_cuts_by_reason"] for e in read_history(tmp_path) if e["event"] == "epoch"] == [expected] * 2
    for epoch in (1, 2):
        assert (f"epoch {epoch}: cuts left out of training: outside 1.00-20.00 s: {short}, unreadable features: 1"
                in caplog.text)
