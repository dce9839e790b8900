"""Tests of the Conv2d front-end and the reworked Conformer encoder."""

from __future__ import annotations

import math

import pytest
import torch

from asrprec.models import build_transducer, make_pad_mask
from asrprec.models.conformer import (
    CONFORMER_PRESETS,
    RENAMED_FIELDS,
    ConformerEncoder,
    RelPositionMultiheadAttention,
    build_conformer_encoder,
    rel_positional_encoding,
)
from asrprec.models.subsampling import Conv2dSubsampling, conv2d_subsampling_output_lens

torch.set_num_threads(1)


def _n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ----------------------------------------------------------------------------- front-end


def _conv_out(n: int, k: int, s: int, p: int) -> int:
    """Textbook conv output length floor((n + 2p - k)/s) + 1."""
    return (n + 2 * p - k) // s + 1


def test_front_end_length_formula():
    torch.manual_seed(0)
    fe = Conv2dSubsampling(80, 16).eval()
    for T in range(7, 41):
        expected = _conv_out(_conv_out(_conv_out(T, 3, 1, 1), 3, 2, 0), 3, 2, 0)
        assert conv2d_subsampling_output_lens(T) == expected == ((T - 1) // 2 - 1) // 2
        out, out_lens = fe(torch.randn(1, T, 80), torch.tensor([T]))
        assert out.shape == (1, expected, 16)
        assert out_lens.tolist() == [expected]
    lens = torch.arange(7, 100)
    assert torch.equal(conv2d_subsampling_output_lens(lens), ((lens - 1) // 2 - 1) // 2)
    with pytest.raises(ValueError, match="at least 7"):
        fe(torch.randn(1, 6, 80))
    with pytest.raises(ValueError, match="shape"):
        fe(torch.randn(1, 20, 40))


# ----------------------------------------------------------------------------- positional encoding / attention


def test_rel_positional_encoding_formula():
    T, D = 5, 8
    pe = rel_positional_encoding(T, D)
    assert pe.shape == (1, 2 * T - 1, D) and pe.dtype == torch.float32
    for n in range(2 * T - 1):
        r = T - 1 - n  # row n encodes relative position r = i - j
        for k in range(D // 2):
            w = 10000.0 ** (-2 * k / D)
            assert pe[0, n, 2 * k].item() == pytest.approx(math.sin(r * w), abs=1e-6)
            assert pe[0, n, 2 * k + 1].item() == pytest.approx(math.cos(r * w), abs=1e-6)


def test_rel_shift_picks_relative_position():
    B, H, T = 2, 3, 6
    n = torch.arange(2 * T - 1)
    i = torch.arange(T)
    # bd[b, h, i, n] encodes (query i, relative position T-1-n)
    bd = ((T - 1 - n)[None, :] + 100 * i[:, None]).float().expand(B, H, T, 2 * T - 1)
    out = RelPositionMultiheadAttention.rel_shift(bd)
    expected = (i[:, None] - i[None, :]) + 100 * i[:, None]  # relative position i - j
    assert torch.equal(out, expected.float().expand(B, H, T, T))


def test_attention_ignores_padded_keys():
    torch.manual_seed(0)
    att = RelPositionMultiheadAttention(16, 4).eval()
    x = torch.randn(1, 9, 16)
    mask = make_pad_mask(torch.tensor([6]), 9)
    pe = rel_positional_encoding(9, 16)
    y1 = att(x, pe, mask)
    x2 = x.clone()
    x2[:, 6:] = 1e4  # garbage in padded frames must not leak into valid queries
    y2 = att(x2, pe, mask)
    torch.testing.assert_close(y1[:, :6], y2[:, :6])
    assert torch.isfinite(y2).all()


# ----------------------------------------------------------------------------- encoder


def test_encoder_output_shape_and_lens():
    torch.manual_seed(0)
    enc = build_conformer_encoder(size="tiny")
    lens = torch.tensor([83, 60, 7])
    out, out_lens = enc(torch.randn(3, 83, 80), lens)
    assert enc.output_dim == 144
    assert out.shape == (3, ((83 - 1) // 2 - 1) // 2, 144) and out.dtype == torch.float32
    assert out_lens.tolist() == [((L - 1) // 2 - 1) // 2 for L in lens.tolist()]
    assert out_lens.dtype == torch.int64


def test_encoder_rejects_bad_lengths():
    enc = build_conformer_encoder(size="tiny", num_encoder_layers=1)
    with pytest.raises(ValueError, match="feature_lens"):
        enc(torch.randn(2, 30, 80), torch.tensor([30, 5]))
    with pytest.raises(ValueError, match="feature_lens"):
        enc(torch.randn(2, 30, 80), torch.tensor([31, 20]))
    with pytest.raises(ValueError, match="feature_lens"):
        enc(torch.randn(2, 30, 80), torch.tensor([30]))


def test_padding_invariance_eval():
    torch.manual_seed(0)
    enc = build_conformer_encoder(size="tiny", num_encoder_layers=2).eval()
    lens = [61, 46, 31]  # different residues mod 4 exercise the front-end's right edge
    T = max(lens)
    utts = [torch.randn(L, 80) for L in lens]
    batch = torch.full((3, T, 80), 7.5)  # arbitrary padding value
    for b, u in enumerate(utts):
        batch[b, : lens[b]] = u
    with torch.no_grad():
        out, out_lens = enc(batch, torch.tensor(lens))
        for b, u in enumerate(utts):
            alone, alone_lens = enc(u[None], torch.tensor([lens[b]]))
            L = int(out_lens[b])
            assert L == int(alone_lens[0]) == alone.shape[1]
            torch.testing.assert_close(out[b, :L], alone[0], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("mode", ["amp-bf16", "amp-fp16", "model-bf16"])
def test_training_step_is_finite(mode):
    torch.manual_seed(0)
    enc = build_conformer_encoder(size="tiny").train()
    # make every balancer fire so its low-precision backward is exercised
    for m in enc.modules():
        if hasattr(m, "prob"):
            m.prob = 1.0
    feats = torch.randn(3, 64, 80)
    lens = torch.tensor([64, 50, 33])
    if mode == "model-bf16":
        enc.to(torch.bfloat16)
        out, out_lens = enc(feats, lens, warmup=0.5)  # fp32 features are cast to the model dtype
        want = torch.bfloat16
    else:
        dt = torch.bfloat16 if mode == "amp-bf16" else torch.float16
        with torch.autocast("cpu", dtype=dt):
            out, out_lens = enc(feats, lens, warmup=0.5)
        want = dt
    assert out.dtype == want  # nothing (e.g. a positional-encoding buffer) upcast the activations
    mask = ~make_pad_mask(out_lens, out.shape[1])
    loss = (out.float() ** 2 * mask[..., None]).sum() / mask.sum()
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad).all(), name


def test_warmup_bypass():
    torch.manual_seed(0)
    enc = build_conformer_encoder(size="tiny", num_encoder_layers=2, dropout=0.0, layer_dropout=0.0)
    feats = torch.randn(2, 40, 80)
    lens = torch.tensor([40, 29])
    with torch.no_grad():
        enc.eval()
        ev0, _ = enc(feats, lens, warmup=0.0)
        ev1, _ = enc(feats, lens, warmup=1.0)
        torch.testing.assert_close(ev0, ev1, rtol=0, atol=0)  # eval ignores warmup
        # independent reference for warmup=0 in training: each layer's output mixed 0.1 / 0.9 with its input
        x, out_lens = enc.encoder_embed(feats, lens)
        x, pe = enc.encoder_pos(x)
        mask = make_pad_mask(out_lens, x.shape[1])
        for layer in enc.layers:
            x = 0.1 * layer(x, pe, mask) + 0.9 * x
        enc.train()
        tr0, _ = enc(feats, lens, warmup=0.0)
        tr1, _ = enc(feats, lens, warmup=1.0)
    torch.testing.assert_close(tr0, x, rtol=1e-5, atol=1e-5)
    assert (tr0 - ev0).abs().max() > 1e-2  # warm-up changes the training forward
    # fully warmed up with no dropout: training forward equals eval forward (balancers are forward identities)
    torch.testing.assert_close(tr1, ev1, rtol=1e-5, atol=1e-5)


def test_layer_dropout_draws():
    torch.manual_seed(0)
    layer = build_conformer_encoder(size="tiny", num_encoder_layers=1, layer_dropout=0.25).layers[0].train()
    alphas = [layer.bypass_alpha(1.0) for _ in range(4000)]
    assert set(alphas) == {1.0, 0.1}
    assert alphas.count(0.1) / 4000 == pytest.approx(0.25, abs=0.03)
    assert layer.eval().bypass_alpha(0.0) == 1.0


# ----------------------------------------------------------------------------- builder and parameter counts


def _closed_form_params(F_in: int, D: int, L: int, FF: int, K: int, C=(8, 32, 128)) -> int:
    """Parameter count derived by hand (scaled layers: weight + bias + one scalar log-scale per tensor).

    Front-end: Conv2d 1->c1, c1->c2, c2->c3 (3x3, each weight+bias+2 scales), Linear(c3*F'->D)+bias+2,
    BasicNorm with fixed eps (0). Per layer: 2 feed-forwards (2·D·FF + FF + D + 4 each), attention
    (in_proj 3D²+3D+2, out_proj D²+D+2, linear_pos D²+1, pos_bias_u/v 2D, their scales 2),
    conv module (pointwise 2D²+2D+2, depthwise D·K+D+2, pointwise D²+D+2), BasicNorm eps (1).
    """
    Fp = ((F_in - 1) // 2 - 1) // 2
    c1, c2, c3 = C
    front = (1 * c1 * 9 + c1 + 2) + (c1 * c2 * 9 + c2 + 2) + (c2 * c3 * 9 + c3 + 2) + (c3 * Fp * D + D + 2)
    ff = 2 * D * FF + FF + D + 4
    attn = (3 * D * D + 3 * D + 2) + (D * D + D + 2) + (D * D + 1) + 2 * D + 2
    conv = (2 * D * D + 2 * D + 2) + (D * K + D + 2) + (D * D + D + 2)
    layer = 2 * ff + attn + conv + 1
    return front + L * layer


@pytest.mark.parametrize("size", sorted(CONFORMER_PRESETS))
def test_preset_parameter_counts(size):
    c = CONFORMER_PRESETS[size]
    with torch.device("meta"):  # no memory, no init cost
        enc = build_conformer_encoder(size=size)
    assert _n_params(enc) == _closed_form_params(80, c.encoder_dim, c.num_encoder_layers, c.feedforward_dim,
                                                 c.cnn_module_kernel, c.frontend_channels)
    if size == "librispeech":
        # icefall pruned_transducer_stateless2 defaults: d_model 512, 12 layers, 8 heads, ff 2048, kernel 31
        assert (c.encoder_dim, c.num_encoder_layers, c.num_heads, c.feedforward_dim, c.cnn_module_kernel) == \
            (512, 12, 8, 2048, 31)
        assert _n_params(enc) == 77_096_192
    if size == "tiny":
        assert 1_000_000 <= _n_params(enc) <= 3_000_000


def test_frontend_channels_set_the_front_end_widths():
    enc = build_conformer_encoder(size="tiny", frontend_channels=[4, 8, 16], num_encoder_layers=1)
    convs = [m for m in enc.encoder_embed.conv if isinstance(m, torch.nn.Conv2d)]
    assert [(m.in_channels, m.out_channels) for m in convs] == [(1, 4), (4, 8), (8, 16)]
    assert enc.encoder_embed.out.in_features == 16 * 19  # c3 x F' (F' = 19 for 80 bins)
    c = enc.config
    assert c.frontend_channels == (4, 8, 16)
    assert _n_params(enc) == _closed_form_params(80, c.encoder_dim, 1, c.feedforward_dim, c.cnn_module_kernel,
                                                 (4, 8, 16))
    out, lens = enc.eval()(torch.randn(2, 50, 80), torch.tensor([50, 30]))
    assert out.shape == (2, conv2d_subsampling_output_lens(50), c.encoder_dim)
    for bad in ((8, 32), (8, 0, 64)):
        with pytest.raises(ValueError, match="frontend_channels"):
            build_conformer_encoder(size="tiny", frontend_channels=bad)


def test_builder_validates():
    with pytest.raises(ValueError, match="unknown conformer size"):
        build_conformer_encoder(size="huge")
    with pytest.raises(ValueError, match="unknown ConformerConfig keys"):
        build_conformer_encoder(size="tiny", d_modle=128)
    with pytest.raises(ValueError, match="divisible"):
        build_conformer_encoder(size="tiny", num_heads=5)
    enc = build_conformer_encoder(size="tiny", num_features=40, num_encoder_layers=1)
    assert isinstance(enc, ConformerEncoder) and enc.config.num_features == 40 and len(enc.layers) == 1


def test_earlier_field_names_build_the_same_model_with_a_deprecation_warning():
    """A model.json written with the earlier names (d_model, num_layers, ff_dim, cnn_kernel) builds the model
    the new names build: same parameter names, shapes and (same seed) values."""
    old = {"d_model": 96, "num_layers": 2, "num_heads": 4, "ff_dim": 192, "cnn_kernel": 7}
    new = {"encoder_dim": 96, "num_encoder_layers": 2, "num_heads": 4, "feedforward_dim": 192, "cnn_module_kernel": 7}
    assert {RENAMED_FIELDS.get(k, k): v for k, v in old.items()} == new
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match="'d_model' is deprecated; use 'encoder_dim'"):
        a = build_transducer(encoder="conformer", size="tiny", vocab_size=20, encoder_overrides=old)
    torch.manual_seed(0)
    b = build_transducer(encoder="conformer", size="tiny", vocab_size=20, encoder_overrides=new)
    assert a.encoder.config == b.encoder.config and a.encoder.config.encoder_dim == 96
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ValueError, match="both 'ff_dim' and its new name 'feedforward_dim'"):
        build_conformer_encoder(size="tiny", ff_dim=64, feedforward_dim=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["amp-bf16", "amp-fp16", "model-bf16"])
def test_training_step_is_finite_cuda(mode):
    torch.manual_seed(0)
    enc = build_conformer_encoder(size="tiny").train().cuda()
    for m in enc.modules():
        if hasattr(m, "prob"):
            m.prob = 1.0
    feats = torch.randn(3, 64, 80, device="cuda")
    lens = torch.tensor([64, 50, 33], device="cuda")
    if mode == "model-bf16":
        enc.to(torch.bfloat16)
        out, out_lens = enc(feats, lens, warmup=0.5)
        want = torch.bfloat16
    else:
        dt = torch.bfloat16 if mode == "amp-bf16" else torch.float16
        with torch.autocast("cuda", dtype=dt):
            out, out_lens = enc(feats, lens, warmup=0.5)
        want = dt
    assert out.dtype == want
    mask = ~make_pad_mask(out_lens, out.shape[1])
    loss = (out.float() ** 2 * mask[..., None]).sum() / mask.sum()
    loss.backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), name
