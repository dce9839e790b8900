"""A TDT model exported offline: the joiner graph carries the duration logits and their durations, onnxruntime's
search jumps by them and recognises what asrprec's TDT greedy search does on the PyTorch model; a streaming export
and sherpa-onnx are refused with the reason."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.export

VOCAB = 64
DURATIONS = (0, 1, 2, 3, 4)


@torch.no_grad()
def _tdt_model(feats: list[torch.Tensor]) -> torch.nn.Module:
    """A random Zipformer TDT transducer made decisive as the other export tests' models (their conftest): joiner
    projections at full scale, a sharpened output, blank on about half of the frames, and durations 1-4 each likely
    (so that onnxruntime has to follow every jump)."""
    from asrprec.models import build_transducer

    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=VOCAB,
                             loss={"loss": "tdt", "tdt_durations": list(DURATIONS)}).eval()
    g = torch.Generator().manual_seed(1)
    for name, p in model.encoder.named_parameters():
        if name.endswith(("out_proj.weight", "pointwise_conv2.weight")) or "chunkwise_conv_scale" in name:
            p.add_(torch.randn(p.shape, generator=g) * (p.std() * 5 + 0.05))
    j = model.joiner
    for lin in (j.encoder_proj, j.decoder_proj):
        lin.weight.mul_(4.0)
        lin.bias.mul_(4.0)
    j.output_linear.weight.mul_(6.0)
    j.output_linear.bias.zero_()
    j.output_linear.bias[1] = -100.0  # <unk>: sherpa-style searches treat it as blank, asrprec's emits it
    j.output_linear.bias[VOCAB] = -100.0  # duration 0: keep one token per frame, onnxruntime's cap
    dec = j.decoder_proj(model.predict(torch.zeros(1, model.decoder.context_size, dtype=torch.int64)))
    margins = []
    for f in feats:
        enc, n = model.encode(f[None], torch.tensor([f.shape[0]]))
        logits = j(j.encoder_proj(enc[0, : int(n[0])]), dec[0], project_input=False)
        margins.append(logits[:, 1:VOCAB].max(dim=-1).values - logits[:, 0])
    j.output_linear.bias[0] = _between_middle(torch.cat(margins))
    return model


@pytest.fixture(scope="module")
def tdt(waves, fbank, tokenizer, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from asrprec.export import export_offline

    feats = [fbank(w) for w in waves]
    model = _tdt_model(feats)
    return model, feats, export_offline(model, tokenizer, tmp_path_factory.mktemp("tdt"))


def test_joiner_graph_has_the_duration_head(tdt):
    import onnxruntime as ort

    from asrprec.export import read_metadata

    model, _, ex = tdt
    assert read_metadata(ex.joiner)["tdt_durations"] == "0,1,2,3,4"
    assert read_metadata(ex.decoder)["vocab_size"] == str(VOCAB)
    sess = ort.InferenceSession(str(ex.joiner), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(2)
    enc, dec = torch.randn(3, model.joiner.joiner_dim, generator=g), torch.randn(3, model.joiner.joiner_dim, generator=g)
    got = sess.run(None, {"encoder_out": enc.numpy(), "decoder_out": dec.numpy()})[0]
    with torch.no_grad():
        want = model.joiner(enc, dec, project_input=False)
    assert got.shape == (3, VOCAB + len(DURATIONS))
    assert float(abs(torch.from_numpy(got) - want).max()) <= 1e-4 * max(1.0, float(want.abs().max()))


def test_onnxruntime_decoding_is_asrprec_tdt_greedy_search(tdt):
    """The onnxruntime search over the exported files gives the tokens of asrprec's TDT greedy search (one token
    per frame) on the PyTorch model, for a padded batch, following jumps of every duration."""
    from asrprec.decoding import DecodingOptions, TdtLabelLoopingGreedy, decode, tdt_greedy_search
    from asrprec.export import load_onnx_model

    model, feats, ex = tdt
    lens = torch.tensor([f.shape[0] for f in feats])
    x = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
    with torch.no_grad():
        enc, enc_lens = model.encode(x, lens)
        want, frames = tdt_greedy_search(model, enc, enc_lens, 1, return_timestamps=True)
        assert TdtLabelLoopingGreedy(model)(enc, enc_lens) == want
    runtime = load_onnx_model(ex.encoder.parent)
    got = runtime.decode(x, lens)
    assert got == want
    # with each token's frame and predicted duration, as asrprec's TDT greedy search reports them
    timed = runtime.decode(x, lens, return_frames=True)
    with torch.no_grad():
        mine = decode(model, x, lens, DecodingOptions(method="greedy_search"), return_timestamps=True)
    assert [list(r.tokens) for r in mine] == want and [r.frames for r in timed] == frames
    assert [r.durations for r in timed] == [list(r.durations) for r in mine]
    assert sum(map(len, want)) >= 5 * len(want) and len({k for h in want for k in h}) >= 5  # not trivial
    jumps = {b - a for f in frames for a, b in zip(f, f[1:])}
    assert {2, 3, 4} <= jumps  # tokens followed jumps of several durations


def test_streaming_export_and_sherpa_onnx_are_refused(tdt, waves, tmp_path):
    from asrprec.export import export_streaming
    from asrprec.export.sherpa import recognize

    model, _, ex = tdt
    with pytest.raises(ValueError, match="streaming export of a TDT model"):
        export_streaming(model, None, tmp_path, chunk_size=16, left_context_frames=64)
    pytest.importorskip("sherpa_onnx")
    with pytest.raises(ValueError, match="librosa-style"):
        recognize(ex.encoder.parent, waves[:1], streaming=False)


def _between_middle(values):
    """Halfway between the two middle values: a threshold at the median with no value exactly on it (an exact tie
    between blank and a token would let two runtimes' last digits pick differently)."""
    v = values.flatten().sort().values
    k = max(1, len(v) // 2)
    return (v[k - 1] + v[min(k, len(v) - 1)]) / 2


def test_exported_encoder_keeps_the_per_utterance_mean_normalisation(tokenizer, tmp_path):
    """``feature_norm="utterance"`` (the embedded recipe's) is part of the exported encoder graph: onnxruntime gives
    PyTorch's encoder output for a padded batch (sherpa-onnx's padding value past each end), and a constant offset
    per utterance and bin changes neither."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import onnxruntime as ort

    from asrprec.export import export_offline
    from asrprec.models import build_transducer

    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=VOCAB,
                             encoder_overrides={"feature_norm": "utterance"},
                             loss={"loss": "tdt", "tdt_durations": list(DURATIONS)}).eval()
    ex = export_offline(model, tokenizer, tmp_path)
    sess = ort.InferenceSession(str(ex.encoder), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([120, 77])
    x = torch.randn(2, 120, 80, generator=g) * 3 - 8
    pad = torch.arange(120)[None, :] >= lens[:, None]
    x[pad] = -23.0259
    with torch.no_grad():
        want, want_lens = model.encode(x, lens)
        want = model.joiner.encoder_proj(want)
    shifted = torch.where(pad[..., None], x, x + 2.0 * torch.randn(2, 1, 80, generator=g))
    for inp in (x, shifted):
        got, got_lens = sess.run(None, {"x": inp.numpy(), "x_lens": lens.numpy()})
        assert got_lens.tolist() == want_lens.tolist()
        for i, n in enumerate(want_lens.tolist()):
            err = float(abs(torch.from_numpy(got[i, :n]) - want[i, :n]).max())
            assert err <= 1e-4 * max(1.0, float(want.abs().max())), err
