"""Zipformer2 encoder: published parameter counts, lengths, padding invariance, causality, precision smoke tests,
and the custom functions against their formulas / plain-autograd twins."""

import math

import pytest
import torch
import torch.nn.functional as F

from asrprec.models import ScheduledFloat, set_batch_count
from asrprec.models.zipformer import build_zipformer_encoder, swoosh_l, swoosh_r, zipformer_config
from asrprec.models.zipformer.activations import ActivationDropoutAndLinear, softmax
from asrprec.models.zipformer.layers import Zipformer2EncoderLayer
from asrprec.models.zipformer.norm import BiasNorm

# k2-fsa/icefall egs/librispeech/ASR/RESULTS.md (front-end / Zipformer2 / head / total)
PUBLISHED = {
    "small": (611_953, 21_377_826, 1_295_836, 23_285_615),
    "medium": (611_953, 63_382_150, 1_554_908, 65_549_011),
    "large": (611_953, 146_013_641, 1_813_980, 148_439_574),
}


def _head_params(encoder_dim: int, vocab: int = 500, decoder_dim: int = 512, joiner_dim: int = 512,
                 context: int = 2) -> int:
    """Transducer head as icefall builds it: stateless decoder (Embedding + grouped Conv1d, groups=dim//4, no
    bias), joiner (enc/dec projections + output linear), and the two "simple" projections of the pruned loss."""
    decoder = vocab * decoder_dim + decoder_dim * (decoder_dim // (decoder_dim // 4)) * context
    joiner = (encoder_dim * joiner_dim + joiner_dim) + (decoder_dim * joiner_dim + joiner_dim) + \
        (joiner_dim * vocab + vocab)
    simple = (encoder_dim * vocab + vocab) + (decoder_dim * vocab + vocab)
    return decoder + joiner + simple


def _count(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_parameter_counts_match_published(size):
    with torch.device("meta"):
        enc = build_zipformer_encoder(size=size)
    cfg = zipformer_config(size)
    fe, zf, head, total = PUBLISHED[size]
    assert _head_params(cfg.output_dim) == head
    assert _count(enc.encoder_embed) == fe
    # icefall carries an unused per-layer ``bypass_scale`` (embed_dim params, "TODO remove"); we leave it out.
    unused = sum(n * d for n, d in zip(cfg.num_encoder_layers, cfg.encoder_dim))
    assert _count(enc.encoder) + unused == zf
    ours_total = _count(enc) + _head_params(enc.output_dim)
    assert abs(ours_total - total) / total < 1e-3


def test_causal_medium_matches_streaming_count():
    # RESULTS.md: medium streaming (--causal 1) has 66.11 M parameters.
    with torch.device("meta"):
        enc = build_zipformer_encoder(size="medium", causal=True)
    cfg = zipformer_config("medium")
    unused = sum(n * d for n, d in zip(cfg.num_encoder_layers, cfg.encoder_dim))
    total = _count(enc) + unused + _head_params(enc.output_dim)
    assert round(total / 1e6, 2) == 66.11


# icefall's six-stack layout (1, 2, 4, 8, 4, 2) at tiny widths: the structural tests run on it as well as on the
# three-stack ``tiny`` preset, so the 8x stack and the unequal-width bypasses stay covered.
SIX_STACK = dict(downsampling_factor=(1, 2, 4, 8, 4, 2), encoder_dim=(64, 96, 96, 96, 96, 96),
                 feedforward_dim=(192, 256, 256, 256, 256, 256), cnn_module_kernel=(15, 15, 7, 7, 7, 15))


def test_tiny_is_small():
    with torch.device("meta"):
        enc = build_zipformer_encoder(size="tiny")
        six = build_zipformer_encoder(size="tiny", **SIX_STACK)
    assert enc.encoder.downsampling_factor == (2, 4, 2)
    assert 0.5e6 <= _count(enc) <= 3e6
    assert _count(enc) < _count(six) <= 3e6


def test_config_errors():
    with pytest.raises(ValueError, match="unknown ZipformerConfig keys"):
        build_zipformer_encoder(size="tiny", encoder_dims=(1,))
    with pytest.raises(ValueError, match="unknown Zipformer size"):
        build_zipformer_encoder(size="huge")
    with pytest.raises(ValueError, match="entries but there are 3 stacks"):
        build_zipformer_encoder(size="tiny", num_encoder_layers=(1, 2))
    with pytest.raises(ValueError, match="entries but there are 6 stacks"):
        build_zipformer_encoder(size="tiny", **SIX_STACK, num_encoder_layers=(1, 2))


@pytest.fixture(scope="module", params=["three-stack", "six-stack"])
def tiny(request):
    torch.manual_seed(0)
    overrides = SIX_STACK if request.param == "six-stack" else {}
    return build_zipformer_encoder(size="tiny", **overrides).eval()


def test_output_lengths(tiny):
    lens = torch.tensor([61, 40, 9, 58])
    x = torch.randn(4, 61, 80)
    with torch.no_grad():
        y, ylens = tiny(x, lens)
    assert y.shape == (4, ((61 - 7) // 2 + 1) // 2, tiny.output_dim)
    assert ylens.tolist() == [((t - 7) // 2 + 1) // 2 for t in lens.tolist()]
    with pytest.raises(ValueError, match="at least 9"):
        tiny(torch.randn(1, 8, 80), torch.tensor([8]))
    with pytest.raises(ValueError, match=r"\(B, T, 80\)"):
        tiny(torch.randn(1, 20, 40), torch.tensor([20]))


def test_padding_invariance(tiny):
    torch.manual_seed(1)
    lens = [75, 52, 33]
    feats = [torch.randn(n, 80) for n in lens]
    batch = torch.zeros(3, max(lens), 80)
    for i, f in enumerate(feats):
        batch[i, : lens[i]] = f
    with torch.no_grad():
        y, ylens = tiny(batch, torch.tensor(lens))
        for i, f in enumerate(feats):
            yi, yli = tiny(f.unsqueeze(0), torch.tensor([lens[i]]))
            assert int(yli) == int(ylens[i])
            torch.testing.assert_close(y[i, : int(yli)], yi[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("overrides", [{}, SIX_STACK], ids=["three-stack", "six-stack"])
def test_causal_chunks_ignore_future(overrides):
    torch.manual_seed(2)
    enc = build_zipformer_encoder(size="tiny", causal=True, **overrides).eval()
    chunk = 16  # 50 Hz frames
    t_in = 160
    x = torch.randn(1, t_in, 80)
    lens = torch.tensor([t_in])
    with torch.no_grad():
        y0, _ = enc(x, lens, chunk_size=chunk, left_context_frames=64)
        # first two chunks end at 50 Hz frame 31; the front-end looks at input frames up to 2*t + 14 for
        # 50 Hz frame t (conv stack 2t+8, ConvNeXt +3 frames), so input frames > 2*31 + 14 = 76 are the future.
        x2 = x.clone()
        x2[:, 77:] += 5.0 * torch.randn_like(x2[:, 77:])
        y1, _ = enc(x2, lens, chunk_size=chunk, left_context_frames=64)
        n_out = 2 * chunk // 2  # 25 Hz frames covering the first two chunks
        torch.testing.assert_close(y1[:, :n_out], y0[:, :n_out], atol=1e-5, rtol=1e-5)
        assert (y1[:, n_out:] - y0[:, n_out:]).abs().max() > 1e-3  # later frames do see it
        # without chunking (full context) the early frames change too
        yf0, _ = enc(x, lens, chunk_size=-1)
        yf1, _ = enc(x2, lens, chunk_size=-1)
        assert (yf1[:, :n_out] - yf0[:, :n_out]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="multiple of every downsampling factor"):
        enc(x, lens, chunk_size=6)


def test_noncausal_rejects_chunking(tiny):
    with pytest.raises(ValueError, match="causal=True"):
        tiny(torch.randn(1, 40, 80), torch.tensor([40]), chunk_size=16)


def _train_step(enc, x, lens, autocast_dtype=None):
    enc.train()
    set_batch_count(enc, 500)
    enc.zero_grad()
    ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else torch.autocast(
        "cpu", enabled=False)
    with ctx:
        y, ylens = enc(x, lens)
        loss = (y.float() ** 2).mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in enc.parameters() if p.grad is not None]
    assert len(grads) > 0.9 * len(list(enc.parameters()))
    for p in enc.parameters():
        if p.grad is not None:
            assert p.grad.dtype == p.dtype
            assert torch.isfinite(p.grad).all()
    return y


@pytest.mark.parametrize("policy", ["fp32", "amp-fp16", "amp-bf16", "bf16"])
def test_training_step_finite(policy):
    torch.manual_seed(3)
    enc = build_zipformer_encoder(size="tiny")
    x = torch.randn(2, 64, 80)
    lens = torch.tensor([64, 50])
    if policy == "bf16":
        enc = enc.to(torch.bfloat16)
        y = _train_step(enc, x.to(torch.bfloat16), lens)
        assert y.dtype == torch.bfloat16
    else:
        dt = {"fp32": None, "amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}[policy]
        y = _train_step(enc, x, lens, dt)
        assert y.dtype == torch.float32


def test_set_batch_count_drives_schedules():
    enc = build_zipformer_encoder(size="tiny").train()
    sfs = [m for m in enc.modules() if isinstance(m, ScheduledFloat)]
    assert sfs
    layer = next(m for m in enc.modules() if isinstance(m, Zipformer2EncoderLayer))
    assert float(layer.attention_skip_rate) == 0.0  # batch count unset -> default
    set_batch_count(enc, 0)
    assert float(layer.attention_skip_rate) == pytest.approx(0.2)
    set_batch_count(enc, 2000)
    assert float(layer.attention_skip_rate) == pytest.approx(0.125)
    enc.eval()
    assert float(layer.attention_skip_rate) == 0.0
    sf = ScheduledFloat((0.0, 1.0), (10.0, 3.0))
    set_batch_count(sf, 5)
    assert float(sf) == 2.0


# ---- custom functions ---------------------------------------------------------------------------------------

def _swoosh_ref(x, offset, const):
    return torch.log1p(torch.exp(x - offset)) - 0.08 * x - const


@pytest.mark.parametrize("fn,offset,const", [(swoosh_l, 4.0, 0.035), (swoosh_r, 1.0, 0.313261687)])
def test_swoosh_values_and_derivatives(fn, offset, const):
    x64 = torch.linspace(-12, 12, 2001, dtype=torch.float64)
    ref = _swoosh_ref(x64, offset, const)
    dref = torch.sigmoid(x64 - offset) - 0.08  # d/dx log(1+e^(x-a)) = sigmoid(x-a)
    x = x64.float().requires_grad_(True)
    y = fn(x)
    torch.testing.assert_close(y.double(), ref, atol=1e-6, rtol=1e-6)
    (g,) = torch.autograd.grad(y.sum(), x)
    # derivative stored as uint8 over a range of width 1.0: error <= 1/510
    assert (g.double() - dref).abs().max() <= 1.0 / 510 + 1e-6
    if fn is swoosh_r:
        assert abs(fn(torch.zeros(1)).item()) < 1e-6
    for dt in (torch.bfloat16, torch.float16):
        xd = x.detach().to(dt).requires_grad_(True)
        yd = fn(xd)
        assert yd.dtype == dt
        (gd,) = torch.autograd.grad(yd.sum(), xd)
        assert gd.dtype == dt


@pytest.mark.parametrize("fn,offset,const", [(swoosh_l, 4.0, 0.035), (swoosh_r, 1.0, 0.313261687)])
def test_swoosh_far_from_zero(fn, offset, const):
    # log(1 + e^z) written without overflow in float64: max(z, 0) + log1p(e^-|z|); far out the CPU's softplus must
    # keep the linear part and never overflow, with and without autograd
    x64 = torch.cat([torch.linspace(-1e4, 1e4, 2001, dtype=torch.float64),
                     torch.linspace(-100, 100, 2001, dtype=torch.float64)])
    z = x64 - offset
    ref = z.clamp_min(0) + torch.log1p(torch.exp(-z.abs())) - 0.08 * x64 - const
    for requires_grad in (False, True):
        y = fn(x64.float().requires_grad_(requires_grad))
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.double(), ref, atol=1e-6, rtol=1e-6)


def test_activation_dropout_linear_matches_plain():
    torch.manual_seed(4)
    m = ActivationDropoutAndLinear(16, 8, activation="SwooshR", dropout_p=0.0).double()
    x = torch.randn(5, 3, 16, dtype=torch.float64, requires_grad=True)
    y = m(x)
    xr = x.detach().clone().requires_grad_(True)
    w = m.weight.detach().clone().requires_grad_(True)
    b = m.bias.detach().clone().requires_grad_(True)
    yr = F.linear(_swoosh_ref(xr, 1.0, 0.313261687), w, b)
    torch.testing.assert_close(y, yr)
    g = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, m.weight, m.bias), g)
    rx, rw, rb = torch.autograd.grad(yr, (xr, w, b), g)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    torch.testing.assert_close(gb, rb)


def test_biasnorm_against_formula_and_gradcheck():
    torch.manual_seed(5)
    norm = BiasNorm(6).double().eval()
    with torch.no_grad():
        norm.bias.uniform_(-1, 1)
        norm.log_scale.fill_(0.3)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    ref = x * math.exp(0.3) / ((x - norm.bias) ** 2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(norm(x), ref)
    assert torch.autograd.gradcheck(lambda a, b, s: _bn(a, b, s), (x, norm.bias, norm.log_scale))
    xb = torch.randn(4, 6, dtype=torch.bfloat16)
    assert BiasNorm(6)(xb).dtype == torch.bfloat16


def _bn(x, b, s):
    from asrprec.models.zipformer.norm import _BiasNormFunction
    return _BiasNormFunction.apply(x, b, s, -1)


def test_softmax_function_gradcheck_and_dtype():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: softmax(a, -1), (x,))
    xf = torch.randn(3, 7, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = softmax(xf, -1)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert xf.grad.dtype == torch.float32


def test_bypass_function_matches_plain():
    from asrprec.models.zipformer.layers import bypass
    torch.manual_seed(6)
    for scale_shape in [(5,), (3, 5)]:
        a = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
        b = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
        s = torch.rand(*scale_shape, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(bypass, (a, b, s))
        torch.testing.assert_close(bypass(a, b, s), a + (b - a) * s)


def test_frontend_channels_set_the_front_end_widths():
    enc = build_zipformer_encoder(size="tiny", frontend_channels=(4, 8, 16))
    convs = [m for m in enc.encoder_embed.conv if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [4, 8, 16]
    # the output projection flattens (channels x 19 frequency bins) of 80-dim features
    assert enc.encoder_embed.out.in_features == 16 * 19
    # the front-end's parameters follow the textbook conv/linear counts (ConvNeXt: depthwise 7x7, 1x1 up 3x, 1x1 down)
    c1, c2, c3, d = 4, 8, 16, enc.encoder_embed.out.out_features
    expect = (9 * c1 + c1) + (9 * c1 * c2 + c2) + (9 * c2 * c3 + c3) + (49 * c3 + c3) + (c3 * 3 * c3 + 3 * c3) \
        + (3 * c3 * c3 + c3) + (19 * c3 * d + d)
    fe = enc.encoder_embed
    got = sum(p.numel() for n, p in fe.named_parameters() if not n.startswith("out_norm"))
    assert got == expect
    enc.eval()
    out, lens = enc(torch.randn(2, 107, 80), torch.tensor([107, 60]))
    assert lens.tolist() == [((107 - 7) // 2 + 1) // 2, ((60 - 7) // 2 + 1) // 2]
    with pytest.raises(ValueError, match="frontend_channels"):
        zipformer_config("tiny", frontend_channels=(8, 32))



@pytest.mark.parametrize("ratio", [0, 1, 2])
def test_convnext_hidden_ratio_sets_or_removes_the_convnext(ratio):
    c1, c2, c3 = 4, 8, 16
    enc = build_zipformer_encoder(size="tiny", frontend_channels=(c1, c2, c3), convnext_hidden_ratio=ratio)
    fe = enc.encoder_embed
    d = fe.out.out_features
    # textbook counts: three 3x3 convs, the ConvNeXt (depthwise 7x7, 1x1 up by `ratio`, 1x1 down), the projection
    convs = (9 * c1 + c1) + (9 * c1 * c2 + c2) + (9 * c2 * c3 + c3)
    convnext = (49 * c3 + c3) + (c3 * ratio * c3 + ratio * c3) + (ratio * c3 * c3 + c3) if ratio else 0
    got = sum(p.numel() for n, p in fe.named_parameters() if not n.startswith("out_norm"))
    assert got == convs + convnext + (19 * c3 * d + d)
    assert (fe.convnext is None) == (ratio == 0)
    enc.eval()
    out, lens = enc(torch.randn(2, 107, 80), torch.tensor([107, 60]))
    assert lens.tolist() == [((107 - 7) // 2 + 1) // 2, ((60 - 7) // 2 + 1) // 2]
    assert torch.isfinite(out).all()


def test_convnext_hidden_ratio_and_dropout_errors():
    with pytest.raises(ValueError, match="convnext_hidden_ratio"):
        zipformer_config("tiny", convnext_hidden_ratio=-1)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="dropout"):
            zipformer_config("tiny", dropout=bad)


def test_dropout_constant_or_icefall_schedule():
    def ff_rates(enc):
        return {round(float(m.out_proj.dropout_p), 6) for n, m in enc.named_modules()
                if type(m).__name__ == "FeedforwardModule"}

    enc = build_zipformer_encoder(size="tiny", dropout=None)  # the tiny preset itself has dropout 0
    set_batch_count(enc, 0.0)
    assert ff_rates(enc) == {0.3} and float(enc.encoder_embed.dropout.p) == 0.3
    set_batch_count(enc, 20000.0)
    assert ff_rates(enc) == {0.1} and float(enc.encoder_embed.dropout.p) == pytest.approx(0.1)
    enc = build_zipformer_encoder(size="tiny", dropout=0.05)
    for n in (0.0, 20000.0):
        set_batch_count(enc, n)
        assert ff_rates(enc) == {0.05} and float(enc.encoder_embed.dropout.p) == 0.05
    assert zipformer_config("tiny").dropout == 0.0 and zipformer_config("small").dropout is None
    assert ff_rates(build_zipformer_encoder(size="tiny")) == {0.0}


def test_convolution_module_matches_a_conv1d_reference():
    """The non-causal conv module (depthwise conv run as a channels-last 2-D conv) against the textbook
    Conv1d formulation, written out in float64: values and the input gradient, with padded frames."""
    from asrprec.models.zipformer.layers import ConvolutionModule

    torch.manual_seed(3)
    m = ConvolutionModule(12, kernel_size=7, causal=False).double().eval()
    T, B = 9, 3
    x = torch.randn(T, B, 12, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 6:] = True
    mask[2, 4:] = True

    def reference(x):
        h = F.linear(x, m.in_proj.weight, m.in_proj.bias)
        a, gate = h.chunk(2, dim=-1)
        a = (a * torch.sigmoid(gate)).permute(1, 2, 0)  # (B, D, T)
        a = a.masked_fill(mask.unsqueeze(1), 0.0)
        a = F.conv1d(a, m.depthwise_conv.weight, m.depthwise_conv.bias, padding=3, groups=12)
        a = a.permute(2, 0, 1)
        a = F.softplus(a - 1.0) - 0.08 * a - 0.313261687  # SwooshR by its formula (exact autograd derivative)
        return F.linear(a, m.out_proj.weight, m.out_proj.bias)

    got = m(x, key_padding_mask=mask)
    want = reference(x)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    (gx,) = torch.autograd.grad(got, x, g)
    (wx,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(gx, wx)


def test_configure_streaming_fixes_the_decoding_chunk():
    from asrprec.models import build_transducer, configure_streaming

    torch.manual_seed(3)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=16,
                             encoder_overrides={"causal": True}).eval()
    x, lens = torch.randn(2, 120, 80), torch.tensor([120, 90])
    with pytest.raises(ValueError, match="--chunk-size 32"):
        configure_streaming(model, None, None)  # trained on several chunk sizes: decoding must pick one
    with pytest.raises(ValueError, match="left context"):
        configure_streaming(model, 32, None)
    with pytest.raises(ValueError, match="multiple of every downsampling factor"):
        configure_streaming(model, 6, 64)
    assert configure_streaming(model, 32, 64) == "chunk-32-left-64"
    with torch.no_grad():
        explicit, _ = model.encoder(x, lens, chunk_size=32, left_context_frames=64)
        fixed = [model.encode(x, lens)[0] for _ in range(3)]  # no random draw any more
    for y in fixed:
        torch.testing.assert_close(y, explicit)
    assert configure_streaming(model, -1, None) == "causal-full-context"
    with torch.no_grad():
        full, _ = model.encoder(x, lens, chunk_size=-1)
        torch.testing.assert_close(model.encode(x, lens)[0], full)
    plain = build_transducer(encoder="zipformer", size="tiny", vocab_size=16)
    assert configure_streaming(plain, None, None) == ""
    with pytest.raises(ValueError, match="not causal"):
        configure_streaming(plain, 32, 64)
    conformer = build_transducer(encoder="conformer", size="tiny", vocab_size=16, encoder_overrides={"num_layers": 1})
    assert configure_streaming(conformer, None, None) == ""


def _balancer_grad_by_autograd(x, g, limits, grad_scale, channel_dim):
    """icefall's formulation: autograd through the per-channel statistics' penalty, in float64."""
    min_mean, max_mean, min_rms, max_rms = limits
    xf = x.detach().double().requires_grad_(True)
    dims = [i for i in range(x.ndim) if i != channel_dim % x.ndim]
    mean = xf.mean(dim=dims, keepdim=True)
    msq = (xf ** 2).mean(dim=dims, keepdim=True)
    std = (msq - mean ** 2).sqrt()
    rms = msq.sqrt()
    m = mean / std
    loss = ((m - m.clamp(min_mean, max_mean)).abs() + (rms.clamp(min_rms, max_rms) / rms).log().abs()).sum()
    (lg,) = torch.autograd.grad(loss, xf)
    lg_rms = (lg ** 2).mean(dim=dims, keepdim=True).sqrt().clamp(min=1e-20)
    gd = g.double()
    return gd + gd.abs() * lg * (grad_scale / lg_rms)


@pytest.mark.parametrize("channel_dim,shape", [(-1, (7, 3, 6)), (1, (3, 6, 5, 4))])
def test_balancer_grad_matches_autograd_of_its_penalty(channel_dim, shape):
    from asrprec.models.zipformer.grad_shaping import balancer_grad

    torch.manual_seed(11)
    x = torch.randn(*shape, dtype=torch.float64)
    c = x.shape[channel_dim]
    view = [1] * x.ndim
    view[channel_dim] = c
    # per channel: mean too high, mean too low, rms too small, rms too large, both violated, within limits
    shift = torch.tensor([3.0, -3.0, 0.0, 0.0, 2.5, 0.1]).reshape(view)
    scale = torch.tensor([1.0, 1.0, 0.05, 20.0, 0.02, 1.0]).reshape(view)
    x = x * scale + shift * scale
    g = torch.randn_like(x)
    limits = (-1.0, 1.0, 0.5, 4.0)
    got = balancer_grad(x, g, limits, 0.04, channel_dim)
    want = _balancer_grad_by_autograd(x, g, limits, 0.04, channel_dim)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    within = [slice(None)] * x.ndim
    within[channel_dim] = 5
    assert torch.equal(got[tuple(within)], g[tuple(within)])  # no extra term inside the limits
    assert not torch.allclose(got, g)  # and the violating channels do get one


def test_balancer_module_backward_in_fp32_and_bf16():
    from asrprec.models.zipformer.grad_shaping import Balancer, _abs_to_rms, _proportion_positive_to_mean

    torch.manual_seed(12)
    b = Balancer(4, channel_dim=-1, min_positive=0.3, max_positive=0.7, min_abs=0.5, max_abs=2.0, prob=1.0).train()
    x32 = torch.randn(50, 4) * torch.tensor([1.0, 0.1, 10.0, 1.0]) + torch.tensor([0.0, 0.0, 0.0, 3.0])
    g = torch.randn(50, 4)
    limits = (_proportion_positive_to_mean(0.3), _proportion_positive_to_mean(0.7), _abs_to_rms(0.5),
              _abs_to_rms(2.0))
    want = _balancer_grad_by_autograd(x32, g, limits, 0.04, -1)
    x = x32.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(b(x), x, g)
    torch.testing.assert_close(gx.double(), want, rtol=1e-4, atol=1e-6)
    xb = x32.bfloat16().requires_grad_(True)
    (gb,) = torch.autograd.grad(b(xb), xb, g.bfloat16())
    assert gb.dtype == torch.bfloat16
    # statistics from the bf16-rounded input; the result rounded to bf16
    want_b = _balancer_grad_by_autograd(x32.bfloat16(), g.bfloat16(), limits, 0.04, -1)
    torch.testing.assert_close(gb.double(), want_b, rtol=2e-2, atol=2e-2)
