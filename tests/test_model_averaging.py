"""The running average of the weights (icefall's model_avg) against explicit means of weight snapshots."""

import pytest
import torch
from torch import nn

from asrprec.checkpoint import (
    CheckpointMismatchError, RunningAverage, average_between, load_decoding_weights, save_checkpoint,
    TrainingObjects,
)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(dtype)
    return m


def _perturb(m, g):
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
        m[1].num_batches_tracked += 1


def _snap(m):
    return {k: v.detach().double().clone() if v.is_floating_point() else v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_running_average_and_span_means_equal_explicit_means(tmp_path, dtype):
    m, g = _model(dtype), torch.Generator().manual_seed(1)
    avg = RunningAverage(m, period=3)
    snaps, saved = [], {}
    for batch in range(1, 31):
        _perturb(m, g)
        if avg.maybe_update(m, batch):
            snaps.append(_snap(m))
        if batch % 10 == 0:  # an "epoch" ends every 10 batches
            saved[batch // 10] = save_checkpoint(tmp_path / f"epoch-{batch // 10}.pt", TrainingObjects(model=m, model_avg=avg))
    assert avg.count == len(snaps) == 10  # batches 3, 6, ..., 30
    want_all = {k: torch.stack([s[k] for s in snaps]).mean(0) for k in snaps[0] if snaps[0][k].is_floating_point()}
    for k, v in want_all.items():
        torch.testing.assert_close(avg.weights[k], v, rtol=1e-12, atol=1e-12)
    # epochs 2..3 = snapshots after batch 10 up to batch 30: batches 12, 15, ..., 30 (7 snapshots)
    got = average_between(saved[1], saved[3])
    after = snaps[3:]
    for k, v in got.items():
        if v.is_floating_point():
            want = torch.stack([s[k] for s in after]).mean(0)
            assert v.dtype == dtype
            torch.testing.assert_close(v.double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
        else:
            assert torch.equal(v, m.state_dict()[k])  # counters come from the last model
    # the recipe-facing loader: --epoch 3 --avg 2 --use-averaged-model is the same span
    fresh = _model(dtype)
    assert "epoch-1.pt to epoch-3.pt" in load_decoding_weights(fresh, tmp_path, 3, 2, use_averaged_model=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, got[k])
    whole = average_between(None, saved[3])
    torch.testing.assert_close(whole["0.weight"].double(), want_all["0.weight"], rtol=1e-2, atol=1e-6)


def test_averaging_errors_name_the_fix(tmp_path):
    m = _model()
    save_checkpoint(tmp_path / "epoch-1.pt", TrainingObjects(model=m))
    with pytest.raises(CheckpointMismatchError, match="without --use-averaged-model"):
        average_between(None, tmp_path / "epoch-1.pt")
    avg = RunningAverage(m, period=100)
    save_checkpoint(tmp_path / "epoch-2.pt", TrainingObjects(model=m, model_avg=avg))
    save_checkpoint(tmp_path / "epoch-3.pt", TrainingObjects(model=m, model_avg=avg))
    with pytest.raises(CheckpointMismatchError, match="smaller --average-period"):
        average_between(tmp_path / "epoch-2.pt", tmp_path / "epoch-3.pt")
    with pytest.raises(ValueError, match="--avg 3 with --epoch 2 would average epochs 0..2.*Fix: --avg 2 or less"):
        load_decoding_weights(m, tmp_path, 2, 3, use_averaged_model=True)
    with pytest.raises(ValueError, match=">= 1 batch"):
        RunningAverage(m, period=0)
