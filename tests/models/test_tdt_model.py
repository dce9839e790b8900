"""The TDT transducer: the joiner's duration head, the loss configuration's checks, the loss against the reference
backend on logits computed outside the model, and forward + backward for both encoders under every policy."""

import copy
import math

import pytest
import torch
from torch import nn

from asrprec.losses import rnnt_loss_smoothed, tdt_loss
from asrprec.models import Decoder, Joiner, LossConfig, Transducer, build_transducer, pruned_loss_scales
from asrprec.precision import POLICIES, get_policy


class LinearEncoder(nn.Module):
    def __init__(self, num_features=8, dim=12):
        super().__init__()
        self.proj = nn.Linear(num_features, dim)
        self.output_dim = dim

    def forward(self, x, lens):
        return torch.tanh(self.proj(x)), lens


def tiny_tdt(vocab=5, durations=(0, 1, 2, 3), **loss):
    torch.manual_seed(0)
    return Transducer(LinearEncoder(), Decoder(vocab, 16, blank_id=0, context_size=2),
                      Joiner(12, 16, 10, vocab, durations=durations),
                      loss=LossConfig(loss="tdt", tdt_durations=durations, **loss))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(3, 9, 8, generator=g)
    targets = torch.tensor([[1, 2, 3], [4, 4, -1], [2, -1, -1]])
    return feats, torch.tensor([9, 6, 4]), targets, torch.tensor([3, 2, 1])


def test_joiner_duration_head_and_builder():
    j = Joiner(12, 16, 10, 5, durations=(0, 1, 2))
    assert j.output_linear.out_features == 5 + 3 and j.vocab_size == 5 and j.durations == (0, 1, 2)
    assert Joiner(12, 16, 10, 5).output_linear.out_features == 5
    model = build_transducer(vocab_size=20, loss={"loss": "tdt", "tdt_durations": [0, 1, 2, 4]})
    assert model.durations == (0, 1, 2, 4) and model.joiner.output_linear.out_features == 24
    assert build_transducer(vocab_size=20).durations == ()
    for bad in ((2, 1), (0, 0, 1), (-1, 1), (0,)):
        with pytest.raises(ValueError, match="durations"):
            Joiner(12, 16, 10, 5, durations=bad)


def test_loss_config_checks():
    with pytest.raises(ValueError, match="do not contain 1"):
        LossConfig(loss="tdt", tdt_durations=(0, 2, 4))
    with pytest.raises(ValueError, match="lean"):
        LossConfig(loss="tdt", joint_mode="lean")
    with pytest.raises(ValueError, match="tdt_omega"):
        LossConfig(loss="tdt", tdt_omega=1.5)
    with pytest.raises(ValueError, match="tdt_aux"):
        LossConfig(loss="tdt", tdt_aux="ctc")
    assert LossConfig(loss="tdt", tdt_durations=[0, 1]).tdt_durations == (0, 1)  # as model.json gives it
    # a joiner whose head disagrees with the loss is refused, both ways
    with pytest.raises(ValueError, match="durations"):
        Transducer(LinearEncoder(), Decoder(5, 16), Joiner(12, 16, 10, 5), loss=LossConfig(loss="tdt"))
    with pytest.raises(ValueError, match="durations"):
        Transducer(LinearEncoder(), Decoder(5, 16), Joiner(12, 16, 10, 5, durations=(0, 1)), loss=LossConfig())


@pytest.mark.parametrize("aux", ["none", "simple"])
@pytest.mark.parametrize("sigma", [0.0, 0.05])
def test_forward_equals_reference_loss_of_independent_logits(aux, sigma):
    """The model's TDT term (auto backend) equals the torch reference backend on logits built here from the model's
    parts, and the total is the simple loss's warm-up mix (icefall's scales) when the auxiliary is on."""
    model = tiny_tdt(tdt_aux=aux, tdt_sigma=sigma).train()
    model.batch_count = 500.0
    feats, feat_lens, targets, target_lens = _batch()
    out = model(feats, feat_lens, targets, target_lens)
    with torch.no_grad():
        enc = torch.tanh(model.encoder.proj(feats))
        dec = model.decoder(model.decoder_input(targets, target_lens))
        j = model.joiner
        logits = j.output_linear(torch.tanh(j.encoder_proj(enc)[:, :, None] + j.decoder_proj(dec)[:, None]))
        want = tdt_loss(logits, targets, feat_lens, target_lens, durations=(0, 1, 2, 3), sigma=sigma,
                        reduction="sum", backend="torch")
    assert out["transducer_loss"].item() == pytest.approx(want.item(), rel=1e-5)
    if aux == "none":
        assert "simple_loss" not in out and out["loss"].item() == pytest.approx(want.item(), rel=1e-5)
    else:
        simple = rnnt_loss_smoothed(model.simple_lm_proj(dec), model.simple_am_proj(enc), targets, feat_lens,
                                    target_lens, lm_only_scale=0.25, am_only_scale=0.0, reduction="sum")
        s, p = pruned_loss_scales(500.0, model.loss_config)
        assert 0.5 < s < 1.0 and 0.1 < p < 1.0
        assert out["simple_loss"].item() == pytest.approx(simple.item(), rel=1e-5)
        assert out["loss"].item() == pytest.approx(s * simple.item() + p * want.item(), rel=1e-5)
    out["loss"].backward()
    head = model.joiner.output_linear.weight.grad[model.vocab_size:]  # the duration rows learn
    assert head.abs().sum() > 0


@pytest.mark.parametrize("encoder", ["zipformer", "conformer"])
@pytest.mark.parametrize("precision", POLICIES)
def test_every_encoder_and_policy_trains(encoder, precision):
    """Forward + backward of a tiny real encoder with the TDT loss under each policy's prepared model and autocast:
    a finite loss near the fp32 one, finite gradients reaching the duration head."""
    torch.manual_seed(0)
    base = build_transducer(encoder=encoder, size="tiny", vocab_size=16, loss={"loss": "tdt"},
                            model_warmup_batches=0).train()
    g = torch.Generator().manual_seed(0)
    feats, feat_lens = torch.randn(2, 80, 80, generator=g), torch.tensor([80, 61])
    targets, target_lens = torch.tensor([[1, 5, 7], [3, 3, -1]]), torch.tensor([3, 2])
    ref = base(feats, feat_lens, targets, target_lens)["transducer_loss"].item()
    policy = get_policy(precision, "cpu")
    model = policy.prepare_model(copy.deepcopy(base))
    with policy.autocast():
        out = model(feats, feat_lens, targets, target_lens)
    assert out["loss"].dtype == torch.float32 and math.isfinite(out["loss"].item())
    assert out["transducer_loss"].item() == pytest.approx(ref, rel=0.05)
    out["loss"].backward()
    grad = model.joiner.output_linear.weight.grad
    assert torch.isfinite(grad).all() and grad[16:].abs().sum() > 0
