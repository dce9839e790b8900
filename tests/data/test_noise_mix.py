"""MUSAN-style noise mixing (lhotse CutMix through DataConfig.noise_mix): it changes the training features, at
signal-to-noise ratios inside the requested range measured from the signals themselves (waveforms for on-the-fly
features, mel energies for precomputed ones); and lazily read manifests train like eager ones."""

import logging

import numpy as np
import pytest
import torch

from asrprec.data import AsrDataModule, DataConfig, NoiseMixConfig, compute_fbank, load_cuts, write_cuts
from asrprec.data import corpora
from asrprec.data.datamodule import noise_mix_transform

from .conftest import needs_espeak

pytestmark = needs_espeak
SNR = (10.0, 20.0)


@pytest.fixture(scope="module")
def noise_cuts_path(corpus_layouts, tmp_path_factory):
    """The MUSAN fixture's 10 s windows with fbank (and audio), as the recipe's stage 4 makes them."""
    root, _ = corpus_layouts
    out = tmp_path_factory.mktemp("musan")
    corpora.prepare_musan_manifests(root, out)
    path = out / "musan_cuts.jsonl.gz"
    compute_fbank(corpora.musan_noise_cuts(out), out / "feats", path, num_jobs=1)
    return path


def _snr_db(signal_power, noise_power):
    return 10.0 * np.log10(signal_power / noise_power)


def test_waveform_snr_is_in_the_requested_range(tiny_corpus, noise_cuts_path):
    """On-the-fly features mix waveforms: the noise (mixed minus clean audio) is 10-20 dB below the speech, and the
    SNRs are drawn across that range rather than fixed."""
    _, cuts = tiny_corpus
    clean = cuts["train"]
    mix = noise_mix_transform(NoiseMixConfig(str(noise_cuts_path), p=1.0, snr_db=SNR), on_the_fly_feats=True)
    mixed = mix(clean)
    snrs = []
    for c, m in zip(clean, mixed):
        assert m.id == c.id and m.duration == pytest.approx(c.duration)
        x, y = c.load_audio()[0].astype(np.float64), m.load_audio()[0].astype(np.float64)
        assert y.shape == x.shape
        snrs.append(_snr_db(np.mean(x**2), np.mean((y - x) ** 2)))
    # the last 50 ms of a cut get no noise (lhotse keeps noise 50 ms short of the end): up to ~0.2 dB above range
    assert min(snrs) >= SNR[0] - 0.01 and max(snrs) <= SNR[1] + 0.3, snrs
    assert max(snrs) - min(snrs) > 3.0, snrs


def test_feature_domain_snr_and_the_batches_change(tiny_fbank, noise_cuts_path):
    """Precomputed features mix mel energies: exp(mixed) - exp(clean) is the added noise energy, 10-20 dB below the
    speech's; batches from the training loader differ from the clean ones on every cut, and only in training."""
    _, cuts = tiny_fbank
    clean = cuts["train"]
    mix = noise_mix_transform(NoiseMixConfig(str(noise_cuts_path), p=1.0, snr_db=SNR), on_the_fly_feats=False)
    snrs = []
    for c, m in zip(clean, mix(clean)):
        a, b = np.exp(c.load_features().astype(np.float64)), np.exp(m.load_features().astype(np.float64))
        assert a.shape == b.shape and np.all(b >= a * (1 - 1e-5))  # noise only adds energy
        snrs.append(_snr_db(a.sum(), (b - a).sum()))
    assert min(snrs) >= SNR[0] - 0.05 and max(snrs) <= SNR[1] + 0.05, snrs
    assert max(snrs) - min(snrs) > 3.0, snrs

    config = dict(max_duration=1000.0, num_buckets=1, shuffle=False, spec_augment=False, min_cut_s=0.0)
    noisy_dm = AsrDataModule(DataConfig(**config, noise_mix=NoiseMixConfig(str(noise_cuts_path), p=1.0)))
    (noisy,) = list(noisy_dm.train_dataloader(clean))
    (plain,) = list(AsrDataModule(DataConfig(**config)).train_dataloader(clean))
    (valid,) = list(noisy_dm.valid_dataloader(clean))
    assert noisy["cut_ids"] == plain["cut_ids"] and torch.equal(noisy["feature_lens"], plain["feature_lens"])
    for i, n in enumerate(plain["feature_lens"].tolist()):
        assert not torch.allclose(noisy["features"][i, :n], plain["features"][i, :n], atol=0.1)
    assert torch.equal(valid["features"], plain["features"])


def test_noise_is_a_function_of_the_batch_not_of_the_process(tiny_fbank, noise_cuts_path):
    """Exact resume and any number of DataLoader workers need each batch's noise to depend only on the run's seed,
    the epoch and the batch's cuts: two datasets preparing the same batch after different histories agree bitwise;
    another epoch or another seed draws other noise."""
    from asrprec.data.datamodule import AsrDataset

    _, cuts = tiny_fbank
    clean = cuts["train"]
    first, second = clean.subset(first=2), clean.subset(last=2)

    def dataset(seed):
        return AsrDataset(on_the_fly_feats=False, seed=seed, cut_transforms=[
            noise_mix_transform(NoiseMixConfig(str(noise_cuts_path), p=1.0, snr_db=SNR), on_the_fly_feats=False)])

    a, b = dataset(seed=7), dataset(seed=7)
    b[second], b[first], b[second]  # another history of draws
    assert torch.equal(a[first]["features"], b[first]["features"])
    a.set_epoch(2)
    assert not torch.equal(a[first]["features"], b[first]["features"])
    assert not torch.equal(dataset(seed=8)[first]["features"], b[first]["features"])


def test_mixing_probability(tiny_fbank, noise_cuts_path):
    """p=0.5 mixes about half of the cuts (400 cuts: binomial, 4.5 sigma bounds); p=0 none."""
    import lhotse

    _, cuts = tiny_fbank
    many = lhotse.CutSet.from_cuts(c.with_id(f"{c.id}-{k}") for k in range(34) for c in cuts["train"]).subset(first=400)
    for p, lo, hi in ((0.5, 155, 245), (0.0, 0, 0)):
        mixed = noise_mix_transform(NoiseMixConfig(str(noise_cuts_path), p=p), on_the_fly_feats=False)(many)
        n = sum(isinstance(c, lhotse.cut.MixedCut) for c in mixed)
        assert lo <= n <= hi, (p, n)


def test_noise_config_errors(tiny_corpus, tmp_path):
    _, cuts = tiny_corpus
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        NoiseMixConfig("x", p=1.5)
    with pytest.raises(ValueError, match="low <= high"):
        NoiseMixConfig("x", snr_db=(20.0, 10.0))
    with pytest.raises(ValueError, match="unknown NoiseMixConfig keys"):
        DataConfig.from_dict({"noise_mix": {"cuts_path": "x", "snr": 5}})
    assert DataConfig.from_dict({"noise_mix": {"cuts_path": "x", "snr_db": [5, 15]}}).noise_mix.snr_db == (5.0, 15.0)
    audio_only = tmp_path / "audio_only.jsonl.gz"
    write_cuts(cuts["dev"], audio_only)
    with pytest.raises(ValueError, match="has no features"):
        noise_mix_transform(NoiseMixConfig(str(audio_only)), on_the_fly_feats=False)
    with pytest.raises(FileNotFoundError, match="noise cuts"):
        noise_mix_transform(NoiseMixConfig(str(tmp_path / "missing.jsonl.gz")), on_the_fly_feats=False)


def test_lazy_manifest_trains_like_the_eager_one(tiny_fbank, tmp_path, caplog):
    """A lazily read training manifest yields the same cuts as the eager one, filtered by duration without being
    counted up front, and each dropped cut is named once however often the set is read."""
    _, cuts = tiny_fbank
    write_cuts(cuts["train"], tmp_path / "train.jsonl.gz")
    lazy = load_cuts(tmp_path / "train.jsonl.gz")
    durations = sorted(c.duration for c in cuts["train"])
    cut_at = (durations[2] + durations[3]) / 2  # three cuts are shorter
    config = DataConfig(max_duration=20.0, num_buckets=2, min_cut_s=cut_at, spec_augment=False)
    expected = {c.id for c in cuts["train"] if c.duration >= cut_at}
    with caplog.at_level(logging.WARNING, logger="asrprec.data.datamodule"):
        loader = AsrDataModule(config).train_dataloader(lazy)
        seen = [i for _ in range(2) for batch in loader for i in batch["cut_ids"]]
    assert sorted(seen) == sorted(list(expected) * 2)
    dropped = [r.getMessage() for r in caplog.records if "dropped cut" in r.getMessage()]
    assert len(dropped) == 3, dropped
    eager_ids = [i for batch in AsrDataModule(config).train_dataloader(cuts["train"]) for i in batch["cut_ids"]]
    assert sorted(eager_ids) == sorted(expected)
