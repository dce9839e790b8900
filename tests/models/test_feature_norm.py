"""Per-utterance mean normalisation of the features (``feature_norm="utterance"``): the formula against a float64
loop, the encoders' invariance to a constant offset per utterance and bin (which the plain front-end lacks), the
padded batch against each utterance alone, and the options that refuse it."""

import json

import numpy as np
import pytest
import torch

from asrprec.models import build_model, build_transducer
from asrprec.models.masks import utterance_mean_norm
from asrprec.models.options import ModelOptions


def test_formula_against_a_float64_loop():
    g = torch.Generator().manual_seed(0)
    x, lens = torch.randn(3, 11, 5, generator=g) * 4 + 2, torch.tensor([11, 7, 1])
    got = utterance_mean_norm(x, lens).double().numpy()
    ref = np.zeros((3, 11, 5))
    for b, n in enumerate(lens.tolist()):
        for f in range(5):
            col = [float(x[b, t, f]) for t in range(n)]
            mean = sum(col) / n
            for t in range(n):
                ref[b, t, f] = col[t] - mean
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert not got[1, 7:].any() and not got[2, 1:].any()  # padding is zero


@pytest.mark.parametrize("encoder", ["zipformer", "conformer"])
def test_encoder_ignores_a_constant_offset_per_utterance_and_bin(encoder):
    torch.manual_seed(0)
    x, lens = torch.randn(2, 60, 80), torch.tensor([60, 45])
    offset = 3.0 * torch.randn(2, 1, 80)  # e.g. another channel's or loudness' constant spectral tilt
    shifted = x + offset * (torch.arange(60)[None, :, None] < lens[:, None, None])
    normed = build_transducer(encoder=encoder, size="tiny", vocab_size=16,
                              encoder_overrides={"feature_norm": "utterance"}).eval()
    plain = build_transducer(encoder=encoder, size="tiny", vocab_size=16).eval()
    with torch.no_grad():
        a, b = normed.encoder(x, lens)[0], normed.encoder(shifted, lens)[0]
        assert torch.allclose(a, b, atol=1e-4)
        assert not torch.allclose(plain.encoder(x, lens)[0], plain.encoder(shifted, lens)[0], atol=1e-2)


def test_padded_batch_gives_each_utterance_its_own_output():
    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=16,
                             encoder_overrides={"feature_norm": "utterance"}).eval()
    x = torch.randn(2, 70, 80)
    x[1, 50:] = 7.0  # padding that would move the mean if it were counted
    with torch.no_grad():
        batch, batch_lens = model.encoder(x, torch.tensor([70, 50]))
        alone, alone_lens = model.encoder(x[1:, :50], torch.tensor([50]))
    n = int(alone_lens[0])
    assert int(batch_lens[1]) == n
    assert torch.allclose(batch[1, :n], alone[0, :n], atol=1e-5)


def test_options_record_it_and_refuse_what_cannot_work():
    class Tok:
        vocab_size, blank_id = 16, 0

    options = ModelOptions(feature_norm="utterance")
    model, config = build_model(options, Tok.vocab_size, Tok.blank_id)
    stored = json.loads(json.dumps(config))  # as model.json holds it
    assert stored["encoder_overrides"]["feature_norm"] == "utterance"
    rebuilt = build_transducer(**stored)
    assert rebuilt.encoder.encoder_embed.feature_norm == "utterance"
    _, plain = build_model(ModelOptions(), Tok.vocab_size, Tok.blank_id)
    assert plain["encoder_overrides"]["feature_norm"] == "none"
    with pytest.raises(ValueError, match="--model.feature_norm none"):
        ModelOptions(feature_norm="utterance", causal=True).all_encoder_overrides()
    with pytest.raises(ValueError, match="give it once"):
        ModelOptions(feature_norm="utterance", encoder_overrides={"feature_norm": "none"}).all_encoder_overrides()
    with pytest.raises(ValueError, match="causal"):
        build_transducer(encoder="zipformer", size="tiny", vocab_size=16,
                         encoder_overrides={"feature_norm": "utterance", "causal": True})
    with pytest.raises(ValueError, match="feature_norm must be one of none, utterance"):
        build_transducer(encoder="conformer", size="tiny", vocab_size=16, encoder_overrides={"feature_norm": "global"})


def test_cr_ctc_views_are_made_from_normalised_features():
    """Training with CR-CTC masks two views of the batch with the utterance's mean: normalising first makes the
    whole training loss blind to a constant offset per utterance and bin (the masks then hold zeros, not the raw
    mean the offset moves)."""
    from asrprec.models import CtcConfig

    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=16, ctc=CtcConfig(use_cr_ctc=True),
                             loss={"loss": "tdt"}, encoder_overrides={"feature_norm": "utterance",
                                                                      "padding_invariant": True}).train()
    g = torch.Generator().manual_seed(1)
    x, lens = torch.randn(2, 80, 80, generator=g), torch.tensor([80, 64])
    shifted = x + 4.0 * torch.randn(2, 1, 80, generator=g) * (torch.arange(80)[None, :, None] < lens[:, None, None])
    targets, target_lens = torch.tensor([[3, 4, 5], [6, 7, 0]]), torch.tensor([3, 2])
    losses = []
    for inp in (x, shifted):
        torch.manual_seed(7)  # the same masks, dropout and layer skips for both
        losses.append(model(inp, lens, targets, target_lens)["loss"])
    assert torch.allclose(losses[0], losses[1], rtol=1e-4)
