"""Real streaming (chunk by chunk, with caches) against simulated streaming (whole utterances under a chunk mask).

The two are written differently: simulated streaming masks attention scores and runs the chunked convolution over
the whole input; streaming carries keys, values and convolution context from one call to the next. Equal outputs
on every valid frame of a padded batch check both, including the end of each utterance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asrprec.models import build_transducer, configure_streaming
from asrprec.models.zipformer import build_zipformer_encoder


def _sharpen_(enc: torch.nn.Module) -> torch.nn.Module:
    """A fresh model's residual branches start tiny (output scales 0.01-0.1), so a wrong cache changes its output
    by ~1e-4 only; random weights of trained size make every branch and cache matter (a wrong one: ~1e-1)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if name.endswith(("out_proj.weight", "pointwise_conv2.weight")) or "chunkwise_conv_scale" in name:
                p.add_(torch.randn(p.shape, generator=g) * (p.std() * 5 + 0.05))
    return enc


def _stream(enc, feats, lens, chunk, left, fill_processed: int = 0, step=None):
    """Run ``enc`` chunk by chunk (``step``, default ``enc.streaming_forward``, does one chunk)."""
    step = step or enc.streaming_forward
    b, t, _ = feats.shape
    states = enc.get_init_states(b, chunk, left)
    states[-1] += fill_processed  # test hook: pretend the caches were already full
    la = enc.streaming_lookahead
    padded = F.pad(feats, (0, 0, 0, 2 * chunk + la), value=7.0)  # padding content must not matter
    outs, out_lens = [], torch.zeros(b, dtype=torch.int64)
    for start in range(0, t, 2 * chunk):
        out, n, states = step(padded[:, start: start + 2 * chunk + la], lens - start, states)
        outs.append(out)
        out_lens += n.clamp(min=0)
    return torch.cat(outs, dim=1), out_lens


@pytest.fixture(scope="module")
def causal_tiny():
    torch.manual_seed(0)
    return _sharpen_(build_zipformer_encoder(size="tiny", causal=True).eval())


def _batch(t=200, lens=(200, 167, 120)):
    g = torch.Generator().manual_seed(2)
    return torch.randn(len(lens), t, 80, generator=g), torch.tensor(lens)


def _max_err(a, b, lens):
    return max(float((a[i, :n] - b[i, :n]).abs().max()) for i, n in enumerate(lens.tolist()))


@pytest.mark.parametrize("chunk,left", [(16, 32), (32, 64), (8, 36)])
def test_streaming_equals_simulated_streaming(causal_tiny, chunk, left):
    feats, lens = _batch()
    with torch.no_grad():
        want, want_lens = causal_tiny(feats, lens, chunk_size=chunk, left_context_frames=left)
        got, got_lens = _stream(causal_tiny, feats, lens, chunk, left)
    assert torch.equal(got_lens, want_lens)
    assert _max_err(got, want, want_lens) < 1e-4 * float(want.abs().max())
    # the comparison has power: a different left context, or caches treated as full from the start, differ
    with torch.no_grad():
        other, _ = _stream(causal_tiny, feats, lens, chunk, left // 2)
        unmasked, _ = _stream(causal_tiny, feats, lens, chunk, left, fill_processed=10_000)
    assert _max_err(other, want, want_lens) > 1e-3
    assert _max_err(unmasked, want, want_lens) > 1e-2


def test_streaming_without_convnext_and_six_stacks():
    torch.manual_seed(3)
    enc = _sharpen_(build_zipformer_encoder(
        size="tiny", causal=True, convnext_hidden_ratio=0, downsampling_factor=(1, 2, 4, 8, 4, 2),
        encoder_dim=(32,) * 6, feedforward_dim=(64,) * 6, num_encoder_layers=(1,) * 6,
        encoder_unmasked_dim=(32,) * 6, num_heads=(2,) * 6, cnn_module_kernel=(7,) * 6).eval())
    assert enc.streaming_lookahead == 7
    feats, lens = _batch(200, (200, 133))
    with torch.no_grad():
        want, want_lens = enc(feats, lens, chunk_size=16, left_context_frames=64)
        got, got_lens = _stream(enc, feats, lens, 16, 64)
    assert torch.equal(got_lens, want_lens)
    assert _max_err(got, want, want_lens) < 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("mode", ["bf16-cast", "amp-bf16"])
def test_streaming_low_precision(causal_tiny, mode):
    """bf16 streaming against bf16 simulated streaming (same roundings, different order: within a few bf16 steps)
    and against fp32 (within bf16 rounding of a 3-stack model)."""
    feats, lens = _batch(200, (200, 150))
    with torch.no_grad():
        want32, want_lens = causal_tiny(feats, lens, chunk_size=16, left_context_frames=32)
        if mode == "bf16-cast":
            enc = build_zipformer_encoder(size="tiny", causal=True).eval()
            enc.load_state_dict(causal_tiny.state_dict())
            enc = enc.to(torch.bfloat16)
            want, _ = enc(feats.bfloat16(), lens, chunk_size=16, left_context_frames=32)
            got, got_lens = _stream(enc, feats.bfloat16(), lens, 16, 32)
            assert got.dtype == torch.bfloat16
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want, _ = causal_tiny(feats, lens, chunk_size=16, left_context_frames=32)
                got, got_lens = _stream(causal_tiny, feats, lens, 16, 32)
    assert torch.equal(got_lens, want_lens)
    scale = float(want32.abs().max())
    assert _max_err(got.float(), want.float(), want_lens) < 0.02 * scale
    assert _max_err(got.float(), want32, want_lens) < 0.1 * scale


def test_streaming_rejects_bad_use(causal_tiny):
    with pytest.raises(ValueError, match="even chunk size"):
        causal_tiny.get_init_states(1, 15, 32)
    with pytest.raises(ValueError, match="finite left context"):
        causal_tiny.get_init_states(1, 16, -1)
    with pytest.raises(ValueError, match="multiple of every downsampling factor"):
        causal_tiny.get_init_states(1, 6, 32)
    states = causal_tiny.get_init_states(1, 16, 32)
    with pytest.raises(ValueError, match="2 x chunk_size"):
        causal_tiny.streaming_forward(torch.randn(1, 40, 80), torch.tensor([40]), states)
    with pytest.raises(ValueError, match="B=2 streams"):
        causal_tiny.streaming_forward(torch.randn(2, 45, 80), torch.tensor([45, 45]), states)
    with pytest.raises(ValueError, match="tensors of get_init_states"):
        causal_tiny.streaming_forward(torch.randn(1, 45, 80), torch.tensor([45]), states[:-1])
    causal_tiny.train()
    try:
        with pytest.raises(RuntimeError, match="eval"):
            causal_tiny.streaming_forward(torch.randn(1, 45, 80), torch.tensor([45]), states)
    finally:
        causal_tiny.eval()
    with pytest.raises(ValueError, match="causal"):
        build_zipformer_encoder(size="tiny").eval().get_init_states(1, 16, 32)
    model = build_transducer(encoder="zipformer", size="tiny", vocab_size=20).eval()
    with pytest.raises(ValueError, match="--streaming applies to causal"):
        configure_streaming(model, 16, 32, streaming=True)
    causal = build_transducer(encoder="zipformer", size="tiny", vocab_size=20,
                              encoder_overrides={"causal": True}).eval()
    with pytest.raises(ValueError, match="finite left context"):
        configure_streaming(causal, 16, -1, streaming=True)
    assert configure_streaming(causal, 16, 32, streaming=True) == "streaming-chunk-16-left-32"


def test_streams_join_and_leave_a_pool(causal_tiny):
    """Streams started at different times and batched mid-way (stack_states), then split again (unstack_states),
    give each stream the outputs it gets alone."""
    feats, lens = _batch(200, (200, 200))
    chunk, left, la = 16, 32, causal_tiny.streaming_lookahead
    step = 2 * chunk + la
    padded = F.pad(feats, (0, 0, 0, step))

    def alone(i, n_chunks):
        st = causal_tiny.get_init_states(1, chunk, left)
        outs = []
        for c in range(n_chunks):
            o, _, st = causal_tiny.streaming_forward(padded[i: i + 1, 2 * chunk * c: 2 * chunk * c + step],
                                                     lens[i: i + 1] - 2 * chunk * c, st)
            outs.append(o)
        return torch.cat(outs, dim=1), st

    with torch.no_grad():
        want_a, _ = alone(0, 4)
        want_b, _ = alone(1, 2)
        _, st_a = alone(0, 3)  # stream a is 3 chunks in when stream b (1 chunk in) joins
        _, st_b = alone(1, 1)
        pool = causal_tiny.stack_states([st_a, st_b])
        piece = torch.cat((padded[0:1, 96: 96 + step], padded[1:2, 32: 32 + step]))
        out, _, pool = causal_tiny.streaming_forward(piece, torch.stack((lens[0] - 96, lens[1] - 32)), pool)
        a_next, b_next = causal_tiny.unstack_states(pool)
    assert torch.allclose(out[0], want_a[0, 24:32], atol=1e-5)
    assert torch.allclose(out[1], want_b[0, 8:16], atol=1e-5)
    assert int(a_next[-1]) == 4 * chunk and int(b_next[-1]) == 2 * chunk
    with pytest.raises(ValueError, match="tensors"):
        causal_tiny.stack_states([st_a[:-1]])


def test_exported_streaming_step_matches_eager(causal_tiny, tmp_path):
    """torch.export of one streaming step (dynamic batch), saved and loaded, runs a whole stream to the eager
    outputs, at a batch size other than the example's."""
    chunk, left = 16, 32
    program = causal_tiny.export_streaming(chunk, left, example_batch_size=2)
    torch.export.save(program, tmp_path / "encoder.pt2")
    step = torch.export.load(tmp_path / "encoder.pt2").module()
    feats, lens = _batch(200, (200, 167, 120))
    with torch.no_grad():
        want, want_lens = _stream(causal_tiny, feats, lens, chunk, left)
        got, got_lens = _stream(causal_tiny, feats, lens, chunk, left, step=step)
    assert torch.equal(got_lens, want_lens)
    assert _max_err(got, want, want_lens) < 1e-5 * float(want.abs().max())
