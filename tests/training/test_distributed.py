"""Data-parallel training under torchrun with 2 CPU processes (gloo), checked against single-process routes.

The scenarios run once, in one torchrun job (tests/training/_ddp_worker.py); each test compares what the ranks
wrote with a reference computed here, in this process, without a process group: one process trained on the
union of both ranks' batches, a float64 gradient, the single-process schedule counts, an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asrprec.devices import rank_device
from asrprec.precision import get_policy
from asrprec.training import TrainConfig, compute_loss, train
from asrprec.training.distributed import setup_distributed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "_ddp_worker.py"
_spec = importlib.util.spec_from_file_location("asrprec_tests_ddp_worker", WORKER)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

COOPERATIVE = ("steps", "grads", "shards", "files", "resume", "resume_mid", "precisions", "zipformer", "nonfinite",
               "forward_oom", "collapse", "compiled")
# last: rank 1 fails inside a backward pass, which ends the job
LAST = "backward_oom"


def torchrun(out: Path, *scenarios: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           str(out), *scenarios]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One torchrun job: every scenario, then the failing one; (out dir, the finished process, seconds)."""
    out = tmp_path_factory.mktemp("ddp")
    p = torchrun(out, *COOPERATIVE, LAST)
    return out, p, time.time()


@pytest.fixture(scope="module")
def ranks(job):
    """{scenario: [rank 0 result, rank 1 result]} of the cooperative scenarios (all of them finished)."""
    out, p, _ = job
    missing = [f"{n}-rank{r}" for n in COOPERATIVE for r in (0, 1) if not (out / f"{n}-rank{r}.json").exists()]
    assert not missing, f"no result from {missing}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    results = {}
    for name in COOPERATIVE:
        results[name] = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
        for r, res in enumerate(results[name]):
            assert res["ok"], f"scenario {name} failed on rank {r}:\n{res.get('traceback')}"
    return out, results


def load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if tol:
            torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), k


def single_process(tmp_path, batches, valid, encoder=None, **kw):
    model = W.make_model(encoder)
    state = train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(), train_dl=batches, valid_dl=valid,
                  cfg=W.train_cfg(tmp_path, num_epochs=1, **kw))
    return W.params(model), state


# -- the step and its gradients ---------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "scaled_adam"])
@pytest.mark.parametrize("steps", [1, 2])
def test_two_ranks_step_like_one_process_on_the_union(ranks, tmp_path, optimizer, steps):
    out, res = ranks
    ref, state = single_process(tmp_path, W.Loader(W.union(W.make_batches(2 * steps)), 2.0), W.make_batches(2, 1),
                                optimizer=optimizer, ref_duration=1.0)
    r0, r1 = (load(out / f"steps-{optimizer}-{steps}-rank{r}.pt") for r in (0, 1))
    assert_same(r0, r1)  # the replicas stay identical
    assert_same(r0, ref, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(r0[k], W.params(W.make_model())[k]) for k in r0)  # it did train
    # the logged losses are the global batch's: summed over ranks before dividing by the frames
    logged = res["steps"][0][f"{optimizer}-{steps}"]
    assert math.isclose(logged["train_loss"], state.history[-1]["train_loss"], rel_tol=1e-5)
    assert math.isclose(logged["valid_loss"], state.history[-1]["valid_loss"], rel_tol=1e-5)


def test_compiled_encoder_under_ddp_steps_like_one_eager_process(ranks, tmp_path):
    # --compile under torchrun: the encoder is compiled in place before DDP wraps the model
    out, res = ranks
    torch.manual_seed(0)  # the ranks' initial weights
    encoder = W.PlainEncoder()
    ref, state = single_process(tmp_path, W.Loader(W.union(W.make_batches(4)), 2.0), W.make_batches(2, 1),
                                encoder=encoder, ref_duration=1.0)
    r0, r1 = (load(out / f"compiled-rank{r}.pt") for r in (0, 1))
    assert_same(r0, r1)
    assert_same(r0, ref, rtol=1e-5, atol=1e-6)
    assert res["compiled"][0]["keys"] == sorted(ref)  # no _orig_mod. in the names
    assert math.isclose(res["compiled"][0]["history"]["train_loss"], state.history[-1]["train_loss"], rel_tol=1e-5)


def union_gradient_float64() -> dict[str, torch.Tensor]:
    model = W.make_model().double()
    batch = W.union(W.make_batches(2))[0]
    batch = {**batch, "features": batch["features"].double()}
    loss, _ = compute_loss(model, batch, W.Tok(), get_policy("fp32", "cpu"))
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def test_gradients_are_summed_over_ranks_not_averaged(ranks):
    """DDP's gradient equals the float64 gradient of the loss summed over both ranks' utterances (an average
    over ranks would be half of it); bf16 buckets too, within bf16's precision."""
    out, _ = ranks
    ref = union_gradient_float64()
    for r in (0, 1):
        got = load(out / f"grads-fp32-rank{r}.pt")
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6 * ref[k].abs().max().item())
    flat_ref = torch.cat([g.flatten() for g in ref.values()])
    for r in (0, 1):
        got = load(out / f"grads-bf16-rank{r}.pt")
        flat = torch.cat([got[k].flatten() for k in ref])
        assert (flat - flat_ref).norm() < 0.05 * flat_ref.norm()
    assert_same(load(out / "grads-bf16-rank0.pt"), load(out / "grads-bf16-rank1.pt"))


# -- data, files, resume -------------------------------------------------------------------------------------


def test_each_rank_reads_its_own_shard(ranks):
    _, res = ranks
    r0, r1 = res["shards"]
    assert (r0["rank"], r0["world_size"], r0["sampler_rank"]) == (0, 2, 0)
    assert (r1["rank"], r1["world_size"], r1["sampler_rank"]) == (1, 2, 1)
    a, b = set(r0["epoch_ids"]), set(r1["epoch_ids"])
    assert not a & b and a | b == {f"c{i}" for i in range(22)}
    assert len(r0["epoch_ids"]) == len(a) and len(r1["epoch_ids"]) == len(b)
    # the loop (after its OOM scan of each rank's riskiest batches) trained on exactly the rank's shard
    assert r0["trained_ids"] == r0["epoch_ids"] and r1["trained_ids"] == r1["epoch_ids"]
    va, vb = set(r0["valid_ids"]), set(r1["valid_ids"])
    assert not va & vb and va | vb == {f"c{i}" for i in range(9)}
    for r in (r0, r1):
        assert "built for rank 0 of 1, but this is rank" in r["unsharded_error"] and "setup_distributed" in \
            r["unsharded_error"]


def test_explicit_rank_gives_the_same_shards_without_a_process_group(ranks):
    """AsrDataModule(rank=, world_size=) in one process deals the same shards as the ranks got from the group."""
    from asrprec.data import AsrDataModule, DataConfig

    _, res = ranks
    for r in (0, 1):
        dm = AsrDataModule(DataConfig(max_duration=4.0, num_buckets=2, spec_augment=False, seed=3), rank=r,
                           world_size=2)
        dl = dm.train_dataloader(W.memory_cuts(22))
        dl.sampler.set_epoch(1)
        assert [c for b in dl for c in b["cut_ids"]] == res["shards"][r]["epoch_ids"]
    with pytest.raises(ValueError, match="rank must be in"):
        AsrDataModule(rank=2, world_size=2)


def test_only_rank0_writes_files(ranks):
    out, res = ranks
    assert res["files"][1]["files"] == []
    files = res["files"][0]["files"]
    assert {"epoch-1.pt", "epoch-2.pt", "checkpoint-3.pt", "checkpoint-4.pt"} <= set(files)
    assert any(f.startswith("tensorboard/events.out.tfevents") for f in files)
    assert torch.load(out / "files-rank0" / "epoch-2.pt", weights_only=True)["model_avg"]["count"] == 4


def test_resume_under_two_ranks_continues_exactly(ranks):
    out, res = ranks
    full, resumed = (torch.load(out / d / "epoch-3.pt", weights_only=True)["model"] for d in ("resume-a", "resume-b"))
    assert_same(full, resumed)
    for r in (0, 1):  # every rank restored the same state, not only the one that saved
        assert_same(load(out / f"resume-resumed-rank{r}.pt"), load(out / f"resume-full-rank{r}.pt"))
        got = res["resume"][r]
        assert got["batch_idx_train"] == [9, 9]
        assert got["valid_loss"][0] == got["valid_loss"][1] and got["train_loss"][0] == got["train_loss"][1]
        # the restored schedule count carries on where the uninterrupted run was
        assert got["resumed_counts"] == got["full_counts"][-3:]


def test_mid_epoch_resume_under_two_ranks_continues_exactly(ranks):
    """Cut back to the checkpoint after step 4 of 6 (mid epoch 2) and resumed: every rank's weights equal the
    uninterrupted run's bit for bit, which needs each rank's own random generators back (the encoder draws
    dropout masks from them every step)."""
    out, res = ranks
    full, resumed = (torch.load(out / d / "epoch-2.pt", weights_only=True)["model"]
                     for d in ("resume-mid-a", "resume-mid-b"))
    assert_same(full, resumed)
    for r in (0, 1):
        assert_same(load(out / f"resume-mid-resumed-rank{r}.pt"), load(out / f"resume-mid-full-rank{r}.pt"))
        assert res["resume_mid"][r]["batch_idx_train"] == 6


def test_schedules_follow_the_audio_seen_not_the_steps(ranks, tmp_path):
    """2 ranks take half the steps of one process through the same data; the schedules count world_size per step,
    so Eden, the transducer's warm-ups and the encoder (× encoder_schedule_scale) are where one process is at
    the end of each epoch."""
    out, res = ranks
    model = W.make_model()
    train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(), train_dl=W.make_batches(6),
          valid_dl=W.make_batches(2, 1), cfg=W.train_cfg(tmp_path, num_epochs=3, encoder_schedule_scale=10.0))
    one = model.encoder.seen_counts
    assert one == [10.0 * k for k in range(1, 19)]  # one process: its steps, unchanged
    two = res["resume"][0]["full_counts"]
    assert two == [20.0 * k for k in range(1, 10)]
    assert [two[i] for i in (2, 5, 8)] == [one[i] for i in (5, 11, 17)]  # epoch ends agree
    assert res["resume"][0]["transducer_count"] == model.batch_count == 18.0
    for epoch in (1, 2, 3):
        ddp = torch.load(out / "resume-a" / f"epoch-{epoch}.pt", weights_only=True)["scheduler"]["batch"]
        single = torch.load(tmp_path / f"epoch-{epoch}.pt", weights_only=True)["scheduler"]["batch"]
        assert ddp == single == 6.0 * epoch


def test_ref_duration_counts_seconds_of_audio(tmp_path):
    model = W.make_model()
    train(model=model, policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(), train_dl=W.Loader(W.make_batches(3), 30.0),
          valid_dl=W.make_batches(1, 1), cfg=W.train_cfg(tmp_path, num_epochs=1, ref_duration=10.0, encoder_schedule_scale=2.0))
    assert model.encoder.seen_counts == [6.0, 12.0, 18.0]  # 30 s / 10 s per step, × 2 for the encoder
    assert model.batch_count == 9.0
    with pytest.raises(ValueError, match="needs the training sampler's max_duration"):
        train(model=W.make_model(), policy=get_policy("fp32", "cpu"), tokenizer=W.Tok(), train_dl=W.make_batches(1),
              valid_dl=W.make_batches(1, 1), cfg=W.train_cfg(tmp_path / "b", ref_duration=10.0))
    with pytest.raises(ValueError, match="ref_duration must be >= 0"):
        TrainConfig(exp_dir=str(tmp_path), ref_duration=-1.0)


# -- precision policies, layer skipping ------------------------------------------------------------------------


def test_amp_bf16_and_bf16_steps_are_finite_and_replicas_agree(ranks):
    out, res = ranks
    for name in ("amp-bf16", "bf16", "amp-fp16"):
        r0, r1 = res["precisions"]
        if "unsupported" in r0[name]:
            assert name == "amp-fp16", r0[name]
            continue
        assert r0[name]["finite"] and r1[name]["finite"]
        assert r0[name]["dtype"] == ("torch.bfloat16" if name == "bf16" else "torch.float32")
        assert_same(load(out / f"prec-{name}-rank0.pt"), load(out / f"prec-{name}-rank1.pt"))
        assert math.isfinite(r0[name]["train_loss"]) and r0[name]["valid_loss"] == r1[name]["valid_loss"]


def test_zipformer_with_layer_skipping_trains_under_ddp(ranks):
    out, res = ranks
    r0, r1 = res["zipformer"]
    assert r0["forced"] == 0 and r1["forced"] == 3  # rank 1 never used its 3 positional projections
    assert r0["steps"] == r1["steps"] == 2 and math.isfinite(r0["train_loss"])
    params = [load(out / f"zipformer-rank{r}.pt") for r in (0, 1)]
    assert_same(*params)
    assert all(torch.isfinite(v).all() for v in params[0].values())
    # the controls: torch's DDP without find_unused_parameters trains the same model when nothing is skipped,
    # and fails with the "unused parameters" error when the projections are
    for r in (r0, r1):
        assert r["plain_ddp_nothing_skipped"] is None
        assert "find_unused_parameters" in r["plain_ddp_skipped"]


# -- stopping together -----------------------------------------------------------------------------------------


def test_nonfinite_loss_on_one_rank_skips_the_step_on_all(ranks, tmp_path):
    out, res = ranks
    r0, r1 = res["nonfinite"]
    assert r0["batch_idx_train"] == r1["batch_idx_train"] == 3
    for r in (r0, r1):  # each rank names its own cuts and the rank whose loss was not finite
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "batch 2 of the epoch" in r["warnings"][0] and "skipped, non-finite loss" in r["warnings"][0]
        assert "not finite on rank(s) [1] (the step is skipped on every rank)" in r["warnings"][0]
    assert "cuts: 0-2a, 0-2b" in r0["warnings"][0] and "cuts: 0-3a, 0-3b" in r1["warnings"][0]
    batches = W.make_batches(6)
    batches[3]["features"][0, 0, 0] = float("nan")  # rank 1's second batch
    ref, _ = single_process(tmp_path, W.Loader(W.union(batches), 2.0), W.make_batches(2, 1), ref_duration=1.0,
                            max_skipped_fraction=0.5)
    for r in (0, 1):
        assert_same(load(out / f"nonfinite-rank{r}.pt"), ref, rtol=1e-5, atol=1e-6)


def test_out_of_memory_on_one_rank_stops_every_rank_with_its_message(ranks):
    _, res = ranks
    r0, r1 = res["forward_oom"]
    assert r1["error"]["type"] == "BatchOutOfMemory" and "oom-batch-2-rank1.pt" in r1["error"]["message"]
    assert r0["error"]["type"] == "RankFailedError"
    msg = r0["error"]["message"]
    assert msg.startswith("rank 1 failed during training batch 2; every rank stops.") and "out of memory" in msg
    assert "bad-model.pt" in r0["files"] and "oom-batch-2-rank1.pt" in r0["files"]


def test_gradient_overflow_on_one_rank_stops_both_together(ranks):
    _, res = ranks
    for name in ("amp-fp16", "fp32"):
        for r in res["collapse"]:
            if "unsupported" in r[name]:
                assert name == "amp-fp16"
                continue
            assert r[name]["error"]["type"] == "GradScaleCollapse" and r[name]["calls"] == 2, r[name]


def test_failure_in_backward_ends_the_job_with_the_message(job, ranks):
    """No agreement is possible once the gradient all-reduce has begun: the failing rank exits with its error and
    the job ends (rank 0, waiting in the all-reduce, is ended too instead of waiting forever)."""
    out, p, ended = job
    assert p.returncode != 0
    assert "BatchOutOfMemory: out of memory on cpu" in p.stderr and "simulated, in backward" in p.stderr
    assert not any(out.glob(f"{LAST}-rank*.json"))  # neither rank finished the scenario
    started = max(float((out / f"{LAST}-started-rank{r}").read_text()) for r in (0, 1))
    assert ended - started < 60  # rank 0 did not sit out the 90 s collective timeout the worker sets


# -- set-up ---------------------------------------------------------------------------------------------------


def test_ddp_gradients_fit_the_buckets_and_unused_parameters_are_searched_only_where_possible(job):
    """No stride warning (the Zipformer's depthwise convolutions return gradients strided otherwise in a size-1
    dimension); find_unused_parameters only for the models that need it, so DDP never reports a search that found
    nothing for the other scenarios' models."""
    from asrprec.models import LossConfig
    from asrprec.training.distributed import may_leave_parameters_unused

    _, p, _ = job
    assert "Grad strides do not match bucket view strides" not in p.stderr
    assert "did not find any unused parameters" not in p.stderr
    assert not may_leave_parameters_unused(W.make_model())  # pruned loss: every parameter in every step
    full = W.make_model()
    full.loss_config = LossConfig(loss="full")
    assert may_leave_parameters_unused(full)  # the simple projections serve only the pruned loss
    assert may_leave_parameters_unused(W._zipformer(None)[0])  # the positional projection is skipped at random


def test_plain_python_stays_single_process(monkeypatch):
    for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    env = setup_distributed("cpu")
    assert (env.rank, env.world_size, env.backend, env.is_distributed) == (0, 1, None, False)
    assert not torch.distributed.is_initialized()


def test_incomplete_torchrun_environment_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for v in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing. Fix: launch with torchrun"):
        setup_distributed("cpu")


def test_an_explicit_gpu_index_under_torchrun_is_refused(monkeypatch):
    for v, x in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(v, x)
    with pytest.raises(ValueError, match="each process uses the GPU of its LOCAL_RANK"):
        rank_device("cuda:0")
    assert rank_device("cpu") == torch.device("cpu")


@pytest.mark.gpu
def test_nccl_ranks_on_two_gpus(tmp_path):
    """The same scenarios with NCCL, one GPU per rank (cuda:LOCAL_RANK): replicas stay identical under every
    policy (amp-fp16's GradScaler included), skips and stops are agreed, nothing hangs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    names = ("steps", "grads", "resume", "precisions", "zipformer", "nonfinite", "forward_oom", "collapse")
    p = torchrun(tmp_path, "--cuda", *names)
    assert p.returncode == 0, p.stderr[-6000:]
    res = {n: [json.loads((tmp_path / f"{n}-rank{r}.json").read_text()) for r in (0, 1)] for n in names}
    for n, (r0, r1) in res.items():
        assert r0["ok"] and r1["ok"], (n, r0.get("traceback"), r1.get("traceback"))
    for stem in ("steps-adamw-2", "steps-scaled_adam-2", "resume-resumed", "zipformer", "nonfinite",
                 *(f"prec-{n}" for n in ("amp-bf16", "bf16", "amp-fp16"))):
        assert_same(load(tmp_path / f"{stem}-rank0.pt"), load(tmp_path / f"{stem}-rank1.pt"))
    assert_same(load(tmp_path / "resume-resumed-rank0.pt"), load(tmp_path / "resume-full-rank0.pt"))
    ref = union_gradient_float64()
    got = load(tmp_path / "grads-fp32-rank0.pt")
    for k in ref:  # TF32 is off for matmuls by default; cuDNN is not involved in this model
        torch.testing.assert_close(got[k], ref[k], rtol=1e-3, atol=1e-5 * ref[k].abs().max().item())
    assert res["forward_oom"][0]["error"]["type"] == "RankFailedError"
    assert res["forward_oom"][1]["error"]["type"] == "BatchOutOfMemory"
    for r in res["collapse"]:
        assert r["amp-fp16"]["error"]["type"] == r["fp32"]["error"]["type"] == "GradScaleCollapse"


# -- the embedded recipe ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_espeak_recipe_trains_and_decodes_under_torchrun(tmp_path):
    """``torchrun --nproc_per_node 2 recipes/espeak/train.py`` on a tiny corpus, then a (single-process) decode."""
    pytest.importorskip("espeakng_loader", reason="pip install 'asrprec[synth]'")
    recipe, data, exp = ROOT / "recipes" / "espeak", tmp_path / "data", tmp_path / "exp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def run(*cmd):
        p = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=1800)
        assert p.returncode == 0, f"{cmd[:3]} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
        return p.stdout + p.stderr

    run(recipe / "prepare.py", "--data-dir", data, "--num-train", 40, "--num-dev", 8, "--num-test", 8,
        "--vocab-size", 40)
    run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", 2, recipe / "train.py", "--data-dir", data,
        "--exp-dir", exp, "--num-epochs", 2, "--train.max_batches_per_epoch", 3, "--max-duration", 10,
        "--train.progress_bar", "false", "--train.scan_oom", "on", "--train.average_period", 1)
    log = (exp / "train.log").read_text()
    assert "processes: rank 0 of 2 (local rank 0), backend gloo" in log and "[rank 1]" not in log
    assert "OOM scan: single_longest_cut" in log
    ck = torch.load(exp / "epoch-2.pt", weights_only=True)
    assert ck["extra"]["world_size"] == 2 and ck["extra"]["batch_idx_train"] == 6
    assert ck["extra"]["adjusted_batch_count"] == 12.0  # 2 ranks x 6 steps (ref-duration = max-duration)
    assert ck["model_avg"]["count"] == 6
    written = {p.name for p in exp.iterdir()}
    assert {"epoch-1.pt", "epoch-2.pt", "config.json", "config.yaml", "model.json", "history.json", "train.log",
            "tensorboard", "bpe.model", "run.lock"} == written
    out = run(recipe / "decode.py", "--data-dir", data, "--exp-dir", exp, "--epoch", 2, "--avg", 2, "--splits", "test")
    assert "test: WER" in out
    out = run(recipe / "decode.py", "--data-dir", data, "--exp-dir", exp, "--epoch", 2, "--avg", 1,
              "--use-averaged-model", "--splits", "test")
    assert "test: WER" in out
