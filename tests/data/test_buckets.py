"""Duration buckets of a corpus, the planned per-bucket sampler, and padding accounting, each against a count made
here from the cuts or by hand."""

import importlib.util
import math
import random
from pathlib import Path

import pytest
from lhotse import CutSet, SupervisionSegment
from lhotse.testing.dummies import dummy_cut

from asrprec.data.buckets import PaddingTotals, batch_padding, corpus_buckets, planned_sampler
from asrprec.data.datamodule import AsrDataModule, DataConfig

_spec = importlib.util.spec_from_file_location(
    "asrprec_tests_ddp_worker_b", Path(__file__).resolve().parents[1] / "training" / "_ddp_worker.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def cuts_of(durations, words=None):
    out = []
    for i, d in enumerate(durations):
        c = dummy_cut(i, duration=d, recording_duration=d)
        c.supervisions = [SupervisionSegment(id=f"s{i}", recording_id=c.recording_id, start=0.0, duration=d,
                                             text=" ".join(["w"] * (words[i] if words else 1)))]
        out.append(c)
    return CutSet.from_cuts(out)


def test_padding_of_a_hand_made_batch():
    # frames 10, 7, 3 and tokens 2, 4, 1: the batch is 3 x 10 frames (30) and 3 x 10 x 5 joint cells (150);
    # valid frames 20, valid cells 10x3 + 7x5 + 3x2 = 71
    p = batch_padding([10, 7, 3], [2, 4, 1])
    assert (p.frames, p.padded_frames, p.joint, p.padded_joint) == (30, 10, 150, 79)
    assert p.frame_fraction == pytest.approx(1 / 3) and p.joint_fraction == pytest.approx(79 / 150)
    none = batch_padding([5, 5], [3, 3])
    assert none.padded_frames == 0 and none.padded_joint == 0
    tot = PaddingTotals()
    tot.add(p)
    tot.add(none)
    assert tot.frame_fraction == pytest.approx(10 / 40) and tot.joint_fraction == pytest.approx(79 / 190)
    assert batch_padding([], []).frames == 0


def test_epoch_padding_in_the_training_report():
    from asrprec.training.reporting import add_padding

    class Chars:  # one token per character
        def encode(self, texts):
            return [[1] * len(t) for t in texts]

    totals = {}
    import torch

    add_padding(totals, {"feature_lens": torch.tensor([10, 7, 3]), "texts": ["ab", "abcd", "a"]}, Chars())
    add_padding(totals, {"feature_lens": torch.tensor([5, 5]), "texts": ["abc", "abc"]}, Chars())
    assert totals == {"frames": 40, "padded_frames": 10, "joint": 190, "padded_joint": 79}


def test_corpus_buckets_against_a_count_of_the_cuts():
    rng = random.Random(0)
    durations = [round(rng.uniform(1, 20), 2) for _ in range(400)]
    words = [rng.randint(1, 30) for _ in durations]
    stats = corpus_buckets(cuts_of(durations, words), 6, count_tokens=lambda t: len(t.split()))
    assert 2 <= len(stats) <= 6
    assert sum(s.cuts for s in stats) == 400
    lower = 0.0
    for s in stats:
        inside = [i for i, d in enumerate(durations) if lower < d <= s.max_duration]
        assert len(inside) == s.cuts and s.min_duration == lower
        assert s.max_duration == max(durations[i] for i in inside)
        assert s.seconds == pytest.approx(sum(durations[i] for i in inside))
        assert s.max_tokens == max(words[i] for i in inside)
        lower = s.max_duration
    # lhotse's buckets hold about equal audio each
    assert max(s.seconds for s in stats) < 2.2 * min(s.seconds for s in stats)
    assumed = corpus_buckets(cuts_of(durations), 6, tokens_per_second=3.0)
    assert assumed[-1].max_tokens == round(3.0 * max(durations))


def test_planned_sampler_serves_each_bucket_its_batch_size():
    rng = random.Random(1)
    durations = [round(rng.uniform(1, 20), 2) for _ in range(300)]
    edges, sizes = [5.0, 12.0, 20.0], [9, 4, 2]
    sampler = planned_sampler(cuts_of(durations), edges, sizes, shuffle=True, drop_last=True, seed=0,
                              mean_batch_seconds=33.0)
    seen = 0
    for batch in sampler:
        ds = [c.duration for c in batch]
        k = next(j for j, e in enumerate(edges) if max(ds) <= e)
        assert all((edges[k - 1] if k else 0.0) < d <= edges[k] for d in ds)  # one bucket per batch
        assert len(ds) == sizes[k]  # drop_last: every batch full
        seen += len(ds)
    assert seen > 250
    assert sampler.constraint.max_duration == 33.0
    from asrprec.training.oom import sampler_max_duration

    assert sampler_max_duration(sampler) == 33.0  # what the schedules count by


def assert_state_resumes_the_same_batches(make):
    """A sampler from ``make()`` stopped after four batches, its ``state_dict`` loaded into a new one: the new one
    serves the batches the first would have served next."""
    full = [[c.id for c in b] for b in make()]
    s = make()
    it = iter(s)
    first = [[c.id for c in next(it)] for _ in range(4)]
    state = s.state_dict()
    again = make()
    again.load_state_dict(state)
    rest = [[c.id for c in b] for b in again]
    assert first + rest == full


def test_planned_sampler_state_resumes_the_same_batches():
    durations = [1 + (i * 7919 % 1900) / 100 for i in range(200)]
    cuts = cuts_of(durations)

    def make():
        return planned_sampler(cuts, [8.0, 20.0], [5, 3], shuffle=True, drop_last=False, seed=3)

    assert_state_resumes_the_same_batches(make)


def test_datamodule_uses_the_plan():
    from asrprec.precision.batch_plan import BatchPlan, CostFit, PlannedBucket

    cuts = W.memory_cuts(40)
    plan = BatchPlan(buckets=[PlannedBucket(1.2, 6, 1), PlannedBucket(2.0, 3, 1)], budget_bytes=1, safety=0.7,
                     fit=CostFit(0, 0, 0, 0, 1, 0, 0))
    dm = AsrDataModule(DataConfig(spec_augment=False, min_cut_s=0.0, max_cut_s=2.0))
    loader = dm.train_dataloader(cuts, batch_plan=plan)
    n = 0
    for b in loader:
        longest = float(b["feature_lens"].max()) / 100
        assert len(b["cut_ids"]) <= (6 if longest <= 1.2 else 3)
        n += len(b["cut_ids"])
    assert n == 40
    assert math.isclose(loader.sampler.constraint.max_duration, plan.mean_batch_seconds())


def test_memory_flags_reach_the_recipes():
    from asrprec.config import ConfigError
    import importlib.util as iu
    import sys

    root = Path(__file__).resolve().parents[2]
    for recipe in ("espeak", "librispeech", "custom"):
        spec = iu.spec_from_file_location(f"r_{recipe}", root / "recipes" / recipe / "train.py")
        mod = iu.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        cfg = mod.command_line().parse(["--max-memory", "40GiB", "--data.plan_only", "true",
                                        "--data.memory_safety", "0.9"]).data
        assert (cfg.max_memory, cfg.plan_only, cfg.memory_safety) == ("40GiB", True, 0.9)
        with pytest.raises(ConfigError, match="--plan-only prints the plan of --max-memory"):
            mod.command_line().build(dotted=[("data.plan_only", "true")])


def _tempo_of(cut, epoch):
    from asrprec.data.augment import utterance_tempo

    return utterance_tempo(5, epoch, cut.id, round(cut.duration * 100), "w", (0.9, 1.8))


def _tempo_padding(batches, epoch):
    """Padded share of the frames after each cut's tempo change, and the batch count (lengths d / f, here)."""
    total = valid = 0.0
    for b in batches:
        lens = [c.duration / _tempo_of(c, epoch) for c in b]
        total, valid = total + len(lens) * max(lens), valid + sum(lens)
    return 1 - valid / total


def test_tempo_bucketing_sampler_buckets_by_the_duration_after_the_tempo():
    from lhotse.dataset import DynamicBucketingSampler

    from asrprec.data.buckets import tempo_bucketing_sampler

    rng = random.Random(2)
    cuts = cuts_of([round(rng.uniform(1, 4), 2) for _ in range(600)])
    common = dict(max_duration=15.0, num_buckets=10, shuffle=True, seed=3)
    plain = DynamicBucketingSampler(cuts, **common)
    sampler = tempo_bucketing_sampler(cuts, tempo_of=_tempo_of, **common)
    # each cut counts duration x m / factor, m the harmonic mean of the factors: for 0.9-1.8, 0.9 / ln 2
    m = 0.9 / math.log(2)
    for epoch in (1, 2):
        plain.set_epoch(epoch)
        sampler.set_epoch(epoch)
        ours, theirs = list(sampler), list(plain)
        assert sorted(c.id for b in ours for c in b) == sorted(c.id for c in cuts)  # every cut once
        for b in ours:  # lhotse's padding-aware limit (rows x longest) on the lengths after the tempo; lhotse
            # closes a batch once the next row would pass it, so the rows before the last one keep to it
            rows = [c.duration * m / _tempo_of(c, epoch) for c in b][:-1]
            assert len(rows) * max(rows, default=0) <= 15.0 * 1.02
        assert abs(len(ours) - len(theirs)) <= 0.05 * len(theirs)  # as many batches (updates) as without it
        pad, pad_plain = _tempo_padding(ours, epoch), _tempo_padding(theirs, epoch)
        assert pad < 0.1 and pad < pad_plain / 2, (pad, pad_plain)
    # each epoch its own factors: the buckets change with them
    sampler.set_epoch(1)
    one = [sorted(c.id for c in b) for b in sampler]
    sampler.set_epoch(2)
    assert sorted(map(tuple, one)) != sorted(tuple(sorted(c.id for c in b)) for b in sampler)


def test_tempo_bucketing_sampler_state_resumes_the_same_batches():
    from asrprec.data.buckets import tempo_bucketing_sampler

    cuts = cuts_of([1 + (i * 7919 % 300) / 100 for i in range(200)])

    def make():
        s = tempo_bucketing_sampler(cuts, tempo_of=_tempo_of, max_duration=10.0, num_buckets=4, shuffle=True,
                                    drop_last=False, seed=3)
        s.set_epoch(2)
        return s

    assert_state_resumes_the_same_batches(make)
