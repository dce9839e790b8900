"""Checkpoints: round trip, exact resume, cross-policy rules, atomic writes, rotation, averaging."""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from asrprec.checkpoint import (
    CheckpointMismatchError,
    CheckpointPolicyWarning,
    EpochSelectionError,
    LoadOptions,
    TrainingObjects,
    average_checkpoints,
    epoch_checkpoint_path,
    find_epoch_checkpoints,
    keep_last_k,
    load_checkpoint,
    save_checkpoint,
)
from asrprec.precision import get_policy


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Sampler:
    """Stand-in for a lhotse sampler: only state_dict / load_state_dict matter."""

    def __init__(self):
        self.epoch, self.consumed = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, s):
        self.epoch, self.consumed = s["epoch"], s["consumed"]


def make_parts(policy_name: str, init_seed: int):
    """Model + optimizer + scheduler + scaler as the training loop builds them for ``policy_name``."""
    policy = get_policy(policy_name)
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 3), nn.BatchNorm1d(3))
    model = policy.prepare_model(model)
    opt = policy.build_optimizer(model.parameters(), lambda p: torch.optim.AdamW(p, lr=0.05))
    inner = getattr(opt, "inner", opt)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    scaler = policy.make_scaler(init_scale=8.0) if policy.grad_scaler else policy.make_scaler()
    return policy, model, opt, sched, scaler


def train_step(model, opt, sched, scaler, policy) -> float:
    """One step whose loss depends on torch, numpy and python RNGs (data, dropout, 'augmentation')."""
    model.train()
    x = torch.randn(5, 6) + torch.from_numpy(np.random.randn(5, 6).astype("float32")) * random.random()
    with policy.autocast():
        loss = model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    sched.step()
    return loss.item()


def seed_all(s):
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


@pytest.mark.parametrize("policy_name", ["fp32", "amp-fp16", "bf16"])
def test_resume_reproduces_next_step(tmp_path, policy_name):
    if policy_name == "amp-fp16":
        try:
            get_policy("amp-fp16")
        except Exception as e:  # an honest skip: some CPU torch builds have no fp16 autocast/GradScaler
            pytest.skip(str(e))
    # uninterrupted run
    seed_all(123)
    policy, model, opt, sched, scaler = make_parts(policy_name, init_seed=0)
    straight = [train_step(model, opt, sched, scaler, policy) for _ in range(3)]
    final = copy.deepcopy(model.state_dict())

    # interrupted run: 2 steps, save, fresh objects (different init), load, step 3
    seed_all(123)
    policy, model, opt, sched, scaler = make_parts(policy_name, init_seed=0)
    sampler = Sampler()
    first = [train_step(model, opt, sched, scaler, policy) for _ in range(2)]
    sampler.consumed = 10
    path = save_checkpoint(
        tmp_path / "checkpoint-2.pt", TrainingObjects(model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                                                      sampler=sampler),
        policy=policy, config={"lr": 0.05}, extra={"batch_idx_train": 2, "epoch": 1},
    )
    seed_all(999)  # disturb every RNG
    policy, model2, opt2, sched2, scaler2 = make_parts(policy_name, init_seed=1)
    sampler2 = Sampler()
    info = load_checkpoint(
        path, TrainingObjects(model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2, sampler=sampler2),
        policy=policy
    )
    assert info["extra"] == {"batch_idx_train": 2, "epoch": 1}
    assert info["config"] == {"lr": 0.05}
    assert info["policy"]["policy"] == policy_name
    assert sampler2.consumed == 10
    assert scaler2.get_scale() == scaler.get_scale()
    assert sched2.get_last_lr() == sched.get_last_lr()
    third = train_step(model2, opt2, sched2, scaler2, policy)
    assert first == straight[:2]
    assert third == straight[2]  # bit-exact: same ops, same state, same random numbers
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final[k]), k


def test_round_trip_restores_rng_streams(tmp_path):
    policy, model, opt, sched, scaler = make_parts("fp32", 0)
    _, avg, _, _, _ = make_parts("fp32", 4)
    save_checkpoint(tmp_path / "a.pt", TrainingObjects(model=model, model_avg=avg), policy=policy)
    after_save = (torch.rand(3), np.random.rand(3), random.random())
    seed_all(7)
    _, avg2, _, _, _ = make_parts("fp32", 5)
    load_checkpoint(tmp_path / "a.pt", TrainingObjects(model=model, model_avg=avg2))
    assert all(torch.equal(avg2.state_dict()[k], v) for k, v in avg.state_dict().items())
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(after_save[0], again[0])
    assert np.array_equal(after_save[1], again[1])
    assert after_save[2] == again[2]
    seed_all(7)
    x = torch.rand(3)
    load_checkpoint(tmp_path / "a.pt", TrainingObjects(model=model), options=LoadOptions(restore_rng=False))
    seed_all(7)
    assert torch.equal(torch.rand(3), x)


def test_weights_cross_policy_and_optimizer_mismatch(tmp_path):
    policy32, model32, opt32, _, _ = make_parts("fp32", 0)
    path = save_checkpoint(tmp_path / "fp32.pt", TrainingObjects(model=model32, optimizer=opt32), policy=policy32)
    policy16, model16, opt16, _, _ = make_parts("bf16", 5)
    with pytest.warns(CheckpointPolicyWarning, match="'fp32'"):
        load_checkpoint(path, TrainingObjects(model=model16), policy=policy16)
    for k, v in model32.state_dict().items():
        got = model16.state_dict()[k]
        assert got.dtype == (torch.bfloat16 if v.is_floating_point() else v.dtype)
        assert torch.equal(got, v.to(got.dtype)), k
    with pytest.raises(CheckpointMismatchError, match="Fix: resume under the saved policy"):
        with pytest.warns(CheckpointPolicyWarning):
            load_checkpoint(path, TrainingObjects(model=model16, optimizer=opt16), policy=policy16)
    # and the other way: bf16 master-weights state into a plain optimizer
    path16 = save_checkpoint(tmp_path / "bf16.pt", TrainingObjects(model=model16, optimizer=opt16), policy=policy16)
    with pytest.raises(CheckpointMismatchError, match="optimizer=None"):
        load_checkpoint(path16, TrainingObjects(model=model32, optimizer=opt32))
    with pytest.raises(CheckpointMismatchError, match="no 'scheduler'"):
        load_checkpoint(path16, TrainingObjects(scheduler=torch.optim.lr_scheduler.StepLR(opt32, 1)))


def test_atomic_write_keeps_old_checkpoint(tmp_path, monkeypatch):
    _, model, _, _, _ = make_parts("fp32", 0)
    path = save_checkpoint(tmp_path / "epoch-1.pt", TrainingObjects(model=model), extra={"epoch": 1})
    before = path.read_bytes()
    real_save = torch.save

    def failing_save(obj, f, *a, **kw):
        real_save({"partial": torch.zeros(1000)}, f)  # some bytes reach the temp file, then the failure
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, TrainingObjects(model=model), extra={"epoch": 2})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["epoch-1.pt"]  # no temporary file left
    assert load_checkpoint(path, TrainingObjects(), options=LoadOptions(restore_rng=False))["extra"] == {"epoch": 1}


def test_only_rank_zero_writes_and_wrappers_are_unwrapped(tmp_path, monkeypatch):
    _, model, _, _, _ = make_parts("fp32", 0)
    with monkeypatch.context() as m:
        m.setattr("asrprec.checkpoint.io.get_rank", lambda: 1)
        assert save_checkpoint(tmp_path / "r1.pt", TrainingObjects(model=model)) is None
    assert not (tmp_path / "r1.pt").exists()
    wrapped = nn.DataParallel(model)  # same .module convention as DistributedDataParallel
    path = save_checkpoint(tmp_path / "w.pt", TrainingObjects(model=wrapped))
    state = torch.load(path, weights_only=True)["model"]
    assert set(state) == set(model.state_dict())
    _, fresh, _, _, _ = make_parts("fp32", 3)
    load_checkpoint(path, TrainingObjects(model=nn.DataParallel(fresh)), options=LoadOptions(restore_rng=False))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_keep_last_k(tmp_path):
    for n in (8, 16, 100, 24, 4):
        (tmp_path / f"checkpoint-{n}.pt").write_bytes(b"x")
    (tmp_path / "epoch-1.pt").write_bytes(b"x")
    (tmp_path / "checkpoint-best.pt").write_bytes(b"x")  # no number: never rotated
    assert keep_last_k(tmp_path, "checkpoint-*.pt", 2, rank=1) == []
    removed = keep_last_k(tmp_path, "checkpoint-*.pt", 2)
    assert sorted(p.name for p in removed) == ["checkpoint-16.pt", "checkpoint-4.pt", "checkpoint-8.pt"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-100.pt", "checkpoint-24.pt", "checkpoint-best.pt", "epoch-1.pt"]
    assert keep_last_k(tmp_path, "checkpoint-*.pt", 0) == []


@pytest.mark.parametrize("policy_name", ["fp32", "bf16"])
def test_average_equals_arithmetic_mean(tmp_path, policy_name):
    states = []
    for e in (1, 2, 3):
        _, model, _, _, _ = make_parts(policy_name, e)
        model.train()
        model(torch.randn(4, 6).to(next(model.parameters()).dtype))  # moves BN stats, num_batches_tracked
        if e == 3:
            model(torch.randn(4, 6).to(next(model.parameters()).dtype))
        save_checkpoint(epoch_checkpoint_path(tmp_path, e), TrainingObjects(model=model))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    paths = find_epoch_checkpoints(tmp_path, epoch=3, avg=3)
    assert [p.name for p in paths] == ["epoch-1.pt", "epoch-2.pt", "epoch-3.pt"]
    avg = average_checkpoints(paths)
    for k, last in states[-1].items():
        if last.is_floating_point():
            want = sum(s[k].float().numpy().astype(np.float64) for s in states) / 3.0
            assert avg[k].dtype == last.dtype
            assert torch.equal(avg[k], torch.from_numpy(want).to(last.dtype)), k
        else:
            assert torch.equal(avg[k], last), k  # integer buffers come from the last checkpoint
    assert int(avg["4.num_batches_tracked"]) == 2


def test_find_epoch_checkpoints_errors(tmp_path):
    for e in (1, 2, 4):
        (tmp_path / f"epoch-{e}.pt").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"missing epoch-3\.pt.*present: epoch-1\.pt, epoch-2\.pt, epoch-4\.pt"):
        find_epoch_checkpoints(tmp_path, epoch=4, avg=3)
    with pytest.raises(EpochSelectionError, match=r"--avg 3 with --epoch 2 would average epochs 0\.\.2, but epochs "
                       r"count from 1 \(present in .*: epoch-1\.pt, epoch-2\.pt, epoch-4\.pt\)\. Fix: --avg 2 or less"):
        find_epoch_checkpoints(tmp_path, epoch=2, avg=3)
    with pytest.raises(EpochSelectionError, match="--avg 0: the number of epochs averaged is at least 1. Fix: --avg 1"):
        find_epoch_checkpoints(tmp_path, epoch=2, avg=0)
    with pytest.raises(EpochSelectionError, match=r"--epoch 0: epochs count from 1 .*Fix: pass --epoch N of one"):
        find_epoch_checkpoints(tmp_path, epoch=0, avg=1)
    assert [p.name for p in find_epoch_checkpoints(tmp_path, epoch=2, avg=2)] == ["epoch-1.pt", "epoch-2.pt"]


def test_average_rejects_different_models(tmp_path):
    _, a, _, _, _ = make_parts("fp32", 0)
    b = nn.Linear(2, 2)
    save_checkpoint(tmp_path / "a.pt", TrainingObjects(model=a))
    save_checkpoint(tmp_path / "b.pt", TrainingObjects(model=b))
    with pytest.raises(CheckpointMismatchError, match="same model"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])
    with pytest.raises(ValueError, match="at least one"):
        average_checkpoints([])
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.pt", TrainingObjects())


def test_load_model_weights_names_the_mismatch_and_the_fix():
    from asrprec.checkpoint import CheckpointMismatchError, load_model_weights

    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    same = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    load_model_weights(same, src.state_dict())
    for a, b in zip(src.parameters(), same.parameters()):
        assert torch.equal(a, b)
    wider = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    with pytest.raises(CheckpointMismatchError, match=r"shape\(s\) differ.*0.weight: checkpoint \(4, 3\) vs model "
                                                      r"\(5, 3\).*Fix: build the model with the training run"):
        load_model_weights(wider, src.state_dict(), source="average of epoch-1.pt")
    deeper = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint, e.g. \['2.bias', '2.weight'\]"):
        load_model_weights(deeper, src.state_dict())
    with pytest.raises(CheckpointMismatchError, match="unexpected"):
        load_model_weights(torch.nn.Sequential(torch.nn.Linear(3, 4)), src.state_dict())


def _at(path, batch, epoch, end):
    """A checkpoint file recording only a training position."""
    save_checkpoint(path, TrainingObjects(model=nn.Linear(1, 1)),
                    extra={"batch_idx_train": batch, "epoch": epoch, "progress": {"epoch": epoch, "epoch_done": end}})


def test_latest_and_newer_checkpoints_follow_the_training_position(tmp_path):
    from asrprec.checkpoint import find_latest_checkpoint, newer_checkpoints, remove_stale_temporaries

    _at(tmp_path / "checkpoint-4.pt", 4, 1, False)  # the last batch of epoch 1 ...
    _at(tmp_path / "epoch-1.pt", 4, 1, True)  # ... then the end of epoch 1 at the same batch
    _at(tmp_path / "checkpoint-2.pt", 2, 1, False)
    assert find_latest_checkpoint(tmp_path).name == "epoch-1.pt"
    _at(tmp_path / "checkpoint-6.pt", 6, 2, False)
    assert find_latest_checkpoint(tmp_path).name == "checkpoint-6.pt"
    names = lambda ps: [p.name for p in ps]
    assert names(newer_checkpoints(tmp_path, (2, 1, False))) == ["checkpoint-4.pt", "checkpoint-6.pt", "epoch-1.pt"]
    assert names(newer_checkpoints(tmp_path, (4, 1, False))) == ["checkpoint-6.pt", "epoch-1.pt"]
    assert names(newer_checkpoints(tmp_path, (4, 1, True))) == ["checkpoint-6.pt"]
    # an unreadable newest file is passed over; a leftover of a killed write is no checkpoint and is removed
    (tmp_path / "checkpoint-8.pt").write_bytes(b"PK\x03\x04 truncated")
    (tmp_path / ".tmp-x1y2z3-checkpoint-9.pt").write_bytes(b"half")
    assert find_latest_checkpoint(tmp_path).name == "checkpoint-6.pt"
    assert names(remove_stale_temporaries(tmp_path)) == [".tmp-x1y2z3-checkpoint-9.pt"]
    assert not (tmp_path / ".tmp-x1y2z3-checkpoint-9.pt").exists()


def test_unreadable_checkpoints_are_named_with_the_fix(tmp_path):
    from asrprec.checkpoint import CheckpointReadError, read_checkpoint

    _at(tmp_path / "epoch-1.pt", 1, 1, True)
    (tmp_path / "epoch-2.pt").write_bytes(b"")
    with pytest.raises(CheckpointReadError, match=r"epoch-2.pt is empty \(0 bytes\).*present: epoch-1.pt, epoch-2.pt"):
        read_checkpoint(tmp_path / "epoch-2.pt")
    data = (tmp_path / "epoch-1.pt").read_bytes()
    (tmp_path / "epoch-3.pt").write_bytes(data[:-100])
    with pytest.raises(CheckpointReadError, match="truncated or corrupt") as info:
        read_checkpoint(tmp_path / "epoch-3.pt")
    assert "weights_only" not in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"epoch-4.pt does not exist \(checkpoints in .*: epoch-1.pt"):
        read_checkpoint(tmp_path / "epoch-4.pt")
    torch.save({"model": {}, "extra": Sampler()}, tmp_path / "custom.pt")  # a Python object safe loading refuses
    with pytest.raises(CheckpointReadError, match="safe loading .*refuses.*source you trust"):
        read_checkpoint(tmp_path / "custom.pt")
