"""Zipformer fast/lean paths against independent references: the autocast Linear (no saved weight copy), the
SimpleDownsample function, the channels-last ConvNeXt and the front-end's permuted-weight flatten."""

import pytest
import torch
import torch.nn.functional as F

from asrprec.models.zipformer.conv import _Conv2d
from asrprec.models.zipformer.frontend import ConvNeXt, ZipformerConv2dSubsampling
from asrprec.models.zipformer.layers import SimpleDownsample, _SimpleDownsampleFunction
from asrprec.models.zipformer.linear import Linear


def _swoosh_l_ref(x):
    return torch.log1p(torch.exp(x - 4.0)) - 0.08 * x - 0.035


def _saved_storages(fn):
    """Shapes/dtypes of the storages autograd saves while running fn()."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def test_autocast_linear_matches_autocast_and_saves_no_weight_copy():
    torch.manual_seed(0)
    lin = Linear(16, 8)
    ref = torch.nn.Linear(16, 8)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(5, 3, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, saved = _saved_storages(lambda: lin(x))
        yr = ref(xr)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, yr)  # same bf16 matmul
    # only the input's bf16 copy and the fp32 parameter itself; no bf16 copy of the (8, 16) weight
    assert not any(s[0] == (8, 16) and s[1] == torch.bfloat16 for s in saved)
    g = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, lin.weight, lin.bias), g)
    rx, rw, rb = torch.autograd.grad(yr, (xr, ref.weight, ref.bias), g)
    assert gx.dtype == gw.dtype == gb.dtype == torch.float32
    torch.testing.assert_close(gx, rx, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(gw, rw, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gb, rb, atol=1e-2, rtol=1e-2)
    # outside autocast it is plain nn.Linear
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced-form"])
def test_simple_downsample_against_loop_and_gradcheck(traced, monkeypatch):
    # the traced form (what torch.compile sees: padding by indexing, no tensor sized by the padding) is checked
    # in eager mode by switching it on
    from asrprec.models.zipformer import layers

    monkeypatch.setattr(layers, "is_tracing", lambda: traced)
    torch.manual_seed(1)
    for t, ds in [(8, 2), (7, 2), (9, 4), (5, 8), (10, 4), (1, 2)]:
        m = SimpleDownsample(ds).double()
        with torch.no_grad():
            m.bias.normal_()
        x = torch.randn(t, 2, 3, dtype=torch.float64, requires_grad=True)
        w = m.bias.softmax(0)
        ref = torch.stack([sum(w[k] * x[min(i * ds + k, t - 1)] for k in range(ds))
                           for i in range((t + ds - 1) // ds)])
        torch.testing.assert_close(m(x), ref)
        assert torch.autograd.gradcheck(lambda a, b: _SimpleDownsampleFunction.apply(a, b, ds), (x, m.bias))


def _convnext_ref(m, x):
    """icefall's NCHW formulation with plain ops (eval mode: no balancer/whiten/layer skip)."""
    h = F.conv2d(x, m.depthwise_conv.weight, m.depthwise_conv.bias, padding=m.padding, groups=x.shape[1])
    h = F.conv2d(h, m.pointwise_conv1.weight, m.pointwise_conv1.bias)
    h = F.conv2d(_swoosh_l_ref(h), m.pointwise_conv2.weight, m.pointwise_conv2.bias)
    return x + h


def test_convnext_channels_last_matches_nchw_reference():
    torch.manual_seed(2)
    m = ConvNeXt(8).double().eval()
    with torch.no_grad():
        m.pointwise_conv2.weight.normal_()  # undo the 0.01 init so the branch matters
    x = torch.randn(2, 8, 11, 6, dtype=torch.float64, requires_grad=True)
    y = m(x)
    xr = x.detach().clone().requires_grad_(True)
    yr = _convnext_ref(m, xr)
    torch.testing.assert_close(y, yr)
    g = torch.randn_like(yr)
    params = [m.depthwise_conv.weight, m.depthwise_conv.bias, m.pointwise_conv1.weight, m.pointwise_conv2.weight,
              m.pointwise_conv2.bias]
    got = torch.autograd.grad(y, [x] + params, g)
    want = torch.autograd.grad(yr, [xr] + params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("case", [((3, 1, 3, 5), (1, 1), (1, 2), 3), ((4, 3, 3, 3), (2, 2), (0, 0), 1),
                                  ((4, 3, 3, 3), (1, 2), (0, 1), 1)], ids=["depthwise", "stride-2", "stride-1x2"])
def test_conv_op_backward_gradcheck(case):
    # the custom-op backward (channels-last copies, for torch.compile) against finite differences
    wshape, stride, pad, groups = case
    torch.manual_seed(3)
    x = torch.randn(2, 3, 9, 7, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(*wshape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(wshape[0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: _Conv2d.apply(*a, stride, pad, groups), (x, w, b))
    # an input without gradient (the features into the first conv): the weight and bias gradients alone
    x0 = x.detach()
    assert torch.autograd.gradcheck(lambda *a: _Conv2d.apply(x0, *a, stride, pad, groups), (w, b))
    torch.testing.assert_close(_Conv2d.apply(x, w, b, stride, pad, groups),
                               F.conv2d(x, w, b, stride=stride, padding=pad, groups=groups))


def test_conv_ops_and_autocast():
    # opcheck: the fake (meta) kernel torch.compile traces with gives the real op's shapes, strides and dtypes
    torch.manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        for shape, wshape, stride, pad, groups in (((2, 4, 9, 6), (4, 1, 3, 3), (1, 1), (1, 1), 4),
                                                   ((2, 4, 1, 9), (4, 1, 1, 5), (1, 1), (0, 2), 4),
                                                   ((2, 4, 9, 7), (6, 4, 3, 3), (2, 2), (0, 0), 1),
                                                   ((2, 4, 8, 9), (6, 4, 3, 3), (1, 2), (0, 1), 1)):
            x = torch.randn(*shape, dtype=dtype)  # NCHW: the ops make their channels-last copies
            w = torch.randn(*wshape, dtype=dtype)
            args = (*stride, *pad, groups)
            torch.library.opcheck(torch.ops.asrprec.conv2d.default, (x, w, torch.randn(wshape[0], dtype=dtype), *args))
            g = torch.randn_like(F.conv2d(x, w, stride=stride, padding=pad, groups=groups))
            for input_grad in (True, False):
                torch.library.opcheck(torch.ops.asrprec.conv2d_backward.default, (g, x, w, *args, input_grad))
    # under CPU bf16 autocast: the gradients autograd gives for F.conv2d (bf16 conv, fp32 gradients)
    x = torch.randn(2, 4, 9, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(4, 1, 3, 5, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    g = torch.randn(2, 4, 9, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _Conv2d.apply(x, w, b, (1, 1), (1, 2), 4)
        yr = F.conv2d(x, w, b, padding=(1, 2), groups=4)
    assert y.dtype == yr.dtype == torch.bfloat16
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    got = torch.autograd.grad(y, (x, w, b), g.to(y.dtype))
    want = torch.autograd.grad(yr, (x, w, b), g.to(y.dtype))
    for a, r in zip(got, want):
        assert a.dtype == r.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=1e-2, atol=1e-2)


def test_frontend_flatten_matches_channel_major_flatten():
    torch.manual_seed(3)
    m = ZipformerConv2dSubsampling(40, 16).double().eval()
    x = torch.randn(2, 30, 40, dtype=torch.float64)
    lens = torch.tensor([30, 30])
    y, _ = m(x, lens)
    # reference: icefall's (B, T, C, F) flatten, NCHW throughout
    h = m.conv(x.unsqueeze(1))
    h = _convnext_ref(m.convnext, h)
    b, c, t, f = h.shape
    ref = m.out_norm(m.out(h.transpose(1, 2).reshape(b, t, c * f)))
    torch.testing.assert_close(y, ref)
