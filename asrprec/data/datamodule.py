"""Dataloaders over lhotse CutSets: dynamic bucketing by duration, fbank features, SpecAugment, noise mixing.

Follows icefall ``egs/librispeech/ASR/zipformer/asr_datamodule.py`` in substance
(``DynamicBucketingSampler(max_duration)``, ``batch_size=None`` dataloaders, SpecAugment on the
training set only, unshuffled dev/test) with our own small dataset class and a typed config.
Optional for any recipe through :class:`DataConfig`: MUSAN-style noise mixing of the training cuts (lhotse
``CutMix``, :class:`NoiseMixConfig`) and lazily read manifests (``lhotse.load_manifest_lazy``; filtered and
bucketed without being read whole).

A batch is a dict (legend: B cuts, T feature frames, F = 80 mel bins):

* ``features``: (B, T, F) float32, zero-padded on the right past each row's length;
* ``feature_lens``: (B,) int64, valid frames per row;
* ``texts``: list[str] of length B (a cut's supervisions joined by spaces);
* ``cut_ids``: list[str] of length B;
* ``dropped_cuts`` (only when a cut was left out): list of ``{"cut_id", "reason"}`` for cuts whose features or
  audio could not be read or hold NaN / Inf (checked on every batch: one ``isfinite`` pass), or (training and
  validation) whose transcript is empty; B may then be 0.

Rows are sorted by duration, longest first (what packing-based losses and encoders expect).
"""

from __future__ import annotations

import logging
import random
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from asrprec._optional import require
from asrprec.config import option, strict_from_dict
from asrprec.data.augment import (UtteranceJoiner, change_batch_tempo, change_batch_warp, count_words,
                                  frequency_mask_width, noise_mix_transform, utterance_tempo)
from asrprec.data.buckets import Batching
from asrprec.data.durations import _filter_durations, _is_lazy
from asrprec.data.frames import FRAME_SHIFT_S
from asrprec.precision.batch_plan import CALIBRATION_SAFETY
from asrprec.rng import seed_from, seeded_rng

log = logging.getLogger(__name__)


@dataclass
class SpecAugmentConfig:
    """lhotse ``SpecAugment`` settings; ``time_warp_factor=None`` turns time warping off (it is slow);
    ``features_mask_size=None``: icefall's 27 bins of 80 scaled to ``num_mel_bins``
    (:func:`asrprec.data.augment.frequency_mask_width`). CR-CTC's masks (the model's) take the same width."""

    time_warp_factor: int | None = None
    num_frame_masks: int = 2
    frames_mask_size: int = 100
    max_frames_mask_fraction: float = 0.15
    num_feature_masks: int = 2
    features_mask_size: int | None = None
    p: float = 0.9

    def __post_init__(self) -> None:
        if self.time_warp_factor == 0:  # a recipe's "0 = no time warping"
            self.time_warp_factor = None
        if self.features_mask_size is not None:
            frequency_mask_width(1, self.features_mask_size)  # checks it


@dataclass
class NoiseMixConfig:
    """lhotse ``CutMix`` of training cuts with noise cuts (MUSAN in icefall's recipes): each cut gets noise with
    probability ``p``, at a signal-to-noise ratio drawn uniformly from ``snr_db`` (``(low, high)`` in dB).

    ``cuts_path``: a CutSet manifest of noise cuts (e.g. :func:`asrprec.data.corpora.musan_noise_cuts` after
    :func:`asrprec.data.compute_fbank`). With precomputed features the noise cuts need features (lhotse mixes
    in the mel-energy domain); with on-the-fly features they need audio (lhotse mixes the waveforms).
    """

    cuts_path: str
    p: float = 0.5
    snr_db: tuple[float, float] = (10.0, 20.0)

    def __post_init__(self) -> None:
        self.cuts_path = str(self.cuts_path)
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"noise mixing probability p must be in [0, 1], got {self.p}")
        snr = tuple(float(v) for v in self.snr_db)
        if len(snr) != 2 or snr[0] > snr[1]:
            raise ValueError(f"snr_db must be a (low, high) pair in dB with low <= high, got {self.snr_db}")
        self.snr_db = snr


@dataclass
class DataConfig:
    """How batches are made. ``max_duration``: seconds of audio per batch; ``num_buckets=1`` means no
    bucketing (lhotse's ``SimpleCutSampler``); durations outside
    [``min_cut_s``, ``max_cut_s``] are dropped from the training set (with a log line)."""

    max_duration: float = option(200.0, help="seconds of audio per batch (per GPU under torchrun)")
    num_buckets: int = option(10, help="duration buckets of lhotse's DynamicBucketingSampler; 1 = none")
    shuffle: bool = True
    drop_last: bool = False
    on_the_fly_feats: bool = option(False, help="compute fbank from the audio instead of reading features")
    spec_augment: bool = option(True, help="apply SpecAugment to the training batches")
    spec_augment_config: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)
    tempo_range: tuple[float, float] | None = option(
        None, metavar="LOW,HIGH", help="training: each utterance sped up by a factor drawn from [LOW, HIGH] (fbank)")
    tempo_per_batch: bool = option(False, help="training: one tempo factor per batch, not per utterance (the "
                                               "bucketed batch gains no padding)")
    tempo_buckets: bool = option(True, help="training: draw each utterance's tempo before batching and bucket by "
                                            "its duration after it (less padding)")
    tempo_fast: tuple[float, float, float] | None = option(
        None, metavar="SHARE,LOW,HIGH", help="training: this share of the utterances brought to a rate drawn from "
        "[LOW, HIGH] words per minute (their words over their duration) instead of tempo_range's factor")
    warp_range: tuple[float, float] | None = option(
        None, metavar="LOW,HIGH", help="training: each utterance's formants moved by a factor drawn from [LOW, HIGH] "
                                       "(vocal-tract length perturbation of the mel axis)")
    concat_prob: float = option(0.0, help="training: share of utterances joined, 2 to concat_max_utterances at a time "
                                          "with pauses of faint noise between them, into one example (a model for "
                                          "long recordings, whose chunks hold several utterances)")
    concat_max_utterances: int = option(3, help="training: the most utterances in one joined example")
    concat_pause_s: tuple[float, float] = option((0.2, 1.0), metavar="LOW,HIGH",
                                                 help="training: seconds of pause between joined utterances")
    concat_pause_db: tuple[float, float] = option((-75.0, -40.0), metavar="LOW,HIGH",
                                                  help="training: level of the pauses' white noise, dBFS RMS")
    num_workers: int = option(0, help="dataloader worker processes")
    seed: int = 0
    min_cut_s: float = 0.5
    max_cut_s: float = 20.0
    num_mel_bins: int = 80
    # noise mixing of training cuts (lhotse CutMix); None = off
    noise_mix: NoiseMixConfig | None = None
    # DynamicBucketingSampler's look-ahead for estimating buckets and its shuffle buffer (cuts); None = lhotse's
    # defaults. They matter for lazily read manifests, where a sampler sees only this many cuts at a time.
    bucketing_buffer_size: int | None = None
    shuffle_buffer_size: int | None = None
    # batches sized by memory (asrprec.precision.batch_plan; asrprec.training.batch_plan applies them)
    max_memory: str = option("", metavar="SIZE",
                             help="size each bucket's batch to fit SIZE per GPU (40GB, 40GiB, 0.9 of the GPU)")
    plan_only: bool = option(False, help="with --max-memory: print the batch plan and exit")
    memory_safety: float = option(CALIBRATION_SAFETY, help="with max_memory: keep the projected step under SIZE x "
                                                           "this (projected / measured peak)")

    def __post_init__(self) -> None:
        if isinstance(self.spec_augment_config, dict):
            self.spec_augment_config = strict_from_dict(SpecAugmentConfig, self.spec_augment_config)
        if isinstance(self.noise_mix, dict):
            self.noise_mix = strict_from_dict(NoiseMixConfig, self.noise_mix)
        for name in ("bucketing_buffer_size", "shuffle_buffer_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or None for lhotse's default), got {getattr(self, name)}")
        if self.max_duration <= 0:
            raise ValueError(f"max_duration must be > 0 seconds, got {self.max_duration}")
        for name in ("tempo_range", "warp_range"):
            if getattr(self, name) is not None:
                value = tuple(getattr(self, name))
                if len(value) != 2 or not 0 < value[0] <= value[1]:
                    raise ValueError(f"{name} must be (low, high) with 0 < low <= high, got {value}")
                setattr(self, name, value)
        if self.tempo_fast is not None:
            self.tempo_fast = tuple(self.tempo_fast)
            share, low, high = self.tempo_fast if len(self.tempo_fast) == 3 else (-1, 0, 0)
            if not (0 <= share <= 1 and 0 < low <= high) or self.tempo_per_batch:
                raise ValueError(f"tempo_fast must be (share, low_wpm, high_wpm) with share in [0, 1] and 0 < low <= "
                                 f"high, without tempo_per_batch; got {self.tempo_fast}")
        if not 0 <= self.concat_prob <= 1:
            raise ValueError(f"concat_prob must be in [0, 1], got {self.concat_prob}")
        if self.concat_max_utterances < 2:
            raise ValueError(f"concat_max_utterances must be >= 2, got {self.concat_max_utterances}")
        for name in ("concat_pause_s", "concat_pause_db"):
            value = tuple(getattr(self, name))
            seconds = name == "concat_pause_s"
            if len(value) != 2 or value[0] > value[1] or (seconds and value[0] <= 0):
                raise ValueError(f"{name} must be (low, high) with low <= high{' and low > 0' if seconds else ''}, "
                                 f"got {value}")
            setattr(self, name, value)
        if self.num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {self.num_buckets}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if not 0 < self.memory_safety <= 1:
            raise ValueError(f"memory_safety must be in (0, 1] (projected / measured peak), got {self.memory_safety}")
        if self.plan_only and not self.max_memory:
            raise ValueError("--plan-only prints the plan of --max-memory; fix: add --max-memory SIZE")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataConfig":
        """Build from a plain dict (e.g. YAML); unknown keys are an error."""
        return strict_from_dict(cls, d)


class AsrDataset(torch.utils.data.Dataset):
    """Maps a CutSet (one sampler batch) to the batch dict described in the module doc.

    A cut whose features or audio cannot be read or hold NaN / Inf, or (with ``drop_empty_transcripts``, for
    training and validation losses; a test reference may be empty) whose transcript is empty, is left out of its
    batch and named in ``batch["dropped_cuts"]`` (a list of ``{"cut_id", "reason"}``; the key is present only when
    a cut was left out); a batch of which no cut remains has zero rows. The training and decoding loops log and
    count them.

    Augmentation (``cut_transforms`` such as noise mixing, then SpecAugment) is seeded per batch from ``seed``, the
    epoch (:meth:`set_epoch`) and the batch's cut ids, inside a block that restores the process's random generators
    afterwards: a batch is augmented the same way in whichever process or DataLoader worker prepares it, so a
    resumed run (or one with another ``num_workers``) sees exactly the batches of an uninterrupted one, and the
    training process's own random draws are untouched.
    """

    def __init__(self, *, on_the_fly_feats: bool, spec_augment: Any | None = None, num_mel_bins: int = 80,
                 seed: int = 0, drop_empty_transcripts: bool = True,
                 cut_transforms: Sequence[Callable[[Any], Any]] = (),
                 tempo_range: tuple[float, float] | None = None,
                 tempo_per_batch: bool = False,
                 tempo_fast: tuple[float, float, float] | None = None,
                 tempo_per_cut: bool = False,
                 warp_range: tuple[float, float] | None = None,
                 count_tokens: Callable[[str], int] | None = None,
                 joiner: UtteranceJoiner | None = None) -> None:
        super().__init__()
        self.drop_empty_transcripts = drop_empty_transcripts
        self.spec_augment = spec_augment
        self.joiner = joiner  # several utterances into one example, before the tempo
        self.tempo_range = tempo_range  # asrprec.data.augment.change_tempo, before SpecAugment
        self.tempo_per_batch = tempo_per_batch  # one factor for the whole batch
        self.tempo_fast = tempo_fast  # (share, low, high): that share brought to a rate in [low, high] wpm
        if tempo_per_cut and (tempo_per_batch or joiner is not None):
            raise ValueError("tempo_per_cut draws each cut's own factor: not with tempo_per_batch or a joiner")
        self.tempo_per_cut = tempo_per_cut  # each cut's factor from utterance_tempo (what the sampler bucketed by)
        self.warp_range = warp_range  # asrprec.data.augment.warp_frequency, after the tempo
        self.count_tokens = count_tokens or count_words  # a transcript's tokens, for the tempo's floor
        # CutSet -> CutSet transforms applied before features are read (lhotse CutMix: noise mixing)
        self.cut_transforms = list(cut_transforms)
        self.num_mel_bins = num_mel_bins
        self.seed = seed
        self.epoch = 0
        self.otf = None
        if on_the_fly_feats:
            from asrprec.data.features import OnTheFlyFbank

            self.otf = OnTheFlyFbank(num_mel_bins)

    def tempo_of(self, cut: Any, epoch: int) -> float:
        """``cut``'s tempo factor in ``epoch`` when each cut has its own (``tempo_per_cut``), from its duration and
        transcript: what :func:`asrprec.data.buckets.tempo_bucketing_sampler` buckets it by."""
        return utterance_tempo(self.seed, epoch, cut.id, max(1, round(cut.duration / FRAME_SHIFT_S)), cut_text(cut),
                               self.tempo_range, self.count_tokens, fast=self.tempo_fast)

    def set_epoch(self, epoch: int) -> None:
        """The epoch enters the augmentation seed (a DataLoader's workers get the value it has at ``iter()``)."""
        self.epoch = int(epoch)

    def _load(self, cuts: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from lhotse.dataset.collation import collate_features

        if not len(cuts):
            return torch.zeros(0, 0, self.num_mel_bins), torch.zeros(0, dtype=torch.int64)
        return self.otf(cuts) if self.otf is not None else collate_features(cuts)

    def _readable(self, cuts: Any) -> tuple[Any, list[dict[str, str]]]:
        """The cuts that load, and ``{"cut_id", "reason"}`` for each that does not (tried one by one)."""
        from lhotse import CutSet

        good, dropped = [], []
        for cut in cuts:
            try:
                if self.otf is not None:
                    cut.load_audio()
                elif cut.has_features:
                    cut.load_features()
                good.append(cut)
            except Exception as e:  # lhotse / lilcom / soundfile raise many types for unreadable files
                first = (str(e).strip().splitlines() or [""])[0][:200]
                dropped.append({"cut_id": cut.id, "reason": f"unreadable {'audio' if self.otf else 'features'} "
                                                          f"({type(e).__name__}: {first})"})
        return CutSet.from_cuts(good), dropped

    @staticmethod
    def _without_nonfinite(features: torch.Tensor, feature_lens: torch.Tensor, cuts: list, finite: torch.Tensor,
                           dropped: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """The rows whose features are all finite (``finite``: (B,) bool); each other row named in ``dropped``."""
        for i in (~finite).nonzero().flatten().tolist():
            n = int((~torch.isfinite(features[i])).sum())
            dropped.append({"cut_id": cuts[i].id, "reason": f"non-finite features ({n} NaN/Inf values)"})
        keep = finite.nonzero().flatten()
        feature_lens = feature_lens[keep]
        longest = int(feature_lens.max()) if len(keep) else 0
        return features[keep, :longest], feature_lens, [cuts[i] for i in keep.tolist()]

    def __getitem__(self, cuts: Any) -> dict[str, Any]:
        from lhotse import CutSet

        dropped = [{"cut_id": c.id, "reason": "empty transcript"} for c in cuts if self.drop_empty_transcripts
                   and (not c.supervisions or not any(s.text and s.text.strip() for s in c.supervisions))]
        if dropped:
            bad = {d["cut_id"] for d in dropped}
            cuts = CutSet.from_cuts(c for c in cuts if c.id not in bad)
        cuts = cuts.sort_by_duration(ascending=False)
        if self.cut_transforms and len(cuts):
            with seeded_rng(seed_from(self.seed, self.epoch, "cut-transforms", *sorted(c.id for c in cuts))):
                for transform in self.cut_transforms:
                    reseed = getattr(transform, "reseed", None)
                    if reseed is not None:
                        reseed(random.getrandbits(63))
                    cuts = transform(cuts)
        if self.otf is None:
            missing = [c.id for c in cuts if not c.has_features]
            if missing:  # a configuration error, not bad data
                raise ValueError(
                    f"cut {missing[0]!r} has no precomputed features; fix: compute them with "
                    f"asrprec.data.compute_fbank(...) or use DataConfig(on_the_fly_feats=True)"
                )
        try:
            features, feature_lens = self._load(cuts)
        except Exception:  # find the cut(s) that fail and train on the rest
            cuts, unreadable = self._readable(cuts)
            dropped += unreadable
            features, feature_lens = self._load(cuts)
        features = features.float()
        feature_lens = feature_lens.long()
        # lhotse pads precomputed log-mels with log(1e-10); zero every padded frame so both paths agree
        pad = torch.arange(features.shape[1])[None, :] >= feature_lens[:, None]
        features = features.masked_fill(pad[:, :, None], 0.0)
        cuts = list(cuts)
        finite = torch.isfinite(features).flatten(1).all(dim=1)  # one pass over the batch; padding is zero
        if not bool(finite.all()):
            features, feature_lens, cuts = self._without_nonfinite(features, feature_lens, cuts, finite, dropped)
        cut_ids = [c.id for c in cuts]
        texts = [cut_text(c) for c in cuts]
        if self.joiner is not None and cut_ids:
            with seeded_rng(seed_from(self.seed, self.epoch, "join", *sorted(cut_ids))):
                features, feature_lens, texts, cut_ids = self.joiner(features, feature_lens, texts, cut_ids)
        if (self.tempo_range is not None or self.tempo_fast is not None) and self.tempo_per_cut and cut_ids:
            features, feature_lens = change_batch_tempo(features, feature_lens, texts, None, factors=[
                self.tempo_of(c, self.epoch) for c in cuts])
        elif (self.tempo_range is not None or self.tempo_fast is not None) and cut_ids:
            with seeded_rng(seed_from(self.seed, self.epoch, "tempo", *sorted(cut_ids))):
                features, feature_lens = change_batch_tempo(features, feature_lens, texts, self.tempo_range,
                                                            self.count_tokens, per_batch=self.tempo_per_batch,
                                                            fast=self.tempo_fast)
        if self.warp_range is not None and cut_ids:
            with seeded_rng(seed_from(self.seed, self.epoch, "warp", *sorted(cut_ids))):
                features = change_batch_warp(features, feature_lens, self.warp_range)
        if self.spec_augment is not None and cut_ids:
            # row by row on the valid frames only: lhotse's batch call masks (and takes the mask value's
            # mean over) the padded matrix, padding included
            with seeded_rng(seed_from(self.seed, self.epoch, *sorted(cut_ids))):
                for i, n in enumerate(feature_lens.tolist()):
                    features[i, :n] = self.spec_augment(features[i : i + 1, :n])[0]
        batch = {"features": features, "feature_lens": feature_lens, "texts": texts, "cut_ids": cut_ids}
        if dropped:
            batch["dropped_cuts"] = dropped
        return batch


def _bucketing_sampler(cuts: Any, *, num_buckets: int, buffer_size: int | None = None,
                       shuffle_buffer_size: int | None = None, tempo_of: Callable[[Any, int], float] | None = None,
                       **kwargs: Any) -> Any:
    """DynamicBucketingSampler, or SimpleCutSampler for one bucket (lhotse's bucketing needs at least two);
    ``tempo_of(cut, epoch)``: each cut's tempo factor, to bucket by the duration after it
    (:func:`asrprec.data.buckets.tempo_bucketing_sampler`).

    An eager CutSet gets at most one bucket per two cuts (lhotse estimates the bins from them); a lazy one is not
    counted (that would read the whole manifest)."""
    from lhotse.dataset import DynamicBucketingSampler, SimpleCutSampler

    num_buckets = _buckets_used(cuts, num_buckets)
    if num_buckets <= 1:
        return SimpleCutSampler(cuts, **kwargs)
    buffers = {k: v for k, v in (("buffer_size", buffer_size), ("shuffle_buffer_size", shuffle_buffer_size))
               if v is not None}
    if tempo_of is not None:
        from asrprec.data.buckets import tempo_bucketing_sampler

        return tempo_bucketing_sampler(cuts, num_buckets=num_buckets, tempo_of=tempo_of, **buffers, **kwargs)
    with warnings.catch_warnings():
        # lhotse suggests lazy CutSets for memory; our corpora are small and eager on purpose
        warnings.filterwarnings("ignore", message=".*eagerly read CutSet.*")
        return DynamicBucketingSampler(cuts, num_buckets=num_buckets, **buffers, **kwargs)


def _tempo_per_cut(config: DataConfig) -> bool:
    """Whether each training utterance gets its own tempo factor before batching (``tempo_buckets``): with a
    tempo, drawn per utterance, and no utterances joined (the joiner's rows exist only inside a batch)."""
    return (config.tempo_buckets and (config.tempo_range is not None or config.tempo_fast is not None)
            and not config.tempo_per_batch and config.concat_prob == 0)


def cut_text(cut: Any) -> str:
    """A cut's transcript: its supervisions' texts, stripped and joined by spaces."""
    return " ".join((s.text or "").strip() for s in cut.supervisions).strip()


def _buckets_used(cuts: Any, num_buckets: int) -> int:
    """The buckets :func:`_bucketing_sampler` makes (1: none). lhotse estimates the bins from the cuts: an eager set
    gets at most one bucket per two cuts."""
    return max(1, num_buckets if _is_lazy(cuts) else min(num_buckets, len(cuts) // 2))


def _speed_perturbed_ids(cuts: Any, look: int = 1000) -> list[str]:
    """Speed factors found in the first ``look`` cut ids (lhotse's ``perturb_speed`` appends ``_sp<factor>``; a
    shuffled training manifest mixes them in from its start)."""
    import itertools
    import re

    found = set()
    for cut in itertools.islice(iter(cuts), look):
        m = re.search(r"_sp(\d+(?:\.\d+)?)$", cut.id)
        if m:
            found.add(m.group(1))
    return sorted(found, key=float)


def describe_augmentation(config: DataConfig, cuts: Any | None = None) -> str:
    """One line on the training data's augmentation: MUSAN (noise) mixing with its probability and SNR range,
    SpecAugment with its masks, and whether ``cuts`` hold speed-perturbed copies (from their first ids)."""
    parts = []
    n = config.noise_mix
    parts.append(f"noise mixing p={n.p:g} at {n.snr_db[0]:g}-{n.snr_db[1]:g} dB SNR ({n.cuts_path})" if n
                 else "noise mixing off")
    if config.spec_augment:
        s = config.spec_augment_config
        warp = f"time warp {s.time_warp_factor}" if s.time_warp_factor else "no time warp"
        parts.append(f"SpecAugment p={s.p:g}: {s.num_frame_masks} frame masks of <= {s.frames_mask_size} frames "
                     f"(<= {s.max_frames_mask_fraction:g} of the frames), {s.num_feature_masks} feature masks of <= "
                     f"{frequency_mask_width(config.num_mel_bins, s.features_mask_size)} bins, {warp}")
    else:
        parts.append("SpecAugment off")
    if config.tempo_range is not None:
        parts.append(f"tempo x{config.tempo_range[0]:g}-{config.tempo_range[1]:g} (fbank frames resampled, one "
                     f"factor per {'batch' if config.tempo_per_batch else 'utterance'})")
    if _tempo_per_cut(config):
        parts.append("batches bucketed by each utterance's duration after its tempo change")
    if config.tempo_fast is not None:
        share, low, high = config.tempo_fast
        parts.append(f"{share:g} of the utterances brought to {low:g}-{high:g} words per minute instead")
    if config.warp_range is not None:
        parts.append(f"vocal-tract warp x{config.warp_range[0]:g}-{config.warp_range[1]:g} (mel axis resampled)")
    if config.concat_prob > 0:
        parts.append(f"{config.concat_prob:g} of the utterances joined, 2-{config.concat_max_utterances} at a time, "
                     f"with {config.concat_pause_s[0]:g}-{config.concat_pause_s[1]:g} s pauses of noise at "
                     f"{config.concat_pause_db[0]:g} to {config.concat_pause_db[1]:g} dBFS")
    if cuts is not None:
        factors = _speed_perturbed_ids(cuts)
        parts.append(f"speed perturbation present (factors {', '.join(factors)} in the first cut ids)" if factors
                     else "speed perturbation absent (no _sp<factor> cut ids among the first 1000)")
    return "; ".join(parts)


class AsrDataModule:
    """Makes train / valid / test dataloaders from CutSets according to a :class:`DataConfig`.

    The training sampler is kept (``self.train_sampler``); :meth:`sampler_state_dict` / ``sampler_state`` round-trip
    lhotse's own state for use outside :func:`asrprec.training.train`. With ``num_workers > 0`` that state runs
    ahead of training by the prefetched batches, which is why the training loop does not use it: it records the
    batches it consumed and re-creates the position itself (:mod:`asrprec.training.resume`), exactly.

    Under distributed training each rank's samplers serve that rank's shard: ``rank`` and ``world_size``
    default to the initialised process group's (``asrprec.training.setup_distributed``; rank 0 of 1
    without one) and are handed to lhotse's samplers explicitly, which give every rank the same number of
    batches per epoch.
    """

    def __init__(self, config: DataConfig | None = None, *, rank: int | None = None,
                 world_size: int | None = None) -> None:
        require("lhotse")
        self.config = config or DataConfig()
        self.train_sampler: Any | None = None
        group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.world_size = world_size if world_size is not None else (
            torch.distributed.get_world_size() if group else 1)
        self.rank = rank if rank is not None else (torch.distributed.get_rank() if group else 0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {self.rank} of {self.world_size}")

    def _spec_augment(self) -> Any:
        from lhotse.dataset import SpecAugment

        c = self.config.spec_augment_config
        return SpecAugment(
            time_warp_factor=c.time_warp_factor or 0,
            num_frame_masks=c.num_frame_masks,
            frames_mask_size=c.frames_mask_size,
            max_frames_mask_fraction=c.max_frames_mask_fraction,
            num_feature_masks=c.num_feature_masks,
            features_mask_size=frequency_mask_width(self.config.num_mel_bins, c.features_mask_size),
            p=c.p,
        )

    def _loader(self, dataset: AsrDataset, sampler: Any, seed: int | None) -> torch.utils.data.DataLoader:
        from lhotse.dataset import make_worker_init_fn

        return torch.utils.data.DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,  # the sampler yields whole batches (CutSets)
            num_workers=self.config.num_workers,
            persistent_workers=False,
            worker_init_fn=make_worker_init_fn(seed=seed, rank=self.rank, world_size=self.world_size)
            if seed is not None else None,
        )

    def train_dataloader(self, cuts: Any, sampler_state: dict[str, Any] | None = None,
                         batch_plan: Any | None = None,
                         count_tokens: Callable[[str], int] | None = None) -> torch.utils.data.DataLoader:
        """Shuffled, duration-filtered, bucketed batches with SpecAugment (if enabled).

        ``count_tokens``: a transcript's number of tokens (the tokenizer's), which bounds ``tempo_range``'s speed-up
        (:func:`asrprec.data.augment.tempo_factor`); without it, words are counted.
        ``sampler_state``: a :meth:`sampler_state_dict` from a checkpoint, to resume mid-epoch.
        ``batch_plan``: a :class:`asrprec.precision.batch_plan.BatchPlan`: its buckets and batch sizes replace
        ``max_duration`` and ``num_buckets`` (:func:`asrprec.data.buckets.planned_sampler`).
        Call ``loader.sampler.set_epoch(epoch)`` at the start of each epoch for a new shuffle.
        """
        c = self.config
        log.info("training augmentation: %s", describe_augmentation(c, cuts))
        cuts, duration_drops = _filter_durations(cuts, c.min_cut_s, c.max_cut_s)
        common = dict(shuffle=c.shuffle, drop_last=c.drop_last, seed=c.seed, rank=self.rank,
                      world_size=self.world_size)
        dataset = AsrDataset(
            on_the_fly_feats=c.on_the_fly_feats,
            spec_augment=self._spec_augment() if c.spec_augment else None,
            num_mel_bins=c.num_mel_bins,
            cut_transforms=[noise_mix_transform(c.noise_mix, on_the_fly_feats=c.on_the_fly_feats)]
            if c.noise_mix else (),
            seed=c.seed,
            tempo_range=c.tempo_range,
            tempo_per_batch=c.tempo_per_batch,
            tempo_fast=c.tempo_fast,
            tempo_per_cut=_tempo_per_cut(c) and batch_plan is None,
            warp_range=c.warp_range,
            count_tokens=count_tokens,
            joiner=UtteranceJoiner(c.concat_prob, c.concat_max_utterances, c.concat_pause_s, c.concat_pause_db,
                                   c.num_mel_bins) if c.concat_prob > 0 else None,
        )
        if batch_plan is not None:
            from asrprec.data.buckets import planned_sampler

            buffers = {k: v for k, v in (("buffer_size", c.bucketing_buffer_size),
                                         ("shuffle_buffer_size", c.shuffle_buffer_size)) if v is not None}
            sampler = planned_sampler(cuts, batch_plan.edges, batch_plan.batch_sizes,
                                      mean_batch_seconds=batch_plan.mean_batch_seconds(), **buffers, **common)
            batching = Batching(None, len(batch_plan.edges), c.drop_last, self.world_size)
        else:
            tempo = dict(tempo_of=dataset.tempo_of) if dataset.tempo_per_cut else {}
            sampler = _bucketing_sampler(cuts, max_duration=c.max_duration, num_buckets=c.num_buckets,
                                         buffer_size=c.bucketing_buffer_size,
                                         shuffle_buffer_size=c.shuffle_buffer_size, **tempo, **common)
            batching = Batching(c.max_duration, _buckets_used(cuts, c.num_buckets), c.drop_last, self.world_size)
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        self.train_sampler = sampler
        loader = self._loader(dataset, sampler, seed=c.seed)
        # the training loop gives each epoch's total (asrprec.training.skips.dropped_cut_totals), and says why an
        # epoch made no batch (asrprec.training.skips.no_batch_reason)
        loader.duration_drops = duration_drops
        loader.batching = batching
        return loader

    def sampler_state_dict(self) -> dict[str, Any]:
        """The training sampler's position (epoch, batches served) for a checkpoint."""
        if self.train_sampler is None:
            raise RuntimeError("no training sampler yet; call train_dataloader(cuts) first")
        return self.train_sampler.state_dict()

    def _eval_loader(self, cuts: Any, drop_empty_transcripts: bool) -> torch.utils.data.DataLoader:
        c = self.config
        sampler = _bucketing_sampler(cuts, max_duration=c.max_duration, shuffle=False, num_buckets=c.num_buckets,
                                     buffer_size=c.bucketing_buffer_size, rank=self.rank, world_size=self.world_size)
        dataset = AsrDataset(on_the_fly_feats=c.on_the_fly_feats, spec_augment=None, num_mel_bins=c.num_mel_bins,
                             drop_empty_transcripts=drop_empty_transcripts)
        return self._loader(dataset, sampler, seed=None)

    def valid_dataloader(self, cuts: Any) -> torch.utils.data.DataLoader:
        """Unshuffled batches without augmentation; every readable cut with a transcript is kept."""
        return self._eval_loader(cuts, drop_empty_transcripts=True)

    def test_dataloader(self, cuts: Any) -> torch.utils.data.DataLoader:
        """Unshuffled batches without augmentation; every readable cut is kept (an empty reference too)."""
        return self._eval_loader(cuts, drop_empty_transcripts=False)
