"""Whole-step memory projection: fake tensors against the same step on real CPU tensors, and each part of the
breakdown against its formula (parameter bytes, optimizer state per parameter, DDP buckets, pruned-loss tensors)."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from asrprec.models import Decoder, Joiner, LossConfig, Transducer
from asrprec.optim import ScaledAdam
from asrprec.precision.memory import LiveMemoryTracker, autocast_on, fake_module_
from asrprec.precision.memory_step import ddp_bucket_bytes, project_step, storage_bytes

B, T, F, U, V, D = 2, 12, 8, 3, 11, 16


def r512(n: int) -> int:
    return -(-n // 512) * 512


class ToyEncoder(nn.Module):
    """(B, T, F) -> (B, T, D) with a softmax and a layer norm (ops whose autocast dtype differs by device)."""

    output_dim = D

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(F, D)
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, D)

    def forward(self, x, lens):
        h = self.inp(x)
        h = h * torch.softmax(h, dim=-1)
        return self.out(self.norm(h)), lens


def toy_transducer(loss: str = "pruned", vocab: int = V) -> Transducer:
    torch.manual_seed(0)
    return Transducer(ToyEncoder(), Decoder(vocab, D), Joiner(D, D, D, vocab),
                      loss=LossConfig(loss=loss, prune_range=2, backend="torch"), model_warmup_batches=0)


def toy_batch(device):
    return (torch.randn(B, T, F, device=device), torch.full((B,), T, device=device),
            torch.randint(1, V, (B, U), device=device), torch.full((B,), U, device=device))


def step_loss(model, batch):
    return model(*batch)["loss"]


OPTIMIZERS = {"scaled_adam": lambda ps: ScaledAdam(ps, lr=0.045, clipping_scale=2.0, batched=True),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)}


@pytest.mark.parametrize("policy,opt,loss", [("fp32", "scaled_adam", "pruned"), ("amp-bf16", "adamw", "pruned"),
                                             ("bf16", "scaled_adam", "pruned"), ("fp32", "adamw", "full")])
def test_fake_step_equals_real_step(policy, opt, loss):
    """The projection runs the same ops on fake tensors as a real CPU step: every part and the peak agree
    (the real run's random token ids differ, which changes no shape)."""
    kw = dict(ddp=True, cuda_forward=False)
    fake = project_step(lambda: toy_transducer(loss), toy_batch, step_loss, policy, OPTIMIZERS[opt], fake=True, **kw)
    real = project_step(lambda: toy_transducer(loss), toy_batch, step_loss, policy, OPTIMIZERS[opt], fake=False, **kw)
    for part, value in real.as_dict().items():
        assert getattr(fake, part, fake.as_dict()[part]) == value, part
    assert real.peak >= real.persistent + real.gradients


def test_parameters_and_optimizer_state_follow_their_formulas():
    model = toy_transducer()
    numels = [p.numel() for p in model.parameters()]
    for policy, name in (("fp32", "scaled_adam"), ("bf16", "adamw")):
        res = project_step(toy_transducer, toy_batch, step_loss, policy, OPTIMIZERS[name], cuda_forward=False)
        size = 2 if policy == "bf16" else 4
        assert res.parameters == sum(r512(n * size) for n in numels)
        assert res.gradients == res.parameters  # one .grad per parameter, in its dtype
        # bf16: the optimizer runs on fp32 master copies (PrecisionPolicy.build_optimizer's default)
        assert res.master_weights == (sum(r512(n * 4) for n in numels) if policy == "bf16" else 0)
        if name == "adamw":  # exp_avg, exp_avg_sq (fp32) and a 0-dim step count per parameter
            want = sum(2 * r512(n * 4) + 512 for n in numels)
        else:  # ScaledAdam: delta, exp_avg_sq; for tensors also param_rms, scale_exp_avg_sq, scale_grads(4)
            want = sum(2 * r512(n * 4) + (3 * 512 if n > 1 else 0) for n in numels)
        assert res.optimizer_state == want, (policy, name)


def test_ddp_buckets_follow_torch_rule():
    """Against torch's own bucket assignment (reducer.cpp, reached through torch.distributed)."""
    dist = pytest.importorskip("torch.distributed")
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if assign is None:
        pytest.skip("this torch build has no torch.distributed bucket assignment")
    params = [torch.empty(n, requires_grad=True) for n in (300_000, 10, 200_000, 4_000_000, 3_000_000, 7)]
    params.append(torch.empty(100_000, dtype=torch.bfloat16, requires_grad=True))
    for cap in (25.0, 5.0):
        limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, int(cap * 2**20)]
        buckets, _ = assign(params, limits, [False] * len(params))
        want = sorted(sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets)
        assert sorted(ddp_bucket_bytes(params, cap)) == want
    assert sum(ddp_bucket_bytes(params)) == sum(p.numel() * p.element_size() for p in params)


def test_pruned_loss_keeps_one_fp32_logits_tensor():
    """The pruned joint + loss keeps (B, T', S, V) logits for backward: growing V by dV grows the memory alive at
    the end of the forward by B·T'·S·dV·4 bytes (fp32 logits) plus the V-sized parameters and the simple loss's
    (B, T', V) and (B, U+1, V) projections, each counted once per byte of width."""
    S = 2  # prune_range of toy_transducer

    def fwd_end(vocab: int) -> int:
        res = project_step(lambda: toy_transducer(vocab=vocab), toy_batch, step_loss, "fp32",
                           OPTIMIZERS["adamw"], cuda_forward=False, block=1)
        return res.forward_end - res.persistent

    v1, v2 = 64, 64 + 256
    grow = fwd_end(v2) - fwd_end(v1)
    dv = v2 - v1
    logits = B * T * S * dv * 4
    # simple loss: am (B, T, V) and lm (B, U+1, V) projections and their log-softmax-like normalisers, fp32
    simple_max = 4 * (B * T + B * (U + 1)) * dv * 4
    assert logits <= grow <= logits + simple_max, (grow, logits)


def test_cuda_autocast_extra_counts_the_fp32_softmax():
    """CUDA autocast runs softmax in fp32 (and saves its fp32 output); CPU autocast keeps it in bf16. On a
    plain module the difference is the softmax output's extra 2 bytes per element."""
    if not torch.backends.cuda.is_built():
        pytest.skip("fake CUDA tensors need a CUDA build of torch")

    class Soft(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return torch.softmax(self.lin(x), dim=-1)

    def live(device):
        mode = FakeTensorMode()
        m = fake_module_(Soft(), mode, device)
        tr = LiveMemoryTracker(block=1)
        with mode, tr:
            x = torch.empty(32, 64, device=device)
            tr.track(*m.parameters(), x)
            tr.sweep()
            base = tr.current
            with autocast_on(device, torch.bfloat16):
                y = m(x)
            tr.sweep()
            return tr.current - base, y.dtype

    (cpu, cpu_dt), (cuda, cuda_dt) = live("cpu"), live("cuda")
    assert (cpu_dt, cuda_dt) == (torch.bfloat16, torch.float32)
    assert cuda - cpu == 32 * 64 * 2


ICEFALL_DIR = Path(__file__).resolve().parents[3] / "shared" / "third_party" / "icefall_zipformer"


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_step_bench", Path(__file__).resolve().parents[2]
                                                  / "benchmarks" / "memory_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_worst_batch_is_the_samplers():
    """The OOM scan's batches for --max-duration: lhotse's bucketing sampler fills a batch up to max_duration
    seconds of audio (it may pass it by less than one cut); the longest-cut batch holds the longest cut; the
    most-cuts batch has the most utterances."""
    pytest.importorskip("lhotse")
    bench = _bench()
    durations = [1.0 + 0.5 * (i % 39) for i in range(600)]  # 1 .. 20 s
    batches = {b["criterion"]: b for b in bench.pessimistic_batches(durations, 60.0, 4, 3.0)}
    assert all(40.0 <= b["seconds"] < 60.0 + 20.0 for b in batches.values())
    assert batches["single_longest_cut"]["frames"] == 2000
    assert batches["max_num_cuts"]["B"] == max(b["B"] for b in batches.values())
    assert batches["single_longest_cut"]["U"] == 60  # 3 tokens/s x 20 s


@pytest.mark.skipif(not ICEFALL_DIR.is_dir(), reason=f"icefall's model files not at {ICEFALL_DIR}")
def test_icefall_step_builds_the_published_model():
    """benchmarks/memory_step.py --icefall-dir builds icefall's Zipformer medium transducer: its parameter
    count is icefall's RESULTS.md figure (65,549,011)."""
    build, _ = _bench().icefall_step(ICEFALL_DIR, 500)
    assert sum(p.numel() for p in build().parameters()) == 65_549_011


@pytest.mark.slow
def test_fake_zipformer_transducer_step_equals_real_step():
    """The whole recipe step (Zipformer tiny, pruned loss, ScaledAdam, bf16 with fp32 masters) projected on fake
    tensors against the same step counted on real CPU tensors."""
    import random

    from asrprec.models import build_transducer, set_batch_count

    def build():
        random.seed(0)
        torch.manual_seed(0)
        m = build_transducer(encoder="zipformer", size="tiny", vocab_size=64)
        set_batch_count(m, 1e9)
        return m

    def batch(device):
        return (torch.randn(2, 150, 80, device=device), torch.full((2,), 150, device=device),
                torch.randint(1, 64, (2, 5), device=device), torch.full((2,), 5, device=device))

    kw = dict(ddp=True, cuda_forward=False)
    fake = project_step(build, batch, step_loss, "bf16", OPTIMIZERS["scaled_adam"], fake=True, **kw)
    real = project_step(build, batch, step_loss, "bf16", OPTIMIZERS["scaled_adam"], fake=False, **kw)
    assert fake.as_dict() == real.as_dict()


def test_storage_bytes_counts_shared_storage_once():
    a = torch.empty(100)
    assert storage_bytes([a, a[:10], a.view(10, 10), None]) == 512
    assert storage_bytes([a], block=1) == 400
    assert math.isclose(storage_bytes([torch.empty(129)]), 1024)
