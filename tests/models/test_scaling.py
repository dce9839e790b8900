"""Tests of asrprec.models.scaling against formulas evaluated independently in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from asrprec.models.scaling import (
    ActivationBalancer,
    BasicNorm,
    DoubleSwish,
    ScaledConv1d,
    ScaledConv2d,
    ScaledLinear,
    double_swish,
)

torch.set_num_threads(1)


def _randomize_scales(m: torch.nn.Module) -> None:
    with torch.no_grad():
        m.weight_scale.fill_(0.3)
        if m.bias is not None:
            m.bias.normal_()
            m.bias_scale.fill_(-0.7)


# ----------------------------------------------------------------------------- scaled layers


def test_scaled_linear_equals_linear_with_scaled_params():
    torch.manual_seed(0)
    m = ScaledLinear(6, 5)
    _randomize_scales(m)
    x = torch.randn(4, 3, 6)
    w = m.weight.double() * math.exp(0.3)
    b = m.bias.double() * math.exp(-0.7)
    ref = x.double() @ w.T + b
    torch.testing.assert_close(m(x).double(), ref, rtol=1e-5, atol=1e-6)
    # parameter layout: weight, bias, and one scalar log-scale each
    assert m.weight_scale.shape == () and m.bias_scale.shape == ()
    assert sum(p.numel() for p in m.parameters()) == 6 * 5 + 5 + 2
    nb = ScaledLinear(6, 5, bias=False)
    assert nb.get_bias() is None and sum(p.numel() for p in nb.parameters()) == 30 + 1


def test_scaled_linear_initial_effective_std():
    # effective weight std should be initial_scale / sqrt(fan_in) (like a default-initialised layer)
    torch.manual_seed(0)
    m = ScaledLinear(400, 300, initial_scale=0.25)
    std = m.get_weight().detach().double().std().item()
    assert std == pytest.approx(0.25 / math.sqrt(400), rel=0.02)
    assert torch.all(m.bias == 0)


def test_scaled_convs_equal_convs_with_scaled_params():
    torch.manual_seed(0)
    c1 = ScaledConv1d(4, 4, 3, padding=1, groups=4)
    _randomize_scales(c1)
    x = torch.randn(2, 4, 9)
    ref = F.conv1d(x.double(), c1.weight.double() * math.exp(0.3), c1.bias.double() * math.exp(-0.7),
                   padding=1, groups=4)
    torch.testing.assert_close(c1(x).double(), ref, rtol=1e-5, atol=1e-6)

    c2 = ScaledConv2d(2, 3, 3, stride=2)
    _randomize_scales(c2)
    x = torch.randn(2, 2, 9, 11)
    ref = F.conv2d(x.double(), c2.weight.double() * math.exp(0.3), c2.bias.double() * math.exp(-0.7), stride=2)
    torch.testing.assert_close(c2(x).double(), ref, rtol=1e-5, atol=1e-6)


def test_scaled_linear_grads_reach_scales():
    torch.manual_seed(0)
    m = ScaledLinear(3, 2)
    m(torch.randn(5, 3)).sum().backward()
    assert m.weight_scale.grad is not None and m.bias_scale.grad is not None


def test_scaled_layer_rejects_bad_scale():
    with pytest.raises(ValueError, match="initial_scale"):
        ScaledLinear(3, 2, initial_scale=0.0)


# ----------------------------------------------------------------------------- BasicNorm


def test_basic_norm_matches_formula():
    torch.manual_seed(0)
    m = BasicNorm(8, channel_dim=1, eps=0.5)
    with torch.no_grad():
        m.eps.fill_(math.log(0.7))
    x = torch.randn(3, 8, 5) * 3
    xd = x.double()
    ref = xd / torch.sqrt((xd**2).mean(dim=1, keepdim=True) + 0.7)
    torch.testing.assert_close(m(x).double(), ref, rtol=1e-6, atol=1e-6)
    assert m.eps.requires_grad
    m(x).sum().backward()
    assert m.eps.grad is not None and torch.isfinite(m.eps.grad)
    fixed = BasicNorm(8, learn_eps=False)
    assert len(list(fixed.parameters())) == 0


def test_basic_norm_keeps_dtype_and_uses_fp32_statistics():
    torch.manual_seed(0)
    m = BasicNorm(16)
    x = torch.randn(4, 16) * 50
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 0.25)
    y = m(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).dtype == torch.float32  # island: output in the input's dtype, not autocast's
        assert m(x.bfloat16()).dtype == torch.bfloat16
    m.to(torch.bfloat16)  # whole-model cast: eps becomes bf16, statistics still fp32
    assert m(x.bfloat16()).dtype == torch.bfloat16


def test_basic_norm_rejects_wrong_channels():
    with pytest.raises(ValueError, match="channels"):
        BasicNorm(8)(torch.randn(2, 7))


# ----------------------------------------------------------------------------- ActivationBalancer


def _balancer_input(dtype=torch.float32) -> torch.Tensor:
    """(N=200, C=4): c0 all negative, c1 all positive, c2 balanced with |x|~1, c3 balanced with tiny |x|."""
    torch.manual_seed(1)
    n = 200
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    mag = torch.rand(n) + 0.5
    x = torch.stack([-mag, mag, sign * mag, sign * 0.01 * mag], dim=1)
    return x.to(dtype)


def _expected_grad(x: torch.Tensor, g: torch.Tensor, *, min_positive, max_positive, max_factor, min_abs,
                   max_abs) -> torch.Tensor:
    """The documented rule, evaluated channel by channel with python floats in float64."""
    mn_pos, mx_pos, mn_abs, mx_abs = min_positive, max_positive, min_abs, max_abs
    x, g = x.double(), g.double()
    out = g.clone()
    for c in range(x.shape[1]):
        xc = x[:, c]
        p = (xc > 0).double().mean().item()
        factor = 0.0
        if p < mn_pos:
            factor += max_factor * (mn_pos - p) / mn_pos
        if p > mx_pos:
            factor -= max_factor * (p - mx_pos) / (1 - mx_pos)
        mean_abs = xc.abs().mean().item()
        direction = 1.0 if mean_abs < mn_abs else (-1.0 if mean_abs > mx_abs else 0.0)
        sgn = torch.where(xc > 0, 1.0, -1.0).double()
        out[:, c] = g[:, c] - g[:, c].abs() * (factor + direction * max_factor * sgn)
    return out


BAL = dict(min_positive=0.05, max_positive=0.95, max_factor=0.04, min_abs=0.2, max_abs=100.0)


@pytest.mark.parametrize("mode", ["fp32", "bf16-tensor", "cpu-autocast-bf16"])
def test_activation_balancer_identity_forward_and_shaped_backward(mode):
    x32 = _balancer_input()
    torch.manual_seed(2)
    g32 = torch.randn_like(x32)
    b = ActivationBalancer(channel_dim=1, prob=1.0, **BAL)
    if mode == "fp32":
        x = x32.clone().requires_grad_()
        y = b(x)
        g = g32
    elif mode == "bf16-tensor":
        x = x32.bfloat16().requires_grad_()
        y = b(x)
        g = g32.bfloat16()
    else:
        x = x32.clone().requires_grad_()
        # a real autocast producer: identity matmul under CPU bf16 autocast gives a bf16 tensor
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x @ torch.eye(4)
            assert h.dtype == torch.bfloat16
            h.retain_grad()
            y = b(h)
        g = g32.bfloat16()
    assert y.dtype == (torch.float32 if mode == "fp32" else torch.bfloat16)
    assert torch.equal(y.detach().float(), x.detach().float() if mode != "cpu-autocast-bf16" else h.detach().float())
    y.backward(g)
    x_seen = (x if mode != "cpu-autocast-bf16" else h).detach()
    grad = x.grad if mode != "cpu-autocast-bf16" else h.grad
    assert grad.dtype == g.dtype  # returned in the incoming dtype
    exp = _expected_grad(x_seen, g.float(), **BAL)
    tol = 1e-6 if mode == "fp32" else 2e-2
    torch.testing.assert_close(grad.double(), exp, rtol=tol, atol=tol)
    # directions: c0 (too few positive): grad lowered -> a descent step raises x
    assert torch.all(grad[:, 0].float() <= g[:, 0].float()) and torch.any(grad[:, 0].float() < g[:, 0].float())
    # c1 (too many positive): grad raised -> a descent step lowers x
    assert torch.all(grad[:, 1].float() >= g[:, 1].float()) and torch.any(grad[:, 1].float() > g[:, 1].float())
    # c2 within all bounds: untouched
    torch.testing.assert_close(grad[:, 2].float(), g[:, 2].float(), rtol=0, atol=0)
    # c3 |x| too small: the change moves x away from zero (descent step sign(x)·|Δ| grows |x|)
    delta = (g[:, 3].float() - grad[:, 3].float()) * torch.sign(x_seen[:, 3].float())
    assert torch.all(delta >= 0) and torch.any(delta > 0)


def test_activation_balancer_shrinks_too_large_values():
    x = (_balancer_input()[:, 2:3] * 500).requires_grad_()
    g = torch.ones_like(x)
    ActivationBalancer(channel_dim=1, prob=1.0, **BAL)(x).backward(g)
    # descent on grad: positive entries get a bigger grad (pushed down), negative ones a smaller (pushed up)
    pos = x.detach()[:, 0] > 0
    assert torch.all(x.grad[pos] > 1) and torch.all(x.grad[~pos] < 1)


def test_activation_balancer_is_noop_when_off():
    x = _balancer_input().requires_grad_()
    g = torch.randn_like(x)
    b = ActivationBalancer(channel_dim=1, prob=0.0, **BAL)
    b(x).backward(g)
    assert torch.equal(x.grad, g)
    x.grad = None
    b = ActivationBalancer(channel_dim=1, prob=1.0, **BAL).eval()
    assert b(x) is x
    with torch.no_grad():
        assert ActivationBalancer(channel_dim=1, prob=1.0)(x) is x


def test_activation_balancer_probability():
    torch.manual_seed(0)
    b = ActivationBalancer(channel_dim=1, prob=0.3, **BAL)
    x = _balancer_input().requires_grad_()
    applied = sum(b(x) is not x for _ in range(2000))
    assert 0.25 < applied / 2000 < 0.35


def test_activation_balancer_validates():
    with pytest.raises(ValueError):
        ActivationBalancer(channel_dim=1, min_positive=0.9, max_positive=0.1)
    with pytest.raises(ValueError):
        ActivationBalancer(channel_dim=1, prob=1.5)


# ----------------------------------------------------------------------------- DoubleSwish


def test_double_swish_value_and_gradcheck():
    x = torch.randn(7, 5, dtype=torch.float64) * 3
    torch.testing.assert_close(double_swish(x), x * torch.sigmoid(x - 1))
    assert torch.autograd.gradcheck(double_swish, x.clone().requires_grad_())


def test_double_swish_low_precision_dtypes():
    x = (torch.randn(64) * 4).requires_grad_()
    ref = x.double() * torch.sigmoid(x.double() - 1)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    for dt in (torch.bfloat16, torch.float16):
        xl = x.detach().to(dt).requires_grad_()
        y = DoubleSwish()(xl)
        assert y.dtype == dt
        y.sum().backward()
        assert xl.grad.dtype == dt
        torch.testing.assert_close(y.double(), ref.detach(), rtol=2e-2, atol=3e-2)
        torch.testing.assert_close(xl.grad.double(), ref_grad.double(), rtol=2e-2, atol=3e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert DoubleSwish()(torch.randn(3)).dtype == torch.float32  # follows its input, not autocast


def test_double_swish_without_autograd_saves_nothing():
    x = torch.randn(4, 6, dtype=torch.float64) * 3
    with torch.no_grad():
        y = double_swish(x.clone().requires_grad_())
    assert y.grad_fn is None
    torch.testing.assert_close(y, x * torch.sigmoid(x - 1))
    # an input that needs no gradient still gives the right value
    torch.testing.assert_close(double_swish(x), x * torch.sigmoid(x - 1))


def test_scaled_conv2d_channels_last_same_values_and_grads():
    torch.manual_seed(0)
    ref = ScaledConv2d(3, 5, kernel_size=3, stride=2, padding=1).double()
    cl = ScaledConv2d(3, 5, kernel_size=3, stride=2, padding=1, channels_last=True).double()
    cl.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    # an independent reference: plain conv2d with the effective weight w * exp(s)
    expect = torch.nn.functional.conv2d(x, ref.weight * ref.weight_scale.exp(), ref.bias * ref.bias_scale.exp(),
                                        stride=2, padding=1)
    y_ref, y_cl = ref(x), cl(x)
    torch.testing.assert_close(y_cl, expect)
    torch.testing.assert_close(y_ref, expect)
    assert y_cl.is_contiguous(memory_format=torch.channels_last) and not y_ref.is_contiguous(
        memory_format=torch.channels_last)
    y_ref.square().sum().backward()
    y_cl.square().sum().backward()
    for (name, a), b in zip(ref.named_parameters(), cl.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    assert cl.weight.is_contiguous()  # stored layout is the default one: checkpoints do not depend on the flag
    assert torch.autograd.gradcheck(cl, x[:1, :, :5, :5].clone().requires_grad_())

