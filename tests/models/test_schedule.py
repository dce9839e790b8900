"""Training-progress schedules: warm-up fractions, scheduled floats and the one set_batch_count."""

import pytest
import torch

from asrprec.models import ScheduledFloat, build_transducer, set_batch_count, warmup_fraction
from asrprec.models.builders import set_batch_count as set_batch_count_from_builders


def test_warmup_fraction():
    assert warmup_fraction(0, 3000) == 0.0
    assert warmup_fraction(1500, 3000) == 0.5
    assert warmup_fraction(9000, 3000) == 1.0
    assert warmup_fraction(5, 0) == 1.0  # no warm-up
    assert warmup_fraction(0, 0) == 1.0
    with pytest.raises(ValueError, match="batch_count"):
        warmup_fraction(-1, 10)


def test_scheduled_float_interpolates_between_points():
    sf = ScheduledFloat((10.0, 3.0), (0.0, 1.0), default=7.0)  # points in any order
    assert float(sf) == 7.0  # batch count unset
    for n, want in ((-5, 1.0), (0, 1.0), (2.5, 1.5), (5, 2.0), (10, 3.0), (99, 3.0)):
        set_batch_count(sf, n)
        assert float(sf) == pytest.approx(want)
    sf.eval()
    assert float(sf) == 7.0  # eval mode: the default
    with pytest.raises(ValueError, match="at least one"):
        ScheduledFloat()


def test_set_batch_count_reaches_the_transducer_and_every_schedule():
    assert set_batch_count_from_builders is set_batch_count  # the training loop's import path
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=20)
    holders = [m for m in model.modules() if hasattr(m, "batch_count")]
    assert model in holders and any(isinstance(m, ScheduledFloat) for m in holders)
    set_batch_count(model, 1234)
    assert all(m.batch_count == 1234.0 and isinstance(m.batch_count, float) for m in holders)


def test_model_warmup_follows_warmup_fraction():
    """The Conformer receives warmup_fraction(batch_count, model_warmup_batches) in training and 1.0 in eval."""
    model = build_transducer(encoder="conformer", size="tiny", vocab_size=20, model_warmup_batches=400)
    seen = []
    model.encoder.forward = lambda f, fl, warmup=1.0: seen.append(warmup) or (torch.zeros(1, 2, 144), fl // 4)
    feats, lens = torch.zeros(1, 9, 80), torch.tensor([9])
    targets, target_lens = torch.ones(1, 1, dtype=torch.int64), torch.tensor([1])
    for n in (0, 100, 400, 1000):
        set_batch_count(model, n)
        model.train()(feats, lens, targets, target_lens)
    model.eval()(feats, lens, targets, target_lens)
    assert seen == [0.0, 0.25, 1.0, 1.0, 1.0]
