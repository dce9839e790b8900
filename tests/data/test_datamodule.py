"""Batches from the datamodule: contents, ordering, max_duration, resume, SpecAugment, duration filter."""

import logging

import pytest
import torch

from asrprec.data.datamodule import AsrDataModule, DataConfig, SpecAugmentConfig

from .conftest import needs_espeak


def _all(loader):
    return list(loader)


@needs_espeak
def test_batch_contents_order_and_max_duration(tiny_fbank):
    _, cuts = tiny_fbank
    train = cuts["train"]
    by_id = {c.id: c for c in train}
    dm = AsrDataModule(DataConfig(max_duration=6.0, num_buckets=2, spec_augment=False, min_cut_s=0.0))
    batches = _all(dm.train_dataloader(train))
    seen = []
    for b in batches:
        assert set(b) == {"features", "feature_lens", "texts", "cut_ids"}
        x, lens = b["features"], b["feature_lens"]
        assert x.dtype == torch.float32 and x.ndim == 3 and x.shape[2] == 80
        assert lens.dtype == torch.int64 and lens.shape == (x.shape[0],) and int(lens.max()) == x.shape[1]
        assert len(b["texts"]) == len(b["cut_ids"]) == x.shape[0]
        durations = [by_id[i].duration for i in b["cut_ids"]]
        assert durations == sorted(durations, reverse=True)  # longest first
        # lhotse's dynamic bucketing may close a batch with the cut that crosses max_duration, never with more
        assert sum(durations[:-1]) <= 6.0 + 1e-6
        for row, cid in enumerate(b["cut_ids"]):
            cut = by_id[cid]
            assert b["texts"][row] == cut.supervisions[0].text
            assert int(lens[row]) == cut.num_frames
            assert torch.equal(x[row, : cut.num_frames], torch.from_numpy(cut.load_features()))
            assert torch.all(x[row, cut.num_frames :] == 0)
        seen += b["cut_ids"]
    assert sorted(seen) == sorted(train.ids)  # one epoch covers every cut once


@needs_espeak
def test_valid_loader_is_unshuffled_and_complete(tiny_fbank):
    _, cuts = tiny_fbank
    dm = AsrDataModule(DataConfig(max_duration=5.0, num_buckets=1))
    a = [b["cut_ids"] for b in dm.valid_dataloader(cuts["dev"])]
    b = [b["cut_ids"] for b in dm.test_dataloader(cuts["dev"])]
    assert a == b and sorted(sum(a, [])) == sorted(cuts["dev"].ids)


@needs_espeak
def test_sampler_state_round_trip(tiny_fbank):
    _, cuts = tiny_fbank
    cfg = DataConfig(max_duration=4.0, num_buckets=2, seed=3, min_cut_s=0.0, spec_augment=False)
    dm = AsrDataModule(cfg)
    loader = dm.train_dataloader(cuts["train"])
    loader.sampler.set_epoch(1)
    it = iter(loader)
    first = [next(it)["cut_ids"] for _ in range(2)]
    state = dm.sampler_state_dict()
    rest = [b["cut_ids"] for b in it]
    assert rest, "the test needs more than two batches"
    resumed = AsrDataModule(cfg).train_dataloader(cuts["train"], sampler_state=state)
    assert [b["cut_ids"] for b in resumed] == rest
    # the full epoch is the concatenation
    full = AsrDataModule(cfg).train_dataloader(cuts["train"])
    full.sampler.set_epoch(1)
    assert [b["cut_ids"] for b in full] == first + rest


@needs_espeak
def test_spec_augment_only_in_training(tiny_fbank):
    _, cuts = tiny_fbank
    train = cuts["train"]
    by_id = {c.id: torch.from_numpy(c.load_features()) for c in train}
    aug = SpecAugmentConfig(p=1.0, num_frame_masks=2, frames_mask_size=20, num_feature_masks=2, features_mask_size=10)
    dm = AsrDataModule(DataConfig(max_duration=100.0, num_buckets=1, spec_augment=True, spec_augment_config=aug, min_cut_s=0.0))
    torch.manual_seed(0)
    changed = 0
    for b in dm.train_dataloader(train):
        for row, cid in enumerate(b["cut_ids"]):
            n = int(b["feature_lens"][row])
            changed += not torch.equal(b["features"][row, :n], by_id[cid])
            assert torch.all(b["features"][row, n:] == 0)  # masks stay inside the valid frames
    assert changed == len(train)
    for b in dm.valid_dataloader(train):
        for row, cid in enumerate(b["cut_ids"]):
            assert torch.equal(b["features"][row, : int(b["feature_lens"][row])], by_id[cid])


@needs_espeak
def test_tempo_perturbation_shortens_training_utterances_only(tiny_fbank):
    _, cuts = tiny_fbank
    train = cuts["train"]
    frames = {c.id: c.num_frames for c in train}
    dm = AsrDataModule(DataConfig(max_duration=100.0, num_buckets=1, spec_augment=False, min_cut_s=0.0,
                                  tempo_range=(1.2, 1.5)))
    seen = {}
    for b in dm.train_dataloader(train):
        for row, cid in enumerate(b["cut_ids"]):
            n = int(b["feature_lens"][row])
            seen[cid] = n
            assert torch.all(b["features"][row, n:] == 0)
    assert seen.keys() == frames.keys()
    for cid, n in seen.items():  # round(T / factor) for a factor in [1.2, 1.5] (or 1: too few frames per word)
        assert round(frames[cid] / 1.5) <= n <= round(frames[cid] / 1.2) or n == frames[cid], cid
    assert sum(n < frames[c] for c, n in seen.items()) >= len(seen) - 2
    for b in dm.valid_dataloader(train):
        assert [int(n) for n in b["feature_lens"]] == [frames[c] for c in b["cut_ids"]]
    # a transcript of more tokens than its frames can hold at 1.2x is left at its own tempo
    dm = AsrDataModule(DataConfig(max_duration=100.0, num_buckets=1, spec_augment=False, min_cut_s=0.0,
                                  tempo_range=(1.2, 1.5)))
    for b in dm.train_dataloader(train, count_tokens=lambda text: 10_000):
        assert [int(n) for n in b["feature_lens"]] == [frames[c] for c in b["cut_ids"]]
    with pytest.raises(ValueError, match="tempo_range"):
        DataConfig(tempo_range=(1.5, 1.2))


@needs_espeak
def test_tempo_fast_brings_every_training_utterance_to_its_target_rate(tiny_fbank):
    from asrprec.data.datamodule import describe_augmentation

    _, cuts = tiny_fbank
    train = cuts["train"]
    config = DataConfig(max_duration=100.0, num_buckets=1, spec_augment=False, min_cut_s=0.0,
                        tempo_fast=(1.0, 400.0, 450.0))
    assert "1 of the utterances brought to 400-450 words per minute" in describe_augmentation(config)
    texts = {c.id: c.supervisions[0].text for c in train}
    seen = 0
    for b in AsrDataModule(config).train_dataloader(train, count_tokens=lambda text: 1):
        for cid, n in zip(b["cut_ids"], b["feature_lens"].tolist()):
            wpm = 60.0 * len(texts[cid].split()) / (n * 0.01)
            assert 400 * 0.98 < wpm < 450 * 1.02, (cid, wpm)  # within a frame of the target
            seen += 1
    assert seen == len(train)
    for b in AsrDataModule(config).valid_dataloader(train):  # held-out batches keep their tempo
        assert [int(n) for n in b["feature_lens"]] == [c.num_frames for c in (train[i] for i in b["cut_ids"])]


@needs_espeak
def test_tempo_per_batch_adds_no_padding(tiny_fbank):
    _, cuts = tiny_fbank
    train = cuts["train"]
    frames = {c.id: c.num_frames for c in train}

    def padding(per_batch):
        dm = AsrDataModule(DataConfig(max_duration=8.0, num_buckets=1, spec_augment=False, min_cut_s=0.0,
                                      tempo_range=(1.0, 1.6), tempo_per_batch=per_batch))
        total = valid = 0
        for b in dm.train_dataloader(train, count_tokens=lambda text: 1):
            n = b["feature_lens"].tolist()
            total, valid = total + len(n) * max(n), valid + sum(n)
            if per_batch:  # one factor: every row shortened by the same ratio, so the longest-first order stays
                ratios = [frames[c] / m for c, m in zip(b["cut_ids"], n)]
                assert max(ratios) - min(ratios) < 0.05 and n == sorted(n, reverse=True)
        return 1 - valid / total

    assert padding(True) < padding(False)


@needs_espeak
def test_vocal_tract_warp_changes_training_spectra_only(tiny_fbank):
    from asrprec.data.augment import warp_frequency

    _, cuts = tiny_fbank
    train = cuts["train"]
    plain = {c.id: torch.from_numpy(c.load_features()) for c in train}

    def batches(warp_range, epoch=0):
        dm = AsrDataModule(DataConfig(max_duration=100.0, num_buckets=1, spec_augment=False, min_cut_s=0.0,
                                      shuffle=False, warp_range=warp_range))
        dl = dm.train_dataloader(train)
        dl.dataset.set_epoch(epoch)
        return {cid: (b["features"][row], int(b["feature_lens"][row])) for b in dl
                for row, cid in enumerate(b["cut_ids"])}

    warped = batches((0.9, 1.1))
    assert warped.keys() == plain.keys()
    grid = torch.linspace(0.9, 1.1, 101).tolist()
    for i, (cid, (x, n)) in enumerate(sorted(warped.items())):
        assert n == plain[cid].shape[0] and torch.all(x[n:] == 0)  # frames and padding untouched
        assert not torch.allclose(x[:n], plain[cid]), cid
        if i < 6:  # some factor in [0.9, 1.1] gives these frames: on a grid (the warp is smooth in alpha)
            best = min(float((warp_frequency(plain[cid], a) - x[:n]).abs().mean()) for a in grid)
            assert best < 0.03 and best < 0.1 * float((x[:n] - plain[cid]).abs().mean()), cid
    again, other_epoch = batches((0.9, 1.1)), batches((0.9, 1.1), epoch=1)
    assert all(torch.equal(again[c][0], warped[c][0]) for c in warped)  # seeded by the batch and the epoch
    assert not all(torch.equal(other_epoch[c][0], warped[c][0]) for c in warped)
    assert all(torch.equal(x[:n], plain[c]) for c, (x, n) in batches((1.0, 1.0)).items())
    with pytest.raises(ValueError, match="warp_range"):
        DataConfig(warp_range=(1.1, 0.9))


@needs_espeak
def test_duration_filter_logs_drops(tiny_fbank, caplog):
    _, cuts = tiny_fbank
    durations = sorted(c.duration for c in cuts["train"])
    threshold = durations[2] + 1e-3  # drops the three shortest
    dm = AsrDataModule(DataConfig(max_duration=100.0, min_cut_s=threshold, spec_augment=False))
    with caplog.at_level(logging.WARNING):
        ids = sum((b["cut_ids"] for b in dm.train_dataloader(cuts["train"])), [])
    assert len(ids) == len(cuts["train"]) - 3
    assert "dropped 3 of 12 cuts" in caplog.text


@needs_espeak
def test_on_the_fly_features_and_missing_features_error(tiny_corpus):
    _, cuts = tiny_corpus  # no precomputed features
    dm = AsrDataModule(DataConfig(max_duration=100.0, on_the_fly_feats=True, spec_augment=False))
    batches = list(dm.valid_dataloader(cuts["dev"]))
    assert sum(b["features"].shape[0] for b in batches) == len(cuts["dev"])
    assert all(b["features"].dtype == torch.float32 and b["features"].shape[2] == 80 for b in batches)
    with pytest.raises(ValueError, match="no precomputed features"):
        next(iter(AsrDataModule(DataConfig(max_duration=100.0)).valid_dataloader(cuts["dev"])))


def test_config_validation():
    with pytest.raises(ValueError, match="unknown DataConfig keys"):
        DataConfig.from_dict({"max_duration": 10, "maxduration": 5})
    cfg = DataConfig.from_dict({"max_duration": 10, "spec_augment_config": {"num_frame_masks": 3}})
    assert cfg.spec_augment_config.num_frame_masks == 3
    with pytest.raises(ValueError, match="unknown SpecAugmentConfig keys"):
        DataConfig.from_dict({"spec_augment_config": {"frames": 3}})
    with pytest.raises(ValueError, match="max_duration"):
        DataConfig(max_duration=0)


def test_the_duration_filter_counts_what_it_keeps_eager_and_lazy(tmp_path):
    from lhotse import CutSet
    from lhotse.testing.dummies import dummy_cut

    from asrprec.data.durations import _filter_durations

    durations = [0.3, 1.0, 2.5, 25.0, 4.0]  # kept within 0.5-20 s: 1.0 + 2.5 + 4.0
    cuts = CutSet.from_cuts(dummy_cut(i, duration=d) for i, d in enumerate(durations))
    kept, counts = _filter_durations(cuts, 0.5, 20.0)
    assert len(kept) == 3 and counts.kept_in_pass() == (3, 7.5) and sum(counts.dropped_in_pass().values()) == 2
    cuts.to_file(tmp_path / "cuts.jsonl.gz")
    lazy, counts = _filter_durations(CutSet.from_jsonl_lazy(tmp_path / "cuts.jsonl.gz"), 0.5, 20.0)
    for _ in range(2):  # a lazy set is counted as a pass meets it, afresh each pass
        counts.start_pass()
        assert counts.kept_in_pass() == (0, 0.0)
        assert [c.duration for c in lazy] == [1.0, 2.5, 4.0]
        assert counts.kept_in_pass() == (3, 7.5) and sum(counts.dropped_in_pass().values()) == 2


@needs_espeak
def test_joined_training_examples_keep_every_utterance_and_the_seed(tiny_fbank):
    _, cuts = tiny_fbank
    train = cuts["train"]
    frames = {c.id: c.num_frames for c in train}
    texts = {c.id: c.supervisions[0].text for c in train}
    config = DataConfig(max_duration=100.0, num_buckets=1, spec_augment=False, min_cut_s=0.0, concat_prob=1.0,
                        concat_max_utterances=2, concat_pause_s=(0.3, 0.3), concat_pause_db=(-60.0, -60.0))
    batches = list(AsrDataModule(config).train_dataloader(train))
    ids = [i for b in batches for cid in b["cut_ids"] for i in cid.split("+")]
    assert sorted(ids) == sorted(frames)  # every utterance once
    pause = 30  # 0.3 s of 10 ms frames
    for b in batches:
        for cid, n, text in zip(b["cut_ids"], b["feature_lens"].tolist(), b["texts"]):
            parts = cid.split("+")
            assert n == sum(frames[p] for p in parts) + pause * (len(parts) - 1)
            assert text == " ".join(texts[p] for p in parts)
    assert sum("+" in cid for b in batches for cid in b["cut_ids"]) == len(frames) // 2
    again = list(AsrDataModule(config).train_dataloader(train))  # seeded per batch: a resume sees the same
    assert all(torch.equal(a["features"], b["features"]) for a, b in zip(batches, again))
    for b in AsrDataModule(config).valid_dataloader(train):  # validation keeps its utterances apart
        assert not any("+" in cid for cid in b["cut_ids"])
    with pytest.raises(ValueError, match="concat_prob"):
        DataConfig(concat_prob=1.5)
    with pytest.raises(ValueError, match="concat_pause_s"):
        DataConfig(concat_pause_s=(0.0, 0.5))


def test_frequency_mask_width_follows_the_feature_width_unless_given():
    """lhotse's SpecAugment gets 27 of every 80 bins by default (icefall's 27 at 80 bins, 13 at 40), or the
    width the config names; a width below one bin is refused."""
    assert AsrDataModule(DataConfig())._spec_augment().features_mask_size == 27
    assert AsrDataModule(DataConfig(num_mel_bins=40))._spec_augment().features_mask_size == 13
    given = DataConfig(num_mel_bins=40, spec_augment_config=SpecAugmentConfig(features_mask_size=10))
    assert AsrDataModule(given)._spec_augment().features_mask_size == 10
    with pytest.raises(ValueError, match="features_mask_size must be >= 1"):
        SpecAugmentConfig(features_mask_size=0)


@needs_espeak
def test_tempo_buckets_batch_each_utterance_by_the_factor_the_dataset_applies(tiny_fbank):
    from asrprec.data.augment import utterance_tempo
    from asrprec.data.datamodule import describe_augmentation

    _, cuts = tiny_fbank
    train = cuts["train"]
    config = DataConfig(max_duration=6.0, num_buckets=2, spec_augment=False, min_cut_s=0.0, seed=4,
                        tempo_range=(0.9, 1.8))
    assert "bucketed by each utterance's duration after its tempo change" in describe_augmentation(config)
    loader = AsrDataModule(config).train_dataloader(train)
    assert hasattr(loader.sampler.constraint, "scale")  # the tempo-aware sampler
    by_id = {c.id: c for c in train}
    for epoch in (1, 2):
        loader.sampler.set_epoch(epoch)
        loader.dataset.set_epoch(epoch)
        seen = 0
        for b in loader:
            for cid, n in zip(b["cut_ids"], b["feature_lens"].tolist()):
                c = by_id[cid]
                f = utterance_tempo(4, epoch, cid, round(c.duration * 100), c.supervisions[0].text.strip(),
                                    (0.9, 1.8))
                assert n == max(1, round(c.num_frames / f)), cid  # change_tempo's length for that factor
                seen += 1
        assert seen == len(train)
    # one factor per batch, joined utterances or the option off: the factors are drawn inside the batch
    for other in (dict(tempo_per_batch=True), dict(concat_prob=0.5), dict(tempo_buckets=False)):
        c = DataConfig(max_duration=6.0, num_buckets=2, spec_augment=False, min_cut_s=0.0, tempo_range=(0.9, 1.8),
                       **other)
        loader = AsrDataModule(c).train_dataloader(train)
        assert not loader.dataset.tempo_per_cut and not hasattr(loader.sampler.constraint, "scale")
        assert "bucketed by each" not in describe_augmentation(c)


@needs_espeak
def test_tempo_buckets_resume_mid_epoch_to_the_same_batches(tiny_fbank):
    from asrprec.training.resume import epoch_iterator

    _, cuts = tiny_fbank
    config = DataConfig(max_duration=4.0, num_buckets=2, spec_augment=False, min_cut_s=0.0, tempo_range=(0.9, 1.8))

    def batches(skip):
        loader = AsrDataModule(config).train_dataloader(cuts["train"])
        return [(b["cut_ids"], b["features"]) for b in epoch_iterator(loader, 3, skip)]

    full = batches(0)
    assert len(full) >= 4
    rest = batches(2)
    assert [ids for ids, _ in rest] == [ids for ids, _ in full[2:]]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(rest, full[2:]))
