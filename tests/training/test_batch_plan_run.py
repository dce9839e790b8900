"""A run on planned batches: each epoch's padding in history.json against a recount of the sampler's batches from
the cuts, and the plan a resumed run reads back."""

import importlib.util
import logging
from pathlib import Path

import pytest

from asrprec.data.datamodule import AsrDataModule, DataConfig
from asrprec.experiment import read_history
from asrprec.precision import get_policy
from asrprec.precision.batch_plan import BatchPlan, CostFit, PlannedBucket, write_plan
from asrprec.training import train

_spec = importlib.util.spec_from_file_location("asrprec_tests_ddp_worker_p",
                                               Path(__file__).resolve().parent / "_ddp_worker.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def plan():
    return BatchPlan(buckets=[PlannedBucket(1.2, 5, 1), PlannedBucket(2.0, 3, 1)], budget_bytes=10**9, safety=0.7,
                     fit=CostFit(0, 0, 0, 0, 1, 0, 0))


def recount(cuts, epoch, tok):
    """Padded frames / frames and padded (T, U+1) cells / cells over the batches the sampler gives in ``epoch``."""
    from asrprec.data.buckets import planned_sampler

    p = plan()
    sampler = planned_sampler(cuts, p.edges, p.batch_sizes, mean_batch_seconds=p.mean_batch_seconds(),
                              shuffle=True, drop_last=False, seed=0, rank=0, world_size=1)
    sampler.set_epoch(epoch)
    f = pf = j = pj = 0
    for batch in sampler:
        t = [c.num_frames for c in batch]
        u = [len(tok.encode([c.supervisions[0].text])[0]) for c in batch]
        f += len(t) * max(t)
        pf += len(t) * max(t) - sum(t)
        j += len(t) * max(t) * (max(u) + 1)
        pj += len(t) * max(t) * (max(u) + 1) - sum(a * (b + 1) for a, b in zip(t, u))
    return pf / f, pj / j


def test_epoch_padding_matches_a_recount(tmp_path, caplog):
    cuts = W.memory_cuts(30)
    dm = AsrDataModule(DataConfig(spec_augment=False, min_cut_s=0.0, max_cut_s=2.0))
    with caplog.at_level(logging.INFO, logger="asrprec.training"):
        train(model=W.make_model(), policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(),
              train_dl=dm.train_dataloader(cuts, batch_plan=plan()), valid_dl=dm.valid_dataloader(cuts.subset(first=2)),
              cfg=W.train_cfg(tmp_path, num_epochs=2))
    epochs = [e for e in read_history(tmp_path) if e["event"] == "epoch"]
    for e in epochs:
        frames, joint = recount(cuts, e["epoch"], W.Tok())
        assert e["padding_frames"] == pytest.approx(frames) and e["padding_joint"] == pytest.approx(joint)
        assert 0 < frames < joint < 1
    assert "epoch 1 padding:" in caplog.text and "of the joint cells" in caplog.text


def test_a_resumed_run_reads_its_plan_back(tmp_path):
    from types import SimpleNamespace

    from asrprec.training.batch_plan import batches_for_run

    write_plan(plan(), tmp_path)
    cfg = SimpleNamespace(exp_dir=str(tmp_path), optimizer="adamw")
    data = DataConfig(max_memory="3GB")
    got = batches_for_run(None, model_options=None, policy=get_policy("fp32", "cpu"), train_cfg=cfg, data_cfg=data,
                          cuts=None, tokenizer=None, resuming=True)
    assert got.batch_sizes == [5, 3] and got.budget_bytes == 10**9
    assert batches_for_run(None, model_options=None, policy=None, train_cfg=cfg, data_cfg=DataConfig(), cuts=None,
                           tokenizer=None, resuming=True) is None


def test_a_new_run_with_the_flags_of_a_stored_plan_reuses_it(tmp_path):
    """A --plan-only run's plan serves the training run with the same flags and data: nothing is projected (the
    model is None here, so a projection would fail); another budget plans again."""
    from types import SimpleNamespace

    from asrprec.training.batch_plan import plan_for_run, run_buckets

    cuts = W.memory_cuts(30)
    data = DataConfig(max_memory="1GB", num_buckets=2, min_cut_s=0.0, max_cut_s=2.0)
    tok = W.Tok()
    pol = get_policy("fp32", "cpu")
    opts = SimpleNamespace(encoder="zipformer", size="tiny", loss="pruned", joint_mode="full")
    cfg = SimpleNamespace(exp_dir=str(tmp_path), optimizer="adamw")
    stored = plan()
    stored.buckets = [PlannedBucket(b.max_duration, 4, 1) for b in run_buckets(data, cuts, tok)]
    stored.budget_bytes, stored.safety = 10**9, data.memory_safety
    stored.describe = {"policy": "fp32", "bf16_update": pol.bf16_update, "bf16_moments": pol.bf16_moments,
                       "encoder": "zipformer", "size": "tiny", "loss": "pruned", "joint_mode": "full",
                       "optimizer": "adamw", "world_size": 1, "vocab_size": tok.vocab_size, "device": "cpu"}
    write_plan(stored, tmp_path)
    got = plan_for_run(None, model_options=opts, policy=pol, train_cfg=cfg, data_cfg=data, cuts=cuts, tokenizer=tok)
    assert got.to_dict() == stored.to_dict()
    with pytest.raises(AttributeError):  # another budget: a new plan, which projects the (absent) model
        plan_for_run(None, model_options=opts, policy=pol, train_cfg=cfg, data_cfg=DataConfig(
            max_memory="2GB", num_buckets=2, min_cut_s=0.0, max_cut_s=2.0), cuts=cuts, tokenizer=tok)
