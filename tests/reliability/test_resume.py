"""Exact resume, checked against an uninterrupted run of the same configuration: the resumed run trains the
remaining batches (and only those), and its final checkpoint holds bitwise the same weights, running average,
optimizer and scaler state, and per-epoch training losses.

Set-up as the recipe's (lhotse bucketing sampler with SpecAugment, a tiny Zipformer, pruned loss, ScaledAdam),
with ``--max-batches-per-epoch 3`` so every resume also checks that the cap counts the batches trained before it.
"""

import re
import shutil

import pytest

from .harness import assert_same, run, weights

CAP = dict(num_epochs=2, max_batches_per_epoch=3)


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory):
    """An uninterrupted run with a checkpoint after every batch (checkpoint-1 ... checkpoint-6, epoch-1/2)."""
    exp = tmp_path_factory.mktemp("reference")
    run(data_root, exp, **CAP)
    return exp


def crashed_at(reference, tmp_path, name):
    """A folder as a run killed right after writing ``name`` left it: that checkpoint and those before it."""
    exp = tmp_path / "exp"
    exp.mkdir()
    keep = {p.name for p in reference.glob("checkpoint-*.pt") if int(p.stem.split("-")[1]) <= _batch(name)}
    # an end-of-epoch checkpoint is written after the mid-epoch one of the same batch
    keep |= {p.name for p in reference.glob("epoch-*.pt") if _batch(p.name) < _batch(name) or p.name == name}
    keep |= {"model.json", "config.json"}
    for n in keep:
        shutil.copy(reference / n, exp / n)
    return exp


def _batch(name):
    return {"epoch-1.pt": 3, "epoch-2.pt": 6}.get(name) or int(re.findall(r"\d+", name)[0])


def trained_batches(caplog):
    return [int(b) for b in re.findall(r"epoch \d+ batch (\d+): loss", caplog.text)]


@pytest.mark.parametrize("name, how", [
    ("checkpoint-2.pt", {"start_batch": 2}),  # mid-epoch
    ("checkpoint-3.pt", {"start_batch": 3}),  # the last batch of epoch 1 (the cap): epoch 1 is not re-trained
    ("epoch-1.pt", {"start_epoch": 2}),  # an end-of-epoch checkpoint
    ("checkpoint-5.pt", {"resume": "latest"}),  # the newest complete checkpoint
])
def test_resume_equals_uninterrupted(reference, data_root, tmp_path, caplog, name, how):
    exp = crashed_at(reference, tmp_path, name)
    caplog.set_level("INFO", logger="asrprec.training")
    state = run(data_root, exp, **CAP, **how, save_every_n=0)
    assert trained_batches(caplog) == list(range(_batch(name) + 1, 7))  # the remaining batches, each once
    assert state.batch_idx_train == 6 and [h["epoch"] for h in state.history] == [1, 2]
    assert_same(weights(reference / "epoch-2.pt"), weights(exp / "epoch-2.pt"))
    assert_same(weights(reference / "epoch-1.pt"), weights(exp / "epoch-1.pt"))


def test_resume_with_dataloader_workers(reference, data_root, tmp_path, caplog):
    """Two workers prefetch ahead of training; the resumed run still trains exactly the remaining batches, and the
    per-batch seeded augmentation makes the result independent of the number of workers."""
    exp = crashed_at(reference, tmp_path, "checkpoint-4.pt")
    caplog.set_level("INFO", logger="asrprec.training")
    run(data_root, exp, **CAP, num_workers=2, resume="latest", save_every_n=0)
    assert trained_batches(caplog) == [5, 6]
    assert_same(weights(reference / "epoch-2.pt"), weights(exp / "epoch-2.pt"))


@pytest.mark.parametrize("precision", ["amp-fp16", "amp-bf16", "bf16"])
def test_resume_under_each_policy(data_root, tmp_path, precision):
    """amp-fp16's grad-scaler state, bf16's fp32 master weights and the running average of the weights (every
    batch here) all continue exactly."""
    cfg = dict(num_epochs=1, max_batches_per_epoch=3, save_every_n=2, average_period=1)
    ref, exp = tmp_path / "ref", tmp_path / "exp"
    run(data_root, ref, precision=precision, **cfg)
    exp.mkdir()
    for n in ("checkpoint-2.pt", "model.json"):
        shutil.copy(ref / n, exp / n)
    run(data_root, exp, precision=precision, **{**cfg, "save_every_n": 0}, resume="latest")
    a, b = weights(ref / "epoch-1.pt"), weights(exp / "epoch-1.pt")
    assert_same(a, b)
    if precision == "amp-fp16":
        assert "grad_scaler" in a["scaler"]
    if precision == "bf16":
        assert "masters" in a["optimizer"]
    assert a["model_avg"]["count"] == 3
