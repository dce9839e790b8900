"""The export wrappers in eager PyTorch (default tier, no onnx needed): each graph computes what the model computes,
the streaming wrapper bridges sherpa-onnx's state layout to asrprec's exactly, and the layout of every Zipformer
preset follows sherpa-onnx's rules (recomputed here from the metadata strings alone)."""

from __future__ import annotations

import pytest
import torch

from asrprec.export.wrappers import JoinerHead, OfflineEncoder, ProjectedDecoder, StreamingEncoder, StreamingLayout
from asrprec.models import build_transducer


def _batch(t=151, lens=(151, 122, 97), seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lens), t, 80, generator=g)
    lens = torch.tensor(lens)
    x[torch.arange(t)[None, :] >= lens[:, None]] = 5.0  # padding content must not matter
    return x, lens


@pytest.mark.parametrize("kind", ["zipformer", "conformer", "causal"])
def test_offline_encoder_is_encode_then_projection(models, kind):
    model = models[kind]
    x, lens = _batch()
    chunking = dict(chunk_size=16, left_context_frames=64) if kind == "causal" else {}
    with torch.no_grad():
        want, want_lens = model.encoder(x, lens, **chunking)
        want = model.joiner.encoder_proj(want)
        got, got_lens = OfflineEncoder(model, **chunking)(x, lens)
    assert torch.equal(got_lens, want_lens)
    for i, n in enumerate(want_lens.tolist()):
        torch.testing.assert_close(got[i, :n], want[i, :n], rtol=0, atol=1e-6)


def test_decoder_graph_maps_minus_one_to_blank(models):
    model = models["zipformer"]
    dec = ProjectedDecoder(model)
    blank = model.decoder.blank_id
    with torch.no_grad():
        sherpa_start = dec(torch.tensor([[-1, blank], [-1, 7]]))
        blanks = model.joiner.decoder_proj(model.predict(torch.tensor([[blank, blank], [blank, 7]]))).squeeze(1)
        last_row = dec(torch.tensor([[model.decoder.vocab_size - 1, blank]]))  # what a bare Gather would read
    torch.testing.assert_close(sherpa_start, blanks, rtol=0, atol=0)
    assert (sherpa_start[0] - last_row[0]).abs().max() > 1e-3


def test_joiner_graph_is_the_joint_on_projected_inputs(models):
    model = models["zipformer"]
    enc, dec = torch.randn(4, 5, 256), torch.randn(4, 5, 256)
    with torch.no_grad():
        want = model.joiner.output_linear(torch.tanh(enc + dec))
        torch.testing.assert_close(JoinerHead(model)(enc, dec), want)


def _sherpa_state_shapes(meta: dict[str, str], n: int) -> list[tuple[int, ...]]:
    """The states sherpa-onnx creates from an encoder's metadata (GetEncoderInitStates in k2-fsa/sherpa-onnx
    sherpa-onnx/csrc/online-zipformer2-transducer-model.cc), written from the metadata strings alone."""
    def ints(key):
        return [int(v) for v in meta[key].split(",")]

    dims, layers, q, v, h, k, left = (ints(key) for key in (
        "encoder_dims", "num_encoder_layers", "query_head_dims", "value_head_dims", "num_heads",
        "cnn_module_kernels", "left_context_len"))
    shapes = []
    for i in range(len(dims)):
        for _ in range(layers[i]):
            shapes += [(left[i], n, q[i] * h[i]), (1, n, left[i], 3 * dims[i] // 4), (left[i], n, v[i] * h[i]),
                       (left[i], n, v[i] * h[i]), (n, dims[i], k[i] // 2), (n, dims[i], k[i] // 2)]
    return shapes + [(n, 128, 3, 19), (n,)]


@pytest.mark.parametrize("size,overrides", [
    ("tiny", {}), ("small", {}),
    ("tiny", {"convnext_hidden_ratio": 0, "num_encoder_layers": (1, 2, 1)}),
])
def test_streaming_layout_follows_sherpa_rules(size, overrides):
    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size=size, vocab_size=32,
                             encoder_overrides={"causal": True, **overrides}).eval()
    cfg = model.encoder.config
    layout = StreamingLayout.of(model, 32, 128)
    meta = layout.metadata()
    n_stacks = len(cfg.downsampling_factor)
    for key in ("encoder_dims", "num_encoder_layers", "query_head_dims", "value_head_dims", "num_heads",
                "cnn_module_kernels", "left_context_len"):
        assert len(meta[key].split(",")) == n_stacks, key
    assert meta["model_type"] == "zipformer2"
    assert meta["encoder_dims"] == ",".join(map(str, cfg.encoder_dim))
    assert meta["num_encoder_layers"] == ",".join(map(str, cfg.num_encoder_layers))
    # 128 left frames = 4 chunks of 32 at 50 Hz; stack i keeps 128 / ds_i of its own frames
    assert meta["left_context_len"] == ",".join(str(128 // d) for d in cfg.downsampling_factor)
    lookahead = 13 if cfg.convnext_hidden_ratio else 7
    assert (int(meta["T"]), int(meta["decode_chunk_len"])) == (64 + lookahead, 64)
    shapes = [tuple(s.shape) for s in layout.init_states(3)]
    assert shapes == _sherpa_state_shapes(meta, 3)
    assert len(shapes) == 6 * sum(cfg.num_encoder_layers) + 2


@pytest.mark.parametrize("overrides", [{}, {"convnext_hidden_ratio": 0}])
def test_streaming_wrapper_runs_streaming_forward_on_sherpa_states(overrides):
    """Chunk after chunk from sherpa-onnx's zero states, the wrapper gives the outputs (projected) and the states
    (re-laid out) of asrprec's own streaming_forward from get_init_states; the caches fill and the frame counter
    passes the left context."""
    torch.manual_seed(0)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=32,
                             encoder_overrides={"causal": True, **overrides}).eval()
    layout = StreamingLayout.of(model, 16, 64)
    step = StreamingEncoder(model, layout)
    enc = model.encoder
    b = 2
    ours = enc.get_init_states(b, 16, 64)
    theirs = layout.init_states(b)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, layout.T + 7 * layout.decode_chunk_len, 80, generator=g)
    with torch.no_grad():
        for k in range(8):
            chunk = x[:, k * layout.decode_chunk_len: k * layout.decode_chunk_len + layout.T]
            out, _, ours = enc.streaming_forward(chunk, torch.full((b,), layout.T), ours)
            got = step(chunk, *theirs)
            theirs = list(got[1:])
            torch.testing.assert_close(got[0], model.joiner.encoder_proj(out), rtol=0, atol=0)
    assert [tuple(s.shape) for s in theirs] == [tuple(s.shape) for s in layout.init_states(b)]
    n = layout.num_layers
    for i in range(n):
        torch.testing.assert_close(theirs[6 * i + 1][0], ours[6 * i + 1].transpose(0, 1), rtol=0, atol=0)
        for j in (0, 2, 3, 4, 5):
            torch.testing.assert_close(theirs[6 * i + j], ours[6 * i + j], rtol=0, atol=0)
    c, t = ours[6 * n].shape[1:3]
    torch.testing.assert_close(theirs[6 * n][:, :c, :t], ours[6 * n], rtol=0, atol=0)
    assert float(theirs[6 * n].abs().sum()) == float(ours[6 * n].abs().sum())  # the rest of sherpa's tensor is 0
    assert theirs[-1].tolist() == [8 * 16] * b and theirs[-1].dtype == torch.int64
