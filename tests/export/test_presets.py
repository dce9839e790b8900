"""Every preset exports (slow; run with -m "export and slow"): the streaming export of each causal Zipformer preset
and the offline export of each Conformer and Zipformer preset load in onnxruntime and match PyTorch on one input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.export, pytest.mark.slow]


class _Tokens:
    vocab_size = 500

    @staticmethod
    def id_to_piece(i: int) -> str:
        return ["<blk>", "<unk>"][i] if i < 2 else f"\u2581t{i}"


def _close(got, want):
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= 1e-4 * scale


@pytest.mark.parametrize("size", ["tiny", "small", "medium", "large"])
def test_zipformer_preset_streams(size, tmp_path):
    from asrprec.export import export_streaming, load_onnx_model
    from asrprec.models import build_transducer

    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size=size, vocab_size=500,
                             encoder_overrides={"causal": True}).eval()
    export_streaming(model, _Tokens(), tmp_path, chunk_size=32, left_context_frames=128)
    onnx_model = load_onnx_model(tmp_path)
    states = onnx_model.init_states(2)
    ours = model.encoder.get_init_states(2, 32, 128)
    x = torch.randn(2, onnx_model.T + onnx_model.decode_chunk_len, 80)
    for k in range(2):
        piece = x[:, k * onnx_model.decode_chunk_len: k * onnx_model.decode_chunk_len + onnx_model.T]
        with torch.no_grad():
            want, _, ours = model.encoder.streaming_forward(piece, torch.full((2,), onnx_model.T), ours)
        got, states = onnx_model.run_encoder(piece.numpy(), states)
        _close(got, model.joiner.encoder_proj(want).detach().numpy())


@pytest.mark.parametrize("encoder,size", [("conformer", "tiny"), ("conformer", "small"),
                                          ("conformer", "librispeech"), ("zipformer", "small"),
                                          ("zipformer", "medium"), ("zipformer", "large")])
def test_preset_exports_offline(encoder, size, tmp_path):
    from asrprec.export import export_offline, load_onnx_model
    from asrprec.models import build_transducer

    torch.manual_seed(0)
    model = build_transducer(encoder=encoder, size=size, vocab_size=500).eval()
    export_offline(model, _Tokens(), tmp_path)
    x, lens = torch.randn(2, 301, 80), torch.tensor([301, 250])
    with torch.no_grad():
        want, want_lens = model.encode(x, lens)
        want = model.joiner.encoder_proj(want)
    got, got_lens = load_onnx_model(tmp_path).encode(x, lens)
    assert got_lens.tolist() == want_lens.tolist()
    for i, n in enumerate(want_lens.tolist()):
        _close(got[i, :n], want[i, :n].numpy())
