"""The batch planner: its batch sizes judged by direct projections of the step (not by its own fit), the order of
policies, the plan file, the too-small budget, and the plan lowered by a (faked) GPU measurement."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from asrprec.models import Decoder, Joiner, LossConfig, Transducer
from asrprec.optim import ScaledAdam
from asrprec.precision import get_policy
from asrprec.precision.batch_plan import (
    CALIBRATION_SAFETY, BatchPlan, BudgetTooSmall, Bucket, lower_plan, parse_memory_size, plan_batches, read_plan,
    write_plan,
)
from asrprec.precision.memory_step import project_step

F, D, V = 8, 16, 11


def r512(n: float) -> int:
    return -(-int(n) // 512) * 512


class Profile:
    """An independent step-memory model written as a list of tensors (not the planner's formula): weights, their
    gradients and optimizer state (``param_bytes`` per parameter element, 2x for Adam's moments), the batch, and
    what backward holds at once: per utterance a (T, 256) activation of ``act`` bytes, four heads of (T, T)
    attention scores, a (T, U + 1, V) joint of ``V`` tokens and its gradient; every tensor rounded to 512 bytes.
    The optimizer step holds the weights, gradients, state, the batch and one state-sized temporary."""

    def __init__(self, act=4, param_bytes=4, params=20_000_000, vocab=1):
        self.act, self.pb, self.n, self.v = act, param_bytes, params, vocab

    def __call__(self, B, T, U):
        weights = r512(self.n * self.pb)
        state = 2 * r512(self.n * 4)
        batch = r512(B * T * 80 * 4) + 2 * r512(B * 8) + r512(B * U * 8)
        acts = [B * T * 256 * self.act] * 6 + [B * 4 * T * T * self.act] * 2 + [B * T * (U + 1) * self.v * 4] * 2
        backward = weights * 2 + state + batch + sum(r512(x) for x in acts)
        optimizer = weights * 2 + state + batch + state
        return SimpleNamespace(backward_peak=backward, optimizer_peak=optimizer, cuda_autocast_extra=0,
                               persistent=weights + state + batch, gradients=weights, inputs=batch)


def peak_of(res):
    return max(res.backward_peak, res.optimizer_peak)


# LibriSpeech-like edges (s) and tokens at 3 per second
BUCKETS = [Bucket(d, int(d * 3)) for d in (4.0, 9.5, 13.0, 15.0, 17.5, 20.0)]
BUDGET = 2_000_000_000


@pytest.fixture(scope="module")
def fp32_plan():
    return plan_batches(Profile(), BUCKETS, BUDGET, verify="all")


def test_planned_batches_fit_and_one_more_utterance_does_not(fp32_plan):
    """Every bucket's planned batch is within budget x safety by the ground-truth step, one more utterance over."""
    truth = Profile()
    cap = BUDGET * CALIBRATION_SAFETY
    assert fp32_plan.cap_bytes == int(cap)
    for b in fp32_plan.buckets:
        assert b.verified and b.batch_size >= 2
        assert peak_of(truth(b.batch_size, b.frames, b.tokens)) == b.projected_peak_bytes <= cap, b
        assert peak_of(truth(b.batch_size + 1, b.frames, b.tokens)) > cap, b
    sizes = fp32_plan.batch_sizes
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 4 * sizes[-1]  # short buckets hold more


@pytest.mark.parametrize("vocab,light", [(1, False), (V, False), (V, True)])
def test_fit_alone_is_close_to_the_step(vocab, light):
    """Unverified, the fitted sizes are within 2 % of the tight ones, and their peaks within 1 % of the cap."""
    fit_only = plan_batches(Profile(vocab=vocab), BUCKETS, BUDGET, joint=vocab, verify="none", light=light)
    assert len(fit_only.fit.points) == (4 if light else 5)
    tight = plan_batches(Profile(vocab=vocab), BUCKETS, BUDGET, joint=vocab, verify="all")
    truth = Profile(vocab=vocab)
    assert fit_only.fit.max_error < 0.01
    for f, t in zip(fit_only.buckets, tight.buckets):
        assert abs(f.batch_size - t.batch_size) <= max(1, 0.02 * t.batch_size), (f, t)
        assert peak_of(truth(f.batch_size, f.frames, f.tokens)) <= 1.01 * fit_only.cap_bytes


@pytest.mark.parametrize("act,param_bytes", [(2, 4), (2, 2), (4, 2)])
def test_fewer_bytes_never_smaller_batches(fp32_plan, act, param_bytes):
    """bf16 activations (amp) and / or 2-byte weights (bf16) at the same budget: never a smaller batch."""
    plan = plan_batches(Profile(act=act, param_bytes=param_bytes), BUCKETS, BUDGET, verify="all")
    for low, full in zip(plan.buckets, fp32_plan.buckets):
        assert low.batch_size >= full.batch_size, (low, full)
    assert sum(plan.batch_sizes) > sum(fp32_plan.batch_sizes)


class AttnEncoder(nn.Module):
    """(B, T, F) -> (B, T, D): a linear layer and one self-attention."""

    output_dim = D

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(F, D)
        self.out = nn.Linear(D, D)

    def forward(self, x, lens):
        h = self.inp(x)
        scores = torch.softmax(h @ h.transpose(1, 2) / D**0.5, dim=-1)
        return self.out(scores @ h), lens


def toy():
    torch.manual_seed(0)
    return Transducer(AttnEncoder(), Decoder(V, D), Joiner(D, D, D, V),
                      loss=LossConfig(loss="pruned", prune_range=2, backend="torch"), model_warmup_batches=0)


def projector(policy="fp32", fake=True):
    def project(B, T, U):
        def make(device):
            return (torch.randn(B, T, F, device=device), torch.full((B,), T, device=device),
                    torch.randint(1, V, (B, U), device=device), torch.full((B,), U, device=device))

        return project_step(toy, make, lambda m, b: m(*b)["loss"], policy,
                            lambda ps: ScaledAdam(ps, lr=0.045, clipping_scale=2.0, batched=True), fake=fake,
                            cuda_forward=False)
    return project


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["amp-bf16", "bf16"])
def test_real_projection_plan_is_tight_and_lower_precision_holds_more(policy):
    """The planner on project_step itself (a toy transducer with attention): the worst bucket settled by projection
    is tight, a real CPU step at that size (the same tracker on real tensors) is within the cap, and a policy with
    fewer bytes plans at least as many utterances."""
    buckets = [Bucket(0.12, 2), Bucket(0.3, 4)]
    budget = 8_000_000
    full = plan_batches(projector("fp32"), buckets, budget, verify="worst", light=True)
    low = plan_batches(projector(policy), buckets, budget, verify="worst", light=True)
    w = full.buckets[-1]
    assert peak_of(projector("fp32")(w.batch_size + 1, w.frames, w.tokens)) > full.cap_bytes
    assert peak_of(projector("fp32", fake=False)(w.batch_size, w.frames, w.tokens)) <= full.cap_bytes
    assert low.buckets[-1].batch_size >= w.batch_size


def test_budget_too_small_names_what_fits_and_the_flag():
    with pytest.raises(BudgetTooSmall) as e:
        plan_batches(Profile(), BUCKETS, 400_000_000, verify="none")
    msg = str(e.value)
    assert "\n" not in msg
    assert "does not hold one utterance of the 20.00 s bucket" in msg
    assert "--max-memory must be at least" in msg and "fix: raise --max-memory" in msg
    need = float(msg.split("must be at least ")[1].split(" GB")[0]) * 1e9
    # the stated minimum holds one utterance of the longest bucket (checked by a plan at that budget)
    plan = plan_batches(Profile(), BUCKETS, int(need * 1.05), verify="all")
    assert plan.buckets[-1].batch_size >= 1
    with pytest.raises(BudgetTooSmall, match="fix: raise --max-memory"):  # the same, found by the settling
        plan_batches(Profile(), BUCKETS, int(need * 0.9), verify="all")


def test_plan_file_round_trips(tmp_path, fp32_plan):
    path = write_plan(fp32_plan, tmp_path)
    assert path.name == "batch_plan.json"
    d = json.loads(path.read_text())
    assert all(set(b) >= {"max_duration", "batch_size", "projected_peak_bytes"} for b in d["buckets"])
    assert [b["max_duration"] for b in d["buckets"]] == [4.0, 9.5, 13.0, 15.0, 17.5, 20.0]
    back = read_plan(tmp_path)
    assert back.to_dict() == fp32_plan.to_dict()
    assert read_plan(tmp_path / "none") is None
    (tmp_path / "batch_plan.json").write_text('{"version": 99}')
    with pytest.raises(ValueError, match="delete it to plan again"):
        read_plan(tmp_path)


def test_resumed_run_keeps_its_plan(tmp_path, fp32_plan):
    """plan_for_run reads the stored plan back when resuming, even under another --max-memory (nothing projected)."""
    from asrprec.training.batch_plan import plan_for_run

    write_plan(fp32_plan, tmp_path)
    cfg = SimpleNamespace(exp_dir=str(tmp_path), optimizer="scaled_adam")
    data = SimpleNamespace(max_memory="1GB", memory_safety=CALIBRATION_SAFETY)
    pol = get_policy("fp32", "cpu")
    kept = plan_for_run(None, model_options=None, policy=pol, train_cfg=cfg, data_cfg=data, cuts=None,
                        tokenizer=None, resuming=True)
    assert kept.batch_sizes == fp32_plan.batch_sizes and kept.budget_bytes == BUDGET


def test_measured_peak_above_the_assumption_lowers_the_plan(fp32_plan):
    worst = fp32_plan.worst()
    same, line = lower_plan(fp32_plan, measured_bytes=int(worst.projected_peak_bytes / 0.8),
                            projected_bytes=worst.projected_peak_bytes)
    assert same is None and "within the plan" in line
    lower, note = lower_plan(fp32_plan, measured_bytes=worst.projected_peak_bytes * 2,
                             projected_bytes=worst.projected_peak_bytes)
    assert "lowered" in note and str(fp32_plan.batch_sizes) in note and str(lower.batch_sizes) in note
    assert lower.safety == pytest.approx(0.5 * 0.95)
    assert all(n <= o for n, o in zip(lower.batch_sizes, fp32_plan.batch_sizes))
    assert lower.batch_sizes[-1] < fp32_plan.batch_sizes[-1]
    assert lower.notes == [note]


def test_device_check_with_a_faked_measurement():
    """check_plan_on_device runs real steps of the worst bucket (here on the CPU) and compares the measurement it
    is given with the projection."""
    from asrprec.training.batch_plan import check_plan_on_device

    pol = get_policy("fp32", "cpu")
    small = plan_batches(Profile(params=2000), [Bucket(0.1, 2), Bucket(0.2, 3)], 2_000_000, verify="none")
    worst = small.worst()
    kept, note = check_plan_on_device(toy(), small, policy=pol, optimizer="scaled_adam", vocab_size=V,
                                      num_mel_bins=F, steps=1, measure=lambda: worst.projected_peak_bytes)
    assert note is None and kept is small
    lowered, note = check_plan_on_device(toy(), small, policy=pol, optimizer="scaled_adam", vocab_size=V,
                                         num_mel_bins=F, steps=1, measure=lambda: 3 * worst.projected_peak_bytes)
    assert note is not None and lowered.batch_sizes[-1] < worst.batch_size
    with pytest.raises(ValueError, match="measure="):
        check_plan_on_device(toy(), small, policy=pol, optimizer="scaled_adam", vocab_size=V)


@pytest.mark.parametrize("text,device,expect", [("40GB", None, 40 * 10**9), ("40GiB", None, 40 * 2**30),
                                                 ("512MiB", None, 512 * 2**20), ("0.9", 80 * 10**9, 72 * 10**9),
                                                 ("1", 16, 16), ("2e9", None, 2 * 10**9)])
def test_memory_sizes(text, device, expect):
    assert parse_memory_size(text, device) == expect


def test_memory_size_errors():
    with pytest.raises(ValueError, match="this run has no GPU; fix: give a size such as --max-memory 8GB"):
        parse_memory_size("0.9", None)
    with pytest.raises(ValueError, match="not a size"):
        parse_memory_size("lots")


def test_table_names_every_bucket(fp32_plan):
    lines = fp32_plan.table().splitlines()
    assert len(lines) == 3 + len(BUCKETS)
    assert lines[3].split("|")[3].strip() == str(fp32_plan.buckets[0].batch_size)
    assert isinstance(BatchPlan.from_dict(fp32_plan.to_dict()), BatchPlan)
