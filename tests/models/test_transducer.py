"""Transducer composition: decoder/joiner shapes, the loss against an independent computation."""

import itertools
import math

import pytest
import torch
from torch import nn

from asrprec.models import Decoder, Joiner, LossConfig, Transducer, pruned_loss_scales


class LinearEncoder(nn.Module):
    """A stand-in encoder: no subsampling, one Linear."""

    def __init__(self, num_features=8, dim=12):
        super().__init__()
        self.proj = nn.Linear(num_features, dim)
        self.output_dim = dim

    def forward(self, x, lens):
        return self.proj(x), lens


def tiny_model(vocab=5, **loss):
    torch.manual_seed(0)
    return Transducer(LinearEncoder(), Decoder(vocab, 16, blank_id=0, context_size=2), Joiner(12, 16, 10, vocab),
                      loss=LossConfig(**{"loss": "full", **loss}))


def brute_force_loss(logits, y):
    """-log sum over all alignments, by enumerating them (float64, one utterance)."""
    T, U1, V = logits.shape
    U = U1 - 1
    logp = logits.double().log_softmax(-1)
    total = []
    # an alignment = positions of the U labels among T+U emissions, the last emission being blank
    for label_pos in itertools.combinations(range(T + U - 1), U):
        t = u = 0
        lp = 0.0
        for i in range(T + U):
            if i in label_pos:
                lp += logp[t, u, y[u]]
                u += 1
            else:
                lp += logp[t, u, 0]
                t += 1
        total.append(lp)
    return -torch.logsumexp(torch.stack([torch.as_tensor(x) for x in total]), 0)


def test_decoder_shapes_and_context():
    d = Decoder(7, 8, blank_id=0, context_size=2)
    y = torch.tensor([[0, 3, 4, 5]])
    full = d(y)  # training: every position
    assert full.shape == (1, 4, 8)
    # decoding with exactly the last two tokens gives the same output as the training path's position
    step = d(y[:, 1:3], need_pad=False)
    assert step.shape == (1, 1, 8) and torch.allclose(step[0, 0], full[0, 2], atol=1e-6)
    with pytest.raises(ValueError, match="context tokens"):
        d(y[:, :1], need_pad=False)
    with pytest.raises(ValueError, match="blank_id"):
        Decoder(5, 8, blank_id=5)


def test_joiner_is_tanh_of_sum():
    j = Joiner(3, 4, 6, 5)
    e, d = torch.randn(2, 3), torch.randn(2, 4)
    expect = j.output_linear(torch.tanh(j.encoder_proj(e) + j.decoder_proj(d)))
    assert torch.allclose(j(e, d), expect)
    assert torch.allclose(j(j.encoder_proj(e), j.decoder_proj(d), project_input=False), expect)


def test_full_loss_matches_enumeration():
    m = tiny_model().double()
    feats = torch.randn(2, 4, 8, dtype=torch.float64)
    feat_lens = torch.tensor([4, 3])
    targets = torch.tensor([[1, 2], [3, -1]])
    target_lens = torch.tensor([2, 1])
    out = m(feats, feat_lens, targets, target_lens)
    enc, _ = m.encode(feats, feat_lens)
    dec = m.decoder(m.decoder_input(targets, target_lens))
    expect = 0.0
    for b in range(2):
        T, U = int(feat_lens[b]), int(target_lens[b])
        logits = m.joiner(enc[b, :T, None], dec[b, None, : U + 1])
        expect += float(brute_force_loss(logits.detach(), targets[b, :U].tolist()))
    assert out["loss"].dtype == torch.float64 and out["loss"].dim() == 0
    assert math.isclose(float(out["loss"].detach()), expect, rel_tol=1e-9)


def test_loss_is_fp32_scalar_under_bf16_autocast():
    m = tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(torch.randn(2, 5, 8), torch.tensor([5, 4]), torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 2]))
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_loss_config_validation_and_warmup_scales():
    with pytest.raises(ValueError, match="loss must be"):
        LossConfig(loss="ctc")
    with pytest.raises(ValueError, match="joint_mode"):
        LossConfig(joint_mode="sparse")
    cfg = LossConfig(loss="pruned", loss_warmup_batches=2000, simple_loss_scale=0.5)
    # icefall: s 1.0 -> 0.5 and p 0.1 -> 1.0 linearly over the warm-up
    assert pruned_loss_scales(0, cfg) == (1.0, pytest.approx(0.1))
    assert pruned_loss_scales(1000, cfg) == (pytest.approx(0.75), pytest.approx(0.55))
    assert pruned_loss_scales(5000, cfg) == (pytest.approx(0.5), pytest.approx(1.0))


def test_targets_must_be_integer():
    m = tiny_model()
    with pytest.raises(ValueError, match="integer"):
        m(torch.randn(1, 4, 8), torch.tensor([4]), torch.tensor([[1.0, 2.0]]), torch.tensor([2]))


def _batch():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(2, 6, 8, generator=g, dtype=torch.float64), torch.tensor([6, 4]),
            torch.tensor([[1, 2, 3], [4, 1, -1]]), torch.tensor([3, 2]))


def test_lean_joint_mode_equals_full_loss_and_gradients():
    full, lean = tiny_model().double(), tiny_model(joint_mode="lean", lean_tile_t=2).double()
    lean.load_state_dict(full.state_dict())
    out_f, out_l = full(*_batch()), lean(*_batch())
    assert torch.allclose(out_f["loss"], out_l["loss"], rtol=1e-10)
    out_f["loss"].backward()
    out_l["loss"].backward()
    for (n, a), b in zip(full.named_parameters(), lean.parameters()):
        if a.grad is not None:
            assert torch.allclose(a.grad, b.grad, rtol=1e-8, atol=1e-10), n


def test_pruned_loss_with_full_band_equals_full_loss():
    full, pruned = tiny_model().double(), tiny_model(loss="pruned", prune_range=4).double()
    pruned.load_state_dict(full.state_dict())
    full.eval(), pruned.eval()
    out_f, out_p = full(*_batch()), pruned(*_batch())
    assert torch.allclose(out_p["pruned_loss"], out_f["loss"], rtol=1e-9)
    assert torch.isfinite(out_p["simple_loss"])
    # eval uses the final scales: 0.5 * simple + 1.0 * pruned
    assert torch.allclose(out_p["loss"], 0.5 * out_p["simple_loss"] + out_p["pruned_loss"])


@pytest.mark.parametrize("encoder,overrides", [("conformer", {"num_layers": 1, "frontend_channels": (4, 8, 16)}),
                                                ("zipformer", {"frontend_channels": (4, 8, 8)})])
def test_resolved_encoder_overrides_rebuild_the_same_architecture(encoder, overrides):
    import json

    from asrprec.models import build_transducer, resolved_encoder_overrides

    torch.manual_seed(0)
    model = build_transducer(encoder=encoder, size="tiny", vocab_size=16, encoder_overrides=overrides)
    resolved = resolved_encoder_overrides(model)
    assert "num_features" not in resolved
    resolved = json.loads(json.dumps(resolved))  # as read back from model.json
    again = build_transducer(encoder=encoder, size="tiny", vocab_size=16, encoder_overrides=resolved)
    assert again.encoder.config == model.encoder.config
    again.load_state_dict(model.state_dict())  # strict: every name and shape agrees
    # without the stored config, the preset alone builds a different front-end: loading must fail
    with pytest.raises(RuntimeError, match="size mismatch"):
        build_transducer(encoder=encoder, size="tiny", vocab_size=16).load_state_dict(model.state_dict(), strict=False)
    with pytest.raises(TypeError, match="config"):
        resolved_encoder_overrides(nn.Linear(2, 2))


def test_builder_defaults_are_the_recommended_setup():
    """build_transducer(vocab_size=V) is the setup the embedded recipe and icefall's current recipe train: a
    Zipformer with the pruned loss; a loss given as a dict is checked key by key."""
    from asrprec.models import build_transducer
    from asrprec.models.zipformer import ZipformerEncoder

    with torch.device("meta"):
        model = build_transducer(vocab_size=20)
        assert isinstance(model.encoder, ZipformerEncoder) and model.loss_config.loss == "pruned"
        with pytest.raises(ValueError, match="did you mean 'prune_range'"):
            build_transducer(vocab_size=20, loss={"loss": "pruned", "prune_rang": 4})


def test_decoding_interface_is_the_join_of_encoder_and_decoder_outputs():
    """project_encoder / project_decoder / join_projected (what the searches call) against the joint of the unprojected
    outputs (Transducer.join), written out as the joiner's formula; and the attributes the searches read."""
    model = tiny_model(vocab=5).eval()
    enc, _ = model.encode(torch.randn(2, 3, 8), torch.tensor([3, 3]))  # (2, 3, 12)
    ctx = torch.tensor([[0, 0], [0, 3], [4, 2]])
    dec = model.predict(ctx)[:, 0]  # (3, 16)
    j = model.joiner
    by_hand = j.output_linear(torch.tanh(enc[:, :, None] @ j.encoder_proj.weight.T + j.encoder_proj.bias
                                         + (dec @ j.decoder_proj.weight.T + j.decoder_proj.bias)[None, None]))
    got = model.join_projected(model.project_encoder(enc)[:, :, None], model.project_decoder(ctx)[None, None])
    torch.testing.assert_close(got, by_hand)  # (2, 3, 3, 5)
    torch.testing.assert_close(got, model.join(enc[:, :, None], dec[None, None]))
    assert model.project_encoder(enc.double()).dtype == torch.float32  # any float dtype in, the joiner's out
    assert (model.blank_id, model.vocab_size, model.context_size, model.durations) == (0, 5, 2, ())
    model.decoder = Decoder(5, 16, blank_id=3, context_size=1)  # the attributes follow the parts
    assert (model.blank_id, model.context_size) == (3, 1)
