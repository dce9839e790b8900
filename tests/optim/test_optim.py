"""ScaledAdam and Eden against formulas, published examples and simple objectives."""

import pytest
import torch
from torch import nn

from asrprec.optim import Eden, ScaledAdam, eden_factor, get_parameter_groups_with_lrs


def _eden_formula(base, b, e, B=7500.0, E=3.5, warm=500.0, start=0.1):
    w = 1.0 if b >= warm else start + (1 - start) * b / warm
    return base * ((b * b + B * B) / (B * B)) ** -0.25 * ((e * e + E * E) / (E * E)) ** -0.25 * w


def _opt(lr=0.045):
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=lr)


def test_eden_published_examples():
    opt = _opt()
    sched = Eden(opt, lr_batches=7500, lr_epochs=3.5, warmup_batches=500, warmup_start=0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0045)  # b=0
    sched.step_epoch(1)
    sched.step_batch(7500)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0371, abs=5e-5)


@pytest.mark.parametrize("b,e", [(0, 0), (1, 0), (250, 0), (499, 2), (500, 0), (3000, 1.5), (20000, 7), (10 ** 6, 30)])
def test_eden_matches_formula(b, e):
    opt = _opt(0.03)
    sched = Eden(opt)
    sched.step_batch(b)
    sched.step_epoch(e)
    assert sched.get_last_lr()[0] == pytest.approx(_eden_formula(0.03, b, e), rel=1e-12)
    assert eden_factor(b, e, 7500, 3.5, 500, 0.1) == pytest.approx(_eden_formula(1.0, b, e), rel=1e-12)


def test_eden_state_dict_and_increment():
    opt = _opt()
    s = Eden(opt)
    for _ in range(10):
        s.step_batch()
    s.step_epoch()
    sd = s.state_dict()
    s2 = Eden(_opt())
    s2.load_state_dict(sd)
    assert (s2.batch, s2.epoch) == (10, 1)
    assert s2.get_last_lr()[0] == pytest.approx(_eden_formula(0.045, 10, 1))
    with pytest.raises(ValueError):
        Eden(opt, lr_batches=0)


def test_scaled_adam_least_squares():
    torch.manual_seed(0)
    a = torch.randn(64, 8)
    w_true = torch.randn(8, 4) * 0.5
    y = a @ w_true
    w = nn.Parameter(torch.randn(8, 4) * 0.1)
    opt = ScaledAdam([w], lr=0.05, clipping_scale=2.0)
    loss0 = ((a @ w - y) ** 2).mean().item()
    for _ in range(400):
        opt.zero_grad()
        loss = ((a @ w - y) ** 2).mean()
        loss.backward()
        opt.step()
    assert loss.item() < 1e-2 * loss0


def test_scaled_adam_learned_scale_respects_max_rms_and_scalar_clamp():
    # The cap acts on the learned overall scale (icefall optim.py _size_update): a gradient whose per-element
    # part is noise but whose projection on p keeps asking for growth makes the scale grow up to the cap only.
    torch.manual_seed(1)
    big = nn.Parameter(torch.randn(16, 16))
    scalar = nn.Parameter(torch.tensor(9.5))
    opt = ScaledAdam([big, scalar], lr=0.1, param_max_rms=1.5, scalar_max=10.0)
    for _ in range(400):
        opt.zero_grad()
        big.grad = torch.randn(16, 16) - 0.05 * big.detach()
        scalar.grad = torch.tensor(-100.0)  # pushes the scalar up forever
        opt.step()
        assert scalar.item() <= 10.0 + 0.1 * 0.1 * 1.0 + 1e-6  # clamped to ±10 before each small update
    rms = (big ** 2).mean().sqrt().item()
    assert 1.3 < rms <= 1.5 * 1.1
    # the same run without a tight cap grows by orders of magnitude
    torch.manual_seed(1)
    free = nn.Parameter(torch.randn(16, 16))
    opt = ScaledAdam([free], lr=0.1, param_max_rms=100.0)
    for _ in range(400):
        free.grad = torch.randn(16, 16) - 0.05 * free.detach()
        opt.step()
    assert (free ** 2).mean().sqrt().item() > 10.0


def test_scaled_adam_does_not_shrink_below_min_rms():
    torch.manual_seed(4)
    small = nn.Parameter(torch.randn(16, 16) * 2e-3)
    opt = ScaledAdam([small], lr=0.1, param_min_rms=1e-3)
    for _ in range(200):
        opt.zero_grad()
        small.grad = torch.randn(16, 16) + 0.2 * small.detach() / 2e-3  # projection asks for shrinking
        opt.step()
    assert (small ** 2).mean().sqrt().item() > 1e-3 * 0.5


def test_scaled_adam_fp32_state_for_bf16_params():
    torch.manual_seed(2)
    a = torch.randn(32, 6)
    y = a @ torch.randn(6, 3)
    w = nn.Parameter(torch.randn(6, 3).to(torch.bfloat16) * 0.1)
    s = nn.Parameter(torch.tensor(1.0, dtype=torch.bfloat16))
    opt = ScaledAdam([w, s], lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        loss = ((a.bfloat16() @ w * s - y.bfloat16()).float() ** 2).mean()
        loss.backward()
        opt.step()
    for p in (w, s):
        assert p.dtype == torch.bfloat16
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert v.dtype == torch.float32, k
        assert torch.equal(opt.state[p]["param_fp32"].to(torch.bfloat16), p.data)
    assert loss.item() < 0.05 * (y ** 2).mean().item()
    # a round trip through state_dict keeps the state fp32
    sd = opt.state_dict()
    opt2 = ScaledAdam([w, s], lr=0.05)
    opt2.load_state_dict(sd)
    assert opt2.state[w]["exp_avg_sq"].dtype == torch.float32


def test_parameter_groups_with_lr_scale():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    model[1].lr_scale = 0.5
    model[1][1].lr_scale = 0.1
    groups = get_parameter_groups_with_lrs(model, lr=1.0, include_names=True)
    by_lr = {g["lr"]: sorted(g["names"]) for g in groups}
    assert by_lr[1.0] == ["0.bias", "0.weight"]
    assert by_lr[0.5] == ["1.0.bias", "1.0.weight"]
    (k005,) = [k for k in by_lr if abs(k - 0.05) < 1e-12]
    assert by_lr[k005] == ["1.1.bias", "1.1.weight"]
    opt = ScaledAdam(get_parameter_groups_with_lrs(model, lr=0.045), lr=0.045)
    sched = Eden(opt)
    assert sorted(g["initial_lr"] for g in opt.param_groups) == pytest.approx([0.045 * 0.05, 0.045 * 0.5, 0.045])
    assert sched.get_last_lr()  # runs
    model(torch.randn(4, 3)).sum().backward()
    opt.step()


def test_clipping_limits_outlier_step():
    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(4, 4))
    opt = ScaledAdam([w], lr=0.01, clipping_scale=2.0, clipping_update_period=20)
    for _ in range(25):
        opt.zero_grad()
        w.grad = torch.randn(4, 4)
        opt.step()
    assert opt._clip["threshold"] is not None
    w.grad = 1000 * torch.randn(4, 4)
    factor = opt._clipping_factor([((w.grad * opt.state[w]["param_rms"]) ** 2).sum()])
    assert factor < 0.01


def _mixed_params(seed):
    """Shapes shared and unshared, scalars, a bf16 tensor and bf16 scalar, two lr groups."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (8, 5), (8, 5), (5,), (5,), (3, 4, 2), (), (), ()]
    ps = [nn.Parameter(torch.randn(s, generator=g) * 0.3) for s in shapes]
    ps += [nn.Parameter((torch.randn(8, 5, generator=g) * 0.3).bfloat16()),
           nn.Parameter(torch.tensor(0.5).bfloat16())]
    return ps


@pytest.mark.parametrize("clipping_scale", [None, 2.0])
def test_batched_scaled_adam_matches_one_tensor_at_a_time(clipping_scale):
    """The stacked update (forced on; the CPU default is per tensor) against the per-tensor loop: same
    parameters and state after steps that cross size updates (every 4), the irregular clipping updates (step 10)
    and skipped (None) gradients."""
    pa, pb = _mixed_params(0), _mixed_params(0)
    kw = dict(lr=0.05, clipping_scale=clipping_scale, clipping_update_period=12)
    opts = []
    for ps, batched in ((pa, True), (pb, False)):
        groups = [{"params": ps[:5] + ps[9:]}, {"params": ps[5:9], "lr": 0.02}]
        opts.append(ScaledAdam(groups, batched=batched, **kw))  # CPU: batched=None would not batch
    g = torch.Generator().manual_seed(1)
    for step in range(30):
        grads = [torch.randn(p.shape, generator=g) * (10.0 if step == 25 else 1.0) for p in pa]
        for ps, opt in zip((pa, pb), opts):
            for i, (p, gr) in enumerate(zip(ps, grads)):
                # parameter 1 (shares its shape with 0 and 2) and a scalar skip some steps
                p.grad = None if (i in (1, 7) and step % 3 == 1) else gr.to(p.dtype)
            opt.step()
    for a, b in zip(pa, pb):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6)
        sa, sb = opts[0].state[a], opts[1].state[b]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"]
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert sa[k].dtype == sb[k].dtype == torch.float32, k
                torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)
    assert opts[0].state[pa[1]]["step"] == 20  # skipped steps are not counted
    if clipping_scale is not None:
        assert opts[0]._clip["threshold"] == pytest.approx(opts[1]._clip["threshold"], rel=1e-5)


def _fp32_params(seed):
    """Shapes shared and unshared, scalars, one parameter that never gets a gradient."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (8, 5), (8, 5), (5,), (5,), (3, 4, 2), (), (), (), (6,)]
    return [nn.Parameter(torch.randn(s, generator=g) * 0.3) for s in shapes]


@pytest.mark.parametrize("clipping_scale,backend", [
    (None, "aot_eager"), (2.0, "aot_eager"), pytest.param(2.0, "inductor", marks=pytest.mark.slow)])
def test_compiled_scaled_adam_matches_the_eager_update(clipping_scale, backend):
    """ScaledAdam.compile (aot_eager: the graph as inductor gets it, run by eager kernels; inductor's generated
    kernels in the slow tier) against the per-tensor eager loop, over steps that cross the scale updates (every 4), the clipping
    updates (step 10, then every 12), a gradient spike, and gradients that are missing on some steps (their
    parameters keep their values and step counts) or always."""
    pa, pb = _fp32_params(0), _fp32_params(0)
    kw = dict(lr=0.05, clipping_scale=clipping_scale, clipping_update_period=12)
    opts = []
    for ps in (pa, pb):
        groups = [{"params": ps[:5] + ps[9:]}, {"params": ps[5:9], "lr": 0.02}]
        opts.append(ScaledAdam(groups, batched=False, **kw))
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    opts[0].compile(backend=counter)
    g = torch.Generator().manual_seed(1)
    for step in range(30):
        grads = [torch.randn(p.shape, generator=g) * (10.0 if step == 25 else 1.0) for p in pa]
        for ps, opt in zip((pa, pb), opts):
            for i, (p, gr) in enumerate(zip(ps, grads)):
                p.grad = None if (i in (1, 7) and step % 3 == 1) or i == 9 else gr.clone()
            opt.step()
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        sa, sb = opts[0].state[a], opts[1].state[b]
        if not sb:  # never had a gradient: eager made no state, the compiled step keeps an unused one
            assert sa["step"] == 0
            continue
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"]
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)
    assert opts[0].state[pa[1]]["step"] == 20  # skipped steps are not counted
    assert torch.equal(pa[9], _fp32_params(0)[9])
    assert counter.frame_count == 1  # one graph for every step
    if clipping_scale is not None:
        assert opts[0]._clip["threshold"] == pytest.approx(opts[1]._clip["threshold"], rel=1e-5)


def test_compiled_scaled_adam_runs_bf16_parameters_eager(caplog):
    pa, pb = _mixed_params(0), _mixed_params(0)
    opts = [ScaledAdam(ps, lr=0.05, batched=False) for ps in (pa, pb)]
    opts[0].compile(backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    with caplog.at_level("INFO", logger="asrprec.optim.scaled_adam"):
        for _ in range(3):
            grads = [torch.randn(p.shape, generator=g) for p in pa]
            for ps, opt in zip((pa, pb), opts):
                for p, gr in zip(ps, grads):
                    p.grad = gr.to(p.dtype)
                opt.step()
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    assert "does not take parameters or gradients that are not float32" in caplog.text
