"""The Zipformer against icefall's own outputs: ``../shared/fixtures/icefall_zipformer/{offline,causal}`` hold two
small icefall Zipformer2 transducer + CTC models (random, perturbed weights) and what icefall's code computes for
a padded batch in eval mode, fp32 (``io.pt``; its README says what each tensor is). The weights are loaded here
by the plain key renaming, so the encoder, joiner, simple projections and CTC head are checked on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asrprec.models import build_transducer, configure_streaming

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "icefall_zipformer"
_PER_STACK = ("num_encoder_layers", "downsampling_factor", "feedforward_dim", "num_heads", "encoder_dim",
              "encoder_unmasked_dim", "cnn_module_kernel", "query_head_dim", "value_head_dim", "pos_head_dim",
              "chunk_size", "left_context_frames")

pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"icefall's reference outputs not at {FIXTURES}")


def _model(kind: str, padding_invariant: bool):
    d = FIXTURES / kind
    flags = json.loads((d / "icefall_args.json").read_text())
    overrides = {k: tuple(int(v) for v in str(flags[k]).split(",")) for k in _PER_STACK}
    overrides.update(pos_dim=int(flags["pos_dim"]), causal=bool(flags["causal"]),
                     padding_invariant=padding_invariant)
    model = build_transducer(encoder="zipformer", size="medium", vocab_size=int(flags["vocab_size"]),
                             decoder_dim=int(flags["decoder_dim"]), joiner_dim=int(flags["joiner_dim"]),
                             context_size=int(flags["context_size"]), ctc={}, encoder_overrides=overrides)
    state = {}
    for key, value in torch.load(d / "pretrained.pt", map_location="cpu", weights_only=False)["model"].items():
        parts = key.split(".")
        if parts[-1] == "bypass_scale" and parts[-3] == "layers":
            continue  # icefall's Zipformer2EncoderLayer.bypass_scale, which its forward never reads
        state["encoder." + key if key.startswith(("encoder.", "encoder_embed.")) else key] = value
    model.load_state_dict(state, strict=True)
    model.eval()
    if flags["causal"]:
        configure_streaming(model, int(flags["chunk_size"]), int(flags["left_context_frames"]))
    return model, torch.load(d / "io.pt", weights_only=False)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1e-4 of the reference's largest magnitude (fp32, a different order of operations)."""
    assert got.shape == want.shape
    err = float((got - want).abs().max())
    assert err <= 1e-4 * float(want.abs().max()), err


@pytest.mark.parametrize("kind", ["offline", "causal"])
def test_icefall_padding_reproduces_icefall_outputs(kind):
    """padding_invariant=False computes icefall's function on the padded batch: every frame (padded ones
    included) of the encoder output, the joiner logits, both simple projections and the CTC log-probs."""
    model, io = _model(kind, padding_invariant=False)
    with torch.no_grad():
        enc, enc_lens = model.encode(io["x"], io["x_lens"])
        dec = model.predict(io["decoder_in"])
        assert enc_lens.tolist() == io["encoder_out_lens"].tolist()
        _close(enc, io["encoder_out"])
        _close(dec, io["decoder_out"])
        _close(model.join(enc[:, :, None], dec[:, None]), io["joiner_logits"])
        _close(model.simple_am_proj(enc), io["simple_am"])
        _close(model.simple_lm_proj(dec), io["simple_lm"])
        _close(model.ctc_log_probs(enc), io["ctc_log_probs"])


@pytest.mark.parametrize("kind", ["offline", "causal"])
def test_padding_invariant_default_agrees_where_nothing_is_padded(kind):
    """The default (each utterance as if alone) is icefall's function for the batch's longest, unpadded
    utterance; icefall's shorter utterances see their padding, so there the two differ."""
    model, io = _model(kind, padding_invariant=True)
    lens = io["x_lens"].tolist()
    assert lens[0] == io["x"].shape[1] and max(lens[1:]) < lens[0]
    with torch.no_grad():
        enc, enc_lens = model.encode(io["x"], io["x_lens"])
    want = io["encoder_out"]
    _close(enc[0], want[0])
    n = int(enc_lens[1])
    assert float((enc[1, :n] - want[1, :n]).abs().max()) > 1e-3 * float(want.abs().max())
