"""onnxruntime against PyTorch: the exported graphs compute what the model computes, at lengths and batch sizes
other than the export's example (odd and even, the shortest the encoders accept, batches with padding), the decoder
on sherpa-onnx's ``-1`` start context, the streaming encoder chunk by chunk against ``streaming_forward``; and the
onnxruntime decoding (asrprec.export.runtime) gives asrprec's greedy search result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.export


def _ort_models(ex):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return [ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"])
            for p in (ex.encoder, ex.decoder, ex.joiner)]


def _close(got, want, what):
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= 1e-5 * scale, f"{what}: max |onnx - torch| = {err:.2e} (scale {scale:.2f})"


@pytest.mark.parametrize("kind,lengths", [
    ("zipformer", [[9], [16], [17], [64], [203], [1601], [250, 249, 9], [101, 100, 40]]),
    ("conformer", [[7], [10], [11], [64], [203], [1601], [250, 249, 7], [101, 100, 40]]),
])
def test_offline_encoder(exported, models, kind, lengths):
    enc_ort, _, _ = _ort_models(exported[kind])
    model = models[kind]
    g = torch.Generator().manual_seed(5)
    for lens in lengths:
        lens_t = torch.tensor(lens)
        x = torch.randn(len(lens), max(lens), 80, generator=g) * 3 - 8
        x[torch.arange(max(lens))[None, :] >= lens_t[:, None]] = -23.0259  # sherpa-onnx's padding value
        with torch.no_grad():
            want, want_lens = model.encode(x, lens_t)
            want = model.joiner.encoder_proj(want)
        got, got_lens = enc_ort.run(None, {"x": x.numpy(), "x_lens": lens_t.numpy()})
        assert got_lens.tolist() == want_lens.tolist(), lens
        for i, n in enumerate(want_lens.tolist()):
            _close(got[i, :n], want[i, :n].numpy(), f"{kind} encoder, lengths {lens}, row {i}")


def test_decoder_and_joiner(exported, models):
    _, dec_ort, join_ort = _ort_models(exported["zipformer"])
    model = models["zipformer"]
    y = torch.tensor([[-1, 0], [-1, 5], [3, 9], [63, 1], [0, 0]])
    with torch.no_grad():
        # asrprec's own search starts from blanks where sherpa-onnx sends -1
        want = model.joiner.decoder_proj(model.predict(y.clamp(min=0))).squeeze(1)
    got = dec_ort.run(None, {"y": y.numpy()})[0]
    _close(got, want.numpy(), "decoder")
    g = torch.Generator().manual_seed(6)
    enc = torch.randn(7, model.joiner.joiner_dim, generator=g)
    dec = torch.randn(7, model.joiner.joiner_dim, generator=g)
    with torch.no_grad():
        want = model.joiner(enc, dec, project_input=False)
    got = join_ort.run(None, {"encoder_out": enc.numpy(), "decoder_out": dec.numpy()})[0]
    _close(got, want.numpy(), "joiner")


def test_streaming_encoder_chunk_by_chunk(exported, models):
    """From the zero states sherpa-onnx makes (built here from the metadata by the runtime), ten chunks of two
    streams (caches filled and the frame counter past the left context) against streaming_forward."""
    from asrprec.export import load_onnx_model

    from_metadata = load_onnx_model(exported["causal"].encoder.parent)
    model = models["causal"]
    meta = from_metadata.metadata
    chunk, left = int(meta["chunk_size"]), int(meta["left_context_frames"])
    t, shift = from_metadata.T, from_metadata.decode_chunk_len
    b = 2
    states = from_metadata.init_states(b)
    ours = model.encoder.get_init_states(b, chunk, left)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(b, t + 9 * shift, 80, generator=g) * 3 - 8
    for k in range(10):
        piece = x[:, k * shift: k * shift + t]
        with torch.no_grad():
            want, _, ours = model.encoder.streaming_forward(piece, torch.full((b,), t), ours)
            want = model.joiner.encoder_proj(want)
        got, states = from_metadata.run_encoder(piece.numpy(), states)
        _close(got, want.numpy(), f"streaming chunk {k}")
    assert states[-1].tolist() == [10 * chunk] * b


def test_onnxruntime_decoding_is_asrprec_greedy_search(exported, models, waves, fbank):
    """The onnxruntime search (one symbol per frame) over the exported offline model gives the token ids of
    asrprec's greedy_search with max_sym_per_frame=1 on the PyTorch model, for a padded batch of utterances."""
    from asrprec.decoding import greedy_search
    from asrprec.export import load_onnx_model

    feats = [fbank(w) for w in waves]
    lens = torch.tensor([f.shape[0] for f in feats])
    x = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
    for kind in ("zipformer", "conformer"):
        model = models[kind]
        with torch.no_grad():
            want = greedy_search(model, *model.encode(x, lens), max_sym_per_frame=1)
        runtime = load_onnx_model(exported[kind].encoder.parent)
        got = runtime.decode(x, lens)
        assert got == want, kind
        assert sum(map(len, want)) >= 5 * len(want) and len({k for h in want for k in h}) >= 5  # not trivial
        # each token's encoder frame too: the frame asrprec's search emitted it on (the CTM's times)
        with torch.no_grad():
            _, frames = greedy_search(model, *model.encode(x, lens), max_sym_per_frame=1, return_timestamps=True)
        timed = runtime.decode(x, lens, return_frames=True)
        assert [r.tokens for r in timed] == want and [r.frames for r in timed] == frames, kind
        assert all(r.durations is None for r in timed)
