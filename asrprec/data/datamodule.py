"""Dataloaders over lhotse CutSets: dynamic bucketing by duration, fbank features, SpecAugment.

Follows icefall ``egs/librispeech/ASR/zipformer/asr_datamodule.py`` in substance
(``DynamicBucketingSampler(max_duration)``, ``batch_size=None`` dataloaders, SpecAugment on the
training set only, unshuffled dev/test) with our own small dataset class and a typed config.

A batch is a dict (legend: B cuts, T feature frames, F = 80 mel bins):

* ``features``: (B, T, F) float32, zero-padded on the right past each row's length;
* ``feature_lens``: (B,) int64, valid frames per row;
* ``texts``: list[str] of length B (a cut's supervisions joined by spaces);
* ``cut_ids``: list[str] of length B.

Rows are sorted by duration, longest first (what packing-based losses and encoders expect).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from asrprec._optional import require
from asrprec.data.validate import filter_by_duration

log = logging.getLogger(__name__)


@dataclass
class SpecAugmentConfig:
    """lhotse ``SpecAugment`` settings; ``time_warp_factor=None`` turns time warping off (it is slow)."""

    time_warp_factor: int | None = None
    num_frame_masks: int = 2
    frames_mask_size: int = 100
    max_frames_mask_fraction: float = 0.15
    num_feature_masks: int = 2
    features_mask_size: int = 27
    p: float = 0.9


@dataclass
class DataConfig:
    """How batches are made. ``max_duration``: seconds of audio per batch; ``num_buckets=1`` means no
    bucketing (lhotse's ``SimpleCutSampler``); durations outside
    [``min_cut_s``, ``max_cut_s``] are dropped from the training set (with a log line)."""

    max_duration: float = 200.0
    num_buckets: int = 10
    shuffle: bool = True
    drop_last: bool = False
    on_the_fly_feats: bool = False
    spec_augment: bool = True
    spec_augment_config: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)
    num_workers: int = 0
    seed: int = 0
    min_cut_s: float = 0.5
    max_cut_s: float = 20.0
    num_mel_bins: int = 80

    def __post_init__(self) -> None:
        if isinstance(self.spec_augment_config, dict):
            self.spec_augment_config = _from_dict(SpecAugmentConfig, self.spec_augment_config)
        if self.max_duration <= 0:
            raise ValueError(f"max_duration must be > 0 seconds, got {self.max_duration}")
        if self.num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {self.num_buckets}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataConfig":
        """Build from a plain dict (e.g. YAML); unknown keys are an error."""
        return _from_dict(cls, d)


def _from_dict(cls: type, d: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys {sorted(unknown)}; valid keys: {sorted(names)}")
    return cls(**d)


class AsrDataset(torch.utils.data.Dataset):
    """Maps a CutSet (one sampler batch) to the batch dict described in the module doc."""

    def __init__(self, *, on_the_fly_feats: bool, spec_augment: Any | None = None, num_mel_bins: int = 80) -> None:
        super().__init__()
        self.spec_augment = spec_augment
        self.otf = None
        if on_the_fly_feats:
            from asrprec.data.features import OnTheFlyFbank

            self.otf = OnTheFlyFbank(num_mel_bins)

    def __getitem__(self, cuts: Any) -> dict[str, Any]:
        from lhotse.dataset.collation import collate_features

        cuts = cuts.sort_by_duration(ascending=False)
        if self.otf is not None:
            features, feature_lens = self.otf(cuts)
        else:
            missing = [c.id for c in cuts if not c.has_features]
            if missing:
                raise ValueError(
                    f"cut {missing[0]!r} has no precomputed features; fix: compute them with "
                    f"asrprec.data.compute_fbank(...) or use DataConfig(on_the_fly_feats=True)"
                )
            features, feature_lens = collate_features(cuts)
        features = features.float()
        feature_lens = feature_lens.long()
        # lhotse pads precomputed log-mels with log(1e-10); zero every padded frame so both paths agree
        pad = torch.arange(features.shape[1])[None, :] >= feature_lens[:, None]
        features = features.masked_fill(pad[:, :, None], 0.0)
        if self.spec_augment is not None:
            # row by row on the valid frames only: lhotse's batch call masks (and takes the mask value's
            # mean over) the padded matrix, padding included
            for i, n in enumerate(feature_lens.tolist()):
                features[i, :n] = self.spec_augment(features[i : i + 1, :n])[0]
        return {
            "features": features,
            "feature_lens": feature_lens,
            "texts": [" ".join(s.text.strip() for s in c.supervisions) for c in cuts],
            "cut_ids": [c.id for c in cuts],
        }


def _bucketing_sampler(cuts: Any, *, num_buckets: int, **kwargs: Any) -> Any:
    """DynamicBucketingSampler, or SimpleCutSampler for one bucket (lhotse's bucketing needs at least two)."""
    from lhotse.dataset import DynamicBucketingSampler, SimpleCutSampler

    num_buckets = min(num_buckets, len(cuts))
    if num_buckets <= 1:
        return SimpleCutSampler(cuts, **kwargs)
    with warnings.catch_warnings():
        # lhotse suggests lazy CutSets for memory; our corpora are small and eager on purpose
        warnings.filterwarnings("ignore", message=".*eagerly read CutSet.*")
        return DynamicBucketingSampler(cuts, num_buckets=num_buckets, **kwargs)


class AsrDataModule:
    """Makes train / valid / test dataloaders from CutSets according to a :class:`DataConfig`.

    The training sampler is kept (``self.train_sampler``) so that a checkpoint can store
    :meth:`sampler_state_dict` and resume mid-epoch by passing it back as ``sampler_state``.
    With ``num_workers > 0`` the sampler runs ahead of training by the prefetched batches, so a
    resumed run skips those few batches (lhotse's and icefall's behaviour too).

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
            features_mask_size=c.features_mask_size,
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

    def train_dataloader(self, cuts: Any, sampler_state: dict[str, Any] | None = None) -> torch.utils.data.DataLoader:
        """Shuffled, duration-filtered, bucketed batches with SpecAugment (if enabled).

        ``sampler_state``: a :meth:`sampler_state_dict` from a checkpoint, to resume mid-epoch.
        Call ``loader.sampler.set_epoch(epoch)`` at the start of each epoch for a new shuffle.
        """
        c = self.config
        cuts = filter_by_duration(cuts, c.min_cut_s, c.max_cut_s)
        sampler = _bucketing_sampler(
            cuts, max_duration=c.max_duration, shuffle=c.shuffle, num_buckets=c.num_buckets, drop_last=c.drop_last, seed=c.seed,
            rank=self.rank, world_size=self.world_size,
        )
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        self.train_sampler = sampler
        dataset = AsrDataset(
            on_the_fly_feats=c.on_the_fly_feats,
            spec_augment=self._spec_augment() if c.spec_augment else None,
            num_mel_bins=c.num_mel_bins,
        )
        return self._loader(dataset, sampler, seed=c.seed)

    def sampler_state_dict(self) -> dict[str, Any]:
        """The training sampler's position (epoch, batches served) for a checkpoint."""
        if self.train_sampler is None:
            raise RuntimeError("no training sampler yet; call train_dataloader(cuts) first")
        return self.train_sampler.state_dict()

    def _eval_loader(self, cuts: Any) -> torch.utils.data.DataLoader:
        c = self.config
        sampler = _bucketing_sampler(cuts, max_duration=c.max_duration, shuffle=False, num_buckets=c.num_buckets,
                                     rank=self.rank, world_size=self.world_size)
        dataset = AsrDataset(on_the_fly_feats=c.on_the_fly_feats, spec_augment=None, num_mel_bins=c.num_mel_bins)
        return self._loader(dataset, sampler, seed=None)

    def valid_dataloader(self, cuts: Any) -> torch.utils.data.DataLoader:
        """Unshuffled batches without augmentation; every cut is kept."""
        return self._eval_loader(cuts)

    def test_dataloader(self, cuts: Any) -> torch.utils.data.DataLoader:
        """Unshuffled batches without augmentation; every cut is kept."""
        return self._eval_loader(cuts)
