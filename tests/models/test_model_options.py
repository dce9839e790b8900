"""``ModelOptions.frontend_convnext``: false builds the Zipformer's front-end without its ConvNeXt block (the
parameter count falls by exactly the block's, counted from the convolutions' shapes), ``model.json`` records it so
that decoding rebuilds the same network, the Conformer (whose front-end has no ConvNeXt) accepts it, and a
contradicting override is refused."""

import json

import pytest

from asrprec.models import build_model, build_transducer
from asrprec.models.options import ModelOptions


def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_false_drops_exactly_the_convnext_and_model_json_rebuilds_it():
    with_block, _ = build_model(ModelOptions(), 16)
    without, config = build_model(ModelOptions(frontend_convnext=False), 16)
    assert with_block.encoder.encoder_embed.convnext is not None
    assert without.encoder.encoder_embed.convnext is None
    c = with_block.encoder.encoder_embed.conv[-3].out_channels  # the channels the block runs at
    h = 3 * c  # icefall's hidden ratio
    # depthwise 7x7 (weights + bias), 1x1 up (c -> h), 1x1 down (h -> c), each with its bias; the balancers and
    # the whitening hold no parameters
    block = (c * 7 * 7 + c) + (c * h + h) + (h * c + c)
    assert _count(with_block) - _count(without) == block
    stored = json.loads(json.dumps(config))  # as model.json holds it
    assert stored["encoder_overrides"]["convnext_hidden_ratio"] == 0
    assert build_transducer(**stored).encoder.encoder_embed.convnext is None


def test_conformer_accepts_it_and_a_contradicting_override_is_refused():
    conformer, _ = build_model(ModelOptions(encoder="conformer", frontend_convnext=False), 16)
    plain, _ = build_model(ModelOptions(encoder="conformer"), 16)
    assert _count(conformer) == _count(plain)  # its front-end has no ConvNeXt to leave out
    with pytest.raises(ValueError, match="give one of them"):
        ModelOptions(frontend_convnext=False, encoder_overrides={"convnext_hidden_ratio": 3}).all_encoder_overrides()
    # the override alone still works, as before the option
    assert ModelOptions(encoder_overrides={"convnext_hidden_ratio": 0}).all_encoder_overrides()[
        "convnext_hidden_ratio"] == 0


def test_cr_ctc_takes_the_recipes_frequency_mask_width(monkeypatch):
    """``--data.spec_augment_config.features_mask_size`` reaches CR-CTC's views (the data module's SpecAugment is off
    under CR-CTC); unset, ``model.json`` leaves it out, as runs from before the setting recorded it."""
    import torch

    import asrprec.models.transducer as transducer

    options = ModelOptions(use_ctc=True, use_cr_ctc=True)
    model, config = build_model(options, 16, features_mask_size=5, num_features=40)
    assert config["ctc"]["features_mask_size"] == 5
    assert "features_mask_size" not in build_model(options, 16)[1]["ctc"]
    seen = []
    real = transducer.spec_augment_views

    def spy(*args, **kwargs):
        seen.append(kwargs["features_mask_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(transducer, "spec_augment_views", spy)
    model.train()
    model(torch.randn(2, 60, 40), torch.tensor([60, 50]), torch.tensor([[3, 4], [5, 0]]), torch.tensor([2, 1]))
    assert seen == [5]
    with pytest.raises(ValueError, match="features_mask_size must be >= 1"):
        build_model(options, 16, features_mask_size=0)


@pytest.mark.parametrize("loss", ["pruned", "tdt"])
def test_head_widths_change_exactly_the_head_and_model_json_rebuilds_them(loss):
    """``decoder_dim`` / ``joiner_dim``: the parameter count moves by what the layers' shapes say, and the record
    rebuilds the same widths; unset, the record leaves them out (a ``tiny`` model's 256 / 256)."""
    vocab, context = 16, 2
    default, default_config = build_model(ModelOptions(loss=loss), vocab)
    narrow, config = build_model(ModelOptions(loss=loss, decoder_dim=64, joiner_dim=48), vocab)
    assert "joiner_dim" not in default_config and "decoder_dim" not in default_config
    outputs = vocab + (5 if loss == "tdt" else 0)  # TDT's duration head (durations 0-4)
    enc = default.joiner.encoder_proj.in_features

    def head(d, j):  # embedding, grouped context convolution (groups d/4, no bias), the simple loss's decoder
        # projection (both losses have the simple term), the joiner's three linears
        return (vocab * d + d * 4 * context + (d * vocab + vocab)
                + (enc * j + j) + (d * j + j) + (j * outputs + outputs))

    assert _count(default) - _count(narrow) == head(256, 256) - head(64, 48)
    stored = json.loads(json.dumps(config))
    assert (stored["decoder_dim"], stored["joiner_dim"]) == (64, 48)
    rebuilt = build_transducer(**stored)
    assert rebuilt.joiner.joiner_dim == 48 and rebuilt.decoder.decoder_dim == 64
    assert _count(rebuilt) == _count(narrow)
    with pytest.raises(ValueError, match="joiner_dim must be a positive width"):
        build_model(ModelOptions(joiner_dim=0), vocab)
