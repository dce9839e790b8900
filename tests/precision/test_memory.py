"""Live-memory accounting and fake-tensor projection, against byte counts worked out by hand."""

import contextlib
import random

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from asrprec.precision.memory import LiveMemoryTracker, autocast_on, fake_module_

N, D, B = 3, 64, 8  # a chain of N bias-free D x D linears on a (B, D) input


def _chain(policy: str, mode=None):
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(N))
    ctx = mode or contextlib.nullcontext()
    if mode is not None:
        fake_module_(layers, mode, "cpu")
    with ctx:
        x = torch.randn(B, D)
    tr = LiveMemoryTracker(block=1)
    amp = autocast_on("cpu", torch.float16) if policy == "amp-fp16" else contextlib.nullcontext()
    with ctx, tr:
        tr.track(*layers.parameters(), x)
        with amp:
            h = x
            for lin in layers:
                h = lin(h)
        tr.sweep()
        fwd = tr.current
        h.float().sum().backward()
        del h
        tr.sweep()
    return fwd, tr.peak, tr.current


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_linear_chain_bytes_match_hand_count(fake):
    params, x = N * D * D * 4, B * D * 4
    fwd, peak, end = _chain("fp32", FakeTensorMode() if fake else None)
    # each layer's output is kept (the next layer saves it for backward; the last one is ours)
    assert fwd == params + x + N * B * D * 4
    assert peak >= fwd
    # after backward and dropping the output: parameters, their fp32 gradients and the input
    assert end == params + N * D * D * 4 + x


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_autocast_weight_copies_are_counted(fake):
    """Under fp16 autocast each weight gets an fp16 copy, the input an fp16 copy, and the activations are
    fp16. Autograd keeps a weight copy only where the gradient w.r.t. the layer's input is needed: not in
    the first layer, whose input does not require grad (so that copy dies with the autocast cache)."""
    fwd, _, end = _chain("amp-fp16", FakeTensorMode() if fake else None)
    assert fwd == N * D * D * 4 + (N - 1) * D * D * 2 + B * D * (4 + 2) + N * B * D * 2
    assert end == N * D * D * (4 + 4) + B * D * 4  # fp32 gradients land on the fp32 parameters


def test_block_rounding_and_shared_views():
    tr = LiveMemoryTracker()  # CUDA's 512-byte blocks
    with tr:
        a = torch.zeros(3)  # 12 bytes -> one block
        v = a.view(3, 1)  # a view: no new storage
        b = torch.zeros(200)  # 800 bytes -> two blocks
        assert tr.current == 512 + 1024
        del a, v
        tr.sweep()
        assert tr.current == 1024
    assert tr.peak == 512 + 1024
    del b


def test_fake_cuda_sees_cuda_autocast_lists():
    """CUDA autocast runs softmax in fp32 and matmul in fp16 (torch.amp docs, "CUDA Ops that can autocast
    to float32"); CPU autocast keeps softmax in the lower precision. autocast_on gives fake CUDA tensors
    the CUDA lists without a CUDA runtime, and restores the state on exit."""
    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda", dtype=torch.float16)
        w = torch.empty(8, 8, device="cuda")
        with autocast_on("cuda", torch.float16):
            assert torch.softmax(x, -1).dtype == torch.float32
            assert (x @ w).dtype == torch.float16
        assert not torch.is_autocast_enabled("cuda")
        assert (x.float() @ w).dtype == torch.float32
    with autocast_on("cpu", torch.float16):
        assert torch.softmax(torch.randn(4, 8).half(), -1).dtype == torch.float16
    assert not torch.is_autocast_enabled("cpu")


def test_value_reads_from_fake_tensors():
    with FakeTensorMode():
        t = torch.empty(3, dtype=torch.int64)
        with LiveMemoryTracker(), pytest.raises(RuntimeError, match="scalar="):
            int(t.max())
        with LiveMemoryTracker(scalar=7):
            assert int(t.max()) == 7
            assert bool((t > 0).any()) is True
    real = torch.tensor([1, 5, 2])
    with LiveMemoryTracker(scalar=7):  # real tensors are read for real
        assert int(real.max()) == 5


def test_fake_zipformer_step_matches_real_step():
    """The projection runs the same ops on fake tensors: the fwd+bwd peak and the memory left afterwards
    agree with the same step on real tensors (tiny preset, CPU), under fp32 and fp16 autocast."""
    from asrprec.models import set_batch_count
    from asrprec.models.zipformer import build_zipformer_encoder

    def step(fake: bool, policy: str):
        random.seed(0)
        torch.manual_seed(0)
        enc = build_zipformer_encoder(size="tiny").train()
        set_batch_count(enc, 20000)
        mode = FakeTensorMode() if fake else contextlib.nullcontext()
        if fake:
            fake_module_(enc, mode, "cpu")
        with mode:
            x, lens = torch.randn(2, 200, 80), torch.full((2,), 200)
        tr = LiveMemoryTracker(scalar=200)
        amp = autocast_on("cpu", torch.float16) if policy == "amp-fp16" else contextlib.nullcontext()
        with mode, tr:
            tr.track(*enc.parameters(), x, lens)
            with amp:
                y, _ = enc(x, lens)
            y.float().pow(2).mean().backward()
            del y
            tr.sweep()
        return tr.peak, tr.current

    for policy in ("fp32", "amp-fp16"):
        (rp, rc), (fp, fc) = step(False, policy), step(True, policy)
        assert rc == fc  # parameters + gradients + input
        assert abs(fp - rp) <= 0.02 * rp, (policy, rp, fp)


def test_shadow_values_answer_reads_of_lengths():
    """Values computed only from known inputs (lengths, masks) are read for real; values from uninitialised or
    random memory, or from anything that depends on them, fall back to ``scalar``."""
    with FakeTensorMode(), LiveMemoryTracker(scalar=lambda t: -1, shadow_numel=1000) as tr:
        lens = torch.tensor([5, 7, 3])
        mask = torch.arange(8).expand(3, 8) >= lens.unsqueeze(-1)
        assert (int(lens.max()), int(mask.sum())) == (7, 24 - 15)
        assert bool(mask.any()) is True and bool(mask.all()) is False
        assert int((lens * 2).min()) == 6
        noise = torch.randint(0, 9, (3,))
        assert int(noise.max()) == -1 and float((noise + lens).float().sum()) == -1.0
        acc = torch.zeros(3, dtype=torch.int64)
        acc.add_(lens)
        assert int(acc.sum()) == 15
        acc.copy_(noise)  # now unknown: its shadow is dropped
        assert int(acc.sum()) == -1
        big = torch.zeros(2000)  # above shadow_numel
        assert float(big.sum()) == -1.0 and tr.shadow(big) is None
